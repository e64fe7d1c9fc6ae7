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
- the scheme cannot run on this device (the Triton FP8 path needs CUDA >= sm89).
ModelOpt checkpoints pass: vLLM serves them with its own methods, on CPU through the emulation kernels the plugin
registers (`quantkit.serve.cpu.peer_kernels`), in a 16-bit engine dtype (vLLM refuses float32 for them).
Returns the quantization_config (None for an unquantized checkpoint).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from quantkit.checkpoints import CheckpointError, TensorHeaders, check_checkpoint_dir
from quantkit.formats.checkpoint_tensors import check_quantized_tensors, refuse_quantized_tensors
from quantkit.formats.experts import EXPERT_MATRIX, EXPERT_PROJECTIONS


def check_servable(model_dir: str | Path) -> dict | None:
    """The checks of the module docstring; the quantization_config, or None for an unquantized checkpoint."""
    model_dir = Path(model_dir)
    config, headers = check_checkpoint_dir(model_dir)
    qc = config.get("quantization_config")
    if qc is None:
        refuse_quantized_tensors(model_dir, headers)
        _check_experts(model_dir, config, None, headers)
        return None
    method = qc.get("quant_method")
    if method == "quantkit":
        _check_quantkit(model_dir, qc, headers)
        _check_experts(model_dir, config, qc, headers)
    return qc


def check_unquantized(model_dir: str | Path, why: str) -> None:
    """CheckpointError unless the checkpoint is unquantized (no quantization_config, no quantized tensors): for
    runners that would silently compute a quantized checkpoint wrongly; `why` opens the message's explanation."""
    model_dir = Path(model_dir)
    config, headers = check_checkpoint_dir(model_dir)
    qc = config.get("quantization_config")
    if qc is not None:
        scheme = qc.get("scheme") or qc.get("quant_algo") or qc.get("format") or ""
        raise CheckpointError(
            f"{model_dir} is a {qc['quant_method']} checkpoint{f' ({scheme})' if scheme else ''}: {why}; "
            "transformers has no loader that reproduces its served numerics (use --backend vllm)"
        )
    refuse_quantized_tensors(model_dir, headers)


def _check_quantkit(model_dir: Path, qc: dict, headers: TensorHeaders) -> None:
    check_quantized_tensors(model_dir, qc, headers)
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
