"""Rotation (QuaRot, Ashkboos et al. 2024): remove activation outliers by rotating the residual stream, folded
offline into the weights, plus an online block Hadamard at each down-projection's input (dense and routed experts).

An RMSNorm without mean subtraction commutes with an orthogonal Q once its weight is moved out:
RMSNorm(x Q) = RMSNorm(x) Q. So, on the float32 model, in place:
1. each norm feeding the residual's readers gets its scale folded into them (reader columns x w, norm weight 1;
   a (1 + w) norm: x (1 + w), w = 0), the final norm likewise into lm_head;
2. every reader of the residual stream (q/k/v/g, gate/up, Gated DeltaNet in_proj_*, router, fused experts'
   gate_up, lm_head) has W <- W Q; every writer (o_proj, down_proj, out_proj, fused experts' down) W <- Q^T W and
   its bias b <- Q^T b; the embedding E <- E Q. Tied embeddings are untied (lm_head = E diag(w) Q differs from E Q);
3. each dense down_proj (`mlp.down_proj`, a shared expert's) has W <- W (I (x) H_b) and a forward pre-hook
   x <- x (I (x) H_b) (`quantkit.formats.hadamard.block_hadamard`), the transform the checkpoint records under
   `online_hadamard` and the fake-quant reference and vLLM method apply before quantizing that input. Fused routed
   experts likewise: every expert's down_proj (E, H, I) <- down_proj (I (x) H_b), recorded per expert matrix
   (`<experts>.<e>.down_proj`), and the module computes act(gate) * up transformed before down_proj
   (`online_experts_forward`; its `online_hadamard` attribute tells `routed_expert_passes` the same).
   With `online_o`, each attention output projection (`ATTENTION_OUT`: o_proj, Gated DeltaNet's out_proj) likewise.
Q is `residual_rotation(hidden, seed)`, float64; each weight is rotated in float64 and rounded once to float32.

Without a residual rotation (`residual=False`; FP-Quant's per-linear transform for MR-GPTQ, Egiazarian et al.,
arXiv 2509.23202): no norm is folded and the residual stream is untouched; every quantized Linear of the decoder
layers has W <- W (I (x) H_b) and the pre-hook x <- x (I (x) H_b) (and fused routed experts their down_proj, as in
3.), all recorded under `online_hadamard`. Exact in real arithmetic on any decoder, which is what a residual
rotation cannot be on Gemma 2/3: their sandwich norms (post_attention_layernorm, post_feedforward_layernorm)
normalize a writer's output and scale it per channel by (1 + w) before it joins the residual, and
RMSNorm(o Q) (1 + w) differs from RMSNorm(o) (1 + w) Q unless w is uniform; no fold into the writer helps, since
the RMS is of the unscaled output.
The logits of a few windows before and after must agree within `TOLERANCE` of the logit scale, or
FunctionPreservationError (the caller discards the model).

What rotation composes with (docs/rotation.md): SmoothQuant and AWQ (after a residual rotation, on the rotated
model; before an input rotation, searched through it: `search_through_online`), GPTQ, MSE scales, mixed precision
(a rotated down_proj must be quantized: its online transform lives in the quantized method). Variant flags acting
inside the token mixer (gated attention, V-scale, head-wise RMSNorm, sinks) commute with it; those acting per channel
on the residual stream do not (PreAffine's pre_scale, GatedNorm's gate, DyT): refused by name.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from quantkit.calibrate.alpha_search import AlphaSearch
from quantkit.calibrate.layers import decoder_stack
from quantkit.calibrate.mappings import ARCHITECTURES, OFFSET_NORMS, LayerPart, input_weight
from quantkit.calibrate.smoothquant import FunctionPreservationError
from quantkit.errors import QuantkitError
from quantkit.formats.experts import (
    ONLINE_HADAMARD,
    Segments,
    fused_experts_modules,
    is_fused_experts,
    routed_experts_forward,
)
from quantkit.formats.hadamard import block_hadamard, online_block, residual_rotation
from quantkit.models.modeling import QuantkitNorm
from quantkit.models.modeling_hybrid import QuantkitHybridNorm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# max |logit change| / max |logit| allowed: float32 weights rotated in float64 and rounded once (relative 2**-24
# each), through ~20 matmuls a layer: far below 1e-3, the bound SmoothQuant's float32 check uses.
TOLERANCE = 1e-3
DENSE_DOWN = ("mlp.down_proj", "mlp.shared_expert.down_proj")  # layer-relative: the online Hadamard's modules
ATTENTION_OUT = ("self_attn.o_proj", "linear_attn.out_proj")  # with `online_o`: the attention outputs' too


class RotationError(QuantkitError, ValueError):
    """The model cannot be rotated (an architecture or norm rotation does not commute with); names the module."""


@dataclass(frozen=True)
class RotationReport:
    """What `rotate_model` did: the seed of Q, the online blocks by module name, the function check's figures."""

    seed: int
    online_hadamard: dict[str, int]
    max_logit_change: float
    logit_scale: float
    residual_block: int | None = None  # Q block-diagonal of this size (`residual_rotation`); None: full width
    residual: bool = True  # False: no residual Q, the online transform at every quantized linear's input

    def to_dict(self) -> dict:
        block = {} if self.residual_block is None else {"residual_block": self.residual_block}
        no_residual = {} if self.residual else {"residual": False}
        return {
            "seed": self.seed,
            **block,
            **no_residual,
            "online_hadamard": self.online_hadamard,
            "max_logit_change": self.max_logit_change,
            "logit_scale": self.logit_scale,
        }


