"""Refuse, before vLLM starts, checkpoints it would fail on obscurely (or, worse, serve wrongly).

`check_servable(model_dir)` reads config.json and the safetensors headers (no tensor data) and raises
`CheckpointError` naming the problem when:
- config.json or the weights are missing or unreadable, or a shard index disagrees with its shards
  (`quantkit.checkpoints.check_checkpoint_dir`: one model.safetensors or shards + model.safetensors.index.json);
- the weights hold quantized tensors but config.json has no `quantization_config`;
- a quantkit `quantization_config` is malformed or disagrees with the tensors (a listed module without
  its tensors, wrong dtypes or scale shapes, quantized tensors of an unlisted module);
- routed experts (`<experts>.<e>.<proj>`, `quantkit.formats.experts`) are incomplete or mixed: every expert
  0..E-1 (E = config num_experts where given) needs gate_proj, up_proj and down_proj, of one shape per
  projection, and an experts module is quantized as a whole or not at all (vLLM's FusedMoE runs all experts
  of a layer with one quant method and one fused gate/up GEMM);
- the scheme cannot run on this device (ModelOpt checkpoints and the Triton FP8 path need CUDA >= sm89).
Returns the quantization_config (None for an unquantized checkpoint).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from quantkit.checkpoints import CheckpointError, TensorHeaders, check_checkpoint_dir
from quantkit.formats.experts import EXPERT_MATRIX, EXPERT_PROJECTIONS
from quantkit.formats.schemes import SCHEMES, checkpoint_suffixes, module_scheme, scheme_from_config

# Suffixes of quantized tensors: quantkit's (but the plain `weight`) and the peers' (ModelOpt, compressed-tensors).
QUANT_SUFFIXES = tuple(s for s in checkpoint_suffixes() if s != "weight") + (
    "weight_scale_2",
    "input_scale",
    "weight_scale_inv",
)


def check_servable(model_dir: str | Path) -> dict | None:
    """The checks of the module docstring; the quantization_config, or None for an unquantized checkpoint."""
    model_dir = Path(model_dir)
    config, headers = check_checkpoint_dir(model_dir)
    qc = config.get("quantization_config")
    if qc is None:
        quantized = sorted(
            n for n, (dtype, _) in headers.items() if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES or dtype.startswith("F8")
        )
        if quantized:
            raise CheckpointError(
                f"{model_dir}: the weights hold quantized tensors ({', '.join(quantized[:3])}, ...) but config.json "
                "has no quantization_config; the checkpoint was not written by `quantkit quantize` or was edited"
            )
        _check_experts(model_dir, config, None, headers)
        return None
    method = qc.get("quant_method")
    if method == "quantkit":
        _check_quantkit(model_dir, qc, headers)
        _check_experts(model_dir, config, qc, headers)
    elif method == "modelopt":
        import torch

        if not torch.cuda.is_available():
            raise CheckpointError(
                f"{model_dir}: ModelOpt checkpoints ({qc.get('quant_algo')}) are served by vLLM on CUDA only; "
                "this machine has no GPU"
            )
    return qc


def _check_quantkit(model_dir: Path, qc: dict, headers: TensorHeaders) -> None:
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
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise CheckpointError(
            f"{model_dir}: quantkit's Triton kernels need FP8 tensor cores (sm89+); this GPU is "
            f"sm{''.join(map(str, torch.cuda.get_device_capability()))}"
        )


def _check_experts(model_dir: Path, config: dict, qc: dict | None, headers: TensorHeaders) -> None:
    """The routed-experts rules of the module docstring (qc: a quantkit quantization_config, or None)."""
    listed = set(qc["quantized_modules"]) if qc else set()
    groups: dict[str, dict[tuple[int, str], tuple[bool, tuple[int, ...]]]] = defaultdict(dict)
    for name, (_, shape) in headers.items():
        module, _, suffix = name.rpartition(".")
        match = EXPERT_MATRIX.match(module)
        if match is None or suffix not in ("weight", "weight_packed"):
            continue
        groups[match["experts"]][(int(match["expert"]), match["proj"])] = (module in listed, tuple(shape))
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    for experts, matrices in sorted(groups.items()):
        count = num_experts or 1 + max(e for e, _ in matrices)
        missing = [f"{experts}.{e}.{p}" for e in range(count) for p in EXPERT_PROJECTIONS if (e, p) not in matrices]
        extra = sorted({e for e, _ in matrices if e >= count})
        if missing or extra:
            raise CheckpointError(
                f"{model_dir}: routed experts {experts} are incomplete for {count} experts: missing "
                f"{missing[:3]}{' ...' if len(missing) > 3 else ''}; unexpected expert ids {extra[:3]}"
            )
        states = {quantized for quantized, _ in matrices.values()}
        if len(states) > 1:
            some = sorted(f"{experts}.{e}.{p}" for (e, p), (q, _) in matrices.items() if not q)[:3]
            raise CheckpointError(
                f"{model_dir}: routed experts {experts} are partly quantized ({some} are not); vLLM's "
                "FusedMoE runs every expert of a layer with one quant method: quantize all or none"
            )
        for proj in EXPERT_PROJECTIONS:
            shapes = {shape for (_, p), (_, shape) in matrices.items() if p == proj}
            if len(shapes) > 1:
                raise CheckpointError(f"{model_dir}: {experts}.*.{proj} have different shapes {sorted(shapes)}")
