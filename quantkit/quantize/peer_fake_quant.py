"""A peer's NVFP4 checkpoint (compressed-tensors `nvfp4-pack-quantized`, as llm-compressor writes it) as fake-quant
modules, so that `quantkit quality` measures a peer row as it measures quantkit's.

Each quantized Linear (one storing `weight_packed`) becomes a `PeerNvFp4Linear`: y = qdq(x) W^T + b in float32, with
W decoded by vLLM's `dequantize_to_dtype` with the float32 reciprocal of the checkpoint's `weight_global_scale`, and x
quantized-dequantized by vLLM's `ref_nvfp4_quant_dequant` with the checkpoint's static `input_global_scale`
(compressed-tensors stores both as quantization scales, 448 * 6 / amax: the inverse of quantkit's decode scales),
as vLLM's compressed-tensors W4A4 NVFP4 scheme prepares them. These are the functions that serve the row on CPU
(`quantkit.serve.cpu.peer_kernels.DecodedOnceNvFp4LinearKernel`), here in float32 as quantkit's own fake-quant
reference runs (bit-equal to the served layer in float32: tests/test_serve_quantized.py). vLLM is imported only
when a peer checkpoint is read (~7 s).

What `read_peer_quantization_config` returns has the keys `quality` reads of a quantkit quantization_config:
recipe (the checkpoint directory's name), quantized_modules, smoothquant None, rotation None. A peer's own
function-preserving transforms (AWQ's scales) are not recorded in the checkpoint, so its layers' inputs do not
match the source's: `quality` measures a peer's noise at the blocks' outputs only (`block_snr_db`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeGuard, cast

import torch

from quantkit.checkpoints import CheckpointError, TensorHeaders
from quantkit.formats.constants import NVFP4_GROUP

QUANT_METHOD = "compressed-tensors"
NVFP4_FORMAT = "nvfp4-pack-quantized"
NVFP4_TENSORS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


def is_peer_config(qc: Any) -> TypeGuard[dict]:
    """Whether a config.json quantization_config is a compressed-tensors one (a peer's checkpoint)."""
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def read_peer_quantization_config(model_dir: Path, qc: dict, headers: TensorHeaders) -> dict:
    """The checked compressed-tensors quantization_config of `model_dir` as quality reads a quantization_config:
    {quant_method, recipe: the directory's name, quantized_modules: every module storing weight_packed (sorted),
    smoothquant: None, rotation: None}. CheckpointError for any format but NVFP4 with static activation scales,
    a checkpoint with a `transform_config` (rotations folded in: its layers no longer read the source's stream), or a
    quantized module missing one of `NVFP4_TENSORS`."""
    formats = {
        str(f) for f in [qc.get("format"), *(g.get("format") for g in qc.get("config_groups", {}).values())] if f
    }
    if formats != {NVFP4_FORMAT}:
        raise CheckpointError(
            f"{model_dir}: compressed-tensors format(s) {sorted(formats)}: quality reads a peer's {NVFP4_FORMAT} "
            "checkpoints only"
        )
    if transforms := qc.get("transform_config"):
        groups = sorted(transforms.get("config_groups", {})) if isinstance(transforms, dict) else []
        raise CheckpointError(
            f"{model_dir}: the checkpoint folds compressed-tensors transforms {groups} into its weights (its "
            "transform_config: SpinQuant's R1 rotates the residual stream, embeddings and head included); quality "
            "feeds a peer's layers the source's hidden states and cannot rebuild that rotated stream, so it would "
            "report noise that is not the quantization's: quality reads a peer's checkpoints without transforms only"
        )
    quantized = sorted(name.removesuffix(".weight_packed") for name in headers if name.endswith(".weight_packed"))
    missing = [f"{m}.{s}" for m in quantized for s in NVFP4_TENSORS if f"{m}.{s}" not in headers]
    if not quantized or missing:
        raise CheckpointError(
            f"{model_dir}: not an NVFP4 checkpoint with static activation scales: "
            + (f"missing {missing[:3]}" if missing else "no module stores weight_packed")
        )
    return {
        "quant_method": QUANT_METHOD,
        "recipe": Path(model_dir).name,
        "quantized_modules": quantized,
        "smoothquant": None,
        "rotation": None,
    }


class PeerNvFp4Linear(torch.nn.Module):
    """y = ref_nvfp4_quant_dequant(x, input_global_scale) @ W^T + b, float32, cast to x's dtype; W (N, K) float32,
    decoded from the checkpoint once."""

    # buffers (register_buffer)
    weight: torch.Tensor
    bias: torch.Tensor | None
    input_global_scale: torch.Tensor

    def __init__(self, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

        # compressed-tensors stores the quantization scale (a divisor); vLLM decodes with its float32 reciprocal
        decode_scale = 1.0 / tensors["weight_global_scale"].max().to(torch.float32)
        weight = dequantize_to_dtype(
            tensors["weight_packed"],
            tensors["weight_scale"],
            decode_scale,
            torch.float32,
            NVFP4_GROUP,
            swizzle=False,
        )
        self.register_buffer("weight", weight)
        self.register_buffer("bias", None if bias is None else bias.float())
        self.register_buffer("input_global_scale", tensors["input_global_scale"].max().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N) in x's dtype."""
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant

        flat = x.float().reshape(-1, x.shape[-1])
        xq = ref_nvfp4_quant_dequant(flat, self.input_global_scale, NVFP4_GROUP).reshape(x.shape)
        return torch.nn.functional.linear(xq, self.weight, self.bias).to(x.dtype)


def install_peer_fake_quant(
    module: torch.nn.Module,
    prefix: str,
    state: dict[str, torch.Tensor],
    qc: dict,
    model_dir: Path,
    only: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """`quantkit.quantize.fake_quant.install_fake_quant` for a peer's checkpoint: the quantized linears under
    prefix (or those in `only`) replaced by `PeerNvFp4Linear` from `state` (popped); returns the rest of the
    state under prefix, renamed relative to `module`."""
    for full in qc["quantized_modules"]:
        if not full.startswith(prefix) or (only is not None and full not in only):
            continue
        name = full[len(prefix) :]
        linear = cast(torch.nn.Linear, module.get_submodule(name))  # a quantized module is a Linear
        tensors = {s: state.pop(f"{full}.{s}") for s in NVFP4_TENSORS}
        fake = PeerNvFp4Linear(tensors, state.pop(f"{full}.bias", None))
        if tuple(fake.weight.shape) != tuple(linear.weight.shape):
            raise CheckpointError(
                f"{model_dir}: {full} decodes to {tuple(fake.weight.shape)}, the model expects "
                f"{tuple(linear.weight.shape)}"
            )
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, fake)
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
