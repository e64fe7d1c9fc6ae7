"""The quantkit model family (Hugging Face side) and the tiny local checkpoints the tests build.

Importing this package registers `model_type: "quantkit"` (dense) and `"quantkit_hybrid"` (Qwen3-Next style
hybrid MoE) with transformers' AutoConfig and AutoModelForCausalLM, so `AutoModelForCausalLM.from_pretrained(dir)`
loads our checkpoints. The hybrid type also gets Qwen3-Next's checkpoint conversion mapping, so its experts are
saved and loaded per expert (`mlp.experts.{i}.gate_proj.weight`, ...) exactly as stock Qwen3-Next checkpoints.
"""

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)

from quantkit.models.configuration import QuantkitConfig
from quantkit.models.configuration_hybrid import QuantkitHybridConfig
from quantkit.models.modeling import QuantkitForCausalLM
from quantkit.models.modeling_hybrid import QuantkitHybridForCausalLM

AutoConfig.register(QuantkitConfig.model_type, QuantkitConfig, exist_ok=True)
AutoModelForCausalLM.register(QuantkitConfig, QuantkitForCausalLM, exist_ok=True)
AutoConfig.register(QuantkitHybridConfig.model_type, QuantkitHybridConfig, exist_ok=True)
AutoModelForCausalLM.register(QuantkitHybridConfig, QuantkitHybridForCausalLM, exist_ok=True)
register_checkpoint_conversion_mapping(
    QuantkitHybridConfig.model_type, get_checkpoint_conversion_mapping("qwen3_next"), overwrite=True
)

__all__ = ["QuantkitConfig", "QuantkitForCausalLM", "QuantkitHybridConfig", "QuantkitHybridForCausalLM"]
