"""The checks every command that takes a checkpoint directory runs before any work.

`check_checkpoint_dir(path)` reads config.json and the safetensors headers (no tensor data) and raises
`CheckpointError` naming the file when config.json is missing or not a JSON object, there are no
*.safetensors weights, or a weights file is unreadable (truncated or corrupt).
`quantkit.serve.checkpoint_check` builds the serving checks on it.

Sharded checkpoints (transformers' layout: `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`,
whose `weight_map` names each tensor's file) are read through `weight_files` (the index's files, else every
*.safetensors), `read_state` (all tensors) and `TensorReader` (one tensor at a time, by plain file reads: no
memory map, so a streaming reader's resident set and address space hold the tensor it asked for and not the
pages of every shard it has touched).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from quantkit.errors import QuantkitError

TensorHeaders = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)
INDEX_FILE = "model.safetensors.index.json"
SOURCE_RECORD = "quantkit_source.json"  # a quantized checkpoint's source: {"path", "fingerprint"}
FINGERPRINT_SAMPLE_BYTES = 1 << 20  # of tensor data from each end of every shard (`weights_fingerprint`)
# safetensors dtype names -> torch dtypes (the safetensors format specification)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(QuantkitError, ValueError):
    """A checkpoint that cannot be used as it is; the message names the file, tensor or key."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of `model.safetensors.index.json`'s weight_map when there is an
    index (CheckpointError names a listed file that is missing), else every *.safetensors, sorted."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index (no JSON weight_map: {err!r})") from err
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) {missing[:3]} that do not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    return files


def tensor_headers(model_dir: Path) -> TensorHeaders:
    """{tensor name: (safetensors dtype, shape)} over the checkpoint's weight files, without reading data; with
    an index, CheckpointError names a tensor its weight_map puts in another file than the one holding it."""
    model_dir = Path(model_dir)
    headers = {}
    located = {}
    for file in weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    headers[name] = (s.get_dtype(), tuple(s.get_shape()))
                    located[name] = file.name
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: unreadable safetensors file (truncated or corrupt?): {err}") from err
    if (model_dir / INDEX_FILE).is_file():
        weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
        wrong = sorted(n for n in set(weight_map) | set(located) if weight_map.get(n) != located.get(n))
        if wrong:
            n = wrong[0]
            raise CheckpointError(
                f"{model_dir / INDEX_FILE}: weight_map disagrees with the shards for {len(wrong)} "
                f"tensor(s), e.g. {n} (index: {weight_map.get(n)}, found in: {located.get(n)})"
            )
    return headers


def read_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (one file or shards), by name."""
    return {k: v for file in weight_files(model_dir) for k, v in load_file(str(file)).items()}


class TensorReader:
    """One tensor at a time from a checkpoint's safetensors files, read with plain file reads (module docstring).

    `reader[name]` returns a new tensor of the stored dtype and shape; `names` lists every tensor (file order).
    `aliases` ({name asked for: name stored}) lets a caller read a checkpoint stored under other names."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.aliases: dict[str, str] = {}
        self._where: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for file in weight_files(model_dir):
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                start, end = entry["data_offsets"]
                self._where[name] = (file, entry["dtype"], tuple(entry["shape"]), 8 + length + start, end - start)

    @property
    def names(self) -> list[str]:
        """Every stored tensor name, in file order (`aliases` not included)."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return self.aliases.get(name, name) in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name` (no data read)."""
        return self._where[self.aliases.get(name, name)][2]

    def __getitem__(self, name: str) -> torch.Tensor:
        file, dtype, shape, offset, nbytes = self._where[self.aliases.get(name, name)]
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, which quantkit does not read")
        data = torch.empty(nbytes, dtype=torch.uint8)
        with open(file, "rb") as f:
            f.seek(offset)
            # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it exports the buffer protocol on 3.11 too
            if f.readinto(memoryview(data.numpy())) != nbytes:  # type: ignore[arg-type]
                raise CheckpointError(f"{file}: tensor {name} is truncated")
        return data.view(SAFETENSORS_DTYPES[dtype]).reshape(shape)


