"""The quantkit hybrid family in transformers: Qwen3-Next with the flag-aware layers swapped in.

transformers' Qwen3NextForCausalLM builds the model (Gated DeltaNet, MoE, embeddings, caches); the layers a flag
changes are replaced: the residual-stream norms (`QuantkitHybridNorm`: (1 + w) RMSNorm, PreAffine, GatedNorm)
and the softmax layers' attention (`QuantkitHybridAttention`: output gate mapping, V-scale, head-wise RMSNorm).
Formulas, conventions and the GA mapping are in `quantkit.models.configuration_hybrid`. Parameter names are the
contract with the vLLM model (`quantkit.serve.hybrid`), which loads the same safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextForCausalLM,
    Qwen3NextRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from quantkit.models.configuration_hybrid import DELTANET_CONV_ACT, QuantkitHybridConfig
from quantkit.models.modeling import attend, project_heads


def has_norm_flags(config: QuantkitHybridConfig) -> bool:
    """True when the residual-stream norms differ from Qwen3NextRMSNorm (PreAffine or GatedNorm)."""
    return bool(config.pre_affine or config.gated_norm_rank)


class QuantkitHybridNorm(Qwen3NextRMSNorm):
    """Qwen3NextRMSNorm, y = (1 + w) * RMSNorm(x), with the norm-side flags:

    - PreAffine: y = (1 + w) * RMSNorm(pre_scale * x), pre_scale (hidden) plain, init 1;
    - GatedNorm, rank r: y <- sigmoid(gate_up(swish(gate_down(y)))) * y (after the (1 + w) scale).
    Normalization in float32 as Qwen3NextRMSNorm; the gate runs in the input's dtype.
    """

    def __init__(self, config: QuantkitHybridConfig) -> None:
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)
        if config.pre_affine:
            self.pre_scale = nn.Parameter(torch.ones(config.hidden_size))
        if config.gated_norm_rank:
            self.gate_down = nn.Linear(config.hidden_size, config.gated_norm_rank, bias=False)
            self.gate_up = nn.Linear(config.gated_norm_rank, config.hidden_size, bias=False)

    @torch.no_grad()
    def reset_variant_parameters(self) -> None:
        """Initial values: w = 0 (scale 1 + w = 1), pre_scale = 1."""
        self.weight.zero_()
        if hasattr(self, "pre_scale"):
            self.pre_scale.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., hidden) in x's dtype: (1 + w) * RMSNorm(pre_scale * x), then the gate if any."""
        h = x.float() * self.pre_scale.float() if hasattr(self, "pre_scale") else x
        y = super().forward(h).to(x.dtype)
        if hasattr(self, "gate_down"):
            y = torch.sigmoid(self.gate_up(F.silu(self.gate_down(y)))) * y
        return y


class QuantkitHybridAttention(Qwen3NextAttention):
    """Qwen3-Next softmax attention with the attention-side flags.

    Output gate (see configuration_hybrid): "elementwise" keeps Qwen3-Next's gate fused into q_proj
    (per head [q_h; g_h]); "headwise" uses a q_proj without gate rows plus g_proj (hidden -> heads); None no gate.
    Order: projections -> q/k norm, RoPE -> V-scale -> SDPA -> head-wise RMSNorm -> gate -> o_proj.
    """

    def __init__(self, config: QuantkitHybridConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, self.head_dim
        self.output_gate = config.attn_output_gate
        if self.output_gate != "elementwise":
            self.q_proj = nn.Linear(config.hidden_size, heads * d, bias=config.attention_bias)
        if self.output_gate == "headwise":
            self.g_proj = nn.Linear(config.hidden_size, heads, bias=False)
        if config.value_scale:
            self.v_scale_theta = nn.Parameter(torch.zeros(kv_heads))
        if config.headwise_rmsnorm:
            self.o_norm = nn.Module()
            self.o_norm.weight = nn.Parameter(torch.ones(d))

    @torch.no_grad()
    def reset_variant_parameters(self) -> None:
        """theta = 0 (C = (d*0.02)^2), head-wise norm weight = 1."""
        if hasattr(self, "v_scale_theta"):
            self.v_scale_theta.zero_()
        if hasattr(self, "o_norm"):
            cast(nn.Parameter, self.o_norm.weight).fill_(1.0)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, hidden) -> (o_proj output (B, T, hidden), attention weights or None), in the class docstring's
        order; this step's k, v go into `past_key_values` (when given)."""
        input_shape = hidden_states.shape[:-1]  # (B, T)

        query = self.q_proj(hidden_states)
        gate = None  # (B, T, H, D) or (B, T, H, 1), pre-sigmoid
        if self.output_gate == "elementwise":
            query, gate = torch.chunk(query.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        elif self.output_gate == "headwise":
            gate = self.g_proj(hidden_states)[..., None]

        qkv = project_heads(self, query, hidden_states, position_embeddings, apply_rotary_pos_emb)
        return attend(self, *qkv, attention_mask, past_key_values, gate, eager_attention_forward, **kwargs)


class QuantkitHybridForCausalLM(Qwen3NextForCausalLM):
    """Qwen3NextForCausalLM whose layers carry the flags of `QuantkitHybridConfig`.

    GLU needs no module of its own: Qwen3-Next's experts, shared expert and MLP apply ACT2FN[hidden_act]
    ("sigmoid" for GLU); DeltaNet's short convolution is pinned to DELTANET_CONV_ACT.
    """

    config_class = QuantkitHybridConfig

    def __init__(self, config: QuantkitHybridConfig) -> None:
        super().__init__(config)
        for idx, layer in enumerate(self.model.layers):
            if layer.block_type == "full_attention":
                layer.self_attn = QuantkitHybridAttention(config, idx)
            else:
                layer.linear_attn.activation = DELTANET_CONV_ACT
            if has_norm_flags(config):
                layer.input_layernorm = QuantkitHybridNorm(config)
                layer.post_attention_layernorm = QuantkitHybridNorm(config)
        if has_norm_flags(config):
            self.model.norm = QuantkitHybridNorm(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if hasattr(module, "reset_variant_parameters"):
            cast(Callable[[], None], module.reset_variant_parameters)()
