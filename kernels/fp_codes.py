"""Triton device functions: float32 <-> E4M3 / E2M1 codes, bit-exact with `quantkit.formats`.

Integer and bit operations only, so the GPU and the interpreter agree with torch to the bit:

- `e4m3_code(y)`: float32 -> E4M3 code (int32, 0..255), round to nearest even, saturating at +-448
  (torch's ``y.clamp(-448, 448).to(float8_e4m3fn)``, `quantkit.formats.fp8.to_e4m3`). The sign bit is
  the sign bit of ``y``: -0.0 -> 0x80, a small negative value that rounds to zero -> 0x80.
- `e4m3_positive_value(code)`: E4M3 code 0..126 -> float32 (exact).
- `e2m1_code(y)`: float32 -> E2M1 code (int32, 0..15) per `quantkit.formats.nvfp4.round_to_e2m1`:
  nearest, ties to even, saturating at +-6, sign bit set exactly when ``y < 0``.
- `e2m1_value(code)`: E2M1 code (any integer tensor, low 4 bits used) -> float32 (code 8 -> -0.0).

Why not ``y.to(tl.float8e4nv)``: for sm90 it compiles to ``cvt.rn.satfinite.e4m3x2.f32`` (RNE,
saturating: right), but Triton 3.9's interpreter rounds ties away from zero, drops the mantissa carry
(1.9375 -> 1.0) and truncates subnormals; the functions here give one answer on both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantkit.formats import constants

# Globals a @triton.jit function reads must be constexpr: the formats' constants, wrapped once here (the
# quantizer kernels import E4M3_MAX and E4M3_MIN_SUBNORMAL from this module).
E4M3_MAX = tl.constexpr(constants.F8E4M3_MAX)
E4M3_MIN_SUBNORMAL = tl.constexpr(constants.F8E4M3_MIN_SUBNORMAL)
_E4M3_MIN_NORMAL = tl.constexpr(constants.F8E4M3_MIN_NORMAL)
_E2M1_SIGN_BIT = tl.constexpr(constants.E2M1_SIGN_BIT)
# E2M1 rounding: the midpoints `constants.E2M1_BOUNDS`, and for each whether a tie there rounds up (to even).
_E2M1_BOUNDS = tl.constexpr(constants.E2M1_BOUNDS)
_E2M1_TIE_UP = tl.constexpr(tuple(b in constants.E2M1_TIES_UP for b in constants.E2M1_BOUNDS))
_E2M1_BOUND_COUNT = tl.constexpr(len(constants.E2M1_BOUNDS))


@triton.jit
def e4m3_code(y):
    """float32 tensor -> int32 E4M3 codes (RNE, saturating at +-448, sign of y kept)."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(y), E4M3_MAX)
    bits = a.to(tl.int32, bitcast=True)
    # Normal E4M3 (a >= 2**-6): round the 23-bit mantissa to 3 bits, ties to even; a mantissa carry
    # moves into the exponent by itself. Rebias the exponent 127 -> 7: (127 - 7) << 3 = 960.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - 960
    # Subnormal E4M3 (a < 2**-6): the code is a / 2**-9 rounded to an integer, ties to even (a code
    # of 8 is the smallest normal, 2**-6, so the carry is right here too). a = m24 * 2**(e - 23), so
    # code = m24 >> (14 - e) rounded; shifts beyond 25 all give 0, so cap there (no shift >= 32).
    exponent = (bits >> 23) - 127
    m24 = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - exponent, 25)
    q = m24 >> shift
    rem = m24 & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    subnormal = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return sign | tl.where(a >= _E4M3_MIN_NORMAL, normal, subnormal)


@triton.jit
def e4m3_positive_value(code):
    """int32 E4M3 codes 0..126 -> float32 values (exact; subnormals m * 2**-9)."""
    exponent = code >> 3
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    return tl.where(exponent == 0, mantissa.to(tl.float32) * E4M3_MIN_SUBNORMAL, normal)


@triton.jit
def e2m1_code(y):
    """float32 tensor -> int32 E2M1 codes: count the midpoints passed (ties to even), sign if y < 0."""
    a = tl.abs(y)
    magnitude = tl.zeros(a.shape, tl.int32)
    for i in tl.static_range(_E2M1_BOUND_COUNT):  # unrolled at compile time
        if _E2M1_TIE_UP[i]:
            magnitude += (a >= _E2M1_BOUNDS[i]).to(tl.int32)
        else:
            magnitude += (a > _E2M1_BOUNDS[i]).to(tl.int32)
    return magnitude | tl.where(y < 0, _E2M1_SIGN_BIT, 0)


@triton.jit
def e2m1_value(code):
    """Integer tensor of E2M1 codes (low 4 bits) -> float32: index i = e << 1 | m, value 0.5 * m for
    e = 0, else (1 + m / 2) * 2**(e - 1); built from float32 bits, sign bit 3 -> bit 31."""
    c = code.to(tl.int32) & 0xF
    exponent = (c >> 1) & 3
    mantissa = c & 1
    magnitude = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    return (magnitude | ((c & 8) << 28)).to(tl.float32, bitcast=True)
