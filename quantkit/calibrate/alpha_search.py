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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

# (consumer module name, x (rows, K) float32, weight (N, K) float32) -> the quantized product x W^T, (rows, N)
QuantizedProduct = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_GRID = tuple(i / 10 for i in range(3, 10))  # 0.3, 0.4, ..., 0.9: the paper's 0.5 among them
DEFAULT_MAX_ROWS = 1024  # rows of X the error is measured on (per mapping)
ROW_STRIDE = 8  # every 8th position of a batch: the sample spans 8x more windows than its rows


@dataclass(frozen=True)
class AlphaSearch:
    """How `smoothquant.layer_factors` chooses each mapping's alpha: `product` the served quantized product of a
    consumer, `grid` the candidate alphas in [0, 1] (first wins ties), `max_rows` the rows of X sampled."""

    product: QuantizedProduct
    grid: tuple[float, ...] = DEFAULT_GRID
    max_rows: int = DEFAULT_MAX_ROWS

    def __post_init__(self) -> None:
        if not self.grid or not all(0.0 <= a <= 1.0 for a in self.grid):
            raise ValueError(f"SmoothQuant alpha search: the grid must be alphas in [0, 1], got {self.grid}")
        if self.max_rows < 1:
            raise ValueError(f"SmoothQuant alpha search: max_rows must be >= 1, got {self.max_rows}")


class RowSampler:
    """Forward pre-hooks keeping every ROW_STRIDE-th row of named modules' inputs, up to `max_rows` each, float32.

    Use as a context manager; `rows[name]` is (rows, K) once the module was called."""

    def __init__(self, model: nn.Module, module_names: Sequence[str], max_rows: int) -> None:
        self.model, self.names, self.max_rows = model, list(dict.fromkeys(module_names)), max_rows
        self.rows: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> RowSampler:
        for name in self.names:
            self._handles.append(self.model.get_submodule(name).register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            kept = self.rows.get(name)
            room = self.max_rows - (0 if kept is None else len(kept))
            if room <= 0:
                return
            x = args[0].detach()
            new = x.reshape(-1, x.shape[-1])[::ROW_STRIDE][:room].float()
            self.rows[name] = new if kept is None else torch.cat([kept, new])

        return hook


@torch.no_grad()
def choose_alpha(
    search: AlphaSearch,
    x: torch.Tensor,
    consumers: Sequence[tuple[str, torch.Tensor]],
    channel_index: torch.Tensor,
    factors: Callable[[float], torch.Tensor],
) -> tuple[float, list[float]]:
    """(the alpha of least error, the error of every grid alpha) for one mapping.

    x: (rows, K) float32 sample of the consumers' input; consumers: (name, weight (N, K)) of each quantized
    consumer, unsmoothed; channel_index: (K,) the smoothing channel of each input column; factors(alpha): s per
    smoothing channel (`smoothing_factors` with the mapping's maxima)."""
    weights = [(name, w.float()) for name, w in consumers]
    exact = [x @ w.T for _, w in weights]
    errors = []
    for alpha in search.grid:
        s = factors(alpha).to(x.device)[channel_index]
        xs = x / s
        err = sum(float((search.product(name, xs, w * s) - y).pow(2).sum()) for (name, w), y in zip(weights, exact))
        errors.append(err)
    best = min(range(len(errors)), key=lambda i: (errors[i], i))
    return search.grid[best], errors
