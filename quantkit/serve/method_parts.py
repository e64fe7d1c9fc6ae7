"""What quantkit's two vLLM quant methods share (the linear method, `quantkit.serve.quant_method`; the routed
experts' method, `quantkit.serve.moe_method`): the kernel choice (QUANTKIT_KERNEL), the parity-capture switch
(QUANTKIT_CAPTURE_DIR, docs in quant_method), copying this rank's part of a checkpoint tensor into a served one and
the emulation's activation fake-quant (compiled for large calls: QUANTKIT_CPU_COMPILE).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
from vllm.logger import init_logger

from quantkit.formats.fp8 import expand_block_scales
from quantkit.formats.schemes import LayerTensor, Scheme

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM configures that logger tree


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


COMPILE_ENV = "QUANTKIT_CPU_COMPILE"  # "off": the emulation's activation fake-quant stays eager
COMPILED_MIN_ROWS = 16  # rows from which the compiled fake-quant is faster (below: its call overhead is not)

_compiled: dict[str, Callable[..., torch.Tensor] | None] = {}  # scheme name -> compiled fake-quant (None: eager)


def check_rank_width(method: Any, k: int, width: str, sharded: bool, advice: str) -> None:
    """ValueError unless this rank's input width `k` (named `width` in the message) holds whole quantization groups
    of the quant method's scheme (`k_multiple`; checked when tensor parallelism splits it) and whole online Hadamard
    blocks (its `online_hadamard`); `advice` ends the Hadamard message. `method`: a quant method with `prefix`,
    `scheme`, `online_hadamard`."""
    prefix, scheme, online_hadamard = method.prefix, method.scheme, method.online_hadamard
    if sharded and k % scheme.k_multiple:
        raise ValueError(
            f"{prefix}: {scheme.name} under tensor parallelism needs {width} ({k}) to be a multiple of "
            f"{scheme.k_multiple}"
        )
    if online_hadamard is not None and k % online_hadamard:
        raise ValueError(
            f"{prefix}: the online Hadamard block {online_hadamard} must divide this rank's {width} ({k}); {advice}"
        )


def emulated_activation(
    scheme: Scheme, x: torch.Tensor, input_global_scale: torch.Tensor | None, row_amax: torch.Tensor | None
) -> torch.Tensor:
    """The torch emulation's quantize-dequantize of a layer input, `scheme.fake_quant_activation(x, input_global_scale,
    row_amax)`, (..., K) -> float32 (..., K). Calls of at least `COMPILED_MIN_ROWS` rows run it compiled by inductor
    (`torch.compile(dynamic=True)`: a few fused C++ loops instead of ~20 passes through memory, each with its float32
    temporary): the same numbers bit for bit (elementwise IEEE operations and max-reductions, exact in any order and
    on AVX2 or AVX-512; tests/test_emulated_activation.py), 2-6x faster from a few hundred rows on 2 cores (a
    4096 x 4864 NVFP4 activation: 248 -> 40 ms; benchmarks/README.md). Eager where no C++ compiler is found, the
    compile fails (logged once), or `QUANTKIT_CPU_COMPILE=off`."""
    rows = x.numel() // max(x.shape[-1], 1)
    fake_quant = _compiled_fake_quant(scheme) if rows >= COMPILED_MIN_ROWS else None
    if fake_quant is not None:
        try:
            return fake_quant(x, input_global_scale, row_amax)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # e.g. the compiler cannot build: stay eager
            logger.warning(
                "quantkit: compiling %s's activation fake-quant failed (%s); eager from now on", scheme.name, e
            )
            _compiled[scheme.name] = None
    return scheme.fake_quant_activation(x, input_global_scale, row_amax)


def _compiled_fake_quant(scheme: Scheme) -> Callable[..., torch.Tensor] | None:
    """`scheme.fake_quant_activation` under torch.compile (made once per scheme), or None: switched off, or no C++
    compiler for inductor's CPU code."""
    if os.environ.get(COMPILE_ENV, "").lower() in ("off", "0", "false"):  # read on every call: a switch, not a memo
        return None
    if scheme.name not in _compiled:
        fake_quant = None
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            # No FX graph cache: its key omits the vector ISA, so C++ written for AVX-512's widths and reloaded
            # under AVX2 (ATEN_CPU_CAPABILITY, or a cache shared between machines) computed wrong numbers or
            # freed memory twice (torch 2.13). The C++ build cache, keyed by source and flags, stays on.
            fake_quant = torch.compile(scheme.fake_quant_activation, dynamic=True, options={"fx_graph_cache": False})
        except (RuntimeError, OSError) as e:  # InvalidCxxCompiler: no g++/clang++ on this machine
            logger.warning("quantkit: no compiled activation fake-quant (%s); eager", e)
        _compiled[scheme.name] = fake_quant
    return _compiled[scheme.name]


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
