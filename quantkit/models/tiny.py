"""Tiny random checkpoints of the quantkit family, built locally for tests and smoke runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantkit.data import stdlib_docstrings
from quantkit.models import QuantkitConfig, QuantkitForCausalLM
from quantkit.models.tokenizer import save_tokenizer, train_bpe_tokenizer

# The smallest decoder shape the tests build in memory (2 layers, 4 query / 2 KV heads of 16); TINY_SHAPE, the
# checkpoints' shape, is it at 256 wide with 64-wide heads.
MICRO_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
TINY_SHAPE: dict[str, Any] = dict(
    MICRO_SHAPE,
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build_tiny_checkpoint(out_dir: str | Path, **options: Any) -> Path:
    """Train a tokenizer on stdlib docstrings and save a randomly initialized model with it.

    Parameters are drawn by `randomize_parameters` with a fixed seed: far enough from their initial
    values that next-token distributions are far from uniform and every variant flag changes the output,
    so logprob comparisons are meaningful. `options`: `build_random_checkpoint`'s draw (vocab_size, seed, dtype,
    init_std) and any `QuantkitConfig` field.
    """
    return build_random_checkpoint(QuantkitConfig, QuantkitForCausalLM, out_dir, **options)


STOCK_ARCHITECTURES = ("qwen3", "llama", "gemma3", "mistral", "qwen2", "qwen3_moe", "mixtral", "phi3", "gemma2")
# Per architecture: the overrides of TINY_SHAPE its config needs (MoE: 4 experts top-2).
_STOCK_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(tie_word_embeddings=True),  # as the released models (vLLM's Gemma classes have no lm_head)
    "gemma3": dict(tie_word_embeddings=True),
}


def build_tiny_stock_checkpoint(out_dir: str | Path, architecture: str = "qwen3", **draw: Any) -> Path:
    """Like `build_tiny_checkpoint`, for a stock transformers decoder: `architecture` is a model_type of
    STOCK_ARCHITECTURES (Qwen3, Llama, Gemma 3 with its four (1 + w) norms a layer, Mistral, Qwen2, Qwen3-MoE and
    Mixtral with 4 experts top-2, Phi-3 with fused qkv/gate_up, Gemma 2). `draw`: vocab_size, seed, dtype,
    init_std."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if architecture not in STOCK_ARCHITECTURES:
        raise ValueError(f"unknown stock architecture {architecture!r}; expected one of {list(STOCK_ARCHITECTURES)}")
    config_class = type(AutoConfig.for_model("gemma3_text" if architecture == "gemma3" else architecture))
    model_class = AutoModelForCausalLM._model_mapping[config_class]
    return build_random_checkpoint(config_class, model_class, out_dir, **draw, **_STOCK_OVERRIDES.get(architecture, {}))


def build_random_checkpoint(
    config_class: type,
    model_class: type,
    out_dir: str | Path,
    *,
    shape: dict[str, Any] | None = None,
    rules: tuple[tuple[str, float, float], ...] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.05,
    **config_overrides: Any,
) -> Path:
    """A BPE tokenizer of `vocab_size` trained on stdlib docstrings and a `model_class` of `config_class` in
    `shape` (default TINY_SHAPE) with `config_overrides`, its parameters drawn by `randomize_parameters` (seed,
    init_std for the matrices, `rules` for the rest), saved in `dtype` to out_dir."""
    out_dir = Path(out_dir)
    tokenizer = train_bpe_tokenizer(stdlib_docstrings(), vocab_size)
    config = config_class(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**TINY_SHAPE, **(shape or {}), **config_overrides},
    )
    torch.manual_seed(seed)
    model = model_class(config)
    randomize_parameters(model, init_std, rules or _RANDOM_PARAMETER_RULES)
    model.to(dtype).save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    return out_dir


# (name suffix, mean, std) for parameters that are not plain weight matrices; first match wins
_RANDOM_PARAMETER_RULES = (
    ("norm.weight", 1.0, 0.2),  # residual, q/k and head-wise norms: scales around 1
    ("pre_scale", 1.0, 0.5),  # PreAffine lambda_1
    ("norm.alpha", 0.5, 0.1),  # DyT alpha
    ("norm.bias", 0.0, 0.1),  # DyT beta
    ("v_scale_theta", 2.0, 0.5),  # V-scale: C = (d*0.02)^2 e^theta comparable to ||v||^2
    ("sink_key", 0.0, 1.0),  # learnable sink k', v' (keys are RMS-normed: entries ~ 1)
    ("sink_value", 0.0, 1.0),
)


@torch.no_grad()
def randomize_parameters(
    model: torch.nn.Module, matrix_std: float, rules: tuple[tuple[str, float, float], ...] = _RANDOM_PARAMETER_RULES
) -> None:
    """Redraw every parameter: weight matrices and embeddings N(0, matrix_std), others per `rules`
    ((name suffix, mean, std), first match wins)."""
    for name, param in model.named_parameters():
        mean, std = next(((m, s) for suffix, m, s in rules if name.endswith(suffix)), (0.0, matrix_std))
        param.normal_(mean, std)
