"""Refuse, before vLLM starts, checkpoints it would fail on obscurely (or, worse, serve wrongly).

`check_servable(model_dir)` reads config.json and the safetensors headers (no tensor data) and raises
`CheckpointError` naming the problem when:
- config.json or the weights are missing or unreadable (`quantkit.checkpoints.check_checkpoint_dir`);
- the weights hold quantized tensors but config.json has no `quantization_config`;
- a quantkit `quantization_config` is malformed or disagrees with the tensors (a listed module without
  its tensors, wrong dtypes or scale shapes, quantized tensors of an unlisted module);
- the scheme cannot run on this device (ModelOpt checkpoints and the Triton FP8 path need CUDA >= sm89).
Returns the quantization_config (None for an unquantized checkpoint).
"""

from __future__ import annotations

import math
from pathlib import Path

from quantkit.checkpoints import CheckpointError, TensorHeaders, check_checkpoint_dir
from quantkit.formats.constants import FP8_WEIGHT_BLOCK as FP8_BLOCK
from quantkit.formats.constants import NVFP4_GROUP

QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "weight_scale_2",
                  "input_scale", "weight_scale_inv")
SCHEME_TENSORS = {  # suffix -> safetensors dtype
    "fp8_block": {"weight": "F8_E4M3", "weight_scale": "F32"},
    "nvfp4": {"weight_packed": "U8", "weight_scale": "F8_E4M3", "weight_global_scale": "F32"},
}


def check_servable(model_dir: str | Path) -> dict | None:
    """The checks of the module docstring; the quantization_config, or None for an unquantized checkpoint."""
    model_dir = Path(model_dir)
    config, headers = check_checkpoint_dir(model_dir)
    qc = config.get("quantization_config")
    if qc is None:
        quantized = sorted(n for n, (dtype, _) in headers.items() if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES or dtype.startswith("F8"))
        if quantized:
            raise CheckpointError(
                f"{model_dir}: the weights hold quantized tensors ({', '.join(quantized[:3])}, ...) but config.json "
                "has no quantization_config; the checkpoint was not written by `quantkit quantize` or was edited"
            )
        return None
    method = qc.get("quant_method")
    if method == "quantkit":
        _check_quantkit(model_dir, qc, headers)
    elif method == "modelopt":
        import torch

        if not torch.cuda.is_available():
            raise CheckpointError(f"{model_dir}: ModelOpt checkpoints ({qc.get('quant_algo')}) are served by vLLM on CUDA only; this machine has no GPU")
    return qc


def validate_quantkit_config(qc: dict, where: str = "quantization_config") -> None:
    """The keys of a quantkit quantization_config (docs/checkpoint-format.md), without the tensors."""
    if qc.get("format_version") != 1:
        raise CheckpointError(f"{where}: format_version {qc.get('format_version')!r} is not supported (expected 1; re-run `quantkit quantize`)")
    scheme = qc.get("scheme")
    if scheme not in SCHEME_TENSORS:
        raise CheckpointError(f"{where}: scheme {scheme!r} is not one of {list(SCHEME_TENSORS)}")
    activation_scale = qc.get("activation_scale")
    if activation_scale not in ("per_token", "static") or (activation_scale == "static" and scheme != "nvfp4"):
        raise CheckpointError(f"{where}: activation_scale {activation_scale!r} is not valid for scheme {scheme}")
    if not qc.get("quantized_modules"):
        raise CheckpointError(f"{where}: quantized_modules is empty")


def _check_quantkit(model_dir: Path, qc: dict, headers: TensorHeaders) -> None:
    validate_quantkit_config(qc, f"{model_dir}/config.json quantization_config")
    scheme, modules = qc["scheme"], qc["quantized_modules"]
    static = qc["activation_scale"] == "static"
    for module in modules:
        expected = dict(SCHEME_TENSORS[scheme], **({"input_global_scale": "F32"} if static else {}))
        for suffix, dtype in expected.items():
            got = headers.get(f"{module}.{suffix}")
            if got is None:
                raise CheckpointError(f"{model_dir}: quantized module {module} ({scheme}) has no tensor {module}.{suffix}")
            if got[0] != dtype:
                raise CheckpointError(f"{model_dir}: {module}.{suffix} is {got[0]}, scheme {scheme} stores {dtype}")
        if scheme == "fp8_block":
            n, k = headers[f"{module}.weight"][1]
            want = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
            if headers[f"{module}.weight_scale"][1] != want:
                raise CheckpointError(f"{model_dir}: {module}.weight_scale has shape {headers[f'{module}.weight_scale'][1]}, "
                                      f"a ({n}, {k}) weight in 128x128 blocks needs {want}")
        else:
            if f"{module}.weight" in headers:
                raise CheckpointError(f"{model_dir}: nvfp4 module {module} also stores an unquantized {module}.weight")
            n, half_k = headers[f"{module}.weight_packed"][1]
            want = (n, half_k * 2 // NVFP4_GROUP)
            if half_k * 2 % NVFP4_GROUP or headers[f"{module}.weight_scale"][1] != want:
                raise CheckpointError(f"{model_dir}: {module}.weight_scale has shape {headers[f'{module}.weight_scale'][1]}, "
                                      f"packed weight {(n, half_k)} needs {want} (one scale per 16 elements)")
    listed = set(modules)
    marker = "weight_packed" if scheme == "nvfp4" else "weight_scale"
    stray = sorted(n.rsplit(".", 1)[0] for n in headers if n.endswith("." + marker) and n.rsplit(".", 1)[0] not in listed)
    if stray:
        raise CheckpointError(f"{model_dir}: {stray[:3]} hold quantized tensors but are not in quantization_config.quantized_modules")
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise CheckpointError(f"{model_dir}: quantkit's Triton kernels need FP8 tensor cores (sm89+); this GPU is "
                              f"sm{''.join(map(str, torch.cuda.get_device_capability()))}")
