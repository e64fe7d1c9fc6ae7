"""Grouped (MoE) GEMMs of both schemes (Triton): rows sorted by expert, each multiplied by its expert's weight.

    fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale, expert_offsets, *, row_index=None, ...) -> y (S, N)
    nvfp4_grouped_gemm(a_packed, a_block_scale, a_global, w_packed, w_block_scale, w_global, expert_offsets,
                       *, row_index=None, ...) -> y (S, N)

    y[s] = A[s] @ W[e]^T   for offsets[e] <= s < offsets[e + 1]  (expert_offsets (E + 1,) int32/int64,
                            `quantkit.kernels.expert_sort`); y[s] = 0 for s >= offsets[E] (no expert here)

Sorted row s reads activation row A[s], or A[row_index[s]] when row_index (S,) is given: the GEMM gathers the
rows itself, so a layer's input is quantized once per token and never copied k times (a token's quantized
row is the same whoever reads it, per-token scales being a function of the row alone). Activation operands
are the dense GEMMs' (`fp8_gemm`, `nvfp4_gemm`), one row per token; weights are the dense layouts stacked over
E experts:

    fp8:   w_q (E, N, K) float8_e4m3fn; w_scale (E, ceil(N/128), ceil(K/128)) float32 (checkpoint blocks) or
           (E, N, ceil(K/128)) (each block row repeated over its rows, as fused gate/up shards hold it)
    nvfp4: w_packed (E, N, Kp/2) uint8; w_block_scale (E, N, Kp/16) float8_e4m3fn; w_global float32 (E,) or
           (E, 1) (one per expert) or (E, N) (one per row: fused gate/up shards keep their own)

The numerics per output tile are the dense kernels' (the K loops are the same functions, `fp8_block_dot`,
`nvfp4_dot`): FP8 dots scaled per 128-block into a float32 accumulator; NVFP4 unpacked and group-scaled into
bf16 tiles, bf16 MMA into float32, second-stage scales (a_global per row, w_global per expert or row) in the
epilogue. No bias (routed experts have none).

Tiles: `expert_tiles` lists, in torch on the device (no host sync), which expert and rows each BLOCK_M tile
covers (the rows of no expert as a group E of their own, written as zeros so that every output is defined);
the grid launches an upper bound of tiles (cdiv(S, BLOCK_M) + min(E + 1, S)) and the spare ones return at
once. A tile never spans two experts, so an expert with 1 row costs a whole (mostly masked) BLOCK_M tile:
default tiles follow the mean rows per expert, S / E.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import triton
import triton.language as tl

from quantkit.formats.constants import F8E4M3_DTYPE, FP8_WEIGHT_BLOCK
from quantkit.kernels.fp8_gemm import fp8_block_dot
from quantkit.kernels.gemm_tiles import OUT_DTYPES, GemmTiles, default_tiles, require, store_tile, tile_ids
from quantkit.kernels.interpreter_quirks import interpreting
from quantkit.kernels.nvfp4_gemm import DEFAULT_BLOCK_K, check_nvfp4_operands, nvfp4_dot

INDEX_DTYPES = (torch.int32, torch.int64)


def expert_tiles(expert_offsets: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(group_ends, tile_group, tile_row) for `rows` sorted rows: group_ends (E + 2,) int32 is expert_offsets
    with `rows` appended, so group E holds the rows of no expert; tile t covers rows [tile_row[t],
    min(tile_row[t] + block_m, group_ends[g + 1])) of group g = tile_group[t] (int32, E + 1: a spare tile).

    Group g has cdiv(count_g, block_m) tiles, listed group after group; their number is at most
    sum over groups with rows of (count_g // block_m + 1) <= cdiv(rows, block_m) + min(E + 1, rows)."""
    ends = torch.cat([expert_offsets.to(torch.int64), torch.full((1,), rows, device=expert_offsets.device)])
    groups = ends.numel() - 1
    tiles = (ends[1:] - ends[:-1] + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(rows, block_m) + min(groups, rows), device=ends.device)
    group = torch.searchsorted(tile_end, t, right=True)  # the first group whose tiles end after t
    g = group.clamp(max=groups - 1)
    row = ends[g] + (t - (tile_end - tiles)[g]) * block_m
    return ends.to(torch.int32), group.to(torch.int32), row.to(torch.int32)


