"""Configuration of the quantkit hybrid family: Qwen3-Next (Gated DeltaNet + gated softmax attention, MoE) plus
the quantkit variant flags that apply to it.

The base is transformers' `Qwen3NextConfig` unchanged (paper 000 App. A.4.1 / Table 5 trains its Table 2 rows on
this shape): `layer_types` puts Gated DeltaNet linear attention in 3 of every 4 layers and softmax attention in every
4th; every layer's FFN is a sparse MoE block (routed experts, top-k, plus one sigmoid-gated shared expert). Stored
with `model_type: "quantkit_hybrid"` and `architectures: ["QuantkitHybridForCausalLM"]` so transformers
(`quantkit.models.modeling_hybrid`) and vLLM (`quantkit.serve.hybrid`) route it to our code; stock checkpoints
(`model_type: "qwen3_next"`) keep loading with transformers' and vLLM's own Qwen3NextForCausalLM.

Qwen3-Next's (1 + w) RMSNorm convention. Every residual-stream norm (input_layernorm, post_attention_layernorm,
the final norm) and the softmax layers' q/k norms are `Qwen3NextRMSNorm` (vLLM: `GemmaRMSNorm`):
    y = x_hat * (1 + w),  x_hat = x / sqrt(mean(x^2) + eps),  w stored in the checkpoint, zero-initialised,
math in float32, cast to the input dtype after the multiplication. The effective per-channel scale is (1 + w),
not w. Where it matters:
- SmoothQuant folding a per-channel divisor s into a norm must write w' = (1 + w) / s - 1 (not w / s), and the
  consumers' columns are multiplied by s as usual;
- PreAffine's pre_scale is a plain multiplier (init 1), applied to x BEFORE the norm; it is not offset;
- GatedNorm acts on y = x_hat * (1 + w), i.e. after the (1 + w) scale;
- DeltaNet's own output norm (`linear_attn.norm`, `Qwen3NextRMSNormGated`, y = x_hat * w * silu(z)) and the
  head-wise RMSNorm flag's `o_norm` (y = x_hat * w) store plain w, init 1.

Flags (the paper definitions and citations are those of `quantkit.models.configuration`; papers in shared/papers/):
- attn_output_gate: None | "headwise" | "elementwise" (default "elementwise" = stock Qwen3-Next) — Gated
  Attention on the softmax layers, o = SDPA(q, k, v) * sigmoid(x W_g). Qwen3-Next already has this gate:
  elementwise, fused into q_proj (q_proj rows are per head [q_h (head_dim); g_h (head_dim)], 2 * heads *
  head_dim in all). The flag maps onto it instead of adding a second gate:
    "elementwise" -> Qwen3-Next's fused gate, stock layout (a stock checkpoint is this config with no other flag);
    "headwise"    -> q_proj without gate rows (heads * head_dim) plus g_proj (hidden -> heads), one gate per head,
                     as the dense family's headwise GA;
    None          -> q_proj without gate rows, no gate.
  (vLLM's Qwen3NextAttention reads a boolean `attn_output_gate`; `quantkit.serve.hybrid` passes it the boolean
  view `attn_output_gate == "elementwise"`.)
- pre_affine: PreAffineRMSNorm(x) = (1 + w) * RMSNorm(pre_scale * x) on every residual-stream norm.
- gated_norm_rank: r > 0 enables GatedNorm after every residual-stream norm, including the DeltaNet layers'
  input norms: y <- sigmoid(W_up swish(W_down y)) * y.
- hidden_act: "silu" (SwiGLU) | "sigmoid" (GLU) for every FFN: routed experts, the shared expert and dense MLPs.
  Qwen3-Next also uses `hidden_act` as the activation of DeltaNet's short convolution; in this family that
  activation is fixed to "silu" (Qwen3-Next's value, DELTANET_CONV_ACT) whatever the FFN activation.
- value_scale: V-scale on the softmax layers (per layer and KV head theta, init 0).
- headwise_rmsnorm: head-wise RMSNorm after value aggregation on the softmax layers (o_norm.weight, head_dim,
  plain w, init 1), applied before the output gate.
Not in this family (dense only): norm_type "dyt" and attention_sink (rejected with an error naming them).
Order on a softmax layer: q/gate, k, v projections -> q/k norm, RoPE -> V-scale -> SDPA -> head-wise RMSNorm
-> output gate -> o_proj. DeltaNet layers are Qwen3-Next's, unchanged; only their input norms carry flags.
"""

from __future__ import annotations

from transformers import Qwen3NextConfig

from quantkit.models.configuration import check_shared_flags, variant_name

DELTANET_CONV_ACT = "silu"  # activation of DeltaNet's short convolution (Qwen3-Next's hidden_act)
HYBRID_VARIANT_FLAGS = ("attn_output_gate", "pre_affine", "gated_norm_rank", "value_scale", "headwise_rmsnorm")
_DENSE_ONLY_FLAGS = ("norm_type", "dyt_alpha_init", "attention_sink")
_BOOKKEEPING_KEYS = {"transformers_version", "quantization_config", "_name_or_path", "auto_map", "torch_dtype"}


class QuantkitHybridConfig(Qwen3NextConfig):
    """Qwen3NextConfig under the `quantkit_hybrid` model type, plus the hybrid variant flags documented above."""

    model_type = "quantkit_hybrid"

    def __init__(
        self,
        attn_output_gate: str | None = "elementwise",
        pre_affine: bool = False,
        gated_norm_rank: int = 0,
        value_scale: bool = False,
        headwise_rmsnorm: bool = False,
        **kwargs,
    ):
        dense_only = sorted(set(kwargs) & set(_DENSE_ONLY_FLAGS))
        if dense_only:
            raise ValueError(
                f"{dense_only} are dense-family flags (QuantkitConfig); the hybrid family has "
                f"{list(HYBRID_VARIANT_FLAGS)} and hidden_act"
            )
        self.attn_output_gate = attn_output_gate
        self.pre_affine = pre_affine
        self.gated_norm_rank = gated_norm_rank
        self.value_scale = value_scale
        self.headwise_rmsnorm = headwise_rmsnorm
        super().__init__(**kwargs)
        self.validate_variant()

    def validate_variant(self) -> None:
        """Raise ValueError naming the problem for unknown keys, unknown flag values, impossible shapes."""
        known = set(Qwen3NextConfig().to_dict()) | set(HYBRID_VARIANT_FLAGS) | _BOOKKEEPING_KEYS
        unknown = sorted(set(self.to_dict()) - known)
        if unknown:
            raise ValueError(
                f"unknown config key(s) {unknown}; quantkit hybrid variant flags are {list(HYBRID_VARIANT_FLAGS)}"
            )
        check_shared_flags(
            self, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok")
        )
        for name in ("pre_affine", "value_scale", "headwise_rmsnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads} (DeltaNet GQA groups must be whole)"
            )
        kinds = {"linear_attention", "full_attention"}
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - kinds:
            raise ValueError(
                f"layer_types must list 'linear_attention' / 'full_attention' for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types}"
            )
        softmax_flags = self.value_scale or self.headwise_rmsnorm or self.attn_output_gate is not None
        if softmax_flags and "full_attention" not in self.layer_types:
            raise ValueError(
                "attention flags (attn_output_gate, value_scale, headwise_rmsnorm) need a full_attention layer"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} > num_experts={self.num_experts}")

    @property
    def variant_name(self) -> str:
        """Short name of the active flags as in the dense family, e.g. "GA(elementwise)+GatedNorm(r16)" (stock
        Qwen3-Next is "GA(elementwise)"; no flag at all is "baseline")."""
        return variant_name(self)
