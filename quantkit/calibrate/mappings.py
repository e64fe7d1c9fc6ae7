"""Which layers SmoothQuant smooths, and how a smoothing factor folds into each kind of layer.

SmoothQuant (Xiao et al. 2023; paper 000 App. A.4.2 applies it before FP8 and NVFP4) migrates activation
outliers into weights: a *smoothing layer* divides its output channel j by s_j, and every *consumer* (a
linear reading exactly that output) multiplies its input column j by s_j. The product is unchanged, so
the model computes the same function; only the ranges the quantizer sees move.

Mappings per decoder layer (Llama, Qwen2, Qwen3, Mistral and quantkit's own family):

| smoothing layer          | consumers                                  | when |
|--------------------------|--------------------------------------------|------|
| input_layernorm          | q_proj, k_proj, v_proj (+ g_proj with GA)  | always (the GA gate reads the same normed input) |
| post_attention_layernorm | gate_proj, up_proj                         | always |
| v_proj                   | o_proj                                     | include_v_o, only where attention is linear in v |
| up_proj                  | down_proj                                  | include_up_down (up enters act(gate)*up linearly) |

The final norm feeds lm_head, which stays BF16 (quantkit's default ignore list): it is not smoothed.

These tables are data: each part of a layer is a `LayerPart` (its `NormGroup`, the v->o / up->down pair it
offers, the linears it quantizes unsmoothed): `SOFTMAX_ATTENTION`, `GLU_MLP` here, `GATED_DELTANET` and
`SPARSE_MOE` below; `ARCHITECTURES` gives each registered architecture its `DecoderFamily` (parts per slot, the
attention / MLP classes v->o and up->down are valid for). A decoder of the same shape is one line there.

Gemma 2 and 3 (`SANDWICH`) have four norms a layer: input_layernorm -> q/k/v, pre_feedforward_layernorm -> gate/up;
their post_attention_layernorm and post_feedforward_layernorm normalize o_proj's and down_proj's outputs before the
residual add and feed no linear (not smoothed). Their attention is softmax (Gemma 2's logit soft-capping acts on
q k^T, not on v) and their MLP a GLU (gelu-tanh), so v -> o and up -> down hold as for Llama.

Architectures with no ARCHITECTURES entry (Phi-3, Mixtral, Qwen3-MoE, ...) take the structural rule,
`traced_mappings`: each decoder layer runs once on 8 random positions with hooks, which find which of its norms
feeds which linears (routers, fused experts) by equal values at the consumers' inputs (on Gemma it finds the
table's norm mappings: pre_feedforward_layernorm -> gate/up, the post-attention / post-feedforward norms left
alone). Norm mappings only; a norm without a registered fold is refused by name. A layer on the meta
device (the streaming skeleton, the check before loading) gets random weights for its pass: no weight is read.

v_proj -> o_proj needs everything between the two to commute with a per-channel scale of v. Softmax
attention is a convex combination of value rows (it does); the GA gate multiplies per head or per channel
(it does); the learnable sink v' replaces v at position 0 (it does, if v' is divided by s too). V-scale
(v * r/(r+C), r = ||v||^2) and head-wise RMSNorm (o_h / RMS(o_h)) are not homogeneous per channel in v:
the mapping is refused there. With GQA, o_proj column h*D+d reads KV channel (h//G)*D+d (transformers'
repeat_kv), so one factor per KV channel is repeated across the G query heads of its group.

Folding a factor into each kind of smoothing layer (`fold_output`, registered per module class):
- RMSNorm (also PreAffine): weight /= s. PreAffine's pre_scale acts before the normalization; untouched.
- DyT: y = weight * tanh(alpha x) + bias: weight /= s and bias /= s.
- GatedNorm / GatedDyT: y' = sigmoid(gate_up(silu(gate_down(y)))) * y. Dividing y by s would change the
  gate's input, so gate_down's columns are multiplied by s as well: the gate value stays the same and y'
  is divided by s exactly. Statistics are taken at the consumers' input, i.e. after the gate.
- LayerNorm: weight /= s and bias /= s.
- Linear (v_proj, up_proj): rows and bias /= s.
- (1+w)-parameterised RMSNorm (Qwen3NextRMSNorm: y = x_hat * (1 + w), w initialised to 0): dividing y by s
  means 1 + w' = (1 + w) / s, i.e. w' = (1 + w) / s - 1 (float32, rounded once). Not "w /= s": that would
  scale only the offset. Precision: the stored w' is an offset from 1, so its absolute rounding error is
  about u * max(1, |w'|) (u = 2**-24 float32, 2**-8 bfloat16) while the effective scale is (1 + w) / s: a
  large s (effective scale << 1) loses relative precision s / (1 + w) times faster than a plain RMSNorm.
  Fold in float32 (quantkit quantize does) and keep such norm weights in float32 where s is large.

Hybrid MoE decoders (Qwen3-Next: Gated DeltaNet layers `linear_attn` in 3 of 4 layers, gated softmax
attention `self_attn` in the 4th, sparse MoE `mlp` with router `gate`, fused routed `experts`, a
`shared_expert` GLU MLP and a `shared_expert_gate`), matched by structure, not class name:

| smoothing layer          | consumers                                                        | when |
|--------------------------|------------------------------------------------------------------|------|
| input_layernorm          | linear_attn.in_proj_qkvz, linear_attn.in_proj_ba                 | Gated DeltaNet layers |
| input_layernorm          | self_attn.q_proj (q and its output gate, fused), k_proj, v_proj  | softmax layers |
| input_layernorm          | + self_attn.g_proj                                               | headwise GA (quantkit hybrid) |
| post_attention_layernorm | mlp.gate (router), every expert's gate/up (experts.gate_up_proj), shared_expert.gate_proj/up_proj, shared_expert_gate | MoE layers, `experts=True` |
| post_attention_layernorm | mlp.gate_proj, mlp.up_proj                                       | dense-MLP layers |
| v_proj / up_proj         | o_proj / down_proj                                                | as above (softmax layers; shared expert and dense MLPs) |

Every reader of a smoothed norm gets the fold, or the function changes. The router and the shared-expert
gate stay unquantized (recipe ignore list) but their weight columns are multiplied by s all the same: the
router's logits x W_r^T are then unchanged, so routing (top-k ids and weights) is unchanged. They are
`fold_only` consumers: folded, but their weights do not enter max|W_j| in the factor (they are never
quantized). `experts=False` leaves the whole MoE-layer norm mapping out (what peers do: llm-compressor
skips MoE blocks and has no Qwen3-Next mapping); the norm then keeps its outliers for the experts.
quantkit's hybrid family (QuantkitHybridForCausalLM): its QuantkitHybridNorm folds as a (1+w) norm (PreAffine's
pre_scale untouched, GatedNorm's gate_down columns x s); V-scale / head-wise RMSNorm refuse v_proj -> o_proj as
in the dense family; GLU experts keep the gated expert layout (docs/smoothquant-moe.md, per flag).
Not smoothed: the Gated DeltaNet's gated RMSNorm -> out_proj (its per-head-dim weight is shared by all
heads and multiplied by silu(z) per channel: possible, not implemented), and routed experts' up -> down
(needs one factor vector per expert).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard, TypeVar, cast

import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2MLP, Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3MLP, Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP, MistralRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextMLP, Qwen3NextRMSNorm

from quantkit.calibrate.layers import layer_arguments
from quantkit.errors import QuantkitError
from quantkit.formats.experts import is_fused_experts
from quantkit.models.modeling import QuantkitAttention, QuantkitNorm
from quantkit.models.modeling_hybrid import QuantkitHybridNorm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

KINDS = ("norm", "v_o", "up_down")


class SmoothQuantMappingError(QuantkitError, ValueError):
    """The model's structure cannot be smoothed (as asked); the message names the modules."""


