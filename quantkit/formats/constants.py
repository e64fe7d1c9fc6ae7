"""Numeric constants of the project's formats, named once and imported everywhere (formats, kernels, serve).

E4M3 here is torch's `float8_e4m3fn` (OCP FP8 E4M3 "fn": no infinities, one NaN pattern, max 448).
E2M1 is the OCP MX FP4 element type: 1 sign, 2 exponent, 1 mantissa bit, max 6, no Inf/NaN.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class ActivationScale(StrEnum):
    """How a scheme scales activations at run time (quantization_config `activation_scale`; equal to its string)."""

    PER_TOKEN = "per_token"  # dynamic: one decode scale per row, row_amax / format max (paper 000)
    STATIC = "static"  # one calibrated per-tensor decode scale (compressed-tensors' NVFP4 convention)


class WeightScales(StrEnum):
    """How a recipe chooses weight decode scales (recipe key `weight_scales`; equal to its string)."""

    MINMAX = "minmax"  # a block's max |w| maps to the format's maximum (round to nearest)
    MSE = "mse"  # the candidate scale with the least squared error (`quantkit.formats.scale_search`)
    FOUR_OVER_SIX = "four_over_six"  # NVFP4 only: each group's max to 6 or to 4, the smaller error (arXiv 2512.02010)


# --- FP8 E4M3 ------------------------------------------------------------------------------------
F8E4M3_DTYPE = torch.float8_e4m3fn
F8E4M3_MAX = 448.0  # largest finite E4M3 value (1.75 * 2**8)
F8E4M3_MIN_NORMAL = 2.0**-6
F8E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive E4M3 value
F8E4M3_MANTISSA_BITS = 3

FP8_WEIGHT_BLOCK = 128  # FP8 W8A8 weights: one scale per 128 x 128 block (paper 000, App. A.4.2)

# --- FP4 E2M1 ------------------------------------------------------------------------------------
F4E2M1_MAX = 6.0
NVFP4_GROUP = 16  # NVFP4: one E4M3 scale per 16 consecutive elements along K

# The 16 E2M1 codes (4 bits: sign << 3 | magnitude index) and their values. Code 0b1000 is -0.
E2M1_POSITIVE_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_POSITIVE_VALUES + tuple(-v for v in E2M1_POSITIVE_VALUES)
E2M1_SIGN_BIT = 0b1000
E2M1_MAGNITUDE_MASK = 0b0111

# Midpoints between consecutive positive E2M1 values: the rounding bounds. An exact midpoint rounds to
# the neighbour with the even mantissa bit (ties to even): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
# 2.5 -> 2, 3.5 -> 4, 5 -> 4. E2M1_TIES_UP are the midpoints whose even neighbour is the upper one.
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIES_UP = (0.75, 1.75, 3.5)

# NVFP4 second-stage (FP32) decode scale: amax / (F8E4M3_MAX * F4E2M1_MAX), so that the largest group
# scale lands on E4M3's max and the largest element on E2M1's max.
NVFP4_GLOBAL_DIVISOR = F8E4M3_MAX * F4E2M1_MAX  # 2688.0
