"""The quantkit model family as vLLM models: the same safetensors as `quantkit.models`, served by vLLM.

A Qwen3 decoder (pre-norm RMSNorm, RoPE, GQA, per-head q/k RMSNorm, SwiGLU) whose residual norms,
attention and MLP carry the variant flags of `quantkit.models.configuration.QuantkitConfig` (formulas
and paper sections are in its docstring; papers in shared/papers/). Parameter names are HF state-dict
names, so checkpoints load without renaming; the transformers model `quantkit.models.modeling` is the
numerical reference (tests/test_variants_vllm.py compares the two per variant).

Layout follows vLLM's own model files: Norm, MLP, Attention, DecoderLayer, Model, ForCausalLM.
All projections that a quantization recipe may touch are vLLM parallel linear layers that receive
`quant_config` and their prefix; GatedNorm's tiny rank-r gates stay unquantized (shared/DESIGN.md).

Where attention lives in vLLM's paged-KV backend, the flags act around it:
- V-scale and the learnable sink change k/v BEFORE the attention call (the cache holds them);
- head-wise RMSNorm and the output gate act on the per-head attention output, before o_proj.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import SupportsLoRA, SupportsPP, SupportsQuant
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, maybe_prefix
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors
from vllm.transformers_utils.config import set_default_rope_theta

from quantkit.models.modeling import rms_normalize, value_scale
from quantkit.serve.float32_norms import mark_float32_loadable

# --------------------------------------------------------------------------------------- norms


def gated_norm_gates(hidden: int, rank: int, prefix: str) -> tuple[nn.Module | None, nn.Module | None]:
    """GatedNorm's gate_down (hidden -> rank) and gate_up (rank -> hidden), or (None, None) for rank 0: d x r gates,
    tiny, never quantized (shared/DESIGN.md). gate_down is a plain `nn.Linear` (vLLM's CPU linears repack and drop
    their weight) whose weight loads float32 where the checkpoint stores it so (SmoothQuant multiplied its columns
    by its factors: `quantkit.serve.float32_norms`)."""
    if not rank:
        return None, None
    gate_down = nn.Linear(hidden, rank, bias=False)
    mark_float32_loadable(gate_down.weight)
    return gate_down, ReplicatedLinear(rank, hidden, bias=False, quant_config=None, prefix=f"{prefix}.gate_up")


def gated_norm_gate(gate_down: nn.Module, gate_up: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """GatedNorm's y <- sigmoid(gate_up(silu(gate_down(y)))) * y; gate_down in its weight's dtype (float32 where
    SmoothQuant scaled its columns; its rank-r output rounded once to y's dtype), the rest in y's dtype."""
    weight = cast(torch.Tensor, gate_down.weight)
    down = F.linear(y.to(weight.dtype), weight).to(y.dtype)
    up, _ = gate_up(F.silu(down))
    return torch.sigmoid(up) * y


class QuantkitNorm(nn.Module):
    """A residual-stream norm with the norm-side flags (input_layernorm, post_attention_layernorm, norm).

    - RMSNorm:   y = weight * RMSNorm(x)   (float32 normalization, cast back, then * weight, as Qwen3).
    - PreAffine (000 sec. 3.3): y = weight * RMSNorm(pre_scale * x), pre_scale learnable, init 1.
    - DyT (000 sec. 3.1): y = weight * tanh(alpha * x) + bias (float32 math, cast back).
    - GatedNorm / GatedDyT (000 sec. 3.4 / 3.5), rank r: y <- sigmoid(gate_up(swish(gate_down(y)))) * y.

    vLLM's convention: `forward(x)` -> y; `forward(x, residual)` -> (y, x + residual), the sum being the
    new residual stream. The plain RMSNorm case is served by vLLM's own `RMSNorm` (see `residual_norm`).
    """

    def __init__(self, config, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.norm_type = config.norm_type
        self.eps = config.rms_norm_eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.pre_scale = nn.Parameter(torch.ones(hidden)) if config.pre_affine else None
        if self.norm_type == "dyt":
            self.bias = nn.Parameter(torch.zeros(hidden))
            self.alpha = nn.Parameter(torch.full((1,), float(config.dyt_alpha_init)))
        self.gate_down, self.gate_up = gated_norm_gates(hidden, config.gated_norm_rank, prefix)
        mark_float32_loadable(self.weight, getattr(self, "bias", None))  # SmoothQuant's folds, unrounded

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_type == "dyt":
            y = self.weight.float() * torch.tanh(self.alpha.float() * x.float()) + self.bias.float()
            return y.to(x.dtype)
        h = x.float() * self.pre_scale.float() if self.pre_scale is not None else x
        return (self.weight * rms_normalize(h, self.eps).to(x.dtype)).to(x.dtype)  # float32 weight: one rounding

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> y (T, H); with `residual`: s = x + residual -> (y of s, s), vLLM's fused-add convention."""
        if residual is not None:
            x = x + residual  # in the model dtype, as the transformers reference does
            residual = x
        y = self._normalize(x)
        if self.gate_down is not None:  # gate_up with it (gated_norm_gates)
            y = gated_norm_gate(self.gate_down, cast(nn.Module, self.gate_up), y)
        return y if residual is None else (y, residual)


def residual_norm(config, prefix: str = "") -> nn.Module:
    """vLLM's fused RMSNorm for the plain base; `QuantkitNorm` when any norm-side flag is on."""
    if config.norm_type == "rmsnorm" and not config.pre_affine and not config.gated_norm_rank:
        return RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return QuantkitNorm(config, prefix=prefix)


class HeadwiseRMSNorm(nn.Module):
    """Head-wise RMSNorm after value aggregation (003 sec. 5.1, eq. 4): o_h <- o_h / RMS(o_h) * weight.

    `weight` (head_dim) is shared across heads; math in float32 (weight included), cast back.
    """

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, o: torch.Tensor) -> torch.Tensor:  # (T, H, D)
        """o (T, heads, head_dim) -> the same shape: each head's RMSNorm times weight, float32 math, in o's dtype."""
        return (self.weight.float() * rms_normalize(o, self.eps)).to(o.dtype)