@dataclass(frozen=True)
class SmoothMapping:
    """One smoothing layer and the linears that read its output.

    `kv_groups` / `head_dim` describe v_proj -> o_proj under GQA: consumer input channel h*D+d reads the
    smoothing layer's channel (h // kv_groups)*D + d. `extra_divide` names parameters that hold further
    copies of the smoothed channels (the attention sink's v', shape (kv_heads, head_dim)): they are divided
    by s together with the smoothing layer. `fold_only`: consumers (a subset of `consumers`) that are folded
    but stay unquantized (router, shared-expert gate), so their weights do not enter max|W_j|.
    """

    smooth: str
    consumers: tuple[str, ...]
    kind: str
    kv_groups: int = 1
    head_dim: int = 0
    extra_divide: tuple[str, ...] = ()
    fold_only: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """A short label for reports: the smoothing layer and its consumers' last name parts."""
        return f"{self.smooth} -> {', '.join(c.rsplit('.', 1)[-1] for c in self.consumers)}"

    def channel_index(self, in_features: int, device: torch.device | None = None) -> torch.Tensor:
        """For each consumer input channel, the smoothing-layer channel it reads (int64, length in_features)."""
        idx = torch.arange(in_features, device=device)
        if self.kind != "v_o" or self.kv_groups == 1:
            return idx
        head, d = idx // self.head_dim, idx % self.head_dim
        return (head // self.kv_groups) * self.head_dim + d


# ---------------------------------------------------------------------------------------------------
# Folding: divide a smoothing layer's output channel j by s_j, exactly (registered per module class)

FoldFn = Callable[[nn.Module, torch.Tensor], None]
_FOLDS: dict[type, FoldFn] = {}
# A fold takes an instance of the classes it is registered for (a narrower first argument than FoldFn's).
_Fold = TypeVar("_Fold", bound=Callable[..., None])


def folds(*classes: type) -> Callable[[_Fold], _Fold]:
    """Register `fn(module, s)` as the way to divide the output channels of `classes` by s."""

    def register(fn: _Fold) -> _Fold:
        for cls in classes:
            _FOLDS[cls] = fn
        return fn

    return register


def fold_fn_for(module: nn.Module) -> FoldFn | None:
    """The registered fold for `module`'s exact class (subclasses may change the forward: not inherited)."""
    return _FOLDS.get(type(module))


def fold_output(module: nn.Module, s: torch.Tensor) -> None:
    """Divide `module`'s output channel j by s[j] by rescaling its parameters in place."""
    fn = fold_fn_for(module)
    if fn is None:
        raise SmoothQuantMappingError(f"no SmoothQuant fold registered for {type(module).__name__}")
    fn(module, s)


@torch.no_grad()
def scale_(param: torch.Tensor, factor: torch.Tensor) -> None:
    """param *= factor (broadcast), computed in float32 and rounded once to param's dtype."""
    param.copy_((param.float() * factor.to(param.device, torch.float32)).to(param.dtype))


@folds(LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm, MixtralRMSNorm, Phi3RMSNorm, Qwen3MoeRMSNorm)
def _fold_rmsnorm(norm: nn.Module, s: torch.Tensor) -> None:
    scale_(cast(torch.Tensor, norm.weight), 1.0 / s)


@folds(nn.LayerNorm)
def _fold_layernorm(norm: nn.LayerNorm, s: torch.Tensor) -> None:
    scale_(norm.weight, 1.0 / s)
    if norm.bias is not None:
        scale_(norm.bias, 1.0 / s)


@folds(QuantkitNorm)
def fold_quantkit_norm(norm: QuantkitNorm, s: torch.Tensor, fold_gate: bool = True) -> None:
    """RMSNorm/PreAffine: weight /= s; DyT: weight and bias /= s; GatedNorm: also gate_down columns *= s.

    `fold_gate=False` exists only to demonstrate (in tests) that the gate fold is what keeps GatedNorm
    function-preserving.
    """
    scale_(norm.weight, 1.0 / s)
    if hasattr(norm, "bias"):  # DyT beta
        scale_(norm.bias, 1.0 / s)
    if hasattr(norm, "gate_down") and fold_gate:  # gate_down(y / s * s) == gate_down(y)
        scale_(norm.gate_down.weight, s[None, :])


# Norms computing y = x_hat * (1 + w): their scale is 1 + weight (the hybrid family, Gemma 1-3); diagnostics read
# them as such too. Subclasses (QuantkitHybridNorm) are instances, but a fold is registered per exact class.
OFFSET_NORMS = (Qwen3NextRMSNorm, GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm)


@folds(*OFFSET_NORMS, QuantkitHybridNorm)
def fold_offset_rmsnorm(norm: nn.Module, s: torch.Tensor, fold_gate: bool = True) -> None:
    """y = x_hat * (1 + w): w' = (1 + w) / s - 1 in float32, rounded once (module docstring: precision).

    A GatedNorm gate on such a norm (a `gate_down` Linear reading y) gets its columns multiplied by s, as in
    `fold_quantkit_norm`; a PreAffine `pre_scale` acts before the normalization and is untouched. Subclasses
    with those flags register this function for their class (`folds(cls)(fold_offset_rmsnorm)`)."""
    with torch.no_grad():
        w = cast(torch.Tensor, norm.weight)
        w.copy_(((1.0 + w.float()) / s.to(w.device, torch.float32) - 1.0).to(w.dtype))
    if hasattr(norm, "gate_down") and fold_gate:
        scale_(cast(nn.Linear, norm.gate_down).weight, s[None, :])


def is_router(module: nn.Module) -> bool:
    """A MoE router that is not an nn.Linear: a 2-D `weight` (num_experts, hidden) and a `top_k` (transformers
    5.x `*TopKRouter`; matched by structure)."""
    weight = getattr(module, "weight", None)
    return (
        not isinstance(module, nn.Linear)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and hasattr(module, "top_k")
    )


def input_weight(module: nn.Module) -> torch.Tensor:
    """The parameter of a consumer whose LAST dimension indexes its input channels: nn.Linear and router
    weight (out, K), fused routed experts' gate_up_proj (E, 2I, K). Multiplying its column j by s_j is the
    consumer's half of the fold."""
    if isinstance(module, nn.Linear) or is_router(module):
        return cast(torch.Tensor, module.weight)
    if is_fused_experts(module):
        return cast(torch.Tensor, module.gate_up_proj)
    raise SmoothQuantMappingError(
        f"{type(module).__name__} is no consumer SmoothQuant knows (Linear, router, fused experts)"
    )


@folds(nn.Linear)
def _fold_linear_rows(linear: nn.Linear, s: torch.Tensor) -> None:
    scale_(linear.weight, (1.0 / s)[:, None])
    if linear.bias is not None:
        scale_(linear.bias, 1.0 / s)


# ---------------------------------------------------------------------------------------------------
# Architectures: which decoder structure each supports, and where v->o / up->down are valid


@dataclass(frozen=True)
class NormGroup:
    """A norm of a decoder layer and the modules reading its output, smoothed together; layer-relative paths.

    A path ending in "?" is optional: used where the layer has it (GA's g_proj, a shared expert), else
    ignored; any other missing path is a problem the plan names. `consumers` are nn.Linear except those in
    `any_module` (fused experts, a transformers router); `fold_only` consumers are folded but never quantized
    (routers, gates), so their weights stay out of max|W_j|. `experts`: the group of a MoE block, dropped by
    `experts=False`."""

    norm: str
    consumers: tuple[str, ...]
    fold_only: tuple[str, ...] = ()
    any_module: tuple[str, ...] = ()
    experts: bool = False


@dataclass(frozen=True)
class LayerPart:
    """One part of a decoder layer as data, a token mixer or an MLP: its norm group; the attention whose
    v_proj -> o_proj (`v_o`) or the GLU MLP whose up_proj -> down_proj (`up_down`) it may smooth (paths, "?" =
    optional); the linears it quantizes that no norm feeds (`unsmoothed`); lines the plan records when v->o or
    up->down is asked of a part that has none (`no_v_o` always, `no_up_down` when asked). `when`: the part
    applies to layers for which it is true (None: every layer)."""

    norm: NormGroup
    v_o: str | None = None
    up_down: str | None = None
    unsmoothed: tuple[str, ...] = ()
    no_v_o: str | None = None
    no_up_down: str | None = None
    when: Callable[[nn.Module], bool] | None = None


SOFTMAX_ATTENTION = LayerPart(
    NormGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.g_proj?")),
    v_o="self_attn",
    unsmoothed=("self_attn.o_proj",),
)
GATED_DELTANET = LayerPart(  # both input projections read the normed input
    NormGroup("input_layernorm", ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")),
    unsmoothed=("linear_attn.out_proj",),
    no_v_o="v_proj -> o_proj: Gated DeltaNet layers have no softmax attention (their out_proj reads a gated RMSNorm)",
    when=lambda layer: hasattr(layer, "linear_attn"),
)
GLU_MLP = LayerPart(
    NormGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    up_down="mlp",
    unsmoothed=("mlp.down_proj",),
)
SPARSE_MOE = LayerPart(
    NormGroup(
        "post_attention_layernorm",
        (
            "mlp.gate",
            "mlp.experts",
            "mlp.shared_expert.gate_proj?",
            "mlp.shared_expert.up_proj?",
            "mlp.shared_expert_gate?",
        ),
        fold_only=("mlp.gate", "mlp.shared_expert_gate"),
        any_module=("mlp.gate", "mlp.experts"),
        experts=True,
    ),
    up_down="mlp.shared_expert?",
    unsmoothed=("mlp.shared_expert.down_proj?",),
    no_up_down="routed experts' up_proj -> down_proj: not implemented (one factor vector per expert)",
    when=lambda layer: _is_sparse_moe(getattr(layer, "mlp", None)),
)


@dataclass(frozen=True)
class DecoderFamily:
    """A decoder whose layers sit at model.model.layers: per slot of a layer (token mixer, MLP), the LayerPart
    alternatives, the first whose `when` holds applying. `linear_attention`: attention classes whose output is
    linear in v per channel (v->o allowed, subject to `_v_o_problem`). `glu_mlps`: MLP classes computing
    down(act(gate(x)) * up(x)) (up->down allowed). `subclasses`: match those classes with isinstance (else the
    exact class)."""

    linear_attention: tuple[type, ...]
    glu_mlps: tuple[type, ...]
    slots: tuple[tuple[LayerPart, ...], ...] = ((SOFTMAX_ATTENTION,), (GLU_MLP,))
    subclasses: bool = False
    no_residual_rotation: str | None = None  # why a residual rotation cannot preserve the function, None: it can


_STOCK = DecoderFamily(
    linear_attention=(LlamaAttention, Qwen2Attention, Qwen3Attention, MistralAttention),
    glu_mlps=(LlamaMLP, Qwen2MLP, Qwen3MLP, MistralMLP),
)
# Qwen3-Next: Gated DeltaNet or softmax attention (whose output gate sigmoid(g) multiplies per channel: still
# linear in v); a sparse MoE block or a dense GLU MLP.
HYBRID = DecoderFamily(
    linear_attention=(Qwen3NextAttention,),
    glu_mlps=(Qwen3NextMLP,),
    slots=((GATED_DELTANET, SOFTMAX_ATTENTION), (SPARSE_MOE, GLU_MLP)),
    subclasses=True,
)
# Gemma 2 / 3: the MLP reads pre_feedforward_layernorm; post_attention_layernorm and post_feedforward_layernorm
# normalize the writers' outputs (sandwich norms) and feed no linear.
SANDWICH_GLU_MLP = LayerPart(
    NormGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    up_down="mlp",
    unsmoothed=("mlp.down_proj",),
)
SANDWICH = DecoderFamily(
    linear_attention=(Gemma2Attention, Gemma3Attention),
    glu_mlps=(Gemma2MLP, Gemma3MLP),
    slots=((SOFTMAX_ATTENTION,), (SANDWICH_GLU_MLP,)),
    no_residual_rotation=(
        "its sandwich norms (post_attention_layernorm, post_feedforward_layernorm) normalize o_proj's and "
        "down_proj's outputs and scale them per channel by (1 + w) before the residual add: RMSNorm(o Q) (1 + w) "
        "is not RMSNorm(o) (1 + w) Q unless w is uniform, and no fold into the writer restores it"
    ),
)
ARCHITECTURES: dict[str, DecoderFamily] = {
    "Gemma2ForCausalLM": SANDWICH,
    "Gemma3ForCausalLM": SANDWICH,
    "LlamaForCausalLM": _STOCK,
    "Qwen2ForCausalLM": _STOCK,
    "Qwen3ForCausalLM": _STOCK,
    "MistralForCausalLM": _STOCK,
    "QuantkitForCausalLM": DecoderFamily(linear_attention=(QuantkitAttention,), glu_mlps=(Qwen3MLP,)),
    "Qwen3NextForCausalLM": HYBRID,
    "QuantkitHybridForCausalLM": HYBRID,
}

# Parameters of an attention module (its own, not its submodules') and what they mean for v -> o.
_ATTN_COMMUTING = {
    "sink_key": "the sink key k' (does not touch v)",
    "sink_value": "the sink value v' (divided by s too)",
}
_ATTN_NONLINEAR_IN_V = {
    "v_scale_theta": "V-scale (v * r/(r+C) with r = ||v||^2) is not homogeneous per channel in v",
    "o_norm": "head-wise RMSNorm (o_h / RMS(o_h) * lambda) normalizes each head's output by its RMS over all channels",
}
# Submodules of attention that do not sit between v_proj and o_proj (q/k norms act on q and k)
_ATTN_SUBMODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "q_norm", "k_norm", "rotary_emb"}


@dataclass(frozen=True)
class MappingPlan:
    """The mappings to smooth, plus a line for each optional mapping that was not applied, and why."""

    architecture: str
    mappings: tuple[SmoothMapping, ...]
    skipped: tuple[str, ...]


def resolve_mappings(
    model: nn.Module,
    include_v_o: bool = False,
    include_up_down: bool = False,
    experts: bool = True,
) -> MappingPlan:
    """The SmoothQuant mappings of `model`.

    experts: smooth the MoE layers' post_attention_layernorm into the router, every expert, the shared
    expert and its gate (hybrid MoE decoders; no effect on dense ones). Raises SmoothQuantMappingError naming
    every module that could not be mapped (missing, of a class with no registered fold, or a linear that no
    mapping accounts for), and when include_v_o / include_up_down asks for a mapping that is not
    function-preserving for this model (naming the reason).
    """
    architecture = type(model).__name__
    layers = _decoder_layers(model, architecture)
    family = _table_family(model, layers)
    if family is None:
        for kind, wanted in (("v_proj -> o_proj", include_v_o), ("up_proj -> down_proj", include_up_down)):
            if wanted:
                raise SmoothQuantMappingError(
                    f"{kind} smoothing needs a registered architecture (whether it is function-preserving depends "
                    f"on the attention / MLP classes); {architecture} has no ARCHITECTURES entry: norm mappings only"
                )
        return traced_mappings(model, architecture, layers)
    problems: list[str] = []
    mappings: list[SmoothMapping] = []
    skipped: list[str] = []
    asked = _Asked(include_v_o, include_up_down, experts)
    for i, layer in enumerate(layers):
        mappings += _layer_mappings(layer, f"model.layers.{i}", family, asked, problems, skipped)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise SmoothQuantMappingError(
            f"SmoothQuant cannot map {architecture}: "
            + "; ".join(problems[:3])
            + more
            + f". Foldable smoothing layers: {sorted(c.__name__ for c in _FOLDS)}. Recipes without SmoothQuant "
            "(w8a8_fp8_block, w4a4_nvfp4, ...) still work."
        )
    return MappingPlan(architecture, tuple(mappings), tuple(dict.fromkeys(skipped)))


def layer_norms(layer: nn.Module, width: int) -> dict[str, nn.Module]:
    """A decoder layer's own norms of the residual width, by structure: its direct children with a (width,) weight
    (norms of any class -- Llama's input/post-attention pair, Gemma 2/3's four; a Linear's weight is 2-D, per-head
    q/k norms sit inside the attention)."""
    return {n: m for n, m in layer.named_children() if getattr(getattr(m, "weight", None), "shape", None) == (width,)}


def _consumer_kind(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_router(module) or is_fused_experts(module)


@torch.no_grad()
def traced_mappings(model: PreTrainedModel, architecture: str, layers: nn.ModuleList) -> MappingPlan:
    """The structural rule for architectures with no ARCHITECTURES entry: which of a decoder layer's norms feeds
    which linears, found by running each decoder layer once on 8 random positions with hooks (a consumer reads a
    norm's output when its input holds the same numbers as that output), with the arguments the model's own
    forward gives it (`layer_arguments`). A layer on the meta device (the skeleton of streaming quantization, or of
    the check before loading) is given random weights for its pass and put back: the structure decides, not the
    values, so the weights need not be loaded. Each norm with consumers becomes a "norm" mapping (routers and
    MoE/shared-expert gates fold_only); norms that feed no linear (Gemma's post-attention and post-feedforward
    norms feed the residual) are left alone. A norm that feeds linears but has no registered fold (`folds`) is
    refused by name."""
    width = model.get_input_embeddings().weight.shape[1]
    real = next((p for p in model.parameters() if not p.is_meta), None)
    device, dtype = (real.device, real.dtype) if real is not None else (torch.device("cpu"), torch.float32)
    hidden = torch.randn(1, 8, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    arguments = layer_arguments(model, layers, hidden)
    outputs: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        on_meta = any(p.is_meta for p in layer.parameters())
        if on_meta:
            _random_weights(model, layer)
        handles = []
        for name, norm in layer_norms(layer, width).items():
            handles.append(
                norm.register_forward_hook(
                    lambda _m, _a, out, key=f"model.layers.{i}.{name}": outputs.__setitem__(key, out.detach())
                )
            )
        for name, module in layer.named_modules():
            if name and _consumer_kind(module):
                handles.append(
                    module.register_forward_hook(
                        lambda _m, args, kwargs, _o, key=f"model.layers.{i}.{name}": inputs.__setitem__(
                            key, (args[0] if args else kwargs["hidden_states"]).detach()
                        ),
                        with_kwargs=True,
                    )
                )
        try:
            layer(hidden, **arguments[i])
        finally:
            for h in handles:
                h.remove()
            if on_meta:
                layer.to("meta")
    mappings, problems = [], []
    for norm_name, y in outputs.items():
        y = y.reshape(-1, width)
        consumers = tuple(
            n
            for n, x in inputs.items()
            if n.startswith(norm_name.rsplit(".", 1)[0] + ".")
            and x.shape[-1] == width
            and x.numel() == y.numel()
            and torch.equal(x.reshape(-1, width), y)
        )
        if not consumers:
            continue
        norm = model.get_submodule(norm_name)
        if fold_fn_for(norm) is None:
            problems.append(f"{norm_name} ({type(norm).__name__}: no fold registered) feeds {', '.join(consumers)}")
            continue
        fold_only = tuple(
            c for c in consumers if is_router(model.get_submodule(c)) or c.endswith((".mlp.gate", "shared_expert_gate"))
        )
        mappings.append(SmoothMapping(norm_name, consumers, "norm", fold_only=fold_only))
    if problems:
        raise SmoothQuantMappingError(
            f"SmoothQuant cannot fold {architecture}: "
            + "; ".join(problems[:3])
            + (" ..." if len(problems) > 3 else "")
            + ". Recipes without SmoothQuant (w8a8_fp8_block, w4a4_nvfp4, ...) still work."
        )
    if not mappings:
        raise SmoothQuantMappingError(
            f"SmoothQuant found no norm of {architecture} that feeds a linear; recipes "
            "without SmoothQuant (w8a8_fp8_block, w4a4_nvfp4, ...) still work"
        )
    logger.info("SmoothQuant: %s is not registered: %d norm mappings traced", architecture, len(mappings))
    return MappingPlan(architecture, tuple(mappings), ())


def _random_weights(model: PreTrainedModel, layer: nn.Module) -> None:
    """Give a decoder layer on the meta device float32 CPU tensors, initialized as the model initializes them."""
    layer.to_empty(device="cpu")
    for module in layer.modules():
        model._init_weights(module)


def _table_family(model: nn.Module, layers: nn.ModuleList) -> DecoderFamily | None:
    """The ARCHITECTURES entry of `model`, HYBRID for unregistered models with Gated DeltaNet / sparse MoE layers,
    None where only the structural rule (a traced forward) can map it."""
    family = ARCHITECTURES.get(type(model).__name__)
    if family is None and any(_is_hybrid_layer(layer) for layer in layers):
        logger.info("SmoothQuant: %s has Gated DeltaNet / sparse MoE layers: hybrid MoE mappings", type(model).__name__)
        return HYBRID
    return family


def _decoder_layers(model: nn.Module, architecture: str) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        children = [name for name, _ in model.named_children()]
        raise SmoothQuantMappingError(
            f"SmoothQuant cannot map {architecture}: no decoder layers at model.model.layers (top-level "
            f"modules: {children}); registered architectures: {sorted(ARCHITECTURES)}"
        )
    return layers


def _is_sparse_moe(mlp: nn.Module | None) -> TypeGuard[nn.Module]:
    """A MoE block: fused routed `experts` and a router `gate` (nn.Linear or a transformers *TopKRouter)."""
    gate = getattr(mlp, "gate", None)
    return is_fused_experts(getattr(mlp, "experts", nn.Module())) and (
        isinstance(gate, nn.Linear) or (gate is not None and is_router(gate))
    )


def _is_hybrid_layer(layer: nn.Module) -> bool:
    return hasattr(layer, "linear_attn") or _is_sparse_moe(getattr(layer, "mlp", None))


@dataclass(frozen=True)
class _Asked:
    """The optional mappings a caller asked for (`resolve_mappings`)."""

    v_o: bool
    up_down: bool
    experts: bool


class _LayerLookup:
    """Finds a layer's submodules by path ("?" suffix: optional), recording what is missing or of the wrong kind in
    `problems`; `found` collects the layer-relative paths of every module found."""

    def __init__(self, layer: nn.Module, prefix: str, problems: list[str]) -> None:
        self.layer, self.prefix, self.problems = layer, prefix, problems
        self.found: list[str] = []

    def __call__(self, path: str, linear: bool = False, foldable: bool = False) -> nn.Module | None:
        path, optional = path.removesuffix("?"), path.endswith("?")
        try:
            found = self.layer.get_submodule(path)
        except AttributeError:
            if not optional:
                self.problems.append(f"{self.prefix}.{path} (missing)")
            return None
        if linear and not isinstance(found, nn.Linear):
            if not optional:
                self.problems.append(f"{self.prefix}.{path} ({type(found).__name__}, expected nn.Linear)")
            return None
        if foldable and fold_fn_for(found) is None:
            self.problems.append(f"{self.prefix}.{path} ({type(found).__name__}: no fold registered)")
            return None
        self.found.append(path)
        return found


def _norm_gate_linears(norms: dict[str, nn.Module | None]) -> set[str]:
    """A GatedNorm's own gate linears (folded with its norm, kept BF16), by layer-relative name."""
    return {
        f"{name}.{g}"
        for name, norm in norms.items()
        for g in ("gate_down", "gate_up")
        if isinstance(getattr(norm, g, None), nn.Linear)
    }


def _layer_mappings(
    layer: nn.Module, prefix: str, family: DecoderFamily, asked: _Asked, problems: list[str], skipped: list[str]
) -> list[SmoothMapping]:
    """One decoder layer's mappings from its family's table: per slot, the first LayerPart whose `when` holds.
    Every linear of the layer must be a consumer, an unsmoothed linear of a part, or a GatedNorm's gate."""
    out: list[SmoothMapping] = []
    accounted: set[str] = set()
    norms: dict[str, nn.Module | None] = {}
    for alternatives in family.slots:
        part = next(p for p in alternatives if p.when is None or p.when(layer))  # the last has no `when`
        module = _LayerLookup(layer, prefix, problems)
        before = len(problems)
        norm = norms[part.norm.norm] = module(part.norm.norm, foldable=True)
        group = part.norm
        found = [c for c in group.consumers if module(c, linear=c not in group.any_module) is not None]
        consumers = [c.removesuffix("?") for c in found]
        for path in part.unsmoothed:
            module(path, linear=True)
        accounted |= set(module.found)
        if len(problems) > before or norm is None:
            continue
        if group.experts and not asked.experts:
            skipped.append(
                f"{group.norm} -> MoE block (router, experts, shared expert): experts smoothing off "
                "(smoothquant.experts: false, as peers do)"
            )
        else:
            fold_only = tuple(f"{prefix}.{c}" for c in consumers if c in group.fold_only)
            out.append(
                SmoothMapping(
                    f"{prefix}.{group.norm}", tuple(f"{prefix}.{c}" for c in consumers), "norm", fold_only=fold_only
                )
            )
        if part.v_o is not None:
            out += _v_o_mappings(layer.get_submodule(part.v_o), f"{prefix}.{part.v_o}", family, asked.v_o, skipped)
        if part.no_v_o is not None:
            skipped.append(part.no_v_o)
        up_down = None if part.up_down is None else module(part.up_down)
        if part.up_down is not None and up_down is not None:
            path = part.up_down.removesuffix("?")
            out += _up_down_mappings(up_down, f"{prefix}.{path}", family, asked.up_down, skipped)
        if part.no_up_down is not None and asked.up_down:
            skipped.append(part.no_up_down)
    accounted |= _norm_gate_linears(norms)
    unmapped = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and n not in accounted]
    problems += [f"{prefix}.{n} (a linear no mapping accounts for)" for n in unmapped]
    return out


def _v_o_mappings(
    attn: nn.Module, path: str, family: DecoderFamily, include_v_o: bool, skipped: list[str]
) -> list[SmoothMapping]:
    """v_proj -> o_proj of the attention at `path`, if asked and valid (raises if asked and not valid)."""
    v_o_problem = _v_o_problem(attn, family)
    if not include_v_o:
        skipped.append(
            "v_proj -> o_proj: "
            + (f"not valid here ({v_o_problem})" if v_o_problem else "not requested (include_v_o=False)")
        )
        return []
    if v_o_problem:
        raise SmoothQuantMappingError(
            f"v_proj -> o_proj smoothing is not function-preserving for {path}: {v_o_problem}. "
            "Smooth without it (include_v_o=False)."
        )
    # Both looked up as nn.Linear by the caller (_LayerLookup(linear=True)).
    v_proj, o_proj = cast(nn.Linear, attn.v_proj), cast(nn.Linear, attn.o_proj)
    head_dim = cast(int, attn.head_dim)
    heads = o_proj.in_features // head_dim
    kv_heads = v_proj.out_features // head_dim
    if o_proj.in_features != heads * head_dim or v_proj.out_features != kv_heads * head_dim or heads % kv_heads:
        raise SmoothQuantMappingError(
            f"{path}: v_proj out {v_proj.out_features} / o_proj in {o_proj.in_features} are not whole "
            f"heads of head_dim {head_dim} with whole GQA groups"
        )
    extra = (f"{path}.sink_value",) if hasattr(attn, "sink_value") else ()
    return [
        SmoothMapping(
            f"{path}.v_proj",
            (f"{path}.o_proj",),
            "v_o",
            kv_groups=heads // kv_heads,
            head_dim=head_dim,
            extra_divide=extra,
        )
    ]


def _up_down_mappings(
    mlp: nn.Module, path: str, family: DecoderFamily, include_up_down: bool, skipped: list[str]
) -> list[SmoothMapping]:
    """up_proj -> down_proj of the GLU MLP at `path`, if asked (raises if the MLP is not a known GLU)."""
    if not include_up_down:
        skipped.append("up_proj -> down_proj: not requested (include_up_down=False)")
        return []
    known = isinstance(mlp, family.glu_mlps) if family.subclasses else type(mlp) in family.glu_mlps
    if not known:
        raise SmoothQuantMappingError(
            f"up_proj -> down_proj smoothing needs an MLP known to compute down(act(gate(x)) * up(x)); "
            f"{path} is {type(mlp).__name__} (known: {[c.__name__ for c in family.glu_mlps]})"
        )
    return [SmoothMapping(f"{path}.up_proj", (f"{path}.down_proj",), "up_down")]


def _v_o_problem(attn: nn.Module, family: DecoderFamily) -> str | None:
    """Why v_proj -> o_proj would not be function-preserving for `attn`, or None if it is."""
    known = isinstance(attn, family.linear_attention) if family.subclasses else type(attn) in family.linear_attention
    if not known:
        return (
            f"{type(attn).__name__} is not a known attention whose output is linear in v "
            f"(known: {[c.__name__ for c in family.linear_attention]})"
        )
    reasons = [why for name, why in _ATTN_NONLINEAR_IN_V.items() if hasattr(attn, name)]
    if reasons:
        return "; ".join(reasons)
    unknown = [n for n, _ in attn.named_parameters(recurse=False) if n not in _ATTN_COMMUTING]
    unknown += [n for n, _ in attn.named_children() if n not in _ATTN_SUBMODULES]
    if unknown:
        return f"attention has parameters/modules {unknown} whose effect on v is unknown"
    return None
