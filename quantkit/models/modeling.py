"""The quantkit model family in transformers: the reference forward pass for calibration and parity.

A Qwen3 decoder whose residual norms and attention are swapped for the flag-aware modules below; the
formulas and citations of every flag are in `quantkit.models.configuration`. Parameter names are the
contract with the vLLM model (`quantkit.serve.models`), which loads the same safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen3Attention,
    Qwen3ForCausalLM,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from quantkit.models.configuration import QuantkitConfig

V_SCALE_C0 = 0.02  # paper 002 sec. 5.1: C = (d_head * 0.02)^2 * exp(theta)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, computed in float32, returned in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class QuantkitNorm(nn.Module):
    """A residual-stream normalization layer: RMSNorm (optionally PreAffine) or DyT, optionally gated.

    - RMSNorm: y = weight * RMSNorm(x); PreAffine (000 sec. 3.3): y = weight * RMSNorm(pre_scale * x).
    - DyT (000 sec. 3.1): y = weight * tanh(alpha * x) + bias.
    - GatedNorm / GatedDyT (000 sec. 3.4/3.5), rank r: y <- sigmoid(gate_up(swish(gate_down(y)))) * y.
    Math in float32; the output has the input's dtype.
    """

    def __init__(self, config: QuantkitConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.norm_type = config.norm_type
        self.eps = config.rms_norm_eps
        self.dyt_alpha_init = config.dyt_alpha_init
        self.weight = nn.Parameter(torch.ones(hidden))
        if config.pre_affine:
            self.pre_scale = nn.Parameter(torch.ones(hidden))
        if config.norm_type == "dyt":
            self.bias = nn.Parameter(torch.zeros(hidden))
            self.alpha = nn.Parameter(torch.full((1,), float(config.dyt_alpha_init)))
        if config.gated_norm_rank:
            self.gate_down = nn.Linear(hidden, config.gated_norm_rank, bias=False)
            self.gate_up = nn.Linear(config.gated_norm_rank, hidden, bias=False)

    @torch.no_grad()
    def reset_variant_parameters(self) -> None:
        """Initial values of the flag parameters: pre_scale = 1, alpha = dyt_alpha_init, bias = 0."""
        self.weight.fill_(1.0)
        if hasattr(self, "pre_scale"):
            self.pre_scale.fill_(1.0)
        if hasattr(self, "alpha"):
            self.alpha.fill_(self.dyt_alpha_init)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., hidden): DyT, or RMSNorm (PreAffine: of pre_scale * x), then the gate if any."""
        if self.norm_type == "dyt":
            y = self.weight.float() * torch.tanh(self.alpha.float() * x.float()) + self.bias.float()
            y = y.to(x.dtype)
        else:
            h = x.float() * self.pre_scale.float() if hasattr(self, "pre_scale") else x
            y = (self.weight * rms_normalize(h, self.eps).to(x.dtype)).to(x.dtype)  # a float32 (folded) weight too
        if hasattr(self, "gate_down"):
            y = torch.sigmoid(self.gate_up(F.silu(self.gate_down(y)))) * y
        return y


class QuantkitAttention(Qwen3Attention):
    """Qwen3 attention with the attention-side flags: V-scale, learnable sink, head-wise RMSNorm, GA.

    Order: q/k/v projections -> q/k norms, RoPE -> V-scale on v (002 sec. 5.1) -> sink k', v' written at
    position 0 (004 Table 2 (d)) -> SDPA -> head-wise RMSNorm (003 eq. 4) -> output gate (000 sec. 3.2)
    -> o_proj.
    """

    def __init__(self, config: QuantkitConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, self.head_dim
        self.output_gate = config.attn_output_gate
        if self.output_gate == "headwise":
            self.g_proj = nn.Linear(config.hidden_size, heads, bias=False)
        elif self.output_gate == "elementwise":
            self.g_proj = nn.Linear(config.hidden_size, heads * d, bias=False)
        if config.value_scale:
            self.v_scale_theta = nn.Parameter(torch.zeros(kv_heads))
        if config.headwise_rmsnorm:
            self.o_norm = nn.Module()
            self.o_norm.weight = nn.Parameter(torch.ones(d))
        if config.attention_sink:
            self.sink_key = nn.Parameter(torch.zeros(kv_heads, d))
            self.sink_value = nn.Parameter(torch.zeros(kv_heads, d))

    @torch.no_grad()
    def reset_variant_parameters(self) -> None:
        """theta = 0 (C = (d*0.02)^2), head-wise norm weight = 1, sink k', v' ~ N(0, initializer_range)."""
        if hasattr(self, "v_scale_theta"):
            self.v_scale_theta.zero_()
        if hasattr(self, "o_norm"):
            cast(nn.Parameter, self.o_norm.weight).fill_(1.0)
        if hasattr(self, "sink_key"):
            self.sink_key.normal_(0.0, self.config.initializer_range)
            self.sink_value.normal_(0.0, self.config.initializer_range)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values=None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, hidden) -> (o_proj output (B, T, hidden), attention weights or None), in the class docstring's
        order; this step's k, v go into `past_key_values` (when given)."""
        query_states, key_states, value_states = project_heads(
            self, self.q_proj(hidden_states), hidden_states, position_embeddings, apply_rotary_pos_emb
        )
        gate = None  # (B, T, H, D) or (B, T, H, 1), pre-sigmoid
        if self.output_gate is not None:  # head-major
            gate = self.g_proj(hidden_states).view(*hidden_states.shape[:-1], query_states.shape[1], -1)
        qkv = (query_states, key_states, value_states)
        eager = eager_attention_forward
        return attend(self, *qkv, attention_mask, past_key_values, gate, eager, position_ids, **kwargs)