@dataclass(frozen=True)
class RotationPlan:
    """What a rotation changes, resolved and checked before any weight changes (`plan_rotation`): the decoder
    stack (`stack_name`, `layers`), each layer's norm/reader/writer parts, the modules outside the layers, and the
    online Hadamard block of each transformed input (by module name: dense down_projs, or with `residual` False
    every quantized Linear of the layers; {} without the online transform). residual False: no Q (`slots` empty)."""

    stack_name: str
    layers: nn.ModuleList
    slots: tuple[tuple[LayerPart, ...], ...]
    embed: nn.Module
    head: nn.Module
    final_norm: nn.Module
    online_hadamard: dict[str, int]
    residual: bool = True


def plan_rotation(
    model: PreTrainedModel,
    online: bool,
    block: int | None = None,
    residual: bool = True,
    quantized: Iterable[str] = (),
    online_o: bool = False,
) -> RotationPlan:
    """Check that `model` can be rotated (architecture, head, every norm, the online blocks) and say how; works on
    a model on the meta device (the streaming path's skeleton). online: the online transform at each dense
    down_proj's and routed experts' down_proj input; online_o: at each attention output projection's too
    (`ATTENTION_OUT`). residual False: no residual Q, any decoder; the online transform at the input of every
    Linear of the decoder layers named in `quantized` (full names). RotationError naming the first problem."""
    if not residual:
        return _plan_input_rotation(model, block, set(quantized))
    architecture = type(model).__name__
    family = ARCHITECTURES.get(architecture)
    instead = (
        "`rotation: {residual: false}` transforms each quantized linear's input online instead and works on any "
        "decoder (recipe w4a4_nvfp4_had16)"
    )
    if family is None:
        raise RotationError(
            f"rotation: {architecture} is not a registered decoder for a residual rotation (known: "
            f"{sorted(ARCHITECTURES)}); {instead}"
        )
    if family.no_residual_rotation is not None:
        reason = family.no_residual_rotation
        raise RotationError(f"rotation: {architecture} takes no residual rotation: {reason}; {instead}")
    stack_name, layers = decoder_stack(model)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    final_norm = cast(nn.Module, model.get_submodule(stack_name.rsplit(".", 1)[0] + ".norm"))
    if head is None or head.bias is not None:
        raise RotationError(f"rotation: {architecture} needs an lm_head without bias")
    _check_norm(final_norm, "final norm")
    online_blocks: dict[str, int] = {}
    for i, layer in enumerate(layers):
        prefix = f"{stack_name}.{i}."
        for part in _parts(layer, family.slots):
            _check_norm(cast(nn.Module, layer.get_submodule(part.norm.norm)), prefix + part.norm.norm)
        for path in (DENSE_DOWN + (ATTENTION_OUT if online_o else ())) if online else ():
            linear = _find(layer, path + "?")
            if isinstance(linear, nn.Linear):
                online_blocks[prefix + path] = _input_block(linear.in_features, block, prefix + path)
        for name, experts in fused_experts_modules(layer).items() if online else ():
            num_experts, _, intermediate = cast(torch.Tensor, experts.down_proj).shape  # (E, H, I)
            b = online_block(intermediate) if block is None else block
            if intermediate % b:
                raise RotationError(
                    f"rotation: online_block {b} does not divide {prefix + name}'s {intermediate} down_proj inputs"
                )
            online_blocks.update({f"{prefix}{name}.{e}.down_proj": b for e in range(num_experts)})
    return RotationPlan(stack_name, layers, family.slots, embed, head, final_norm, online_blocks)


