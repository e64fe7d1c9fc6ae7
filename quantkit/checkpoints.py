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
