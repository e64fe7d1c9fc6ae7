"""Per-channel activation statistics for SmoothQuant and static activation scales.

Data: token windows from `quantkit.data.calibration_windows` (by default the zoo's held-out State of the
Union speeches, which no zoo model was trained on; position 0 of every window is BOS).

Statistics: max |x_j| per input channel j of chosen linears, taken by forward pre-hooks (i.e. at the
consumers' input, after any gate), kept as a running maximum: memory is one vector per linear, whatever
the number of sequences. Paper 000 App. A.4.2 calibrates on 4096 sequences.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn
from tqdm import tqdm

PAPER_NUM_SEQUENCES = 4096  # paper 000 App. A.4.2; defaults of SmoothQuant calibration windows (N, T):
DEFAULT_NUM_SEQUENCES = PAPER_NUM_SEQUENCES
DEFAULT_SEQ_LEN = 512


class ChannelMaxObserver:
    """Forward pre-hooks recording max |x| per input channel of named linears (running max, float32).

    Use as a context manager; `maxima[name]` is a 1-D tensor of in_features (NaN and Inf propagate, so a
    non-finite activation is never hidden by the running max).
    """

    def __init__(self, model: nn.Module, module_names: Iterable[str]) -> None:
        self.model = model
        self.names = list(dict.fromkeys(module_names))
        self.maxima: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> ChannelMaxObserver:
        for name in self.names:
            self._handles.append(self.model.get_submodule(name).register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            amax = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
            prev = self.maxima.get(name)
            self.maxima[name] = amax if prev is None else torch.maximum(prev, amax)

        return hook


@torch.no_grad()
def run_batches(model: nn.Module, tokens: torch.Tensor, batch_size: int, progress: bool = True, desc: str = "") -> None:
    """Forward `tokens` (N, T) through `model` in batches of `batch_size` (eval mode, no cache), with a bar."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with tqdm(total=len(tokens), desc=desc, unit="seq", disable=not progress,
                  mininterval=1 if sys.stderr.isatty() else 30) as bar:
            for start in range(0, len(tokens), batch_size):
                chunk = tokens[start : start + batch_size].to(device)
                model(input_ids=chunk, use_cache=False)
                bar.update(len(chunk))
    finally:
        model.train(was_training)


def channel_max(
    model: nn.Module, tokens: torch.Tensor, module_names: Iterable[str], batch_size: int = 8,
    progress: bool = True, desc: str = "SmoothQuant calibration",
) -> dict[str, torch.Tensor]:
    """max |x_j| at the input of each named linear over the token windows `tokens` (N, T)."""
    with ChannelMaxObserver(model, module_names) as observer:
        run_batches(model, tokens, batch_size, progress, desc)
    missing = [n for n in observer.names if n not in observer.maxima]
    if missing:
        raise RuntimeError(f"SmoothQuant calibration: these linears were never called in the forward pass: {missing}")
    return observer.maxima