def _plan_input_rotation(model: PreTrainedModel, block: int | None, quantized: set[str]) -> RotationPlan:
    """`plan_rotation` without a residual Q: the online block of every quantized Linear in the decoder layers (its
    in_features' `online_block`, or `block`) and of each fused routed experts module's down_proj."""
    stack_name, layers = decoder_stack(model)
    online_blocks: dict[str, int] = {}
    for i, layer in enumerate(layers):
        prefix = f"{stack_name}.{i}."
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and prefix + name in quantized:
                online_blocks[prefix + name] = _input_block(module.in_features, block, prefix + name)
        for name, experts in fused_experts_modules(layer).items():
            if any(m.startswith(f"{prefix}{name}.") for m in quantized):
                num_experts, _, intermediate = cast(torch.Tensor, experts.down_proj).shape  # (E, H, I)
                b = _input_block(intermediate, block, f"{prefix}{name}'s down_proj")
                online_blocks.update({f"{prefix}{name}.{e}.down_proj": b for e in range(num_experts)})
    if not online_blocks:
        raise RotationError("rotation: residual false transforms quantized linears' inputs, but none is quantized")
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    final_norm = cast(nn.Module, model.get_submodule(stack_name.rsplit(".", 1)[0] + ".norm"))
    return RotationPlan(stack_name, layers, (), embed, head, final_norm, online_blocks, residual=False)


def _input_block(k: int, block: int | None, where: str) -> int:
    """The online Hadamard block of an input of k features: `block`, else `online_block(k)`; RotationError when
    `block` does not divide k."""
    b = online_block(k) if block is None else block
    if k % b:
        raise RotationError(f"rotation: online_block {b} does not divide {where}'s {k} inputs")
    return b


@torch.no_grad()
def rotate_outside(model: PreTrainedModel, plan: RotationPlan, q: torch.Tensor) -> None:
    """Rotate the modules outside the decoder layers in place: E <- E Q, the final norm folded into lm_head,
    lm_head <- lm_head Q; tied embeddings untied first (config.tie_word_embeddings becomes False). Nothing
    without a residual rotation."""
    if not plan.residual:
        return
    head, embed = plan.head, plan.embed
    if head.weight is embed.weight:  # tied: lm_head becomes E diag(w) Q, the embedding E Q
        head.weight = nn.Parameter(cast(torch.Tensor, head.weight).detach().clone())
        model.config.tie_word_embeddings = False
    _rotate_in(cast(torch.Tensor, embed.weight), q)
    _fold_norm_into(plan.final_norm, [head], "final norm")
    _rotate_in(cast(torch.Tensor, head.weight), q)


@torch.no_grad()
def rotate_layer(plan: RotationPlan, i: int, q: torch.Tensor) -> None:
    """Rotate decoder layer i in place (float32 weights loaded): its norms folded into their readers, readers
    W <- W Q, writers W <- Q^T W (with a residual Q), and each Linear of `plan.online_hadamard` W <- W (I (x) H_b)
    with the forward pre-hook that transforms its input; each fused experts module's down_proj likewise, with
    `online_experts_forward` as its forward."""
    layer, prefix = plan.layers[i], f"{plan.stack_name}.{i}."
    for part in _parts(layer, plan.slots):
        readers = [m for m in (_find(layer, p) for p in part.norm.consumers) if m is not None]
        _fold_norm_into(cast(nn.Module, layer.get_submodule(part.norm.norm)), readers, prefix + part.norm.norm)
        for reader in readers:
            _rotate_in(input_weight(reader), q)
        writers = [m for m in (_find(layer, p) for p in part.unsmoothed) if m is not None]
        writers += [r for r in readers if is_fused_experts(r)]
        for writer in writers:
            _rotate_out(writer, q)
    for name, module in layer.named_modules():  # dense down_projs; without a residual Q every quantized Linear
        if isinstance(module, nn.Linear) and (b := plan.online_hadamard.get(prefix + name)) is not None:
            module.weight.copy_(block_hadamard(module.weight, b))
            module.register_forward_pre_hook(_online_hook(b))
    for name, experts in fused_experts_modules(layer).items():
        if (b := plan.online_hadamard.get(f"{prefix}{name}.0.down_proj")) is not None:
            down_proj = cast(torch.Tensor, experts.down_proj)
            down_proj.copy_(block_hadamard(down_proj, b))
            setattr(experts, ONLINE_HADAMARD, b)
            experts.forward = functools.partial(online_experts_forward, experts)  # type: ignore[method-assign]


