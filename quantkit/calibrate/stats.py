"""Calibration data and per-channel activation statistics for SmoothQuant.

Data: token windows of `seq_len` from a local English corpus — by default the zoo's held-out State of the
Union speeches (`quantkit.models.zoo.corpus_split()`), which no zoo model was trained on. Every window's
position 0 is the tokenizer's BOS (like every served prompt; the attention-sink variant needs it).

Statistics: max |x_j| per input channel j of chosen linears, taken by forward pre-hooks (i.e. at the
consumers' input, after any gate), kept as a running maximum: memory is one vector per linear, whatever
the number of sequences. Paper 000 App. A.4.2 calibrates on 4096 sequences.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

PAPER_NUM_SEQUENCES = 4096  # paper 000 App. A.4.2
DEFAULT_NUM_SEQUENCES = PAPER_NUM_SEQUENCES
DEFAULT_SEQ_LEN = 512


def heldout_texts() -> list[str]:
    """The zoo corpus' held-out speeches (the default calibration text)."""
    from quantkit.models.zoo import corpus_split

    return corpus_split()[1]


def calibration_batches(
    tokenizer,
    num_sequences: int = DEFAULT_NUM_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
    texts: Sequence[str] | None = None,
) -> torch.Tensor:
    """(num_sequences, seq_len) int64 token windows of `texts` (default: `heldout_texts()`).

    The texts are tokenized and concatenated; window starts are spread evenly over the stream, so the
    windows are disjoint when the stream holds num_sequences * seq_len tokens and overlap otherwise (logged
    as a warning with the overlap factor: the held-out speeches are ~116k tokens with the zoo tokenizer).
    Position 0 of each window is set to the tokenizer's BOS when it has one.
    """
    if num_sequences <= 0 or seq_len <= 1:
        raise ValueError(f"need num_sequences >= 1 and seq_len >= 2, got {num_sequences}, {seq_len}")
    texts = heldout_texts() if texts is None else list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("calibration texts must be a non-empty sequence of strings")
    stream = torch.tensor([i for text in texts for i in tokenizer(text)["input_ids"]], dtype=torch.long)
    if len(stream) < seq_len:
        raise ValueError(f"calibration text has {len(stream)} tokens, fewer than one window of seq_len={seq_len}")
    starts = torch.linspace(0, len(stream) - seq_len, num_sequences).round().long()
    need = num_sequences * seq_len
    if need > len(stream):
        logger.warning(
            "SmoothQuant calibration: %d x %d = %d tokens asked from a %d-token corpus: windows overlap "
            "(each token seen ~%.1f times)", num_sequences, seq_len, need, len(stream), need / len(stream),
        )
    batch = stream[starts[:, None] + torch.arange(seq_len)]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        batch[:, 0] = bos
    return batch


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