def weights_fingerprint(model_dir: str | Path) -> str:
    """A SHA-256 (hex) identifying a checkpoint's weights without reading them all: over each weight file (sorted by
    name) its name, its safetensors header (every tensor's name, dtype, shape and offsets) and the first and last
    FINGERPRINT_SAMPLE_BYTES of its tensor data. Two checkpoints of the same architecture with different weights
    differ in the sampled bytes; a file rewritten with the same tensors keeps it."""
    digest = hashlib.sha256()
    for file in sorted(weight_files(Path(model_dir)), key=lambda f: f.name):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = f.read(length)
            start, end = 8 + length, file.stat().st_size
            head = f.read(min(FINGERPRINT_SAMPLE_BYTES, end - start))
            f.seek(max(start, end - FINGERPRINT_SAMPLE_BYTES))
            tail = f.read()
        for part in (file.name.encode(), header, head, tail):
            digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def write_source_record(out_dir: str | Path, source_dir: str | Path) -> None:
    """Record in the quantized checkpoint being written at `out_dir` (its staging directory, so that the record is
    published with it) the checkpoint it comes from: SOURCE_RECORD {"path", "fingerprint"}."""
    record = {"path": str(Path(source_dir).resolve()), "fingerprint": weights_fingerprint(source_dir)}
    (Path(out_dir) / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def source_record(model_dir: str | Path) -> dict | None:
    """The source a quantized checkpoint records (SOURCE_RECORD: path and `weights_fingerprint`), None without one."""
    path = Path(model_dir) / SOURCE_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        raise CheckpointError(f"{path}: expected an object with a fingerprint string")
    return record


def check_checkpoint_dir(model_dir: str | Path) -> tuple[dict, TensorHeaders]:
    """(config.json as a dict, tensor headers) of a checkpoint directory; CheckpointError names what is wrong."""
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{model_dir} is not a checkpoint directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    qc = config.get("quantization_config")
    if qc is not None and not (isinstance(qc, dict) and isinstance(qc.get("quant_method"), str)):
        raise CheckpointError(
            f"{config_file}: quantization_config must be an object with a quant_method string, got {qc!r:.60}"
        )
    return config, tensor_headers(model_dir)


def describe_architecture(config: dict) -> str:
    """One line naming a checkpoint's architecture from its config.json dict, for the report's section headings:
    the model class, then the token mixers (softmax layers, or Gated DeltaNet + softmax for the hybrid family
    and Qwen3-Next) and the MLP (dense, or routed experts top-k, + a shared expert), e.g.
    "QuantkitHybridForCausalLM: 3 Gated DeltaNet + 1 softmax layers, MoE 8 experts top-2 + shared"."""
    arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    layer_types = config.get("layer_types") or []
    linear = sum(t == "linear_attention" for t in layer_types)
    layers = config.get("num_hidden_layers", len(layer_types))
    mixers = f"{linear} Gated DeltaNet + {layers - linear} softmax layers" if linear else f"{layers} softmax layers"
    experts = config.get("num_experts") or 0
    mlp = "dense MLP"
    if experts:
        shared = " + shared" if config.get("shared_expert_intermediate_size") else ""
        mlp = f"MoE {experts} experts top-{config.get('num_experts_per_tok')}{shared}"
    return f"{arch}: {mixers}, {mlp}"


def checkpoint_size(quantized_dir: str | Path, source_dir: str | Path) -> dict[str, float]:
    """{'bytes': the weight files' size, 'bf16_ratio': that over 2 bytes per parameter of the source}."""
    size = sum(f.stat().st_size for f in weight_files(Path(quantized_dir)))
    bf16 = 2 * sum(math.prod(shape) for _, shape in tensor_headers(Path(source_dir)).values())
    return {"bytes": size, "bf16_ratio": size / bf16}
