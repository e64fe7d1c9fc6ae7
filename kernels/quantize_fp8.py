"""Fused FP8 E4M3 per-token activation quantizer (Triton), bit-exact with
`quantkit.formats.quantize_fp8_per_token`.

`quantize_fp8_per_token(x, hadamard=0)`: x (M, K) float32/bfloat16/float16 -> (q (M, K) float8_e4m3fn,
scale (M, 1) float32) of x, or of x's online block Hadamard transform (`hadamard` > 0: a rotated checkpoint's
down_proj input, `quantkit.kernels.hadamard`; the transform is applied to each tile as it is loaded, in both
sweeps). One program quantizes BLOCK_M rows in two sweeps over K: the row amax, then
``q = e4m3(x / scale)`` with the DECODE scale ``scale = amax / 448`` (1.0 for an all-zero row or one
whose scale underflows), all in float32 with correctly rounded division (`tl.div_rn`), RNE and
saturation at +-448 by integer ops (`quantkit.kernels.fp_codes.e4m3_code`); -0.0 stays 0x80.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.formats.constants import F8E4M3_DTYPE
from quantkit.formats.fp8 import check_quantizable
from quantkit.kernels.fp_codes import E4M3_MAX, e4m3_code
from quantkit.kernels.hadamard import check_hadamard, hadamard_scale, hadamard_tile
from quantkit.kernels.interpreter_quirks import interpreting

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_activation(fn: str, x: torch.Tensor) -> None:
    """x must be a 2-D float32/bfloat16/float16 tensor with K > 0 (TypeError / ValueError naming `fn`), and
    finite when on the CPU. A CUDA tensor's values are not checked: that would read x once more and wait for
    the GPU (a host sync, which CUDA-graph capture forbids) on every call of the serving path; NaN or Inf
    there give unspecified codes."""
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        got = getattr(x, "dtype", type(x).__name__)
        raise TypeError(f"{fn}: x must be a float32/bfloat16/float16 tensor, got {got}")
    if not x.is_cuda:
        check_quantizable(x, fn, name="x", ndim=2)
    elif x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"{fn}: x must be 2-D with K > 0, got shape {tuple(x.shape)}")


def check_tile(fn: str, name: str, value: int, least: int = 1) -> None:
    """Tile sizes are powers of two (tl.arange) of at least `least`."""
    if not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"{fn}: {name} must be a power of two >= {least}, got {value!r}")


HADAMARD_TILE_ELEMENTS = 8192  # a transformed tile's elements at most (BLOCK_M x BLOCK_K), held in registers


PROGRAMS = 128  # the programs a quantizer launch aims at when M is small (about one per SM of an H100)


def quantizer_tile(fn: str, m: int, k: int, block_m: int | None, block_k: int, hadamard: int) -> tuple[int, int]:
    """The (BLOCK_M, BLOCK_K) tile of a quantizer sweep over x (m, k). block_m None: chosen by M, at most 16 rows a
    program and at least ~PROGRAMS programs while rows last (M = 16: one row a program; an H100 ran the
    one-program (16, 14336) quantize 2-3x slower than four programs of 4 rows); else checked (a power of two).
    block_k widened to the online Hadamard block when that is larger (a tile holds whole blocks), block_m then cut
    to keep HADAMARD_TILE_ELEMENTS; `hadamard` checked against K (0: no transform)."""
    if block_m is None:  # the interpreter (CI) pays per program, not per row: 16 there
        block_m = 16 if interpreting() else min(16, 1 << (max(1, m // PROGRAMS).bit_length() - 1))
    check_tile(fn, "block_m", block_m)
    check_tile(fn, "block_k", block_k)
    if not hadamard:
        return block_m, block_k
    check_hadamard(fn, hadamard, k)
    block_k = max(block_k, hadamard)
    return max(1, min(block_m, HADAMARD_TILE_ELEMENTS // block_k)), block_k


@triton.jit
def load_rows(x_rows, row_ok, k0, K, BLOCK_K: tl.constexpr, HADAMARD: tl.constexpr, HADAMARD_SCALE: tl.constexpr):
    """float32 (BLOCK_M, BLOCK_K) tile of the rows x_rows ((BLOCK_M, 1) pointers to their first elements),
    columns k0 ..; zeros outside the rows (not row_ok) and beyond K. HADAMARD > 0 (dividing BLOCK_K and K, so a
    tile holds whole blocks): through the online block Hadamard (`quantkit.kernels.hadamard`)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
    if HADAMARD:
        x = hadamard_tile(x, HADAMARD, HADAMARD_SCALE)
    return x


@triton.jit
def row_absmax(
    x_rows,
    row_ok,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HADAMARD: tl.constexpr = 0,
    HADAMARD_SCALE: tl.constexpr = 1.0,
):
    """max |x| (float32, (BLOCK_M,)) of the rows x_rows ((BLOCK_M, 1) pointers to their first elements) over
    K elements (through the online Hadamard when HADAMARD > 0, see `load_rows`), BLOCK_K a step; rows outside
    (not row_ok) give 0."""
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = load_rows(x_rows, row_ok, k0, K, BLOCK_K, HADAMARD, HADAMARD_SCALE)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    return amax


@triton.jit
def _quantize_fp8_per_token_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HADAMARD: tl.constexpr,
    HADAMARD_SCALE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
    amax = row_absmax(x_rows, row_ok, K, BLOCK_M, BLOCK_K, HADAMARD, HADAMARD_SCALE)
    scale = tl.div_rn(amax, tl.full((BLOCK_M,), E4M3_MAX, tl.float32))
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = load_rows(x_rows, row_ok, k0, K, BLOCK_K, HADAMARD, HADAMARD_SCALE)
        y = tl.div_rn(x, tl.broadcast_to(scale[:, None], (BLOCK_M, BLOCK_K)))
        tl.store(q_rows + cols[None, :], e4m3_code(y).to(tl.uint8), mask=mask)


def quantize_fp8_per_token(
    x: torch.Tensor, *, hadamard: int = 0, block_m: int | None = None, block_k: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32/bfloat16/float16 -> (q float8_e4m3fn (M, K), decode scale float32 (M, 1)).

    hadamard > 0 (a power of two dividing K): quantize x's online block Hadamard transform instead, bit-exact
    with quantizing `quantkit.formats.hadamard.block_hadamard(x, hadamard)`. block_m, block_k: the tile one
    program handles per step (powers of two; block_m None: chosen by M, `quantizer_tile`; block_k widened to the
    Hadamard block); they change speed only.
    """
    check_activation("quantize_fp8_per_token", x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    block_m, block_k = quantizer_tile("quantize_fp8_per_token", m, k, block_m, block_k, hadamard)
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _quantize_fp8_per_token_kernel[(triton.cdiv(m, block_m),)](
        x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        q.stride(0),
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        HADAMARD=hadamard,
        HADAMARD_SCALE=hadamard_scale(hadamard) if hadamard else 1.0,
    )
    return q.view(F8E4M3_DTYPE), scale
