"""FP8 E4M3 W8A8 GEMM with 128x128 block-scaled weights and per-token activations (Triton).

`fp8_block_gemm(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16)` -> y (M, N):

    y[m, n] = sum_kb (x_q[m, kb] . w_q[n, kb]) * x_scale[m] * w_scale[n // 128, kb]  (+ bias[n])
    (or w_scale[n, kb] when w_scale has one row per output row, see below)

x_q (M, K) float8_e4m3fn with x_scale (M, 1) float32 (per-token DECODE scales, as
`quantkit.formats.quantize_fp8_per_token` or `quantkit.kernels.quantize_fp8` write them); w_q (N, K)
float8_e4m3fn with w_scale (ceil(N/128), ceil(K/128)) float32 (DECODE scale per 128x128 block, edge
blocks partial, as `quantkit.formats.quantize_fp8_block` and the checkpoint's `weight_scale`) -- or
(N, ceil(K/128)), each block row repeated over its rows: vLLM's fused layers, whose shards (q, k, v) need
not start on a multiple of 128 rows, hold it so (`quantkit.serve.quant_method`); bias (N,)
of any float dtype. kb runs over K blocks of 128: each block's FP8 dot is scaled and added to a float32
accumulator inside the K loop (as vLLM's ``w8a8_block_fp8_matmul``); output cast once at the end.
K and N need not be multiples of 128 (masked loads read zeros past the edges).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from quantkit.formats.constants import F8E4M3_DTYPE, FP8_WEIGHT_BLOCK
from quantkit.kernels.gemm_tiles import (
    GemmTiles,
    check_epilogue_args,
    default_tiles,
    grid_size,
    output_tile,
    require,
    store_tile,
)
from quantkit.kernels.interpreter_quirks import interpreting

_check = partial(require, "fp8_block_gemm")  # _check(cond, msg): ValueError "fp8_block_gemm: msg" unless cond


@triton.jit
def fp8_block_dot(
    x_rows,
    x_scale,
    w_rows,
    w_scale_rows,
    m_ok,
    n_ok,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The K loop of one output tile: float32 (BLOCK_M, BLOCK_N) = sum_kb (x . w) * x_scale * w_scale.

    x_rows (BLOCK_M,) / w_rows (BLOCK_N,): pointers to the first element of each activation / weight row;
    x_scale (BLOCK_M,) float32; w_scale_rows (BLOCK_N,): pointers to each output row's first K-block scale
    (consecutive K blocks adjacent). Rows outside (not m_ok / n_ok) and K past the edge read zeros."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_rows[:, None] + offs_k[None, :]
    w_ptrs = w_rows[None, :] + offs_k[:, None]  # (BLOCK_K, BLOCK_N) view of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & n_ok[None, :], other=0.0)
        w_scale = tl.load(w_scale_rows + kb, mask=n_ok, other=0.0)
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)
    acc = fp8_block_dot(
        x_ptr + offs_m.to(tl.int64) * stride_xm,
        x_scale,
        w_ptr + offs_n.to(tl.int64) * stride_wn,
        w_scale_ptr + (offs_n // SCALE_BLOCK) * stride_wsn,
        m_ok,
        n_ok,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    store_tile(acc, y_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, HAS_BIAS, ROUND_BF16)


def fp8_block_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """y (M, N) = (x_q * x_scale) @ (w_q * w_scale)^T (+ bias), float32 accumulation, `out_dtype` output.

    tiles: default `default_tiles(M, 128, "fp8_block")`; its block_k must be the scale block, 128."""
    for name, t in (("x_q", x_q), ("w_q", w_q)):
        ok = t.dtype == F8E4M3_DTYPE and t.ndim == 2
        _check(ok, f"{name} must be 2-D float8_e4m3fn, got {t.dtype} {tuple(t.shape)}")
    m, k = x_q.shape
    n = w_q.shape[0]
    _check(w_q.shape[1] == k, f"x_q {tuple(x_q.shape)} and w_q {tuple(w_q.shape)} disagree on K")
    _check(
        x_scale.dtype == torch.float32 and tuple(x_scale.shape) == (m, 1),
        f"x_scale must be float32 of shape {(m, 1)}, got {x_scale.dtype} {tuple(x_scale.shape)}",
    )
    blocks = (triton.cdiv(n, FP8_WEIGHT_BLOCK), triton.cdiv(k, FP8_WEIGHT_BLOCK))
    rows = (n, blocks[1])
    _check(
        w_scale.dtype == torch.float32 and tuple(w_scale.shape) in (blocks, rows),
        f"w_scale must be float32 of shape {blocks} (or {rows}, one row per output row) for w_q {(n, k)}, "
        f"got {w_scale.dtype} {tuple(w_scale.shape)}",
    )
    scale_rows = FP8_WEIGHT_BLOCK if tuple(w_scale.shape) == blocks else 1
    check_epilogue_args("fp8_block_gemm", n, bias, out_dtype, (x_q, x_scale, w_q, w_scale))
    tiles = tiles or default_tiles(m, FP8_WEIGHT_BLOCK, "fp8_block")
    _check(tiles.block_k == FP8_WEIGHT_BLOCK, f"tiles.block_k must be the scale block {FP8_WEIGHT_BLOCK}")
    x_q, w_q = x_q.contiguous(), w_q.contiguous()
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    _fp8_block_gemm_kernel[grid_size(m, n, tiles)](
        x_q,
        x_scale,
        w_q,
        w_scale,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x_q.stride(0),
        w_q.stride(0),
        w_scale.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        ROUND_BF16=out_dtype == torch.bfloat16 and interpreting(),
        SCALE_BLOCK=scale_rows,
        **tiles.launch_options(),
    )
    return y
