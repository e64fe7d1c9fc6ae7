"""What a quantized checkpoint's tensors must be, read from the safetensors headers alone (no tensor data).

`refuse_quantized_tensors`: quantized tensors where config.json declares no quantization (an edited checkpoint:
whoever loads it as unquantized would compute with the raw FP8 or packed FP4 bytes as weights).
`check_quantized_tensors`: a quantkit quantization_config against the tensors it describes. Serving
(`quantkit.serve.checkpoint_check`) and the fake-quant reference (`quantkit.quantize.fake_quant`) both run them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from quantkit.checkpoints import CheckpointError, TensorHeaders
from quantkit.formats.schemes import SCHEMES, checkpoint_suffixes, module_scheme, scheme_from_config

# Suffixes of quantized tensors: quantkit's (but the plain `weight`) and the peers' (ModelOpt, compressed-tensors).
QUANT_SUFFIXES = tuple(s for s in checkpoint_suffixes() if s != "weight") + (
    "weight_scale_2",
    "input_scale",
    "weight_scale_inv",
)


def refuse_quantized_tensors(model_dir: str | Path, headers: TensorHeaders) -> None:
    """CheckpointError when a checkpoint without quantization_config holds quantized tensors (FP8 dtypes, scales)."""
    quantized = sorted(
        n for n, (dtype, _) in headers.items() if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES or dtype.startswith("F8")
    )
    if quantized:
        raise CheckpointError(
            f"{model_dir}: the weights hold quantized tensors ({', '.join(quantized[:3])}, ...) but config.json "
            "has no quantization_config; the checkpoint was not written by `quantkit quantize` or was edited"
        )


def check_quantized_tensors(model_dir: str | Path, qc: dict, headers: TensorHeaders) -> None:
    """A quantkit quantization_config against the tensors (headers only): every listed module has its scheme's
    tensors, dtypes and shapes, and no unlisted module holds quantized tensors; CheckpointError names the first
    disagreement (e.g. a config saying nvfp4 over FP8 tensors)."""
    scheme_from_config(qc, f"{model_dir}/config.json quantization_config")
    modules = qc["quantized_modules"]
    shapes: defaultdict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)  # module -> {suffix: shape}
    for name, (_, shape) in headers.items():
        module, dot, suffix = name.rpartition(".")
        if dot:
            shapes[module][suffix] = shape
    for module in modules:
        scheme, activation_scale = module_scheme(qc, module)
        for suffix, dtype in scheme.checkpoint_tensors(activation_scale).items():
            got = headers.get(f"{module}.{suffix}")
            if got is None:
                raise CheckpointError(
                    f"{model_dir}: quantized module {module} ({scheme.name}) has no tensor {module}.{suffix}"
                )
            if got[0] != dtype:
                raise CheckpointError(
                    f"{model_dir}: {module}.{suffix} is {got[0]}, scheme {scheme.name} stores {dtype}"
                )
        problem = scheme.shape_problem(module, shapes[module])
        if problem:
            raise CheckpointError(f"{model_dir}: {problem}")
    listed = set(modules)
    markers = {s.marker for s in SCHEMES.values()}
    stray = sorted(m for m, suffixes in shapes.items() if markers & set(suffixes) and m not in listed)
    if stray:
        raise CheckpointError(
            f"{model_dir}: {stray[:3]} hold quantized tensors but are not in quantization_config.quantized_modules"
        )
