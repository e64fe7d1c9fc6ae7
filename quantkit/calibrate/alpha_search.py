"""SmoothQuant's migration strength chosen per mapping by the quantized output error (`smoothquant.search_alpha`).

SmoothQuant fixes one alpha for the whole model (0.5 in the paper). The best strength differs between mappings:
an input with a few massive channels wants more of its range moved into the weights than a flat one, and 4-bit
formats are hurt by the weight side sooner than 8-bit ones. The search picks, per mapping, the alpha of least
squared error of the consumers' quantized products on calibration rows (the grid search of SmoothQuant's own
repository and of AWQ's scale search, here over alpha with the served quantizers of both operands):

    s(alpha) = smoothing_factors(max|X|, max|W|, alpha)            (per smoothing channel, the paper's formula)
    err(alpha) = sum_c || Q_c(X / s) Q_c(W_c s)^T - X W_c^T ||_F^2  (c: the mapping's quantized consumers)

X (rows, K): rows of the consumers' shared input sampled from the calibration stream (`RowSampler`); W_c (N_c, K)
the unsmoothed weights; s indexed per input column (`SmoothMapping.channel_index`, for GQA v -> o). Q_c is what
serving computes for consumer c, supplied by the caller as `QuantizedProduct` (`quantkit.quantize.fake_quant.
quantized_product`: the recipe's scheme for that module, min-max weight scales, per-token activation scales):
this module knows no format. The grid's first alpha wins ties. The statistics (max|X|) stay those of every
calibration window; only the error is measured on the sample.

With `parent_output` (recipe key `smoothquant.search_parent_output`: llm-compressor's AWQ objective) the error is
instead that of the consumers' parent module's output (their lowest common ancestor: self_attn for q/k/v, mlp for
gate/up, the consumer itself when it is alone), run in float32 on whole calibration batches with each consumer's
weight replaced by Q_c(W_c s) / s and nothing else quantized:

    err(s) = sum_b || parent(inputs_b; W_c <- Q_c(W_c s) / s) - parent(inputs_b) ||_F^2
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import torch
from torch import nn

from quantkit.calibrate.stats import PreHooks

# (consumer module name, x (rows, K) float32, weight (N, K) float32) -> the quantized product x W^T, (rows, N)
QuantizedProduct = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
# (consumer module name, weight (N, K) float32) -> the weight as served, decoded (N, K) float32
QuantizedWeight = Callable[[str, torch.Tensor], torch.Tensor]

DEFAULT_GRID = tuple(i / 10 for i in range(3, 10))  # 0.3, 0.4, ..., 0.9: the paper's 0.5 among them
# AWQ's grid (llm-compressor's AWQModifier defaults, n_grid 20, duo_scaling True): the identity scaling (ratio 0
# without the weight term), then ratios 0, 1/18, ..., 1 of x_mean^r / w_mean^(1 - r)
AWQ_GRID: tuple[tuple[float, bool], ...] = ((0.0, False), *((i / 18, True) for i in range(19)))
AWQ_EPS = 1e-4  # llm-compressor's floor on the scales and on w_mean^(1 - r)


class Rule(StrEnum):
    """How the searched scales are formed (recipe `smoothquant.scales`; equal to its string)."""

    SMOOTHQUANT = "smoothquant"  # s = max|X|^a / max|W|^(1 - a) over DEFAULT_GRID's alphas
    AWQ = "awq"  # s = mean|X|^r / w_mean^(1 - r), normalized, over AWQ_GRID (Lin et al. 2024; `awq_factors`)


DEFAULT_MAX_ROWS = 1024  # rows of X the error is measured on (per mapping)
ROW_STRIDE = 8  # every 8th position of a batch: the sample spans 8x more windows than its rows


@dataclass(frozen=True)
class AlphaSearch:
    """How `smoothquant.layer_factors` chooses each mapping's scales: `product` the served quantized product of a
    consumer, `grid` the candidate alphas in [0, 1] (first wins ties), `max_rows` the rows of X sampled. `rule`
    AWQ: the candidates are AWQ_GRID's instead (`grid` unused), and `weight_block(name)` gives the (rows, columns)
    of one weight decode scale of consumer `name` (its scheme's), which AWQ's w_mean normalizes by. `parent_output`:
    the error is the consumers' parent's output with `weight` (each consumer's decoded weight) in place
    (`choose_scales_by_parent`), on the first max_rows x ROW_STRIDE tokens' whole batches."""

    product: QuantizedProduct
    grid: tuple[float, ...] = DEFAULT_GRID
    max_rows: int = DEFAULT_MAX_ROWS
    rule: Rule = Rule.SMOOTHQUANT
    weight_block: Callable[[str], tuple[int, int]] | None = None
    parent_output: bool = False
    weight: QuantizedWeight | None = None

    def __post_init__(self) -> None:
        if not self.grid or not all(0.0 <= a <= 1.0 for a in self.grid):
            raise ValueError(f"SmoothQuant alpha search: the grid must be alphas in [0, 1], got {self.grid}")
        if self.max_rows < 1:
            raise ValueError(f"SmoothQuant alpha search: max_rows must be >= 1, got {self.max_rows}")
        if self.rule == Rule.AWQ and self.weight_block is None:
            raise ValueError("AWQ search: weight_block (each consumer's weight scale block) is required")
        if self.parent_output and self.weight is None:
            raise ValueError("parent-output search: weight (each consumer's served weight) is required")

    @property
    def parent_tokens(self) -> int:
        """Tokens of whole batches kept per parent module for `parent_output` (the span RowSampler's rows cover)."""
        return self.max_rows * ROW_STRIDE

    def searched_values(self) -> list[float]:
        """What a report lists as the searched grid: the alphas, or AWQ's ratios (in AWQ_GRID's order)."""
        return [ratio for ratio, _ in AWQ_GRID] if self.rule == Rule.AWQ else list(self.grid)


class RowSampler(PreHooks):
    """Forward pre-hooks keeping every ROW_STRIDE-th row of named modules' inputs, up to `max_rows` each, float32,
    and, with `means`, the sum of |x| per input column over every row (AWQ's mean).

    Use as a context manager; `rows[name]` is (rows, K) once the module was called, `mean_abs(name)` (K,)."""

    def __init__(self, model: nn.Module, module_names: Sequence[str], max_rows: int, means: bool = False) -> None:
        super().__init__()
        self.model, self.names, self.max_rows, self.means = model, list(dict.fromkeys(module_names)), max_rows, means
        self.rows: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}  # float64 (K,): sum of |x| over every row seen
        self.count: dict[str, int] = {}

    def mean_abs(self, name: str) -> torch.Tensor:
        """mean |x| per input column of `name` over every row it was called with, float32 (K,)."""
        return (self.abs_sum[name] / self.count[name]).float()

    def __enter__(self) -> RowSampler:
        for name in self.names:
            self._add(self.model.get_submodule(name), self._hook(name))
        return self

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            flat = x.reshape(-1, x.shape[-1])
            if self.means:  # a pass over every row: only AWQ reads it
                total = flat.abs().sum(0, dtype=torch.float64)
                self.abs_sum[name] = total if name not in self.abs_sum else self.abs_sum[name] + total
                self.count[name] = self.count.get(name, 0) + flat.shape[0]
            kept = self.rows.get(name)
            room = self.max_rows - (0 if kept is None else len(kept))
            if room <= 0:
                return
            new = flat[::ROW_STRIDE][:room].float()
            self.rows[name] = new if kept is None else torch.cat([kept, new])

        return hook


def parent_of(consumers: Sequence[str]) -> str:
    """The lowest common ancestor of dotted module names: their longest shared prefix of whole parts (a lone
    consumer is its own parent). ValueError when they share none."""
    parts = [c.split(".") for c in consumers]
    shared = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        shared.append(level[0])
    if not shared:
        raise ValueError(f"{list(consumers)} share no parent module")
    return ".".join(shared)


class ParentSampler:
    """Forward hooks keeping each named module's calls, whole batches, until `max_tokens` tokens each: its inputs
    (args, kwargs, as given) and its output (the first element of a tuple) detached. Use as a context manager;
    `calls[name]` is a list of (args, kwargs, output)."""

    def __init__(self, model: nn.Module, module_names: Sequence[str], max_tokens: int) -> None:
        self.model, self.names, self.max_tokens = model, list(dict.fromkeys(module_names)), max_tokens
        self.calls: dict[str, list[tuple[tuple, dict, torch.Tensor]]] = {}
        self.tokens: dict[str, int] = {}
        self._handles: list = []

    def __enter__(self) -> ParentSampler:
        for name in self.names:
            hook = self._hook(name)
            self._handles.append(self.model.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if self.tokens.get(name, 0) >= self.max_tokens:
                return
            out = (output[0] if isinstance(output, tuple) else output).detach()
            self.calls.setdefault(name, []).append((args, dict(kwargs), out))
            self.tokens[name] = self.tokens.get(name, 0) + out.shape[:-1].numel()

        return hook


@torch.no_grad()
def choose_scales_by_parent(
    search: AlphaSearch,
    parent: nn.Module,
    calls: Sequence[tuple[tuple, dict, torch.Tensor]],
    consumers: Sequence[tuple[str, nn.Linear]],
    channel_index: torch.Tensor,
    candidates: Sequence[torch.Tensor],
) -> tuple[int, list[float]]:
    """As `choose_scales`, with the error of `parent`'s output (`parent_output`): for each candidate s, every
    consumer's weight is set to weight(W s) / s (its input columns' s, `channel_index`), `parent` runs again on
    each recorded call and its squared difference from the recorded output is summed; the weights are restored
    after the search. consumers: (name, Linear) of each quantized consumer, inside `parent`."""
    weight = cast(QuantizedWeight, search.weight)
    originals = [module.weight.data for _, module in consumers]
    errors = []
    try:
        for factors in candidates:
            s = factors.to(originals[0].device)[channel_index].float()
            for (name, module), w in zip(consumers, originals):
                module.weight.data = (weight(name, w.float() * s) / s).to(w.dtype)
            err = 0.0
            for args, kwargs, reference in calls:
                out = parent(*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                err += float((out.float() - reference.float()).pow(2).sum())
            errors.append(err)
    finally:
        for (_, module), w in zip(consumers, originals):
            module.weight.data = w
    return min(range(len(errors)), key=lambda i: (errors[i], i)), errors


@torch.no_grad()
def choose_scales(
    search: AlphaSearch,
    x: torch.Tensor,
    consumers: Sequence[tuple[str, torch.Tensor]],
    channel_index: torch.Tensor,
    candidates: Sequence[torch.Tensor],
) -> tuple[int, list[float]]:
    """(the index of the candidate of least error, the error of every candidate) for one mapping.

    x: (rows, K) float32 sample of the consumers' input; consumers: (name, weight (N, K)) of each quantized
    consumer, unsmoothed; channel_index: (K,) the smoothing channel of each input column; candidates: s per
    smoothing channel, in order (the first of equal errors wins)."""
    weights = [(name, w.float()) for name, w in consumers]
    exact = [x @ w.T for _, w in weights]
    errors = []
    for factors in candidates:
        s = factors.to(x.device)[channel_index]
        xs = x / s
        err = sum(float((search.product(name, xs, w * s) - y).pow(2).sum()) for (name, w), y in zip(weights, exact))
        errors.append(err)
    return min(range(len(errors)), key=lambda i: (errors[i], i)), errors


def choose_alpha(
    search: AlphaSearch,
    x: torch.Tensor,
    consumers: Sequence[tuple[str, torch.Tensor]],
    channel_index: torch.Tensor,
    factors: Callable[[float], torch.Tensor],
) -> tuple[float, list[float]]:
    """(the alpha of least error, the error of every grid alpha) for one mapping (`choose_scales` over
    factors(alpha), the smoothing factors of each grid alpha)."""
    best, errors = choose_scales(search, x, consumers, channel_index, [factors(a) for a in search.grid])
    return search.grid[best], errors


def awq_factors(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool) -> torch.Tensor:
    """AWQ's scales for one grid point, as llm-compressor forms them (`AWQModifier._compute_best_scale`):
    s = max(x_mean^r / (w_mean^(1 - r) + 1e-4), 1e-4) with `duo`, else max(x_mean^r, 1e-4), then divided by
    sqrt(max(s) min(s)) (centred in log space); inf or NaN entries 1. x_mean, w_mean (channels,); float32."""
    x = x_mean.float()
    s = x.pow(ratio) / (w_mean.float().pow(1 - ratio) + AWQ_EPS) if duo else x.pow(ratio)
    s = s.clamp(min=AWQ_EPS)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def weight_mean(weights: Sequence[torch.Tensor], blocks: Sequence[tuple[int, int]]) -> torch.Tensor:
    """AWQ's w_mean (llm-compressor's `AWQModifier._compute_layer_means`): each consumer weight (N, K) as |w| over
    its quantization block's max |w| (+1e-6; `blocks`: each weight's (rows, columns) per decode scale: NVFP4 (1,
    16), FP8 (128, 128); edge blocks partial), then the mean over every consumer's rows, float32 (K,)."""
    total, rows = torch.zeros(weights[0].shape[-1], dtype=torch.float64), 0
    for w, (br, bc) in zip(weights, blocks, strict=True):
        a = w.detach().float().abs()
        n, k = a.shape
        padded = torch.nn.functional.pad(a, (0, -k % bc, 0, -n % br))
        block_max = padded.unflatten(0, (-1, br)).unflatten(-1, (-1, bc)).amax(dim=(1, 3))
        per_element = block_max.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:n, :k]
        total += (a / (per_element + 1e-6)).sum(0, dtype=torch.float64)
        rows += n
    return (total / rows).float()
