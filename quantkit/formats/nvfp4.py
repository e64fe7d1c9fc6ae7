"""NVFP4 W4A4 (paper 000, App. A.4.2): E2M1 elements in groups of 16 along K, two-stage scaling.

Conventions (the reference numerics; kernels and the serving path must match them bit for bit):

- Values: E2M1 codes, 4 bits = ``sign << 3 | magnitude index`` into {0, .5, 1, 1.5, 2, 3, 4, 6};
  code 0b1000 is -0. The sign bit is set exactly when the scaled value is < 0, so a small negative
  value that rounds to zero encodes as -0 (0x8) while +0.0 and -0.0 inputs encode as +0 (0x0), as
  ModelOpt and compressed-tensors do.
- Scales are DECODE scales: ``x ~= e2m1(code) * float(block_scale) * global_scale``.
  * ``block_scale``: one float8_e4m3fn per 16 consecutive elements along K,
    ``e4m3(group_amax / (6 * global_scale))``.
  * ``global_scale`` (the second stage, float32): weights: per tensor, ``amax / (448 * 6)``, a 0-d
    tensor. Activations: ``mode="per_token"`` (the paper's): per row, ``row_amax / (448 * 6)``, shape
    (..., 1); ``mode="static"``: a calibrated per-tensor decode scale passed in, e.g.
    ``calibrated_amax / (448 * 6)`` -- the reciprocal of compressed-tensors' ``input_global_scale``.
  Encoding divides by ``float(block_scale) * global_scale`` (that product first, as ModelOpt does).
- Rounding: E2M1 round to nearest, ties to even (bounds: <=0.25 -> 0, <0.75 -> .5, <=1.25 -> 1,
  <1.75 -> 1.5, <=2.5 -> 2, <3.5 -> 3, <=5 -> 4, else 6), saturating at +-6. Block scales: E4M3 round
  to nearest even, clamped to [2**-9, 448] (448: the static activation mode can see values beyond the
  calibrated amax; those saturate).
- Zeros: a group whose float32 block scale is 0 (all-zero group) gets block scale 1.0 (ModelOpt's
  rule); an all-zero tensor/row gets global scale 1.0. Everything decodes to zeros, never NaN.
  A nonzero group whose block scale would underflow E4M3 (group_amax < ~2e-6 * global amax) gets the
  smallest subnormal 2**-9 instead of 0 -- ModelOpt divides by that 0 there (inf codes); nothing
  else in this module departs from ModelOpt's ``NVFP4QTensor.quantize``.
- Padding: K is zero-padded to a multiple of 16. ``packed``/``block_scale`` keep the padded length;
  ``NVFP4Tensor.k`` holds the original K and ``dequantize_nvfp4`` crops to it.
- Nibble order (``pack_fp4``): byte j of a row holds element 2j in its LOW nibble and element 2j+1
  in its HIGH nibble: ``byte = code[2j] | code[2j+1] << 4`` -- the order of ModelOpt
  (``NVFP4QTensor.quantize``) and compressed-tensors (``pack_fp4_to_uint8``), i.e. of the NVFP4
  checkpoints vLLM loads.
- All arithmetic in float32 (inputs of other float dtypes are converted first); NaN/Inf inputs are
  refused with a ValueError naming the tensor and its shape.
- Error bound per element, with ``S = float(block_scale) * global_scale`` and ``y = x / S``:
  ``|x - deq| <= S * h(|y|)``, h = 0.25 (|y| <= 2), 0.5 (<= 4), 1 (<= 6) (half the grid step at the
  element's magnitude); beyond 6 (block scale rounded down, or static mode) the error is
  ``S * (|y| - 6)`` (saturation), at most ``0.4 * S`` while the block scale is an E4M3 normal.

Parity (tests/test_formats_parity.py): weights bit-exact with ModelOpt 0.42's pure-torch
``NVFP4QTensor.quantize``/``dequantize``, and with compressed-tensors 0.17's TENSOR_GROUP NVFP4 for the
same global scale (see the test's docstring for where float32 rounding of ``1/global`` can differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.formats.constants import (
    E2M1_BOUNDS,
    E2M1_SIGN_BIT,
    E2M1_TIES_UP,
    E2M1_VALUES,
    F4E2M1_MAX,
    F8E4M3_DTYPE,
    F8E4M3_MAX,
    F8E4M3_MIN_SUBNORMAL,
    NVFP4_GLOBAL_DIVISOR,
    NVFP4_GROUP,
    ActivationScale,
)
from quantkit.formats.fp8 import check_quantizable

__all__ = [
    "NVFP4Tensor",
    "dequantize_nvfp4",
    "e2m1_round",
    "e2m1_to_float",
    "fake_quant_nvfp4_activation",
    "fake_quant_nvfp4_four_over_six",
    "four_over_six_block_scales",
    "four_over_six_global_scale",
    "group_squared_error",
    "nvfp4_block_scales",
    "nvfp4_global_scale",
    "pack_fp4",
    "quantize_nvfp4",
    "quantize_nvfp4_activation",
    "quantize_nvfp4_activation_four_over_six",
    "quantize_nvfp4_weight",
    "quantize_nvfp4_weight_four_over_six",
    "round_to_e2m1",
    "unpack_fp4",
]


@dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-encoded tensor of logical shape (..., k).

    packed:       uint8 (..., K_pad // 2), two E2M1 codes a byte (low nibble first), K_pad = ceil(k/16)*16
    block_scale:  float8_e4m3fn (..., K_pad // 16), decode scale of each group of 16
    global_scale: float32 decode scale, 0-d (per tensor) or (..., 1) (per token)
    k:            the original (unpadded) length of the last dimension
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    k: int

    def __post_init__(self) -> None:
        lead, k_pad = tuple(self.packed.shape[:-1]), 2 * self.packed.shape[-1]
        if self.packed.dtype != torch.uint8:
            raise ValueError(f"NVFP4Tensor: packed must be uint8, got {self.packed.dtype}")
        if self.block_scale.dtype != F8E4M3_DTYPE:
            raise ValueError(f"NVFP4Tensor: block_scale must be float8_e4m3fn, got {self.block_scale.dtype}")
        if tuple(self.block_scale.shape) != (*lead, k_pad // NVFP4_GROUP) or k_pad % NVFP4_GROUP:
            raise ValueError(
                f"NVFP4Tensor: packed {tuple(self.packed.shape)} and block_scale "
                f"{tuple(self.block_scale.shape)} disagree (one scale per {NVFP4_GROUP} elements)"
            )
        if not k_pad - NVFP4_GROUP < self.k <= k_pad:
            raise ValueError(f"NVFP4Tensor: k={self.k} does not pad to {k_pad}")
        if self.global_scale.dtype != torch.float32 or tuple(self.global_scale.shape) not in ((), (*lead, 1)):
            raise ValueError(
                f"NVFP4Tensor: global_scale must be float32 of shape () or {(*lead, 1)}, "
                f"got {self.global_scale.dtype} {tuple(self.global_scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape (..., k), padding excluded."""
        return (*self.packed.shape[:-1], self.k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded values (..., k) in `dtype` (`dequantize_nvfp4`)."""
        return dequantize_nvfp4(self, dtype=dtype)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Second-stage decode scale amax / (448 * 6), float32; 1.0 where that is 0 (all-zero tensor/row)."""
    scale = amax.float() / NVFP4_GLOBAL_DIVISOR
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Scaled float32 values -> E2M1 codes (uint8, 0..15): nearest, ties to even, saturate at +-6."""
    a = y.abs()
    magnitude = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for bound in E2M1_BOUNDS:  # count the midpoints passed; on a midpoint, go up only towards an even mantissa
        magnitude += (a >= bound) if bound in E2M1_TIES_UP else (a > bound)
    return magnitude | (y < 0).to(torch.uint8) * E2M1_SIGN_BIT


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Scaled float32 values -> the nearest E2M1 values as float32, = `e2m1_to_float(round_to_e2m1(y))` bit for bit
    (signed zeros included), without the codes. The grid step is 0.5 below 2, 1 below 4, 2 up to 6; adding
    c = step * 2**23 makes the float32 ulp equal the step, so (|y| + c) - c is |y| rounded to a multiple of the step,
    ties to the even multiple (float32 round to nearest even) = the even mantissa. The step comes from |y|'s
    exponent bits (2**(e - 1), e clamped to 0..2); saturate at 6; the sign of y + 0.0 (-0.0 -> +0, as the codes).
    3-8x faster on CPU than the codes' 7 comparisons and table lookup (benchmarks/fake_quant_cost.py; every emulated
    activation goes through it).
    Other dtypes (GPTQ's float64 columns) take the codes' path: the rounding decision is made in y's own precision."""
    if y.dtype != torch.float32:
        return e2m1_to_float(round_to_e2m1(y))
    a = y.abs().clamp_(max=F4E2M1_MAX)
    biased_exponent = (a.view(torch.int32) >> 23).clamp_(127, 129)  # 2**0 .. 2**2; smaller (and 0) -> 127
    c = biased_exponent.add_(22).bitwise_left_shift_(23).view(torch.float32)  # 2**(e - 1) * 2**23
    a.add_(c).sub_(c)  # in place: two float32 temporaries in all, not five (they cost as much as the arithmetic)
    return a.copysign_(torch.add(y, 0.0, out=c))


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer dtype, 0..15) -> float32 values (code 8 -> -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (..., 2n) -> uint8 (..., n): byte j = code[2j] | code[2j+1] << 4 (low nibble first)."""
    if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_fp4: need uint8 codes with an even last dimension, got {codes.dtype} {tuple(codes.shape)}"
        )
    if codes.numel() and int(codes.max()) > 0xF:
        raise ValueError("pack_fp4: codes must be 4-bit (0..15)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., n) -> uint8 codes (..., 2n); inverse of `pack_fp4`."""
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise ValueError(f"unpack_fp4: need a uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def nvfp4_block_scales(group_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Group amax (..., G) and decode global scale (() or (..., 1)) -> E4M3 block decode scales (..., G)."""
    scale = group_amax / (F4E2M1_MAX * global_scale)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(F8E4M3_MIN_SUBNORMAL, F8E4M3_MAX).to(F8E4M3_DTYPE)


def _as_global_scale(global_scale: torch.Tensor | float, lead: tuple[int, ...], fn: str) -> torch.Tensor:
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if tuple(gs.shape) != (*lead, 1) and gs.numel() == 1:
        gs = gs.reshape(())
    elif tuple(gs.shape) != (*lead, 1):
        raise ValueError(f"{fn}: global_scale must be a scalar or of shape {(*lead, 1)}, got {tuple(gs.shape)}")
    if not bool(torch.all(torch.isfinite(gs) & (gs > 0))):
        raise ValueError(f"{fn}: global_scale must be finite and > 0 (a decode scale, amax / 2688)")
    return gs


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | float, *, name: str | None = None) -> NVFP4Tensor:
    """Encode x (..., K) with a given second-stage DECODE scale (scalar, or (..., 1) per row)."""
    check_quantizable(x, "quantize_nvfp4", name=name)
    return _quantize_nvfp4(x, _as_global_scale(global_scale, tuple(x.shape[:-1]), "quantize_nvfp4").to(x.device))


def nvfp4_groups(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> float32 groups of 16 (..., G, 16), zero-padded to K_pad = 16 G."""
    k = x.shape[-1]
    k_pad = -(-k // NVFP4_GROUP) * NVFP4_GROUP
    return torch.nn.functional.pad(x.float(), (0, k_pad - k)).unflatten(-1, (-1, NVFP4_GROUP))


def _scaled_groups(
    x: torch.Tensor, gs: torch.Tensor, block_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., K) in groups of 16 (`nvfp4_groups`) divided by their decode scale: (scaled (..., G, 16) float32,
    E4M3 block scales (..., G): the given ones, else min-max, decode scale block_scale * gs (..., G, 1) float32)."""
    groups = nvfp4_groups(x)
    if block_scale is None:
        block_scale = nvfp4_block_scales(groups.abs().amax(dim=-1), gs)
    scale = (block_scale.float() * gs).unsqueeze(-1)
    return groups / scale, block_scale, scale


def _quantize_nvfp4(x: torch.Tensor, gs: torch.Tensor, block_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    scaled, block_scale, _ = _scaled_groups(x, gs, block_scale)
    codes = round_to_e2m1(scaled.flatten(-2))
    return NVFP4Tensor(packed=pack_fp4(codes), block_scale=block_scale, global_scale=gs, k=x.shape[-1])


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4Tensor -> values (..., k) = e2m1 * (float(block_scale) * global_scale), in `dtype`."""
    values = e2m1_to_float(unpack_fp4(t.packed)).unflatten(-1, (-1, NVFP4_GROUP))
    out = values * (t.block_scale.float() * t.global_scale).unsqueeze(-1)
    return out.flatten(-2)[..., : t.k].to(dtype)


def quantize_nvfp4_weight(
    w: torch.Tensor,
    *,
    name: str | None = None,
    block_scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Weight (N, K) -> NVFP4Tensor with the given per-tensor global decode scale (() or (1,), float32), else
    amax(|w|) / 2688, and the given E4M3 block decode scales (N, K_pad/16), else min-max ones."""
    check_quantizable(w, "quantize_nvfp4_weight", name=name, ndim=2)
    gs = nvfp4_global_scale(w.float().abs().amax()) if global_scale is None else global_scale.float().reshape(())
    return _quantize_nvfp4(w, gs, block_scale)


def fake_quant_nvfp4_weight(w: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """`dequantize_nvfp4(quantize_nvfp4_weight(w))` with min-max scales, float32 (N, K), equal bit for bit, without
    packing the codes and unpacking them again (SmoothQuant's alpha search quantizes each weight once an alpha)."""
    check_quantizable(w, "quantize_nvfp4_weight", name=name, ndim=2)
    scaled, _, scale = _scaled_groups(w, nvfp4_global_scale(w.float().abs().amax()))
    return (e2m1_round(scaled) * scale).flatten(-2)[..., : w.shape[-1]]


def quantize_nvfp4_activation(
    x: torch.Tensor,
    mode: str = ActivationScale.PER_TOKEN,
    global_scale: torch.Tensor | float | None = None,
    *,
    row_amax: torch.Tensor | None = None,
    name: str | None = None,
) -> NVFP4Tensor:
    """Activations (..., K) -> NVFP4Tensor.

    per_token (the paper's): dynamic second-stage scale per row, row_amax / 2688, shape (..., 1);
    `row_amax` (..., 1) gives the max |x| of each whole row when x is a slice of it (a tensor-parallel
    shard of K), default: computed from x.
    static (compressed-tensors' NVFP4): the calibrated per-tensor decode scale `global_scale`; group
    scales are dynamic in both modes.
    """
    return _quantize_nvfp4(x, _activation_global_scale(x, mode, global_scale, row_amax, name))


def fake_quant_nvfp4_activation(
    x: torch.Tensor,
    mode: str = ActivationScale.PER_TOKEN,
    global_scale: torch.Tensor | float | None = None,
    *,
    row_amax: torch.Tensor | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """`dequantize_nvfp4(quantize_nvfp4_activation(...))`, float32 (..., K), equal bit for bit, without packing
    the codes and unpacking them again (the CPU-emulated serving path quantizes every activation this way)."""
    scaled, _, scale = _scaled_groups(x, _activation_global_scale(x, mode, global_scale, row_amax, name))
    return (e2m1_round(scaled) * scale).flatten(-2)[..., : x.shape[-1]]


# Four Over Six's cap on E4M3 block scales: the scale-to-4 candidate is 1.5x the scale-to-6 one, 1.5 * 256 = 384
# stays within E4M3's 448 for every group, the row's largest included (Cook et al. 2025, arXiv 2512.02010).
FOUR_OVER_SIX_SCALE_MAX = 256.0


def group_squared_error(decoded: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Squared error of each group of 16, (..., G, 16) float32 pairs -> (..., G) float32, summed as a fixed tree:
    elements (0, 1), (2, 3), ... first, then those sums pairwise, four levels. Every addition is one IEEE float32
    operation in a stated order, so the fused quantizer (`quantkit.kernels.quantize_nvfp4`) reaches the same sums,
    and the same Four Over Six choices, bit for bit (a library sum may add in any order)."""
    err = (decoded - groups).square()
    while err.shape[-1] > 1:
        err = err[..., 0::2] + err[..., 1::2]
    return err[..., 0]


def four_over_six_block_scales(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Four Over Six's choice (4/6, Cook et al. 2025, arXiv 2512.02010; the reference code's `select_fouroversix`,
    MSE rule) of E4M3 block decode scales for x (..., K) on the second-stage decode scale gs (() or (..., 1)): each
    group of 16 is encoded twice, with `nvfp4_block_scales(gmax, gs)` (its max to E2M1's 6, as plain NVFP4) and
    `nvfp4_block_scales(1.5 gmax, gs)` (its max to 4: a finer grid near the max, 4 -> 6 is E2M1's widest step);
    the scale of smaller squared error (`group_squared_error`) is kept (a tie keeps 6). (..., G) float8_e4m3fn. gs
    must leave room for the 1.5x candidate (FOUR_OVER_SIX_SCALE_MAX)."""
    groups = nvfp4_groups(x)
    group_amax = groups.abs().amax(dim=-1)

    def candidate(stretch: float) -> tuple[torch.Tensor, torch.Tensor]:
        block_scale = nvfp4_block_scales(stretch * group_amax, gs)
        scaled, _, scale = _scaled_groups(x, gs, block_scale)
        return block_scale, group_squared_error(e2m1_round(scaled) * scale, groups)

    (six, err_six), (four, err_four) = candidate(1.0), candidate(1.5)
    return torch.where(err_four < err_six, four.float(), six.float()).to(F8E4M3_DTYPE)


def four_over_six_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Four Over Six's second-stage decode scale amax / (6 * 256), float32 (1.0 where 0): block scales up to 256 for
    the max-to-6 candidate, so the max-to-4 one (1.5x) stays within E4M3's 448."""
    scale = amax.float() / (F4E2M1_MAX * FOUR_OVER_SIX_SCALE_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_nvfp4_activation_four_over_six(
    x: torch.Tensor, *, row_amax: torch.Tensor | None = None, name: str | None = None
) -> NVFP4Tensor:
    """Activations (..., K) -> NVFP4Tensor with Four Over Six scales per token (the `nvfp4_four_over_six` scheme):
    second-stage decode scale per row `four_over_six_global_scale(row amax)` ((..., 1); `row_amax` (..., 1): the
    whole row's max |x| when x is a tensor-parallel slice of K, default computed from x), block scales
    `four_over_six_block_scales`. Still NVFP4 (E2M1 codes, E4M3 group scales, float32 global scale): the NVFP4
    GEMM consumes it unchanged."""
    check_quantizable(x, "quantize_nvfp4_activation_four_over_six", name=name)
    amax = nvfp4_groups(x).abs().amax(dim=(-2, -1))[..., None] if row_amax is None else row_amax.float()
    gs = four_over_six_global_scale(amax)
    return _quantize_nvfp4(x, gs, four_over_six_block_scales(x, gs))


def fake_quant_nvfp4_four_over_six(
    x: torch.Tensor, *, row_amax: torch.Tensor | None = None, name: str | None = None
) -> torch.Tensor:
    """`dequantize_nvfp4(quantize_nvfp4_activation_four_over_six(x, row_amax=row_amax))`, float32 (..., K), equal
    bit for bit, without packing the codes and unpacking them again (the CPU emulation's path)."""
    check_quantizable(x, "fake_quant_nvfp4_four_over_six", name=name)
    amax = nvfp4_groups(x).abs().amax(dim=(-2, -1))[..., None] if row_amax is None else row_amax.float()
    gs = four_over_six_global_scale(amax)
    scaled, _, scale = _scaled_groups(x, gs, four_over_six_block_scales(x, gs))
    return (e2m1_round(scaled) * scale).flatten(-2)[..., : x.shape[-1]]


def quantize_nvfp4_weight_four_over_six(w: torch.Tensor, *, name: str | None = None) -> NVFP4Tensor:
    """Weight (N, K) -> NVFP4Tensor with Four Over Six scales: global decode scale `four_over_six_global_scale(amax)`
    per tensor, block scales `four_over_six_block_scales` (recipe `weight_scales: four_over_six`). The checkpoint
    format and every decoder are unchanged: only the stored scales differ."""
    check_quantizable(w, "quantize_nvfp4_weight_four_over_six", name=name, ndim=2)
    gs = four_over_six_global_scale(w.float().abs().amax())
    return quantize_nvfp4_weight(w, name=name, block_scale=four_over_six_block_scales(w, gs), global_scale=gs)


def _activation_global_scale(
    x: torch.Tensor,
    mode: str,
    global_scale: torch.Tensor | float | None,
    row_amax: torch.Tensor | None,
    name: str | None,
) -> torch.Tensor:
    """The second-stage decode scale of activations x in `mode` (quantize_nvfp4_activation), x checked."""
    fn = "quantize_nvfp4_activation"
    if mode == ActivationScale.PER_TOKEN:
        if global_scale is not None:
            raise ValueError(f"{fn}: mode='per_token' computes its own scale; pass no global_scale")
        check_quantizable(x, fn, name=name)
        amax = x.float().abs().amax(dim=-1, keepdim=True) if row_amax is None else row_amax.float()
        return nvfp4_global_scale(amax)
    if mode == ActivationScale.STATIC:
        if global_scale is None:
            raise ValueError(f"{fn}: mode='static' needs the calibrated global_scale (amax / 2688)")
        check_quantizable(x, "quantize_nvfp4", name=name)
        return _as_global_scale(global_scale, tuple(x.shape[:-1]), "quantize_nvfp4").to(x.device)
    raise ValueError(f"{fn}: mode must be 'per_token' or 'static', got {mode!r}")
