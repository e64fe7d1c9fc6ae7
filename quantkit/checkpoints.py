"""The checks every command that takes a checkpoint directory runs before any work.

`check_checkpoint_dir(path)` reads config.json and the safetensors headers (no tensor data) and raises
`CheckpointError` naming the file when config.json is missing or not a JSON object, there are no
*.safetensors weights, or a weights file is unreadable (truncated or corrupt).
`quantkit.serve.checkpoint_check` builds the serving checks on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from quantkit.errors import QuantkitError

TensorHeaders = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)


class CheckpointError(QuantkitError, ValueError):
    """A checkpoint that cannot be used as it is; the message names the file, tensor or key."""


def tensor_headers(model_dir: Path) -> TensorHeaders:
    """{tensor name: (safetensors dtype, shape)} over every *.safetensors file, without reading data."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    headers = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    headers[name] = (s.get_dtype(), tuple(s.get_shape()))
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: unreadable safetensors file (truncated or corrupt?): {err}") from err
    return headers


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
    return config, tensor_headers(model_dir)