@torch.no_grad()
def rotate_model(
    model: PreTrainedModel,
    seed: int,
    online: bool,
    verify_tokens: torch.Tensor,
    block: int | None = None,
    residual_block: int | None = None,
    residual: bool = True,
    quantized: Iterable[str] = (),
    online_o: bool = False,
) -> RotationReport:
    """Rotate the float32 causal LM `model` in place (module docstring); verify_tokens (B, T) for the function
    check. online: also the online Hadamard on each dense down_proj (weights folded, pre-hook installed), of
    `block` (a power of two dividing its in_features; None: `online_block(in_features)`). residual_block: Q
    block-diagonal of that size (`residual_rotation`), None: full width. residual False: no Q; the online
    Hadamard at the input of every Linear named in `quantized` instead. online_o: the online Hadamard at each
    attention output projection's input too (`plan_rotation`).
    RotationError for an architecture or norm it cannot rotate; FunctionPreservationError if the logits moved."""
    # every check first: a refusal leaves the model as it was
    plan = plan_rotation(model, online, block, residual, quantized, online_o)
    was_training = model.training
    model.eval()
    reference = model(verify_tokens).logits.float()
    hidden = cast(torch.Tensor, plan.embed.weight).shape[1]
    q = residual_rotation(hidden, seed, residual_block) if residual else torch.empty(0)
    rotate_outside(model, plan, q)
    for i in range(len(plan.layers)):
        rotate_layer(plan, i, q)
    after = model(verify_tokens).logits.float()
    model.train(was_training)
    change, scale = (after - reference).abs().max().item(), reference.abs().max().item()
    check_rotation_preserved(type(model).__name__, change, scale)
    logger.info(
        "rotation: %s rotated (seed %d), max |logit change| %.3g of %.3g", type(model).__name__, seed, change, scale
    )
    return RotationReport(seed, plan.online_hadamard, change, scale, residual_block if residual else None, residual)


