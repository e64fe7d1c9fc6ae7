"""Per-channel activation statistics for SmoothQuant and static activation scales.

Data: token windows from `quantkit.data.calibration_windows` (the calibration source, never the measurement
text; windows start as a served prompt starts).

Statistics: max |x_j| per input channel j of chosen linears, taken by forward pre-hooks (i.e. at the
consumers' input, after any gate), kept as a running maximum: memory is one vector per linear, whatever
the number of sequences. Paper 000 App. A.4.2 calibrates on 4096 sequences.

Routed experts (calibrate-all-experts mode): a name `<experts>.<e>.<proj>` (`quantkit.formats.experts`)
asks for the input statistics of one expert matrix of a fused experts module. The observer then runs EVERY
token through EVERY expert on the side, for statistics only (a forward pre-hook: the routed output the model
computes is untouched): gate_proj / up_proj see the block's input x, down_proj sees act(x gate_e^T) * (x up_e^T).
Routed statistics would cover only the tokens the router sent to e (none at all for an expert it never picks
on the calibration data); the served model meets other tokens. This needs the gated layout of
`quantkit.formats.experts` and the module's `act_fn` (transformers' expert modules have both).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from tqdm import tqdm

from quantkit.formats.experts import EXPERT_MATRIX, is_fused_experts

PAPER_NUM_SEQUENCES = 4096  # paper 000 App. A.4.2; defaults of SmoothQuant calibration windows (N, T):
DEFAULT_NUM_SEQUENCES = PAPER_NUM_SEQUENCES
DEFAULT_SEQ_LEN = 512


class PreHooks:
    """A context manager owning forward pre-hooks: subclasses register them on entry with `_add`; every one is
    removed on exit."""

    def __init__(self) -> None:
        self._handles: list = []

    def _add(self, module: nn.Module, hook: Callable) -> None:
        self._handles.append(module.register_forward_pre_hook(hook))

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ChannelMaxObserver(PreHooks):
    """Forward pre-hooks recording max |x| per input channel of named linears (running max, float32).

    Use as a context manager; `maxima[name]` is a 1-D tensor of in_features (NaN and Inf propagate, so a
    non-finite activation is never hidden by the running max).
    """

    def __init__(self, model: nn.Module, module_names: Iterable[str]) -> None:
        super().__init__()
        self.model = model
        self.names = list(dict.fromkeys(module_names))
        self.maxima: dict[str, torch.Tensor] = {}

    def __enter__(self) -> ChannelMaxObserver:
        experts: dict[str, nn.Module] = {}
        for name in self.names:
            match = EXPERT_MATRIX.match(name)
            if match and (fused := _fused_experts_at(self.model, match["experts"])) is not None:
                experts[match["experts"]] = fused
            else:
                self._add(self.model.get_submodule(name), self._hook(name))
        for name, module in experts.items():
            self._add(module, self._all_experts_hook(name))
        return self

    def _update(self, name: str, amax: torch.Tensor) -> None:
        prev = self.maxima.get(name)
        self.maxima[name] = amax if prev is None else torch.maximum(prev, amax)

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            self._update(name, x.reshape(-1, x.shape[-1]).abs().amax(0).float())

        return hook

    def _all_experts_hook(self, name: str):
        """Statistics of every expert matrix of the fused experts module `name` over every token."""
        wanted = set(self.names)

        def hook(module: nn.Module, args: tuple) -> None:
            gate_up_proj = cast(torch.Tensor, module.gate_up_proj)  # a transformers fused experts module
            x = args[0].detach().reshape(-1, args[0].shape[-1])  # (tokens, H)
            x_amax = x.abs().amax(0).float()
            for e in range(gate_up_proj.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    if f"{name}.{e}.{proj}" in wanted:
                        self._update(f"{name}.{e}.{proj}", x_amax)
                if f"{name}.{e}.down_proj" in wanted:
                    gate, up = nn.functional.linear(x, gate_up_proj[e].detach()).chunk(2, dim=-1)
                    act_fn = cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn)
                    self._update(f"{name}.{e}.down_proj", (act_fn(gate) * up).abs().amax(0).float())

        return hook


@dataclass(frozen=True)
class EarlyStop:
    """When a layer's calibration statistics count as settled: at least `min_windows` windows seen, and in each of
    the last `patience` batches every observed vector of per-channel maxima m moved by at most `tolerance`
    relative to its norm, ||m_b - m_{b-1}|| / ||m_b|| (L2). Maxima of a sample grow without bound (slowly, as
    extremes do: on SmolLM2-135M some channel still grew 20-50% in the 12th batch of 8 windows), so no
    per-channel rule settles; the L2 change is carried by the large channels, those whose factors decide the
    quantization error, and it falls as batches come (2-3% per batch after ~80 windows on SmolLM2)."""

    tolerance: float
    patience: int = 2
    min_windows: int = 32


class Settling:
    """Follows a `ChannelMaxObserver` batch by batch: `after_batch(windows)` records the largest relative L2
    change of any observed maxima vector in batch b (`EarlyStop`) and says whether `early_stop` holds (never,
    when it is None)."""

    def __init__(self, observer: ChannelMaxObserver, early_stop: EarlyStop | None) -> None:
        self.observer, self.early_stop = observer, early_stop
        self.change: list[float] = []  # per batch; inf for the first (nothing to compare with)
        self.windows = 0
        self._previous: dict[str, torch.Tensor] = {}

    def after_batch(self, windows: int) -> bool:
        """After a batch of `windows` windows: record its largest relative L2 change of any observed maxima vector
        (inf for a new or non-finite one); True once `early_stop` holds."""
        change = 0.0
        for name, amax in self.observer.maxima.items():
            old = self._previous.get(name)
            if old is None or not torch.isfinite(amax).all():
                change = math.inf
            else:
                change = max(
                    change, ((amax - old).norm() / amax.norm().clamp_min(torch.finfo(torch.float32).tiny)).item()
                )
            self._previous[name] = amax.clone()
        self.change.append(change)
        self.windows += windows
        stop = self.early_stop
        if (
            stop is None
            or not self.observer.maxima
            or self.windows < stop.min_windows
            or len(self.change) < stop.patience
        ):
            return False  # nothing observed (a layer without consumers) is no evidence of settling
        return all(c <= stop.tolerance for c in self.change[-stop.patience :])


def _fused_experts_at(model: nn.Module, name: str) -> nn.Module | None:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if is_fused_experts(module) else None


@torch.no_grad()
def run_batches(model: nn.Module, tokens: torch.Tensor, batch_size: int, progress: bool = True, desc: str = "") -> None:
    """Forward `tokens` (N, T) through `model` in batches of `batch_size` (eval mode, no cache), with a bar."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with tqdm(
            total=len(tokens), desc=desc, unit="seq", disable=not progress, mininterval=1 if sys.stderr.isatty() else 30
        ) as bar:
            for start in range(0, len(tokens), batch_size):
                chunk = tokens[start : start + batch_size].to(device)
                model(input_ids=chunk, use_cache=False)
                bar.update(len(chunk))
    finally:
        model.train(was_training)


def channel_max(
    model: nn.Module,
    tokens: torch.Tensor,
    module_names: Iterable[str],
    batch_size: int = 8,
    progress: bool = True,
    desc: str = "SmoothQuant calibration",
) -> dict[str, torch.Tensor]:
    """max |x_j| at the input of each named linear (or expert matrix `<experts>.<e>.<proj>`, all-experts
    mode) over the token windows `tokens` (N, T)."""
    with ChannelMaxObserver(model, module_names) as observer:
        run_batches(model, tokens, batch_size, progress, desc)
    missing = [n for n in observer.names if n not in observer.maxima]
    if missing:
        raise RuntimeError(f"SmoothQuant calibration: these linears were never called in the forward pass: {missing}")
    return observer.maxima
