"""Where Triton 3.9's interpreter (TRITON_INTERPRET=1, how CI runs kernels on CPU) computes differently
from the GPU, and the switch the kernels use to work around it. Measured on CPU with triton 3.9.0:

- ``tl.dot`` on bfloat16 tiles is wrong: GEMM kernels dot float32 tiles when `interpreting()`.
- float32 -> bfloat16 ``.to()`` truncates (rounds toward zero) instead of rounding to nearest even:
  `round_to_bf16` rounds first, so the truncating cast is exact (GPU: ``cvt.rn.bf16.f32``, no need).
- float32 -> float8e4nv ``.to()`` rounds ties away from zero, drops mantissa carries and truncates
  subnormals: quantizers encode E4M3 with integer ops on all backends (`quantkit.kernels.fp_codes`).
- float8e4nv -> float32 is exact for all finite codes; ``tl.dot`` on float8e4nv tiles is right.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def round_to_bf16(x):
    """float32 tensor -> float32 values rounded to the nearest bfloat16, ties to even (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