def search_through_online(search: AlphaSearch, online_hadamard: dict[str, int]) -> AlphaSearch:
    """SmoothQuant's (or AWQ's) search for a smoothing folded before an input rotation (`residual` False): each
    consumer `name` of `online_hadamard` is served as Q(x H_b) Q(W H_b)^T after the rotation, so its candidate
    products are measured as product(x H_b, W H_b) and its decoded weight, in the unrotated coordinates the parent
    search runs in, as weight(W H_b) H_b (H_b = I (x) H_block is symmetric and orthogonal). Other consumers as
    `search` measures them."""
    product, weight = search.product, search.weight

    def product_through(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b = online_hadamard.get(name)
        return product(name, x, w) if b is None else product(name, block_hadamard(x, b), block_hadamard(w, b))

    def weight_through(name: str, w: torch.Tensor) -> torch.Tensor:
        b = online_hadamard.get(name)
        served = cast(Callable[[str, torch.Tensor], torch.Tensor], weight)
        return served(name, w) if b is None else block_hadamard(served(name, block_hadamard(w, b)), b)

    return replace(search, product=product_through, weight=None if weight is None else weight_through)


def check_online_quantized(recipe: str, online_hadamard: dict[str, int], quantized: Iterable[str]) -> None:
    """ValueError naming the first module with an online Hadamard that the recipe leaves unquantized (the
    transform runs inside the quantized layer's method)."""
    if unquantized := sorted(set(online_hadamard) - set(quantized)):
        raise ValueError(
            f"recipe {recipe}: rotation's online Hadamard needs {unquantized[0]} quantized (the transform runs in "
            "the quantized layer); drop it from the ignore list / bf16 module_schemes, or rotation.online"
        )


def check_rotation_preserved(architecture: str, change: float, scale: float) -> None:
    """FunctionPreservationError unless max |logit change| <= TOLERANCE x the logit scale (NaN fails)."""
    if not change <= TOLERANCE * scale:
        raise FunctionPreservationError(
            f"rotation changed the logits of {architecture}: max |logit change| {change:.4g} of the logit scale "
            f"{scale:.4g}, above {TOLERANCE} of it; the rotated model is discarded"
        )


def _parts(layer: nn.Module, slots: tuple[tuple[LayerPart, ...], ...]) -> list[LayerPart]:
    """The LayerPart of each slot that applies to `layer` (the first whose `when` holds)."""
    return [next(p for p in slot if p.when is None or p.when(layer)) for slot in slots]


def _find(layer: nn.Module, path: str) -> nn.Module | None:
    """The submodule at `path` ("?" suffix: None when absent)."""
    try:
        return layer.get_submodule(path.removesuffix("?"))
    except AttributeError:
        if path.endswith("?"):
            return None
        raise RotationError(f"rotation: the decoder layer has no {path}") from None


def _fold_norm_into(norm: nn.Module, readers: list[nn.Module], where: str) -> None:
    """Move the norm's scale (w, or 1 + w for an offset norm) into its readers' input columns; the norm's scale
    becomes 1. RotationError for a norm that does not commute with a rotation (`_check_norm`)."""
    offset = _check_norm(norm, where)
    weight = cast(torch.Tensor, norm.weight)
    scale = (1.0 + weight.double()) if offset else weight.double()
    for reader in readers:
        _in_float64(input_weight(reader), lambda w: w * scale)
    weight.fill_(0.0 if offset else 1.0)


def _check_norm(norm: nn.Module, where: str) -> bool:
    """Whether `norm` is a (1 + w) RMSNorm (else a plain one, y = w x_hat); RotationError for any other norm."""
    offset = isinstance(norm, (*OFFSET_NORMS, QuantkitHybridNorm))
    if isinstance(norm, (QuantkitNorm, QuantkitHybridNorm)):
        flags = [f for f in ("pre_scale", "gate_down", "bias", "alpha") if hasattr(norm, f)]
        if flags or getattr(norm, "norm_type", "rmsnorm") != "rmsnorm":
            raise RotationError(
                f"rotation: {where} has {flags or [norm.norm_type]} (PreAffine / GatedNorm / DyT act per channel on "
                "the residual stream and do not commute with its rotation)"
            )
    elif not offset and type(norm).__name__.endswith("LayerNorm"):
        raise RotationError(f"rotation: {where} is a {type(norm).__name__} (mean subtraction; RMSNorm only)")
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        raise RotationError(f"rotation: {where} ({type(norm).__name__}) is not an RMSNorm with a weight")
    return offset


ROTATE_ROWS = 4096  # rows of a weight rotated at a time: the float64 copies of a 152k-row embedding stay ~30 MB


def _in_float64(weight: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """weight (..., K) <- fn(weight in float64, (rows, K)) rounded once to its dtype, ROTATE_ROWS rows at a time."""
    rows = weight.view(-1, weight.shape[-1])
    for start in range(0, rows.shape[0], ROTATE_ROWS):
        chunk = rows[start : start + ROTATE_ROWS]
        chunk.copy_(fn(chunk.double()).to(weight.dtype))


def _rotate_in(weight: torch.Tensor, q: torch.Tensor) -> None:
    """A reader's input weight (..., hidden) <- weight Q (float64, rounded once)."""
    _in_float64(weight, lambda w: w @ q)


def _rotate_out(writer: nn.Module, q: torch.Tensor) -> None:
    """A writer's output side <- Q^T: Linear (hidden, K) weight and bias, fused experts' down_proj (E, hidden, I)."""
    if isinstance(writer, nn.Linear):
        writer.weight.copy_((q.T @ writer.weight.double()).to(writer.weight.dtype))
        if writer.bias is not None:
            writer.bias.copy_((writer.bias.double() @ q).to(writer.bias.dtype))
    elif is_fused_experts(writer):
        down = cast(torch.Tensor, writer.down_proj)
        down.copy_((q.T @ down.double()).to(down.dtype))
    else:
        raise RotationError(f"rotation: {type(writer).__name__} writes the residual stream; no rotation known for it")


def online_experts_forward(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A rotated fused experts module's forward (transformers' signature, (T, H) -> (T, H) in the input's dtype):
    each expert's act(gate) * up transformed by `block_hadamard` of the module's `online_hadamard` block before its
    (folded) down_proj; `routed_experts_forward`, the reference's and vLLM emulation's own loop."""
    block = cast(int, getattr(experts, ONLINE_HADAMARD))

    def transform(rows: torch.Tensor, _segments: Segments, which: int) -> torch.Tensor:
        return block_hadamard(rows, block).to(rows.dtype) if which == 1 else rows

    out = routed_experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        cast(torch.Tensor, experts.gate_up_proj),
        cast(torch.Tensor, experts.down_proj),
        cast(Callable[[torch.Tensor], torch.Tensor], experts.act_fn),
        transform,
    )
    return out.to(hidden_states.dtype)


def _online_hook(block: int):
    """A forward pre-hook replacing a Linear's input x by x (I (x) H_block), in x's dtype."""

    def transform(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (block_hadamard(args[0], block).to(args[0].dtype), *args[1:])

    return transform
