"""The online block Hadamard inside a quantizer's tile (Triton), bit-exact with
`quantkit.formats.hadamard.block_hadamard`: a rotated checkpoint's down_proj input is transformed and quantized
in one pass over x (`quantkit.kernels.quantize_fp8`, `quantkit.kernels.quantize_nvfp4`, argument `hadamard`),
instead of the torch butterfly's log2(block) passes and a float32 copy of x.

`hadamard_tile(y, HADAMARD, SCALE)`: y (BLOCK_M, BLOCK_K) float32, HADAMARD a power of two dividing BLOCK_K ->
y (I (x) H_HADAMARD) row by row: the same butterfly as the torch reference (stage h: a + b, a - b of the
elements h apart within each run of 2h, h = 1, 2, ..., HADAMARD / 2), then one multiply by SCALE, the float32
1/sqrt(HADAMARD) the host rounds (`hadamard_scale`). Each element takes the same float32 additions in the same
order as in the reference, and no multiply-add can fuse (adds only, one multiply at the end): the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantkit.formats.hadamard import MAX_ONLINE_BLOCK, check_online_block, hadamard_scale

__all__ = ["check_hadamard", "hadamard_scale", "hadamard_tile"]

_MAX_STAGES = tl.constexpr(MAX_ONLINE_BLOCK.bit_length() - 1)  # log2 of the largest online block


def check_hadamard(fn: str, hadamard: int, k: int) -> None:
    """The online block must be a power of two dividing K (`check_online_block`) and at most MAX_ONLINE_BLOCK, the
    butterfly's stage count here (ValueError naming `fn`)."""
    try:
        check_online_block(hadamard, k)
    except ValueError as err:
        raise ValueError(f"{fn}: {err}") from None
    if hadamard > MAX_ONLINE_BLOCK:
        raise ValueError(f"{fn}: online Hadamard block {hadamard} is above {MAX_ONLINE_BLOCK}")


@triton.jit
def _butterfly(y, H: tl.constexpr):
    """One butterfly stage of y (BLOCK_M, BLOCK_K): (a + b, a - b) of the elements H apart in each run of 2H."""
    BLOCK_M: tl.constexpr = y.shape[0]
    BLOCK_K: tl.constexpr = y.shape[1]
    a, b = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, BLOCK_K // (2 * H), 2, H)), (0, 1, 3, 2)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))


@triton.jit
def hadamard_tile(y, HADAMARD: tl.constexpr, SCALE: tl.constexpr):
    """y (BLOCK_M, BLOCK_K) float32 -> each run of HADAMARD columns times H_HADAMARD (module docstring)."""
    for stage in tl.static_range(_MAX_STAGES):
        if (1 << stage) < HADAMARD:
            y = _butterfly(y, 1 << stage)
    return y * SCALE