@triton.jit
def grouped_tile(
    tile_expert_ptr,
    tile_row_ptr,
    ends_ptr,
    row_index_ptr,
    y_ptr,
    NUM_TILES,
    E,
    N,
    stride_ym,
    GATHER: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """This program's tile of a grouped GEMM, on a 1-D grid of NUM_TILES * cdiv(N, BLOCK_N) programs: (expert,
    src (BLOCK_M,) the operand rows (row_index[offs_m] when GATHER, else offs_m), offs_m (BLOCK_M,) sorted rows
    from the tile's first, offs_n (BLOCK_N,), m_ok, n_ok). expert E (the rows of no expert) stores its zeros here;
    expert > E is a spare tile: the kernel has nothing to compute for expert >= E."""
    pid_m, pid_n = tile_ids(NUM_TILES, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    offs_m = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < tl.load(ends_ptr + tl.minimum(expert, E) + 1)
    n_ok = offs_n < N
    if expert == E:  # rows of no expert: zeros
        zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        store_tile(zeros, y_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, False, ROUND_BF16)
    if GATHER:
        src = tl.load(row_index_ptr + offs_m, mask=m_ok, other=0)
    else:
        src = offs_m
    return expert, src, offs_m, offs_n, m_ok, n_ok


@triton.jit
def _fp8_block_grouped_kernel(
    x_ptr,
    x_scale_ptr,
    row_index_ptr,
    w_ptr,
    w_scale_ptr,
    y_ptr,
    ends_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    NUM_TILES,
    E,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_ym,
    GATHER: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile = (tile_expert_ptr, tile_row_ptr, ends_ptr, row_index_ptr, y_ptr, NUM_TILES, E, N, stride_ym)
    expert, src, offs_m, offs_n, m_ok, n_ok = grouped_tile(*tile, GATHER, ROUND_BF16, BLOCK_M, BLOCK_N, GROUP_M)
    if expert >= E:  # rows of no expert (zeros, stored) or a spare tile
        return
    x_scale = tl.load(x_scale_ptr + src, mask=m_ok, other=0.0)
    e64 = expert.to(tl.int64)
    acc = fp8_block_dot(
        x_ptr + src.to(tl.int64) * stride_xm,
        x_scale,
        w_ptr + e64 * stride_we + offs_n.to(tl.int64) * stride_wn,
        w_scale_ptr + e64 * stride_wse + (offs_n // SCALE_BLOCK) * stride_wsn,
        m_ok,
        n_ok,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    store_tile(acc, y_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, False, ROUND_BF16)


@triton.jit
def _nvfp4_grouped_kernel(
    a_ptr,
    a_scale_ptr,
    a_global_ptr,
    row_index_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    y_ptr,
    ends_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    NUM_TILES,
    E,
    N,
    K_BYTES,
    stride_am,
    stride_asm,
    stride_agm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wge,
    stride_wgn,
    stride_ym,
    GATHER: tl.constexpr,
    TILE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile = (tile_expert_ptr, tile_row_ptr, ends_ptr, row_index_ptr, y_ptr, NUM_TILES, E, N, stride_ym)
    expert, src, offs_m, offs_n, m_ok, n_ok = grouped_tile(*tile, GATHER, ROUND_BF16, BLOCK_M, BLOCK_N, GROUP_M)
    if expert >= E:  # rows of no expert (zeros, stored) or a spare tile
        return
    rows, cols, e64 = src.to(tl.int64), offs_n.to(tl.int64), expert.to(tl.int64)
    acc = nvfp4_dot(
        a_ptr + rows * stride_am,
        a_scale_ptr + rows * stride_asm,
        a_global_ptr + rows * stride_agm,
        w_ptr + e64 * stride_we + cols * stride_wn,
        w_scale_ptr + e64 * stride_wse + cols * stride_wsn,
        w_global_ptr + e64 * stride_wge + cols * stride_wgn,
        m_ok,
        n_ok,
        K_BYTES,
        TILE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    store_tile(acc, y_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, False, ROUND_BF16)


def _check_grouping(
    fn: str,
    a_rows: int,
    expert_offsets: torch.Tensor,
    num_experts: int,
    row_index: torch.Tensor | None,
    out_dtype: torch.dtype,
    tensors: Sequence[torch.Tensor],
) -> int:
    """Check what both grouped GEMMs share; return S, the number of sorted rows."""
    check = partial(require, fn)
    check(
        expert_offsets.dtype in INDEX_DTYPES and tuple(expert_offsets.shape) == (num_experts + 1,),
        f"expert_offsets must be int32/int64 of shape (E + 1,) = {(num_experts + 1,)}, got "
        f"{expert_offsets.dtype} {tuple(expert_offsets.shape)}",
    )
    if row_index is not None:
        check(
            row_index.dtype in INDEX_DTYPES and row_index.ndim == 1,
            f"row_index must be 1-D int32/int64 (S,), got {row_index.dtype} {tuple(row_index.shape)}",
        )
    check(out_dtype in OUT_DTYPES, f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    check(
        len({t.device for t in (*tensors, expert_offsets, *([] if row_index is None else [row_index]))}) == 1,
        "all tensors must be on one device",
    )
    return a_rows if row_index is None else row_index.shape[0]


def _launch(
    kernel,
    y: torch.Tensor,
    expert_offsets: torch.Tensor,
    tiles: GemmTiles,
    operands: Sequence,
    sizes: Sequence[int],
    **constexprs,
) -> torch.Tensor:
    """Run a grouped kernel (arguments: operands, y, the tile map of `expert_tiles`, NUM_TILES, E, N, sizes,
    constexprs) over its tiles, filling y (S, N); returns y."""
    s, n = y.shape
    if s == 0 or n == 0:
        return y
    group_ends, tile_group, tile_row = expert_tiles(expert_offsets, s, tiles.block_m)
    num_tiles = tile_group.numel()
    kernel[(num_tiles * triton.cdiv(n, tiles.block_n),)](
        *operands,
        y,
        group_ends,
        tile_group,
        tile_row,
        num_tiles,
        expert_offsets.numel() - 1,
        n,
        *sizes,
        ROUND_BF16=y.dtype == torch.bfloat16 and interpreting(),
        **tiles.launch_options(),
        **constexprs,
    )
    return y


def fp8_block_grouped_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """y (S, N): sorted row s = (x_q[r] * x_scale[r]) @ (w_q[e] * w_scale[e])^T, r = row_index[s] or s.

    x_q (R, K) float8_e4m3fn, x_scale (R, 1) float32 per-token decode scales; weights as in the module
    docstring. tiles: default `default_tiles(S / E, 128, "fp8_block_grouped")`; block_k must be the scale block, 128."""
    fn = "fp8_block_grouped_gemm"
    check = partial(require, fn)
    check(
        x_q.dtype == F8E4M3_DTYPE and x_q.ndim == 2,
        f"x_q must be 2-D float8_e4m3fn, got {x_q.dtype} {tuple(x_q.shape)}",
    )
    check(
        w_q.dtype == F8E4M3_DTYPE and w_q.ndim == 3,
        f"w_q must be 3-D (E, N, K) float8_e4m3fn, got {w_q.dtype} {tuple(w_q.shape)}",
    )
    r, k = x_q.shape
    e, n = w_q.shape[:2]
    check(e >= 1, "w_q must hold at least one expert")
    check(w_q.shape[2] == k, f"x_q {tuple(x_q.shape)} and w_q {tuple(w_q.shape)} disagree on K")
    check(
        x_scale.dtype == torch.float32 and tuple(x_scale.shape) == (r, 1),
        f"x_scale must be float32 of shape {(r, 1)}, got {x_scale.dtype} {tuple(x_scale.shape)}",
    )
    kb = triton.cdiv(k, FP8_WEIGHT_BLOCK)
    blocks, per_row = (e, triton.cdiv(n, FP8_WEIGHT_BLOCK), kb), (e, n, kb)
    check(
        w_scale.dtype == torch.float32 and tuple(w_scale.shape) in (blocks, per_row),
        f"w_scale must be float32 of shape {blocks} (or {per_row}, one row per output row) for w_q {(e, n, k)}, "
        f"got {w_scale.dtype} {tuple(w_scale.shape)}",
    )
    s = _check_grouping(fn, r, expert_offsets, e, row_index, out_dtype, (x_q, x_scale, w_q, w_scale))
    tiles = tiles or default_tiles(triton.cdiv(s, e), FP8_WEIGHT_BLOCK, "fp8_block_grouped")
    check(tiles.block_k == FP8_WEIGHT_BLOCK, f"tiles.block_k must be the scale block {FP8_WEIGHT_BLOCK}")
    x_q, w_q, x_scale, w_scale = x_q.contiguous(), w_q.contiguous(), x_scale.contiguous(), w_scale.contiguous()
    y = torch.empty((s, n), dtype=out_dtype, device=x_q.device)
    return _launch(
        _fp8_block_grouped_kernel,
        y,
        expert_offsets,
        tiles,
        (x_q, x_scale, x_q if row_index is None else row_index.contiguous(), w_q, w_scale),
        (k, x_q.stride(0), w_q.stride(0), w_q.stride(1), w_scale.stride(0), w_scale.stride(1), y.stride(0)),
        GATHER=row_index is not None,
        SCALE_BLOCK=FP8_WEIGHT_BLOCK if tuple(w_scale.shape) == blocks else 1,
    )


def nvfp4_grouped_gemm(
    a_packed: torch.Tensor,
    a_block_scale: torch.Tensor,
    a_global: torch.Tensor | float,
    w_packed: torch.Tensor,
    w_block_scale: torch.Tensor,
    w_global: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """y (S, N): sorted row s = dequant(a)[r] @ dequant(w[e])^T, r = row_index[s] or s.

    a_packed (R, Kp/2) uint8, a_block_scale (R, Kp/16) float8_e4m3fn, a_global float32 (R, 1) or one number
    (as `quantkit.kernels.quantize_nvfp4` writes them); weights as in the module docstring. tiles: default
    `default_tiles(S / E, 128, "nvfp4_grouped")`; block_k a power of two >= 32."""
    fn = "nvfp4_grouped_gemm"
    check = partial(require, fn)
    check(
        a_packed.dtype == torch.uint8 and a_packed.ndim == 2,
        f"a_packed must be 2-D uint8, got {a_packed.dtype} {tuple(a_packed.shape)}",
    )
    check(
        w_packed.dtype == torch.uint8 and w_packed.ndim == 3,
        f"w_packed must be 3-D (E, N, Kp/2) uint8, got {w_packed.dtype} {tuple(w_packed.shape)}",
    )
    r, k_bytes = a_packed.shape
    e, n = w_packed.shape[:2]
    check(e >= 1, "w_packed must hold at least one expert")
    a_global = check_nvfp4_operands(fn, a_packed, a_block_scale, a_global, w_packed, w_block_scale, rows="R")
    a_global = a_global.reshape(-1).contiguous()
    device = a_packed.device
    check(
        w_global.dtype == torch.float32 and tuple(w_global.shape) in ((e,), (e, 1), (e, n)),
        f"w_global must be float32 (E,), (E, 1) or (E, N) = {(e, n)}, got {w_global.dtype} {tuple(w_global.shape)}",
    )
    w_global = w_global.reshape(e, -1).contiguous()
    s = _check_grouping(
        fn,
        r,
        expert_offsets,
        e,
        row_index,
        out_dtype,
        (a_packed, a_block_scale, a_global, w_packed, w_block_scale, w_global),
    )
    tiles = tiles or default_tiles(triton.cdiv(s, e), DEFAULT_BLOCK_K, "nvfp4_grouped")
    check(
        tiles.block_k >= 32 and tiles.block_k & (tiles.block_k - 1) == 0,
        f"tiles.block_k must be a power of two >= 32 (each dot spans >= 16 elements), got {tiles.block_k}",
    )
    a_packed, w_packed = a_packed.contiguous(), w_packed.contiguous()
    a_block_scale, w_block_scale = a_block_scale.contiguous(), w_block_scale.contiguous()
    y = torch.empty((s, n), dtype=out_dtype, device=device)
    interpret = interpreting()
    return _launch(
        _nvfp4_grouped_kernel,
        y,
        expert_offsets,
        tiles,
        (
            a_packed,
            a_block_scale,
            a_global,
            a_packed if row_index is None else row_index.contiguous(),
            w_packed,
            w_block_scale,
            w_global,
        ),
        (
            k_bytes,
            a_packed.stride(0),
            a_block_scale.stride(0),
            1 if a_global.numel() != 1 else 0,
            w_packed.stride(0),
            w_packed.stride(1),
            w_block_scale.stride(0),
            w_block_scale.stride(1),
            w_global.stride(0),
            1 if w_global.shape[1] != 1 else 0,
            y.stride(0),
        ),
        GATHER=row_index is not None,
        TILE=tl.float32 if interpret else tl.bfloat16,
    )
