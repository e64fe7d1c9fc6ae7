"""Tiling shared by the GEMM kernels: the tile shape and launch settings, which output tile a program
computes (grouped ordering: GROUP_M consecutive programs walk down M over one weight tile, so it is read
from L2 instead of HBM), and the common epilogue. Tiles change speed, never results.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from quantkit.kernels.interpreter_quirks import round_to_bf16


@dataclass(frozen=True)
class GemmTiles:
    """BLOCK_M x BLOCK_N output tile, BLOCK_K elements of K a step; Triton launch settings."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def tile_indices(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (pid_m, pid_n) on a 1-D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    return pid_m, pid_n


@triton.jit
def store_tile(acc, y_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym,
               HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Epilogue: acc (BLOCK_M, BLOCK_N) float32 (+ bias[n]) -> y[offs_m, offs_n] in y's dtype, masked.
    ROUND_BF16: round to nearest first (the interpreter's fp32 -> bf16 cast truncates)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grid_size(m: int, n: int, tiles: GemmTiles) -> tuple[int]:
    """The 1-D launch grid that `tile_indices` maps onto (M, N)."""
    return (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
