"""Which transformers attention implementation a reference forward must use.

transformers' default implementation ("sdpa") ignores attention-logit soft-capping: Gemma 2 caps each score as
c tanh(s / c) (config `attn_logit_softcapping`, c = 50 in the released models) before the softmax; transformers'
"eager" implementation and vLLM's attention (CPU and CUDA) apply it. A reference computed on sdpa is therefore
not the model vLLM serves, and every comparison against it (calibration statistics, fake-quant parity, KL) would
carry that difference. Every quantkit forward of a transformers model asks `reference_attention` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def reference_attention(config: PretrainedConfig) -> str | None:
    """ "eager" where the model soft-caps attention logits (sdpa would drop the cap), else None (transformers'
    default)."""
    text = config.get_text_config()
    return "eager" if getattr(text, "attn_logit_softcapping", None) else None


def load_reference_model(model_dir: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)` in eval mode, with `reference_attention`."""
    config = AutoConfig.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=dtype, attn_implementation=reference_attention(config)
    ).eval()
