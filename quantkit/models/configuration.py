"""Configuration of the quantkit model family: a Qwen3-style base plus one flag per rescaling variant.

The base is a Qwen3-style dense decoder (pre-norm RMSNorm, RoPE, GQA, per-head q/k RMSNorm, SwiGLU),
stored with `model_type: "quantkit"` and `architectures: ["QuantkitForCausalLM"]` so that both
transformers and vLLM route it to our code. Papers: shared/papers/ (000 = "A Unified View of Attention
and Residual Sinks", 002 = "Attention Sinks Induce Gradient Sinks", 003 = "The Structural Origin of
Attention Sink", 004 = "Systematic Outliers in LLMs").

Flags (all off by default = the plain Qwen3 base):
- attn_output_gate: None | "headwise" | "elementwise" — Gated Attention (000 sec. 1 and 3.2; Qiu et al.
  2025b): o = SDPA(q, k, v) * sigmoid(x W_g), x the normed layer input, one gate per head or per channel.
- pre_affine: PreAffineRMSNorm(x) = RMSNorm(lambda_1 * x), lambda_1 learnable, init 1 (000 sec. 3.3).
- gated_norm_rank: r > 0 enables GatedNorm (000 sec. 3.4): y' = sigmoid(W_up swish(W_down y)) * y after
  every normalization layer (the paper uses r = 16).
- norm_type: "rmsnorm" | "dyt" — DyT(x) = gamma * tanh(alpha x) + beta in place of RMSNorm (000 sec. 3.1);
  with gated_norm_rank > 0 this is GatedDyT (000 sec. 3.5).
- hidden_act: "silu" (SwiGLU) | "sigmoid" (GLU, 000 sec. 3.2).
- value_scale: V-scale (002 sec. 5.1): v_hat = v * r / (r + C), r = ||v||^2 per token and head,
  C = (d_head * 0.02)^2 * exp(theta), theta learnable per layer and KV head, init 0.
- headwise_rmsnorm: head-wise RMSNorm after value aggregation (003 sec. 5.1, eq. 4):
  o_h <- o_h / RMS(o_h) * lambda, lambda (d_head) shared across heads, before W_O.
- attention_sink: learnable sink k', v' (004 Table 2 (d)): softmax over [K; k'] with values [V; v'],
  realised exactly by overwriting the key and value of position 0 (a BOS token) with k', v' in every
  layer; RoPE at position 0 is the identity.

"Normalization layers" above are the residual-stream norms: each layer's input_layernorm and
post_attention_layernorm, and the final norm. The per-head q/k norms stay plain RMSNorm.
"""

from __future__ import annotations

from transformers import Qwen3Config

ATTN_OUTPUT_GATES = (None, "headwise", "elementwise")
NORM_TYPES = ("rmsnorm", "dyt")
FFN_ACTS = ("silu", "sigmoid")
VARIANT_FLAGS = (
    "attn_output_gate",
    "pre_affine",
    "gated_norm_rank",
    "norm_type",
    "dyt_alpha_init",
    "value_scale",
    "headwise_rmsnorm",
    "attention_sink",
)
# keys transformers and quantkit write into config.json beyond the dataclass fields
_BOOKKEEPING_KEYS = {"transformers_version", "quantization_config", "_name_or_path", "auto_map", "torch_dtype"}


class QuantkitConfig(Qwen3Config):
    """Qwen3Config under the `quantkit` model type, plus the variant flags documented above."""

    model_type = "quantkit"

    def __init__(
        self,
        attn_output_gate: str | None = None,
        pre_affine: bool = False,
        gated_norm_rank: int = 0,
        norm_type: str = "rmsnorm",
        dyt_alpha_init: float = 0.5,
        value_scale: bool = False,
        headwise_rmsnorm: bool = False,
        attention_sink: bool = False,
        **kwargs,
    ):
        self.attn_output_gate = attn_output_gate
        self.pre_affine = pre_affine
        self.gated_norm_rank = gated_norm_rank
        self.norm_type = norm_type
        self.dyt_alpha_init = dyt_alpha_init
        self.value_scale = value_scale
        self.headwise_rmsnorm = headwise_rmsnorm
        self.attention_sink = attention_sink
        super().__init__(**kwargs)
        self.validate_variant()

    def validate_variant(self) -> None:
        """Raise ValueError naming the problem for unknown keys, unknown flag values, impossible shapes."""
        known = set(Qwen3Config().to_dict()) | set(VARIANT_FLAGS) | _BOOKKEEPING_KEYS
        unknown = sorted(set(self.to_dict()) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; quantkit variant flags are {list(VARIANT_FLAGS)}")
        check_shared_flags(
            self, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        )
        _choice("norm_type", self.norm_type, NORM_TYPES)
        if self.pre_affine and self.norm_type == "dyt":
            raise ValueError("pre_affine scales the input of RMSNorm; it has no meaning with norm_type='dyt'")

    @property
    def variant_name(self) -> str:
        """Short human-readable name of the active flags, e.g. "GA(headwise)+GatedNorm(r16)"."""
        return variant_name(self)


def variant_name(config: Qwen3Config) -> str:
    """Short name of the active flags of either family (QuantkitConfig, QuantkitHybridConfig), e.g.
    "GA(headwise)+GatedNorm(r16)"; "baseline" when no flag is on. Dense-only flags read as off when absent."""
    parts = []
    if config.attn_output_gate:
        parts.append(f"GA({config.attn_output_gate})")
    if config.pre_affine:
        parts.append("PreAffine")
    if getattr(config, "norm_type", "rmsnorm") == "dyt":
        parts.append("GatedDyT" if config.gated_norm_rank else "DyT")
    elif config.gated_norm_rank:
        parts.append(f"GatedNorm(r{config.gated_norm_rank})")
    if config.hidden_act == "sigmoid":
        parts.append("GLU")
    if config.value_scale:
        parts.append("V-scale")
    if config.headwise_rmsnorm:
        parts.append("HeadwiseRMSNorm")
    if getattr(config, "attention_sink", False):
        parts.append("AttnSink")
    return "+".join(parts) or "baseline"


def check_shared_flags(config: Qwen3Config, positive: tuple[str, ...]) -> None:
    """The checks both families make (ValueError naming the problem): the output-gate and FFN activation choices,
    the GatedNorm rank, whole GQA groups, and the sizes in `positive` > 0."""
    _choice("attn_output_gate", config.attn_output_gate, ATTN_OUTPUT_GATES)
    _choice("hidden_act", config.hidden_act, FFN_ACTS)
    if not isinstance(config.gated_norm_rank, int) or not 0 <= config.gated_norm_rank <= config.hidden_size:
        raise ValueError(
            f"gated_norm_rank must be an int in [0, hidden_size={config.hidden_size}], got {config.gated_norm_rank!r}"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads} (GQA groups must be whole)"
        )
    for name in positive:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