def project_heads(
    module: Any, query: torch.Tensor, hidden_states: torch.Tensor, position_embeddings: tuple, rope: Callable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both families' attention before `attend`: q_proj's output `query` (B, T, H*D) and the module's k_proj /
    v_proj of hidden_states (B, T, hidden) -> per-head q_norm / k_norm -> RoPE (`rope`: the family's
    apply_rotary_pos_emb, cos and sin from `position_embeddings`) -> q (B, H, T, D), k and v (B, KVH, T, D)."""
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query_states = module.q_norm(query.reshape(hidden_shape)).transpose(1, 2)
    key_states = module.k_norm(module.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = rope(query_states, key_states, cos, sin)
    return query_states, key_states, value_states


def attend(
    module: Any,  # QuantkitAttention or QuantkitHybridAttention
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values,
    gate: torch.Tensor | None,
    eager: Callable,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What both families' attention does after RoPE (`QuantkitAttention`, `QuantkitHybridAttention`): q (B, H, T, D),
    k and v (B, KVH, T, D) -> V-scale on v -> sink k', v' at position 0 (modules with `sink_key`; needs
    position_ids) -> this step's k, v into `past_key_values` -> the configured attention (`eager`: the family's
    eager implementation) -> head-wise RMSNorm -> output gate (`gate` pre-sigmoid, broadcast over (B, T, H, D)) ->
    o_proj: (o_proj output (B, T, hidden), attention weights or None). The flags are the module's attributes."""
    input_shape = query_states.shape[:1] + query_states.shape[2:3]  # (B, T)
    if hasattr(module, "v_scale_theta"):
        value_states = value_scale(value_states, module.v_scale_theta[None, :, None, None], module.head_dim)
    if hasattr(module, "sink_key"):
        if position_ids is None:
            raise ValueError("attention_sink needs position_ids to find position 0")
        at_zero = (position_ids == 0)[:, None, :, None]  # (B, 1, T, 1)
        key_states = torch.where(at_zero, module.sink_key[None, :, None, :].to(key_states.dtype), key_states)
        value_states = torch.where(at_zero, module.sink_value[None, :, None, :].to(value_states.dtype), value_states)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, module.layer_idx)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
    window = {"sliding_window": module.sliding_window} if hasattr(module, "sliding_window") else {}
    attn_output, attn_weights = attention_interface(
        module,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **window,
        **kwargs,
    )  # (B, T, H, D)

    if hasattr(module, "o_norm"):
        normed = rms_normalize(attn_output, module.config.rms_norm_eps)
        attn_output = (cast(nn.Parameter, module.o_norm.weight) * normed).to(attn_output.dtype)
    if gate is not None:
        attn_output = attn_output * torch.sigmoid(gate)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return module.o_proj(attn_output), attn_weights


def value_scale(v: torch.Tensor, theta: torch.Tensor, head_dim: int) -> torch.Tensor:
    """V-scale (paper 002 sec. 5.1): v * r / (r + C), r = ||v||^2 over the last dim, C = (d*0.02)^2 e^theta.

    `theta` broadcasts against v's head axis; math in float32, result in v's dtype.
    """
    vf = v.float()
    r = vf.pow(2).sum(-1, keepdim=True)
    c = (head_dim * V_SCALE_C0) ** 2 * torch.exp(theta.float())
    return (vf * (r / (r + c))).to(v.dtype)


class QuantkitForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM whose layers carry the variant flags of `QuantkitConfig`.

    GLU needs no module of its own: Qwen3's MLP applies ACT2FN[hidden_act] ("sigmoid" for GLU).
    """

    config_class = QuantkitConfig

    def __init__(self, config: QuantkitConfig) -> None:
        super().__init__(config)
        for idx, layer in enumerate(self.model.layers):
            layer.self_attn = QuantkitAttention(config, idx)
            layer.input_layernorm = QuantkitNorm(config)
            layer.post_attention_layernorm = QuantkitNorm(config)
        self.model.norm = QuantkitNorm(config)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, past_key_values=None, **kwargs):
        """Qwen3's forward; with attention_sink, refuses a fresh sequence that does not start with BOS."""
        if (
            self.config.attention_sink
            and input_ids is not None
            and (past_key_values is None or past_key_values.get_seq_length() == 0)
        ):
            bos = self.config.bos_token_id
            if bos is None or bool((input_ids[:, 0] != bos).any()):
                raise ValueError(
                    f"attention_sink models need the BOS token (id {bos}) at position 0, got ids "
                    f"{input_ids[:, 0].tolist()}: encode with special tokens"
                )
        return super().forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if hasattr(module, "reset_variant_parameters"):
            cast(Callable[[], None], module.reset_variant_parameters)()
