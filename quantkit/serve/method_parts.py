"""What quantkit's two vLLM quant methods share (the linear method, `quantkit.serve.quant_method`; the routed
experts' method, `quantkit.serve.moe_method`): the kernel choice (QUANTKIT_KERNEL), the parity-capture switch
(QUANTKIT_CAPTURE_DIR, docs in quant_method) and copying this rank's part of a checkpoint tensor into a served one.
"""

from __future__ import annotations

import os
from enum import StrEnum

import torch

from quantkit.formats.fp8 import expand_block_scales
from quantkit.formats.schemes import LayerTensor


def copy_checkpoint_part(
    target: torch.Tensor,
    loaded: torch.Tensor,
    spec: LayerTensor,
    shard_rows: list[int],
    index: int,
    rank_shard: int,
    k_rank: int | None,
    where: str,
    scheme_name: str,
) -> None:
    """Copy this rank's part of checkpoint tensor `loaded` (one checkpoint module's `spec.suffix` tensor) into the
    served tensor `target` (`spec.shape`: the fused shards' rows stacked, `shard_rows` rows each).

    index: which fused shard `loaded` is; rank_shard: which slice of that shard's rows this rank holds; k_rank: this
    rank's slice of the input columns (row-parallel under TP), None for all columns."""
    rows = shard_rows[index]
    offset = sum(shard_rows[:index])
    if spec.per_shard is not None:
        if loaded.numel() != 1:
            raise ValueError(
                f"{where}: expected one {spec.suffix} per checkpoint module, got shape {tuple(loaded.shape)}"
            )
        if spec.per_shard == "rows":
            target[offset : offset + rows] = loaded.reshape(())
        else:
            target[index] = loaded.reshape(())
        return
    if spec.rows_per_entry > 1:  # block rows -> one row per output row
        loaded = expand_block_scales(loaded, (spec.rows_per_entry, 1))
    part = loaded[rank_shard * rows : (rank_shard + 1) * rows]
    if k_rank is not None:
        columns = target.shape[1]
        part = part[:, k_rank * columns : (k_rank + 1) * columns]
    target = target[offset : offset + rows]
    if part.shape != target.shape or part.dtype != target.dtype:
        raise ValueError(
            f"{where}: the checkpoint tensor {tuple(loaded.shape)} {loaded.dtype} does not match the layer "
            f"({target.dtype}, {tuple(target.shape)} for this shard and rank; "
            f"quantization_config scheme {scheme_name!r}): "
            f"the checkpoint is inconsistent with its quantization_config"
        )
    target.copy_(part)


KERNEL_ENV = "QUANTKIT_KERNEL"  # auto (default) | triton | torch
CAPTURE_ENV = "QUANTKIT_CAPTURE_DIR"


class Kernel(StrEnum):
    """What computes a quantized layer's product (logged; equal to its string)."""

    TRITON = "triton"  # quantkit.kernels: the fused quantizer + GEMM on the stored codes (CUDA)
    TORCH_EMULATION = "torch-emulation"  # weights decoded once to float32, activations fake-quantized per call


KERNEL_CHOICES = {"auto": None, "triton": Kernel.TRITON, "torch": Kernel.TORCH_EMULATION}  # QUANTKIT_KERNEL values


def select_kernel(layer: torch.nn.Module) -> Kernel:
    """Triton on CUDA, torch emulation elsewhere; QUANTKIT_KERNEL=triton|torch forces one (triton off CUDA needs
    TRITON_INTERPRET=1: a correctness check, not a fast path)."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected auto, triton or torch")
    forced = KERNEL_CHOICES[choice]
    if forced is not None:
        return forced
    return Kernel.TRITON if next(layer.parameters()).is_cuda else Kernel.TORCH_EMULATION