# ----------------------------------------------------------------------------------------- MLP


class SigmoidAndMul(nn.Module):
    """GLU activation (000 sec. 3.2): x -> sigmoid(x[:d]) * x[d:], d = x.shape[-1] // 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2d) -> (..., d): sigmoid(x[..., :d]) * x[..., d:]."""
        d = x.shape[-1] // 2
        return torch.sigmoid(x[..., :d]) * x[..., d:]


class QuantkitMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (hidden_act "silu") or GLU (hidden_act "sigmoid", 000 sec. 3.2)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        if hidden_act == "silu":
            self.act_fn = SiluAndMul()
        elif hidden_act == "sigmoid":
            self.act_fn = SigmoidAndMul()
        else:
            raise ValueError(f"hidden_act={hidden_act!r}: quantkit supports 'silu' (SwiGLU) and 'sigmoid' (GLU)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H): down_proj(act(gate) * up), gate and up from the merged gate_up_proj."""
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


# ----------------------------------------------------------------------------------- attention


def _kv_head_sharded_parameter(data: torch.Tensor, total_num_kv_heads: int) -> nn.Parameter:
    """A parameter whose dim 0 follows the KV heads: each TP rank loads the rows of its own heads.

    Mirrors QKVParallelLinear: with fewer KV heads than ranks, each head is replicated on
    tp_size // total_num_kv_heads consecutive ranks.
    """
    param = nn.Parameter(data, requires_grad=False)

    def weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        tp_rank = get_tensor_model_parallel_rank()
        replicas = max(1, get_tensor_model_parallel_world_size() // total_num_kv_heads)
        num_local = param.shape[0]
        start = (tp_rank // replicas) * num_local
        assert loaded_weight.shape[1:] == param.shape[1:], (loaded_weight.shape, param.shape)
        param.data.copy_(loaded_weight.narrow(0, start, num_local))

    set_weight_attrs(param, {"weight_loader": weight_loader})
    return param


class QuantkitAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm, RoPE, GQA) with the attention-side flags, in this order:

    qkv_proj -> q/k norm, RoPE
      -> V-scale (002 sec. 5.1): v <- v * r / (r + C), r = ||v_h||^2, C = (d*0.02)^2 exp(theta_h)
      -> learnable sink (004 Table 2 (d)): key and value of every position-0 token <- k', v'
         (RoPE at position 0 is the identity; the prompt starts with BOS at position 0)
      -> paged attention (the KV cache holds the scaled / sink k, v)
      -> head-wise RMSNorm (003 sec. 5.1, eq. 4)
      -> output gate (000 sec. 1 and 3.2): o_h <- o_h * sigmoid(x W_g), per head or per channel,
         x = this module's input (the normed hidden state, as for q_proj)
      -> o_proj.
    """

    def __init__(
        self,
        config,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        assert self.total_num_heads % tp_size == 0
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = config.num_key_value_heads
        if self.total_num_kv_heads >= tp_size:
            assert self.total_num_kv_heads % tp_size == 0
        else:
            assert tp_size % self.total_num_kv_heads == 0
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        eps = config.rms_norm_eps

        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=getattr(config, "attention_bias", False),
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        self.q_norm = RMSNorm(self.head_dim, eps=eps)
        self.k_norm = RMSNorm(self.head_dim, eps=eps)

        # GA: one gate per head ("headwise") or per channel ("elementwise"); rows are head-major, so
        # the column-parallel shard of a rank holds the gates of exactly its own query heads.
        self.output_gate = config.attn_output_gate
        self.g_proj = None
        if self.output_gate is not None:
            self.gate_dim = self.head_dim if self.output_gate == "elementwise" else 1
            self.g_proj = ColumnParallelLinear(
                hidden_size,
                self.total_num_heads * self.gate_dim,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.g_proj",
            )
        self.v_scale_theta = None
        if config.value_scale:
            self.v_scale_theta = _kv_head_sharded_parameter(torch.zeros(self.num_kv_heads), self.total_num_kv_heads)
        self.o_norm = HeadwiseRMSNorm(self.head_dim, eps) if config.headwise_rmsnorm else None
        self.sink_key = self.sink_value = None
        if config.attention_sink:
            self.sink_key = _kv_head_sharded_parameter(
                torch.zeros(self.num_kv_heads, self.head_dim), self.total_num_kv_heads
            )
            self.sink_value = _kv_head_sharded_parameter(
                torch.zeros(self.num_kv_heads, self.head_dim), self.total_num_kv_heads
            )

    def _value_scale(self, v: torch.Tensor) -> torch.Tensor:
        """V-scale (002 sec. 5.1), float32 math, result in v's dtype."""
        per_head = v.view(-1, self.num_kv_heads, self.head_dim)
        theta = cast(torch.Tensor, self.v_scale_theta)  # set: forward calls this only then
        return value_scale(per_head, theta[:, None], self.head_dim).view(v.shape)

    def _write_sink(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace k and v of every position-0 token with the learned sink k', v' (004 Table 2 (d))."""
        at_zero = (positions == 0)[:, None]
        # set together: forward calls this only then
        sink_key, sink_value = cast(torch.Tensor, self.sink_key), cast(torch.Tensor, self.sink_value)
        k = torch.where(at_zero, sink_key.reshape(1, -1).to(k.dtype), k)
        v = torch.where(at_zero, sink_value.reshape(1, -1).to(v.dtype), v)
        return k, v

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions (T,), hidden states (T, H) -> (T, H), in the class docstring's order."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        if self.v_scale_theta is not None:
            v = self._value_scale(v.contiguous())
        if self.sink_key is not None:
            k, v = self._write_sink(positions, k, v)

        o = self.attn(q, k, v)
        if self.o_norm is not None or self.g_proj is not None:
            o = o.view(-1, self.num_heads, self.head_dim)
            if self.o_norm is not None:
                o = self.o_norm(o)
            if self.g_proj is not None:
                gate, _ = self.g_proj(hidden_states)
                o = o * torch.sigmoid(gate).view(-1, self.num_heads, self.gate_dim)
            o = o.reshape(-1, self.q_size)
        output, _ = self.o_proj(o)
        return output


# ------------------------------------------------------------------------------- decoder layer


class QuantkitDecoderLayer(nn.Module):
    """Pre-norm decoder layer: norm -> attention -> (+ residual) norm -> MLP, with flag-aware modules."""

    def __init__(
        self,
        config,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        set_default_rope_theta(config, default_theta=1000000)
        self.hidden_size = config.hidden_size
        self.self_attn = QuantkitAttention(
            config, cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = QuantkitMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = residual_norm(config, prefix=f"{prefix}.input_layernorm")
        self.post_attention_layernorm = residual_norm(config, prefix=f"{prefix}.post_attention_layernorm")

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,), hidden states (T, H), residual (T, H) or None (first layer) -> (MLP output, residual
        stream), each (T, H); vLLM's deferred residual: the next norm adds the two."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


# ------------------------------------------------------------------------------- model, LM head


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": -1,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class QuantkitModel(Qwen2Model):
    """Qwen2Model's backbone (embeddings, PP, weight mapping) with quantkit layers and final norm.

    Weight names: Qwen2Model.load_weights maps q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj by
    substring (".q_proj", ".gate_proj", ...). None of the flag parameters (g_proj, v_scale_theta, o_norm,
    sink_key/value, pre_scale, alpha, gate_down/gate_up) contains those substrings, so they load by name.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, decoder_layer_type=QuantkitDecoderLayer)
        if get_pp_group().is_last_rank:
            self.norm = residual_norm(self.config, prefix=f"{prefix}.norm")


class QuantkitForCausalLM(nn.Module, SupportsLoRA, SupportsPP, SupportsQuant):
    """vLLM model for `architectures: ["QuantkitForCausalLM"]` (all variants of the quantkit family)."""

    hf_to_vllm_mapper = Qwen2Model.hf_to_vllm_mapper
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    embedding_modules = {
        "embed_tokens": "input_embeddings",
        "lm_head": "output_embeddings",
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.vllm_config = vllm_config
        self.quant_config = quant_config
        self.model = QuantkitModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))

        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (T,) -> embeddings (T, H) (the backbone's embed_tokens)."""
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Token ids (or inputs_embeds), positions (T,) -> final-normed hidden states (T, H) on the last PP rank, else
        IntermediateTensors for the next rank."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Hidden states (T, H) -> logits (T, vocab): lm_head through vLLM's LogitsProcessor (which may give None)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM: checkpoint tensors by HF name -> parameters (AutoWeightsLoader); returns the names loaded."""
        return AutoWeightsLoader(self).load_weights(weights)
