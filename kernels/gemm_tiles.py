"""What the GEMM kernels share: the tile shape and launch settings with the default tiles per shape class of M,
which output tile a program computes (grouped ordering: GROUP_M consecutive programs walk down M over one weight
tile, so it is read from L2 instead of HBM), the common epilogue, and the checks of the common arguments. Tiles
change speed, never results.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
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

    def launch_options(self) -> dict[str, int]:
        """The keyword arguments a tiled GEMM kernel launches with: its BLOCK_M/N/K and GROUP_M constexprs and
        Triton's num_warps / num_stages."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Shape classes of M (the GEMM's rows; for the grouped GEMMs the mean rows per expert, cdiv(S, E)): name and the
# largest M in it, in order; the last has no bound.
SHAPE_CLASSES = (("decode", 16), ("small", 64), ("prefill", None))

# The tiles each shape class launches with; block_k here is a placeholder, `default_tiles` puts the kernel's.
# benchmarks/tune_tiles.py sweeps candidates per class and kernel; where a kernel's sweep found clearly better
# tiles (geometric-mean speed-up over the class's shapes, no shape much slower), KERNEL_TILES overrides this
# table for that kernel (benchmarks/README.md, "Tile sweep", has the figures, machine and date).
DEFAULT_TILES = {
    "decode": GemmTiles(16, 64, 128, num_warps=4, num_stages=4),  # thin M tiles
    "small": GemmTiles(64, 128, 128, num_warps=4, num_stages=4),
    "prefill": GemmTiles(128, 128, 128, num_warps=8, num_stages=3),
}
GEMM_KERNELS = ("fp8_block", "nvfp4", "fp8_block_grouped", "nvfp4_grouped")
KERNEL_TILES = {  # (kernel, class) -> tiles, from the H100 sweep of 2026-11-25
    ("fp8_block", "decode"): GemmTiles(16, 32, 128, num_warps=4, num_stages=3),  # 1.11x, worst shape 1.00x
    ("nvfp4", "decode"): GemmTiles(16, 32, 128, num_warps=4, num_stages=3),  # 1.18x, worst 0.93x
    ("nvfp4", "small"): GemmTiles(32, 64, 128, num_warps=4, num_stages=3),  # 2.27x, worst 0.90x
}


def shape_class(m: int) -> str:
    """The SHAPE_CLASSES name of a GEMM with m rows (grouped GEMMs: m = mean rows per expert)."""
    return next(name for name, bound in SHAPE_CLASSES if bound is None or m <= bound)


def default_tiles(m: int, block_k: int, kernel: str) -> GemmTiles:
    """The tiles `kernel` (one of GEMM_KERNELS) launches with for m rows: KERNEL_TILES, else DEFAULT_TILES of m's
    shape class; block_k elements of K a step."""
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"default_tiles: unknown kernel {kernel!r}; known: {', '.join(GEMM_KERNELS)}")
    klass = shape_class(m)
    return replace(KERNEL_TILES.get((kernel, klass), DEFAULT_TILES[klass]), block_k=block_k)


def require(fn: str, cond: bool, msg: str) -> None:
    """Raise ValueError("<fn>: <msg>") unless `cond`: a kernel's precondition, checked loudly before launch."""
    if not cond:
        raise ValueError(f"{fn}: {msg}")


def check_epilogue_args(
    fn: str, n: int, bias: torch.Tensor | None, out_dtype: torch.dtype, tensors: Iterable[torch.Tensor]
) -> None:
    """The arguments every GEMM shares: bias None or a float (n,) tensor, out_dtype one of OUT_DTYPES, all
    `tensors` (bias included) on one device."""
    require(
        fn,
        bias is None or (bias.is_floating_point() and tuple(bias.shape) == (n,)),
        f"bias must be a float tensor of shape {(n,)}",
    )
    require(fn, out_dtype in OUT_DTYPES, f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    tensors = tuple(tensors) + (() if bias is None else (bias,))
    require(fn, len({t.device for t in tensors}) == 1, "all tensors must be on one device")


@triton.jit
def tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): this program's tile of a num_pid_m x num_pid_n tile grid, 1-D grid, grouped ordering."""
    pid = tl.program_id(0)
    first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    return pid_m, pid_n


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile on a 1-D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs: (offs_m
    (BLOCK_M,), offs_n (BLOCK_N,), m_ok, n_ok), its rows and columns and which of them lie inside (M, N)."""
    pid_m, pid_n = tile_ids(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def store_tile(
    acc, y_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """Epilogue: acc (BLOCK_M, BLOCK_N) float32 (+ bias[n]) -> y[offs_m, offs_n] in y's dtype, masked.
    ROUND_BF16: round to nearest first (the interpreter's fp32 -> bf16 cast truncates)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grid_size(m: int, n: int, tiles: GemmTiles) -> tuple[int]:
    """The 1-D launch grid that `output_tile` maps onto (M, N)."""
    return (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
