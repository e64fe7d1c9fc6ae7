"""Fused NVFP4 activation quantizer (Triton), bit-exact with `quantkit.formats.quantize_nvfp4_activation`.

`quantize_nvfp4_per_token(x, global_scale=None, hadamard=0)`: x (M, K) float32/bfloat16/float16 ->
(packed uint8 (M, Kp/2), block_scale float8_e4m3fn (M, Kp/16), global float32 (M, 1)), Kp = K rounded
up to a multiple of 16 (zero padded); with `hadamard` > 0 the same of x's online block Hadamard transform (a
rotated checkpoint's down_proj input, `quantkit.kernels.hadamard`), applied to each tile as it is loaded.
All scales are DECODE scales:
``x ~= e2m1(code) * float(block_scale) * global``.

- global: per token (``global_scale=None``, mode "per_token"): ``row_amax / 2688``, 1.0 for an all-zero
  row; static (mode "static"): the calibrated decode scale ``global_scale``, the same for every row -- or
  one per row (M,): rows sorted by expert, each with its expert's static scale (`quantkit.kernels.schemes`).
- block_scale: ``e4m3(clamp(group_amax / (6 * global), 2**-9, 448))``, 1.0 for an all-zero group.
- codes: ``e2m1(x / (float(block_scale) * global))`` (the product first), nearest, ties to even,
  saturating at +-6, sign bit set exactly when the scaled value is < 0; byte j of a row holds element 2j
  in its LOW nibble and element 2j+1 in its HIGH nibble.

One program handles BLOCK_M rows: a sweep over K for the row amax (per-token mode only), then a sweep
that loads the even and odd elements of BLOCK_K / 16 groups as two (BLOCK_M, groups, 8) tiles, so that
the group amax is a reduction over the last axis and the two nibbles of a byte sit at the same index
(with the Hadamard: one contiguous tile, transformed, then split into its even and odd elements).
Division is correctly rounded (`tl.div_rn`); E4M3 and E2M1 rounding by integer ops (`fp_codes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.formats.constants import F4E2M1_MAX, F8E4M3_DTYPE, NVFP4_GLOBAL_DIVISOR, NVFP4_GROUP
from quantkit.formats.nvfp4 import FOUR_OVER_SIX_SCALE_MAX
from quantkit.kernels.fp_codes import (
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    e2m1_code,
    e2m1_value,
    e4m3_code,
    e4m3_positive_value,
)
from quantkit.kernels.hadamard import hadamard_scale
from quantkit.kernels.quantize_fp8 import check_activation, check_tile, load_rows, quantizer_tile, row_absmax

_E2M1_MAX = tl.constexpr(F4E2M1_MAX)
_GLOBAL_DIVISOR = tl.constexpr(NVFP4_GLOBAL_DIVISOR)
_FOUR_OVER_SIX_DIVISOR = tl.constexpr(F4E2M1_MAX * FOUR_OVER_SIX_SCALE_MAX)  # 1536: Four Over Six's global scale
_GROUP = tl.constexpr(NVFP4_GROUP)
_PAIRS = tl.constexpr(NVFP4_GROUP // 2)  # bytes of a packed group


@triton.jit
def _block_scale_code(group_amax, gs2):
    """E4M3 codes of the group decode scales e4m3(clamp(group_amax / (6 * gs), 2**-9, 448)), 1.0 for a zero group."""
    scale = tl.div_rn(group_amax, _E2M1_MAX * gs2)
    scale = tl.where(scale == 0, 1.0, scale)
    return e4m3_code(tl.minimum(tl.maximum(scale, E4M3_MIN_SUBNORMAL), E4M3_MAX))


@triton.jit
def _encode_groups(x_even, x_odd, scale_code, gs2, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    """E2M1 codes of the even and odd elements (BLOCK_M, GROUPS, 8) on the groups' scale codes, and their decode
    denominator float(block_scale) * gs broadcast to the same shape."""
    denominator = tl.broadcast_to((e4m3_positive_value(scale_code) * gs2)[:, :, None], (BLOCK_M, GROUPS, _PAIRS))
    return e2m1_code(tl.div_rn(x_even, denominator)), e2m1_code(tl.div_rn(x_odd, denominator)), denominator


@triton.jit
def _group_squared_error(code_even, code_odd, denominator, x_even, x_odd, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    """(BLOCK_M, GROUPS) squared error of each group, added in `quantkit.formats.nvfp4.group_squared_error`'s tree:
    elements (2j, 2j + 1) first (an even and an odd one), then neighbouring sums, four levels in all."""
    d_even = e2m1_value(code_even) * denominator - x_even
    d_odd = e2m1_value(code_odd) * denominator - x_odd
    err = d_even * d_even + d_odd * d_odd  # (BLOCK_M, GROUPS, 8)
    a, b = tl.split(tl.reshape(err, (BLOCK_M, GROUPS, 4, 2)))
    a, b = tl.split(tl.reshape(a + b, (BLOCK_M, GROUPS, 2, 2)))
    a, b = tl.split(tl.reshape(a + b, (BLOCK_M, GROUPS, 1, 2)))
    return tl.reshape(a + b, (BLOCK_M, GROUPS))


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr,
    packed_ptr,
    block_scale_ptr,
    global_ptr,
    static_global_ptr,
    M,
    K,
    K_PAD,
    stride_xm,
    stride_pm,
    stride_sm,
    stride_static,
    STATIC: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HADAMARD: tl.constexpr,
    HADAMARD_SCALE: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_K // _GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    if STATIC:
        gs = tl.load(static_global_ptr + rows * stride_static, mask=row_ok, other=1.0)  # stride 0: one number
    else:
        amax = row_absmax(x_ptr + rows64[:, None] * stride_xm, row_ok, K, BLOCK_M, BLOCK_K, HADAMARD, HADAMARD_SCALE)
        divisor: tl.constexpr = _FOUR_OVER_SIX_DIVISOR if FOUR_OVER_SIX else _GLOBAL_DIVISOR
        gs = tl.div_rn(amax, tl.full((BLOCK_M,), divisor, tl.float32))
        gs = tl.where(gs > 0, gs, 1.0)
    tl.store(global_ptr + rows, gs, mask=row_ok)

    # (group, pair) indices of one BLOCK_K tile: element 16 g + 2 j (even) and 16 g + 2 j + 1 (odd).
    group = tl.arange(0, GROUPS)[None, :, None]
    pair = tl.arange(0, _PAIRS)[None, None, :]
    row3 = row_ok[:, None, None]
    x_rows = x_ptr + rows64[:, None, None] * stride_xm
    gs2 = tl.broadcast_to(gs[:, None], (BLOCK_M, GROUPS))
    for k0 in range(0, K_PAD, BLOCK_K):
        if HADAMARD:  # K is a multiple of HADAMARD, itself dividing BLOCK_K: whole tiles
            x = load_rows(x_ptr + rows64[:, None] * stride_xm, row_ok, k0, K, BLOCK_K, HADAMARD, HADAMARD_SCALE)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, GROUPS, _PAIRS, 2)))
        else:
            even = k0 + group * _GROUP + pair * 2
            x_even = tl.load(x_rows + even, mask=row3 & (even < K), other=0.0).to(tl.float32)
            x_odd = tl.load(x_rows + even + 1, mask=row3 & (even + 1 < K), other=0.0).to(tl.float32)
        group_amax = tl.maximum(tl.max(tl.abs(x_even), axis=2), tl.max(tl.abs(x_odd), axis=2))
        scale_code = _block_scale_code(group_amax, gs2)
        code_even, code_odd, denominator = _encode_groups(x_even, x_odd, scale_code, gs2, BLOCK_M, GROUPS)
        if FOUR_OVER_SIX:  # the group's max to 4 instead of 6 where that leaves the smaller squared error
            four_code = _block_scale_code(group_amax * 1.5, gs2)
            four_even, four_odd, four_denominator = _encode_groups(x_even, x_odd, four_code, gs2, BLOCK_M, GROUPS)
            err_six = _group_squared_error(code_even, code_odd, denominator, x_even, x_odd, BLOCK_M, GROUPS)
            err_four = _group_squared_error(four_even, four_odd, four_denominator, x_even, x_odd, BLOCK_M, GROUPS)
            use_four = err_four < err_six
            scale_code = tl.where(use_four, four_code, scale_code)
            use_four3 = tl.broadcast_to(use_four[:, :, None], (BLOCK_M, GROUPS, _PAIRS))
            code_even = tl.where(use_four3, four_even, code_even)
            code_odd = tl.where(use_four3, four_odd, code_odd)
        byte = code_even | (code_odd << 4)
        byte_col = k0 // 2 + group * _PAIRS + pair
        tl.store(
            packed_ptr + rows64[:, None, None] * stride_pm + byte_col,
            byte.to(tl.uint8),
            mask=row3 & (byte_col < K_PAD // 2),
        )
        group_col = k0 // _GROUP + tl.arange(0, GROUPS)[None, :]
        tl.store(
            block_scale_ptr + rows64[:, None] * stride_sm + group_col,
            scale_code.to(tl.uint8),
            mask=row_ok[:, None] & (group_col < K_PAD // _GROUP),
        )


def _static_global(global_scale: torch.Tensor | float, m: int, device: torch.device) -> torch.Tensor:
    """A calibrated decode scale (a number or a one-element tensor; checked finite and > 0 unless it is on
    CUDA) -> float32 tensor (1,) on `device`; a
    float32 (m,) tensor on `device` (one scale per row) is returned as it is, its values unchecked (no host
    sync: they are the checkpoint's loaded scales)."""
    if isinstance(global_scale, torch.Tensor) and global_scale.numel() != 1 and global_scale.ndim == 1:
        if global_scale.shape != (m,) or global_scale.dtype != torch.float32 or global_scale.device != device:
            raise ValueError(
                f"quantize_nvfp4_per_token: per-row global_scale must be float32 ({m},) on {device}, got "
                f"{global_scale.dtype} {tuple(global_scale.shape)} on {global_scale.device}"
            )
        return global_scale.contiguous()
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if gs.numel() != 1:
        raise ValueError(
            "quantize_nvfp4_per_token: global_scale must be one number (a per-tensor decode scale) or (M,), "
            f"got shape {tuple(gs.shape)}"
        )
    if not gs.is_cuda and not (torch.isfinite(gs) & (gs > 0)).all():  # on CUDA: no host sync (see check_activation)
        raise ValueError(
            f"quantize_nvfp4_per_token: global_scale must be finite and > 0 (amax / 2688), got {gs.item()}"
        )
    return gs.reshape(1).to(device)


def quantize_nvfp4_four_over_six(
    x: torch.Tensor,
    global_scale: None = None,
    *,
    hadamard: int = 0,
    block_m: int | None = None,
    block_k: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> NVFP4 operands as `quantize_nvfp4_per_token`, with Four Over Six scales (bit-exact with
    `quantkit.formats.nvfp4.quantize_nvfp4_activation_four_over_six`): global row_amax / 1536 per token, each group
    encoded on both of its candidate block scales (its max to 6 and to 4) and the one of smaller squared error kept
    (`_group_squared_error`, a tie keeps 6). Per token only: `global_scale` must be None."""
    if global_scale is not None:
        raise ValueError("quantize_nvfp4_four_over_six: Four Over Six activations are per token (no static scale)")
    return quantize_nvfp4_per_token(x, hadamard=hadamard, block_m=block_m, block_k=block_k, four_over_six=True)


def quantize_nvfp4_per_token(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    hadamard: int = 0,
    block_m: int | None = None,
    block_k: int = 256,
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> (packed uint8 (M, Kp/2), block_scale float8_e4m3fn (M, Kp/16), global float32 (M, 1)).

    global_scale None: per-token second stage row_amax / 2688; else the static calibrated DECODE scale
    (a number or a one-element tensor), used for every row, or a float32 (M,) tensor: one per row (values
    unchecked). hadamard > 0 (a power of two dividing K): quantize x's online block Hadamard transform instead,
    bit-exact with quantizing `quantkit.formats.hadamard.block_hadamard(x, hadamard)`. block_m, block_k (powers
    of two, block_k a multiple of 16, widened to the Hadamard block; block_m None: chosen by M,
    `quantize_fp8.quantizer_tile`): the tile of one program step; they change speed only. four_over_six:
    `quantize_nvfp4_four_over_six`'s scales (per token only).
    """
    check_activation("quantize_nvfp4_per_token", x)
    check_tile("quantize_nvfp4_per_token", "block_k", block_k, least=NVFP4_GROUP)
    static = global_scale is not None
    if static and four_over_six:
        raise ValueError("quantize_nvfp4_per_token: Four Over Six activations are per token (no static scale)")
    m, k = x.shape
    static_global = (
        _static_global(global_scale, m, x.device) if global_scale is not None else torch.empty(1, device=x.device)
    )
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m, block_k = quantizer_tile("quantize_nvfp4_per_token", m, k, block_m, block_k, hadamard)
    k_pad = triton.cdiv(k, NVFP4_GROUP) * NVFP4_GROUP
    packed = torch.empty((m, k_pad // 2), dtype=torch.uint8, device=x.device)
    block_scale = torch.empty((m, k_pad // NVFP4_GROUP), dtype=torch.uint8, device=x.device)
    global_out = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _quantize_nvfp4_kernel[(triton.cdiv(m, block_m),)](
        x,
        packed,
        block_scale,
        global_out,
        static_global,
        m,
        k,
        k_pad,
        x.stride(0),
        packed.stride(0),
        block_scale.stride(0),
        1 if static_global.numel() != 1 else 0,
        STATIC=static,
        FOUR_OVER_SIX=four_over_six,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        HADAMARD=hadamard,
        HADAMARD_SCALE=hadamard_scale(hadamard) if hadamard else 1.0,
    )
    return packed, block_scale.view(F8E4M3_DTYPE), global_out
