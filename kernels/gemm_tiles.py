"""Tiling shared by the GEMM kernels: the tile shape and launch settings, and which output tile a
program computes (grouped ordering: GROUP_M consecutive programs walk down M over one weight tile, so
it is read from L2 instead of HBM). Tiles change speed, never results.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


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


def grid_size(m: int, n: int, tiles: GemmTiles) -> tuple[int]:
    """The 1-D launch grid that `tile_indices` maps onto (M, N)."""
    return (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
