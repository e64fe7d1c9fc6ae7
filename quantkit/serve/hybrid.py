"""The quantkit hybrid family as a vLLM model: the same safetensors as `quantkit.models.modeling_hybrid`.

vLLM's own Qwen3-Next (`vllm.model_executor.models.qwen3_next`) with the layers a flag changes swapped:
the residual-stream norms (`QuantkitHybridNorm`, (1 + w) RMSNorm with PreAffine / GatedNorm) and the softmax
layers' attention (`QuantkitHybridAttention`: output-gate mapping, V-scale, head-wise RMSNorm). Gated DeltaNet
(`QwenGatedDeltaNetAttention`), the sparse MoE block, embeddings, LM head, the mamba-state interface and weight
loading are vLLM's. Formulas, the (1 + w) convention and the GA mapping: `quantkit.models.configuration_hybrid`.

Why the decoder layer, model and LM classes re-implement `__init__` (and only `__init__`): vLLM's constructors
build the stock Qwen3NextAttention from the config, and an `Attention` registers its prefix in vLLM's forward
context once, so the stock layer cannot be built and then replaced; the forwards are inherited unchanged.

GLU experts (hidden_act "sigmoid"): vLLM's fused-MoE kernels implement silu/gelu/swigluoai gates only
(`CPUUnquantizedExperts._supports_activation`) and Qwen2MoeMLP (Qwen3-Next's shared expert) silu only, so GLU
checkpoints get `GLUSparseMoeBlock`: the same routing (softmax, top-k, renormalized), sigmoid-gated shared expert and
per-expert weights, with the routed experts as an eager torch loop over the experts hit (a reference path:
unquantized, replicated across tensor-parallel ranks, no CUDA graphs; fused GLU experts are issue 16's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.fused_moe.utils import is_model_fused_shared_expert_compatible
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextMLP,
    Qwen3NextModel,
    Qwen3NextSparseMoeBlock,
    _should_use_sequence_parallel,
)
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

from quantkit.formats.experts import ExpertLinears, routed_experts_forward
from quantkit.models.configuration_hybrid import DELTANET_CONV_ACT
from quantkit.models.modeling import rms_normalize, value_scale
from quantkit.serve.cpu.linear import ordered_expert_linears, summation_order
from quantkit.serve.float32_norms import mark_float32_loadable
from quantkit.serve.models import (
    HeadwiseRMSNorm,
    QuantkitMLP,
    _kv_head_sharded_parameter,
    gated_norm_gate,
    gated_norm_gates,
)

# ----------------------------------------------------------------------------------------- norms


class QuantkitHybridNorm(nn.Module):
    """Qwen3-Next residual norm y = (1 + w) * RMSNorm(x) with PreAffine (x <- pre_scale * x before the norm) and
    GatedNorm (y <- sigmoid(gate_up(swish(gate_down(y)))) * y); normalization and (1 + w) in float32, cast back
    (as GemmaRMSNorm), gate as `gated_norm_gate`.

    vLLM's convention: `forward(x)` -> y; `forward(x, residual)` -> (y, x + residual).
    """

    def __init__(self, config, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.pre_scale = nn.Parameter(torch.ones(hidden)) if config.pre_affine else None
        self.gate_down, self.gate_up = gated_norm_gates(hidden, config.gated_norm_rank, prefix)
        mark_float32_loadable(self.weight)  # SmoothQuant's folds, unrounded

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> y (T, H); with `residual`: s = x + residual -> (y of s, s), vLLM's fused-add convention."""
        if residual is not None:
            x = x + residual  # in the model dtype, as GemmaRMSNorm for bf16
            residual = x
        h = x.float() * self.pre_scale.float() if self.pre_scale is not None else x
        y = (rms_normalize(h, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if self.gate_down is not None:  # gate_up with it (gated_norm_gates)
            y = gated_norm_gate(self.gate_down, cast(nn.Module, self.gate_up), y)
        return y if residual is None else (y, residual)


def hybrid_residual_norm(config, prefix: str = "") -> nn.Module:
    """vLLM's GemmaRMSNorm (Qwen3-Next's norm) without norm flags; `QuantkitHybridNorm` with PreAffine/GatedNorm."""
    if not config.pre_affine and not config.gated_norm_rank:
        return GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return QuantkitHybridNorm(config, prefix=prefix)


# ------------------------------------------------------------------------------------- attention


class _StockGateView:
    """The hybrid config as vLLM's Qwen3NextAttention reads it: `attn_output_gate` is its boolean (the fused
    elementwise gate in q_proj), every other attribute the config's own."""

    def __init__(self, config) -> None:
        self._config = config
        self.attn_output_gate = config.attn_output_gate == "elementwise"

    def __getattr__(self, name: str):
        return getattr(self._config, name)


class QuantkitHybridAttention(Qwen3NextAttention):
    """vLLM's Qwen3NextAttention with the softmax-layer flags, in this order:

    qkv_proj (q rows with the fused elementwise gate when attn_output_gate == "elementwise") -> q/k norm, RoPE
      -> V-scale (v <- v * r / (r + C), r = ||v_h||^2, C = (d*0.02)^2 exp(theta_h)), before the KV cache
      -> paged attention -> head-wise RMSNorm -> output gate (fused elementwise, or g_proj headwise) -> o_proj.
    """

    def __init__(
        self,
        config,
        model_config: ModelConfig | None = None,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        reduce_results: bool = True,
        prefix: str = "",
    ) -> None:
        super().__init__(
            _StockGateView(config),
            model_config=model_config,
            cache_config=cache_config,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=prefix,
        )
        # headwise GA: one gate per query head; head-major rows, so a column-parallel shard holds its own heads'.
        self.g_proj = None
        if config.attn_output_gate == "headwise":
            self.g_proj = ColumnParallelLinear(
                config.hidden_size,
                self.total_num_heads,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.g_proj",
            )
        self.v_scale_theta = None
        if config.value_scale:
            self.v_scale_theta = _kv_head_sharded_parameter(torch.zeros(self.num_kv_heads), self.total_num_kv_heads)
        self.o_norm = HeadwiseRMSNorm(self.head_dim, config.rms_norm_eps) if config.headwise_rmsnorm else None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions (T,), hidden states (T, H) -> (T, H), in the class docstring's order."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v, gate = self._project_qkv_gate(qkv, positions)  # gate: fused elementwise gate or None
        if self.v_scale_theta is not None:
            per_head = v.contiguous().view(-1, self.num_kv_heads, self.head_dim)
            v = value_scale(per_head, self.v_scale_theta[:, None], self.head_dim).view(v.shape)
        o = self.attn(q, k, v)
        if self.o_norm is not None or gate is not None or self.g_proj is not None:
            o = o.view(-1, self.num_heads, self.head_dim)
            if self.o_norm is not None:
                o = self.o_norm(o)
            if gate is not None:
                o = o * torch.sigmoid(gate.view(-1, self.num_heads, self.head_dim))
            elif self.g_proj is not None:
                head_gate, _ = self.g_proj(hidden_states)
                o = o * torch.sigmoid(head_gate).view(-1, self.num_heads, 1)
            o = o.reshape(-1, self.q_size)
        output, _ = self.o_proj(o)
        return output


# ------------------------------------------------------------------------------------- GLU experts


class GLUExperts(nn.Module):
    """Routed GLU experts: down_e(sigmoid(gate_e(x)) * up_e(x)), weights stacked as w13 (E, 2I, H) = [gate; up]
    and w2 (E, H, I); loads the checkpoint's per-expert `{e}.gate_proj/up_proj/down_proj.<suffix>`. A quantkit
    checkpoint that quantized them gets `quant_method` = `QuantkitGLUExpertsMethod` (its parameters `w13_<suffix>`,
    `w2_<suffix>` and numerics: `quantkit.serve.moe_method`); otherwise they are unquantized, as loaded."""

    SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # vLLM's expert shard ids

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.quant_method = None
        if getattr(quant_config, "quantizes_experts", lambda _: False)(prefix):
            from quantkit.serve.moe_method import QuantkitGLUExpertsMethod

            self.quant_method = QuantkitGLUExpertsMethod(quant_config, prefix)
            self.quant_method.create_weights(self, num_experts, hidden_size, intermediate_size)
            return
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.linears: ExpertLinears | None = None  # the products in this process's summation order, at the first call
        self.ordered = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors `{e}.{gate_proj,up_proj,down_proj}.<suffix>` -> their rows of w13 ([gate; up]) / w2, or
        the quant method's `w13_<suffix>` / `w2_<suffix>`; returns the names of the parameters loaded."""
        inter = self.intermediate_size
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}
        loaded = set()
        for name, tensor in weights:
            expert, proj, suffix = name.split(".")  # "{e}.gate_proj.weight"
            stem = "w2" if proj == "down_proj" else "w13"
            if self.quant_method is not None:
                param = getattr(self, f"{stem}_{suffix}")
                param.weight_loader(param, tensor, name, self.SHARDS[proj], int(expert))
                loaded.add(f"{stem}_{suffix}")
            else:
                getattr(self, stem).data[int(expert), rows[proj]].copy_(tensor)
                loaded.add(stem)
        return loaded

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """x (T, H), top_ids / top_weights (T, k) -> sum_j top_weights[:, j] * expert_{top_ids[:, j]}(x)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, top_ids, top_weights)
        if not self.ordered:  # loaded by now: the numerics stage's second order on CPUs, default on GPUs
            order = "default" if self.w13.is_cuda else summation_order()
            self.linears, self.ordered = ordered_expert_linears(self.w13.data, self.w2.data, order), True
        out = routed_experts_forward(
            x, top_ids, top_weights, self.w13, self.w2, torch.sigmoid, lambda rows, segments, which: rows, self.linears
        )
        return out.to(x.dtype)


class GLUSparseMoeBlock(nn.Module):
    """Qwen3-Next's sparse MoE block with GLU experts: softmax router (float32), top-k, renormalized when
    `norm_topk_prob`, plus the shared GLU expert gated by sigmoid(shared_expert_gate(x)). Parameter names as
    Qwen3NextSparseMoeBlock's (`gate`, `experts`, `shared_expert`, `shared_expert_gate`)."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = ReplicatedLinear(hidden, config.num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate")
        self.experts = GLUExperts(
            config.num_experts,
            hidden,
            config.moe_intermediate_size,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = QuantkitMLP(
                hidden,
                config.shared_expert_intermediate_size,
                "sigmoid",
                quant_config=quant_config,
                prefix=f"{prefix}.shared_expert",
            )
            self.shared_expert_gate = ReplicatedLinear(
                hidden, 1, bias=False, quant_config=None, prefix=f"{prefix}.shared_expert_gate"
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., H): top-k GLU experts (float32 softmax router, renormalized when norm_topk_prob) plus
        the shared expert gated by sigmoid(shared_expert_gate(x))."""
        x = hidden_states.view(-1, hidden_states.shape[-1])
        router_logits, _ = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_ids, top_weights.to(x.dtype))
        if self.shared_expert is not None:
            shared_gate, _ = cast(ReplicatedLinear, self.shared_expert_gate)(x)  # set with shared_expert
            out = out + torch.sigmoid(shared_gate) * self.shared_expert(x)
        return out.view(hidden_states.shape)


# ------------------------------------------------------------------------------------ decoder layer


class QuantkitHybridDecoderLayer(Qwen3NextDecoderLayer):
    """Qwen3NextDecoderLayer (forward inherited) built with the flag-aware norms and softmax attention."""

    def __init__(self, vllm_config: VllmConfig, layer_type: str, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.layer_type = layer_type
        self.layer_idx = extract_layer_index(prefix)
        self.use_attn_reduce_scatter_for_moe = _should_use_sequence_parallel(vllm_config)
        if layer_type == "linear_attention":
            self.linear_attn = QwenGatedDeltaNetAttention(
                config,
                vllm_config=vllm_config,
                prefix=f"{prefix}.linear_attn",
                gqa_interleaved_layout=True,
                reduce_results=not self.use_attn_reduce_scatter_for_moe,
            )
            self.linear_attn.activation = DELTANET_CONV_ACT
        elif layer_type == "full_attention":
            self.self_attn = QuantkitHybridAttention(
                config,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                reduce_results=not self.use_attn_reduce_scatter_for_moe,
                prefix=f"{prefix}.self_attn",
            )
        else:
            raise ValueError(f"Invalid layer_type {layer_type}")
        is_moe_layer = self.layer_idx not in (config.mlp_only_layers or []) and (
            config.num_experts > 0 and (self.layer_idx + 1) % config.decoder_sparse_step == 0
        )
        glu = config.hidden_act == "sigmoid"
        self.mlp: nn.Module
        if is_moe_layer and glu:
            self.mlp = GLUSparseMoeBlock(config, quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp")
        elif is_moe_layer:
            self.mlp = Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        elif glu:
            self.mlp = QuantkitMLP(
                config.hidden_size,
                config.intermediate_size,
                "sigmoid",
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp",
            )
        else:
            self.mlp = Qwen3NextMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = hybrid_residual_norm(config, prefix=f"{prefix}.input_layernorm")
        self.post_attention_layernorm = hybrid_residual_norm(config, prefix=f"{prefix}.post_attention_layernorm")
        self.layer_scale = False


# ------------------------------------------------------------------------------- model, LM head


@support_torch_compile
class QuantkitHybridModel(Qwen3NextModel):
    """Qwen3NextModel (forward, weight mapping and loading inherited) with quantkit hybrid layers and final norm.

    Flag parameter names (g_proj, v_scale_theta, o_norm, pre_scale, gate_down/gate_up) contain none of the
    stacked-weight substrings of Qwen3NextModel.hf_to_vllm_mapper (".q_proj", ".mlp.gate_proj", ...), so they
    load by name.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, config.hidden_size)

        def get_layer(prefix: str) -> QuantkitHybridDecoderLayer:
            return QuantkitHybridDecoderLayer(
                vllm_config, layer_type=config.layer_types[extract_layer_index(prefix)], prefix=prefix
            )

        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, get_layer, prefix=f"{prefix}.layers"
        )
        self.is_fused_shared_expert_enabled = is_model_fused_shared_expert_compatible(
            self.layers, Qwen3NextSparseMoeBlock, "mlp"
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
        if get_pp_group().is_last_rank:
            self.norm = hybrid_residual_norm(config, prefix=f"{prefix}.norm")
        else:
            self.norm = PPMissingLayer()
        self.aux_hidden_state_layers: tuple[int, ...] = ()


class QuantkitHybridForCausalLM(Qwen3NextForCausalLM):
    """vLLM model for `architectures: ["QuantkitHybridForCausalLM"]` (model_type quantkit_hybrid).

    Everything but `__init__` is Qwen3NextForCausalLM's (mamba-state shapes and dtypes, MoE metadata, loading).
    GLU checkpoints expose no fused-MoE layers to vLLM's expert-parallel / EPLB machinery (num_moe_layers = 0).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.quant_config = vllm_config.quant_config
        self.config = config
        self.scheduler_config = vllm_config.scheduler_config
        self.model = QuantkitHybridModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        if config.hidden_act == "sigmoid":
            self.num_moe_layers = 0
        else:
            self.set_moe_parameters()
