"""Tiny random checkpoints of the hybrid family (and of stock Qwen3-Next), built locally for tests and smoke runs.

Shape (issue 15): 4 layers = 3 Gated DeltaNet + 1 gated softmax attention (Qwen3-Next's full_attention_interval 4),
hidden 128, MoE in every layer with 8 experts top-2 plus a shared expert, softmax head_dim 64, DeltaNet key/value
head dim 64 (vLLM's CPU Gated DeltaNet refuses head dim 32 and runs in bfloat16 only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.models.configuration_hybrid import QuantkitHybridConfig
from quantkit.models.modeling_hybrid import QuantkitHybridForCausalLM
from quantkit.models.tiny import build_random_checkpoint

TINY_HYBRID_SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,  # dense-MLP layers only (none here: every layer is MoE)
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)

# (name suffix, mean, std), first match wins. Qwen3-Next's (1 + w) norms store w around 0; DeltaNet's gated
# output norm and the head-wise RMSNorm store a plain scale around 1.
HYBRID_RANDOM_PARAMETER_RULES = (
    ("linear_attn.norm.weight", 1.0, 0.2),
    ("o_norm.weight", 1.0, 0.2),
    ("norm.weight", 0.0, 0.2),  # (1 + w): residual norms, final norm, q/k norms
    ("pre_scale", 1.0, 0.5),  # PreAffine lambda_1
    ("v_scale_theta", 2.0, 0.5),  # V-scale: C = (d*0.02)^2 e^theta comparable to ||v||^2
)
# DeltaNet's A_log, dt_bias and conv1d are drawn N(0, init_std) like the matrices: decay A = exp(A_log) ~ 1,
# softplus(a + dt_bias) ~ 0.7 per token; q, k are L2-normalized and the output RMS-normalized per head, so the
# small conv output still gives an O(1) DeltaNet branch.


def build_tiny_hybrid_checkpoint(out_dir: str | Path, **options: Any) -> Path:
    """Train a tokenizer on stdlib docstrings and save a random `QuantkitHybridForCausalLM` with it.

    `options`: the draw of `quantkit.models.tiny.build_random_checkpoint` (vocab_size, seed, dtype, init_std; with
    HYBRID_RANDOM_PARAMETER_RULES) and any `QuantkitHybridConfig` field (the flags: attn_output_gate, pre_affine,
    gated_norm_rank, hidden_act, value_scale, headwise_rmsnorm).
    """
    model = (QuantkitHybridConfig, QuantkitHybridForCausalLM)
    return build_random_checkpoint(
        *model, out_dir, shape=TINY_HYBRID_SHAPE, rules=HYBRID_RANDOM_PARAMETER_RULES, **options
    )


def build_tiny_qwen3_next_checkpoint(out_dir: str | Path, **options: Any) -> Path:
    """The same shape and draw as a stock transformers `Qwen3NextForCausalLM` (model_type qwen3_next);
    `options` as `build_tiny_hybrid_checkpoint`'s, any `Qwen3NextConfig` field."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model = (Qwen3NextConfig, Qwen3NextForCausalLM)
    return build_random_checkpoint(
        *model, out_dir, shape=TINY_HYBRID_SHAPE, rules=HYBRID_RANDOM_PARAMETER_RULES, **options
    )
