"""NVFP4 W4A4 GEMM for GPUs without FP4 tensor cores (Hopper): dequantize tiles to bf16, bf16 MMA (Triton).

`nvfp4_gemm(a_packed, a_block_scale, a_global, w_packed, w_block_scale, w_global, bias=None,
out_dtype=torch.bfloat16)` -> y (M, N):

    y[m, n] = a_global[m] * w_global[n] * sum_k (e2m1(a)[m, k] * a_bs[m, k // 16]) * (e2m1(w)[n, k] * w_bs[n, k // 16])

Operands as `quantkit.formats.quantize_nvfp4_*` / `quantkit.kernels.quantize_nvfp4` and the checkpoint
(docs/checkpoint-format.md) hold them, with Kp = K zero-padded to a multiple of 16:
a_packed (M, Kp/2) uint8 and w_packed (N, Kp/2) uint8 (element 2j in the LOW nibble of byte j);
a_block_scale (M, Kp/16) and w_block_scale (N, Kp/16) float8_e4m3fn; a_global float32 (M, 1) per token,
or one number ((), (1,), (1, 1) or a Python float) for static activation scales; w_global float32, one
number, or (N,) -- one per output row, for vLLM's fused layers whose shards (q, k, v) keep their own
per-tensor scales. All DECODE scales. bias (N,) of any float dtype.

Each K step unpacks BLOCK_K / 2 bytes per row into the low-nibble and high-nibble halves (elements 2j and
2j + 1; a dot product does not care about the order of K as long as both operands share it), multiplies
each E2M1 value by its group scale -- exact in bf16: a 2-bit by 4-bit significand product, magnitudes
2**-10 .. 2688 -- and accumulates two bf16 dots in float32 (float32 tiles under the interpreter, where
bf16 ``tl.dot`` is wrong). The second-stage scales multiply the accumulator once, in the epilogue.

Two paths, one function: for M up to the "small" shape class (<= 64 rows) the fused kernel above decodes
each tile inside the K loop. For more rows it would decode every weight tile once per M tile, and the decode
(integer work on every element) bounds it far below the tensor cores (benchmarks/README.md, "Measurements
behind design choices", has the H100 figure). So `dequantize_first` rows are decoded once, by
`nvfp4_dequantize`, into bf16 (M, Kp) and (N, Kp) operands -- exact, as above -- and multiplied by a plain
bf16 GEMM with the same epilogue: the same sums as the fused path, the same float32 accumulation. Cost: two
bf16 temporaries of (M + N) * Kp * 2 bytes (one layer's weight in bf16, freed on return).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from quantkit.formats.constants import F8E4M3_DTYPE, NVFP4_GROUP
from quantkit.kernels.fp_codes import e2m1_value
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

_GROUP_BYTES = tl.constexpr(NVFP4_GROUP // 2)  # a packed group of 16 E2M1 codes
DEFAULT_BLOCK_K = 128  # default K step: 128 elements = 64 bytes
# The bf16 GEMM of the dequantize-first path (M > 64): wide tiles, as a dense bf16 GEMM on Hopper wants them.
DEQUANTIZED_TILES = GemmTiles(128, 256, 64, num_warps=8, num_stages=3)
DEQUANTIZE_FIRST_MIN_M = 65  # from this many rows on (the "prefill" shape class), dequantize first
_DEQUANT_ROWS, _DEQUANT_BYTES = 16, 128  # nvfp4_dequantize's block: rows x packed bytes a program

_check = partial(require, "nvfp4_gemm")  # _check(cond, msg): ValueError "nvfp4_gemm: msg" unless cond


@triton.jit
def nvfp4_dot(
    a_rows,
    a_scale_rows,
    a_global_rows,
    w_rows,
    w_scale_rows,
    w_global_rows,
    m_ok,
    n_ok,
    K_BYTES,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile: float32 (BLOCK_M, BLOCK_N) = (sum_k (e2m1(a) * a_bs) * (e2m1(w) * w_bs)) * a_global[m] *
    w_global[n], the K loop in K_BYTES packed bytes a row, BLOCK_K elements a step, the second-stage scales last.

    a_rows (BLOCK_M,) / w_rows (BLOCK_N,): pointers to the first packed byte of each row; a_scale_rows /
    w_scale_rows: pointers to each row's first E4M3 group scale; a_global_rows / w_global_rows: to each row's
    float32 global scale. Rows outside and bytes past the edge read 0."""
    BYTES: tl.constexpr = BLOCK_K // 2
    offs_b = tl.arange(0, BYTES)
    # A as (BLOCK_M, BYTES); W as (BYTES, BLOCK_N), the transposed view the dot wants. Byte j of a row
    # holds elements 2j, 2j + 1 of group j // 8: its scale is loaded once per byte (repeated addresses).
    a_ptrs = a_rows[:, None] + offs_b[None, :]
    a_scale_ptrs = a_scale_rows[:, None] + offs_b[None, :] // _GROUP_BYTES
    w_ptrs = w_rows[None, :] + offs_b[:, None]
    w_scale_ptrs = w_scale_rows[None, :] + offs_b[:, None] // _GROUP_BYTES
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, K_BYTES, BYTES):
        a_mask = m_ok[:, None] & (offs_b[None, :] < K_BYTES - b0)
        w_mask = (offs_b[:, None] < K_BYTES - b0) & n_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0)
        a_scale = tl.load(a_scale_ptrs, mask=a_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=w_mask, other=0)
        w_scale = tl.load(w_scale_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        a_lo = (e2m1_value(a) * a_scale).to(TILE)
        a_hi = (e2m1_value(a >> 4) * a_scale).to(TILE)
        w_lo = (e2m1_value(w) * w_scale).to(TILE)
        w_hi = (e2m1_value(w >> 4) * w_scale).to(TILE)
        acc = tl.dot(a_lo, w_lo, acc)
        acc = tl.dot(a_hi, w_hi, acc)
        a_ptrs += BYTES
        a_scale_ptrs += BYTES // _GROUP_BYTES
        w_ptrs += BYTES
        w_scale_ptrs += BYTES // _GROUP_BYTES
    a_global = tl.load(a_global_rows, mask=m_ok, other=0.0)
    w_global = tl.load(w_global_rows, mask=n_ok, other=0.0)
    return acc * a_global[:, None] * w_global[None, :]


@triton.jit
def _nvfp4_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    a_global_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K_BYTES,
    stride_am,
    stride_asm,
    stride_agm,
    stride_wgn,
    stride_wn,
    stride_wsn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    TILE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows, cols = offs_m.to(tl.int64), offs_n.to(tl.int64)
    acc = nvfp4_dot(
        a_ptr + rows * stride_am,
        a_scale_ptr + rows * stride_asm,
        a_global_ptr + offs_m * stride_agm,
        w_ptr + cols * stride_wn,
        w_scale_ptr + cols * stride_wsn,
        w_global_ptr + offs_n * stride_wgn,
        m_ok,
        n_ok,
        K_BYTES,
        TILE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    store_tile(acc, y_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, HAS_BIAS, ROUND_BF16)


@triton.jit
def _dequantize_kernel(
    packed_ptr,
    scale_ptr,
    out_ptr,
    ROWS,
    K_BYTES,
    stride_p,
    stride_s,
    stride_o,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """out[r, 2j] / out[r, 2j + 1] = e2m1(low / high nibble of packed[r, j]) * scale[r, j // 8]; a program
    decodes BLOCK_R rows x BLOCK_B bytes and stores them as contiguous rows of 2 * BLOCK_B values."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = (rows < ROWS)[:, None] & (offs_b < K_BYTES)[None, :]
    packed = tl.load(packed_ptr + rows[:, None] * stride_p + offs_b[None, :], mask=ok, other=0)
    scale = tl.load(scale_ptr + rows[:, None] * stride_s + (offs_b // _GROUP_BYTES)[None, :], mask=ok, other=0.0).to(
        tl.float32
    )
    values = tl.join(e2m1_value(packed) * scale, e2m1_value(packed >> 4) * scale)  # (R, B, 2): 2j, 2j + 1
    values = tl.reshape(values, (BLOCK_R, 2 * BLOCK_B))
    offs_k = 2 * tl.program_id(1) * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs_k[None, :],
        values.to(out_ptr.dtype.element_ty),
        mask=(rows < ROWS)[:, None] & (offs_k < 2 * K_BYTES)[None, :],
    )


@triton.jit
def _dequantized_gemm_kernel(
    a_ptr,
    a_global_ptr,
    w_ptr,
    w_global_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_am,
    stride_agm,
    stride_wgn,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """y = (a @ w^T) * a_global[m] * w_global[n] (+ bias): a (M, K), w (N, K) dequantized NVFP4 operands."""
    offs_m, offs_n, m_ok, n_ok = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < K - k0) & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_global = tl.load(a_global_ptr + offs_m * stride_agm, mask=m_ok, other=0.0)
    w_global = tl.load(w_global_ptr + offs_n * stride_wgn, mask=n_ok, other=0.0)
    acc = acc * a_global[:, None] * w_global[None, :]
    store_tile(acc, y_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym, HAS_BIAS, ROUND_BF16)


def nvfp4_dequantize(
    packed: torch.Tensor, block_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(R, Kp/2) uint8 codes (element 2j in the low nibble of byte j) and (R, Kp/16) E4M3 group scales ->
    (R, Kp) `dtype` values e2m1 * group scale, without the second-stage scale: exact in bfloat16 (and
    float32). Shapes as `nvfp4_gemm` checks them."""
    rows, k_bytes = packed.shape
    out = torch.empty((rows, 2 * k_bytes), dtype=dtype, device=packed.device)
    grid = (triton.cdiv(rows, _DEQUANT_ROWS), triton.cdiv(k_bytes, _DEQUANT_BYTES))
    _dequantize_kernel[grid](
        packed,
        block_scale,
        out,
        rows,
        k_bytes,
        packed.stride(0),
        block_scale.stride(0),
        out.stride(0),
        BLOCK_R=_DEQUANT_ROWS,
        BLOCK_B=_DEQUANT_BYTES,
    )
    return out


def _one_number(t: torch.Tensor | float, name: str, device: torch.device, fn: str = "nvfp4_gemm") -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    require(fn, t.numel() == 1, f"{name} must be one number here, got shape {tuple(t.shape)}")
    return t.reshape(1)


def check_nvfp4_operands(
    fn: str,
    a_packed: torch.Tensor,
    a_block_scale: torch.Tensor,
    a_global: torch.Tensor | float,
    w_packed: torch.Tensor,
    w_block_scale: torch.Tensor,
    rows: str = "M",
) -> torch.Tensor:
    """What the dense and grouped NVFP4 GEMMs (`fn`) check alike, once the packed operands are uint8 of their rank:
    a_packed (`rows`, Kp/2) and w_packed (..., N, Kp/2) agree on Kp/2, Kp a multiple of 16; a_block_scale (`rows`,
    Kp/16) and w_block_scale (w_packed's leading dims, Kp/16) float8_e4m3fn; a_global float32 (`rows`, 1) or one
    number. Returns a_global as float32: (`rows`, 1) as given, or one element on a_packed's device."""
    r, k_bytes = a_packed.shape
    require(
        fn,
        w_packed.shape[-1] == k_bytes,
        f"a_packed {tuple(a_packed.shape)} and w_packed {tuple(w_packed.shape)} disagree on Kp/2",
    )
    require(
        fn,
        k_bytes % (NVFP4_GROUP // 2) == 0,
        f"packed rows must hold Kp/2 bytes, Kp a multiple of {NVFP4_GROUP}; got {k_bytes}",
    )
    groups = 2 * k_bytes // NVFP4_GROUP
    for name, t, want in (
        ("a_block_scale", a_block_scale, (r, groups)),
        ("w_block_scale", w_block_scale, (*w_packed.shape[:-1], groups)),
    ):
        ok = t.dtype == F8E4M3_DTYPE and tuple(t.shape) == want
        require(fn, ok, f"{name} must be float8_e4m3fn of shape {want}, got {t.dtype} {tuple(t.shape)}")
    if not (isinstance(a_global, torch.Tensor) and a_global.numel() != 1):
        return _one_number(a_global, "a_global", a_packed.device, fn)
    got = f"{a_global.dtype} {tuple(a_global.shape)}"
    ok = a_global.dtype == torch.float32 and tuple(a_global.shape) == (r, 1)
    require(fn, ok, f"a_global must be float32 ({rows}, 1) = {(r, 1)} or one number, got {got}")
    return a_global


def nvfp4_gemm(
    a_packed: torch.Tensor,
    a_block_scale: torch.Tensor,
    a_global: torch.Tensor | float,
    w_packed: torch.Tensor,
    w_block_scale: torch.Tensor,
    w_global: torch.Tensor | float,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    tiles: GemmTiles | None = None,
    dequantize_first: bool | None = None,
) -> torch.Tensor:
    """y (M, N) = dequant(a) @ dequant(w)^T (+ bias), float32 accumulation, `out_dtype` output.

    dequantize_first: decode both operands to bf16 first, then a bf16 GEMM (module docstring); default: from
    DEQUANTIZE_FIRST_MIN_M rows on. tiles: that path's GEMM (default DEQUANTIZED_TILES), else the fused
    kernel's (default `default_tiles(M, 128, "nvfp4")`, block_k a power of two >= 32)."""
    for name, t in (("a_packed", a_packed), ("w_packed", w_packed)):
        _check(t.dtype == torch.uint8 and t.ndim == 2, f"{name} must be 2-D uint8, got {t.dtype} {tuple(t.shape)}")
    m, k_bytes = a_packed.shape
    n = w_packed.shape[0]
    a_global = check_nvfp4_operands("nvfp4_gemm", a_packed, a_block_scale, a_global, w_packed, w_block_scale)
    a_global = a_global.contiguous()
    device = a_packed.device
    if isinstance(w_global, torch.Tensor) and w_global.numel() != 1:
        _check(
            w_global.dtype == torch.float32 and tuple(w_global.shape) == (n,),
            f"w_global must be float32 (N,) = {(n,)} or one number, got {w_global.dtype} {tuple(w_global.shape)}",
        )
        w_global = w_global.contiguous()
    else:
        w_global = _one_number(w_global, "w_global", device)
    check_epilogue_args(
        "nvfp4_gemm", n, bias, out_dtype, (a_packed, a_block_scale, a_global, w_packed, w_block_scale, w_global)
    )
    if dequantize_first is None:
        dequantize_first = m >= DEQUANTIZE_FIRST_MIN_M
    interpret = interpreting()
    a_packed, w_packed = a_packed.contiguous(), w_packed.contiguous()
    a_block_scale, w_block_scale = a_block_scale.contiguous(), w_block_scale.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=device)
    if dequantize_first:
        tile_dtype = torch.float32 if interpret else torch.bfloat16
        a = nvfp4_dequantize(a_packed, a_block_scale, tile_dtype)
        w = nvfp4_dequantize(w_packed, w_block_scale, tile_dtype)
        tiles = tiles or DEQUANTIZED_TILES
        _dequantized_gemm_kernel[grid_size(m, n, tiles)](
            a,
            a_global,
            w,
            w_global,
            bias if bias is not None else y,
            y,
            m,
            n,
            a.shape[1],
            a.stride(0),
            1 if a_global.numel() != 1 else 0,
            1 if w_global.numel() != 1 else 0,
            w.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            ROUND_BF16=interpret and out_dtype == torch.bfloat16,
            **tiles.launch_options(),
        )
        return y
    tiles = tiles or default_tiles(m, DEFAULT_BLOCK_K, "nvfp4")
    _check(
        tiles.block_k >= 32 and tiles.block_k & (tiles.block_k - 1) == 0,
        f"tiles.block_k must be a power of two >= 32 (each dot spans >= 16 elements), got {tiles.block_k}",
    )
    _nvfp4_gemm_kernel[grid_size(m, n, tiles)](
        a_packed,
        a_block_scale,
        a_global,
        w_packed,
        w_block_scale,
        w_global,
        bias if bias is not None else y,
        y,
        m,
        n,
        k_bytes,
        a_packed.stride(0),
        a_block_scale.stride(0),
        1 if a_global.numel() != 1 else 0,
        1 if w_global.numel() != 1 else 0,
        w_packed.stride(0),
        w_block_scale.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        TILE=tl.float32 if interpret else tl.bfloat16,
        ROUND_BF16=interpret and out_dtype == torch.bfloat16,
        **tiles.launch_options(),
    )
    return y
