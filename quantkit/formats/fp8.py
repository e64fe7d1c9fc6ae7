"""FP8 E4M3 W8A8 (paper 000, App. A.4.2): 128x128 block-scaled weights, dynamic per-token activations.

Conventions (the reference numerics; kernels and the serving path must match them bit for bit):

- Scales are DECODE scales, float32: ``x ~= q.float() * scale``. ``scale = amax / 448`` over a
  128x128 weight block (weights) or over one row of the last dimension (activations, "per token").
  The encode scale ``1 / scale`` is never stored; encoding divides by ``scale``.
- Encoding: ``q = clamp(x.float() / scale, -448, 448).to(float8_e4m3fn)`` -- round to nearest, ties to
  even, saturating at +-448 (the clamp only makes explicit what torch's cast already does). All
  arithmetic is float32; the cast to ``float8_e4m3fn`` is the last step (CPU torch has no FP8 add, mul
  or amax). bf16/fp16/fp64 inputs are converted to float32 first.
- Zeros: a block or row whose amax is 0 gets ``scale = 1.0``, so it encodes to zeros and decodes to
  zeros, never NaN (compressed-tensors stores eps there; ModelOpt stores 0 and encodes NaN). The same
  1.0 replaces a scale that underflows float32 (amax < ~3e-43), whose elements then encode to zeros
  too. ``-0.0`` stays ``-0.0`` (E4M3 0x80).
- Padding: a weight whose N or K is not a multiple of 128 is zero-padded internally to the next
  multiple; zeros do not change an amax, so this is the same as partial edge blocks. ``q`` is cropped
  back to ``(N, K)``; ``scale`` has shape ``(ceil(N/128), ceil(K/128))``.
- Error bound per element (half an E4M3 step: 3 mantissa bits, subnormal step 2**-9):
  ``|x - dequantize(q, scale)| <= 2**-4 * |x| + 2**-10 * scale``, up to float32 rounding.
- NaN/Inf inputs are refused with a ValueError naming the tensor and its shape.

Parity (tests/test_formats_parity.py): weights bit-exact with compressed-tensors' FP8_BLOCK
(``calculate_qparams`` + ``quantize``) and ModelOpt's ``FP8QTensor.quantize(block_sizes=128x128)``;
per-token activations bit-exact with compressed-tensors' dynamic TOKEN strategy -- all-zero blocks/rows
aside (see "Zeros"), and -0.0 inputs, which compressed-tensors turns into +0 by adding its zero point.
"""

from __future__ import annotations

import math

import torch

from quantkit.formats.constants import F8E4M3_DTYPE, F8E4M3_MAX, FP8_WEIGHT_BLOCK

__all__ = [
    "check_quantizable",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token",
    "expand_block_scales",
    "fp8_scale_from_amax",
    "quantize_fp8_block",
    "quantize_fp8_per_token",
    "to_e4m3",
]


def check_quantizable(x: torch.Tensor, fn: str, *, name: str | None = None, ndim: int | None = None) -> None:
    """Refuse what no format here can encode: non-float dtypes, wrong rank, empty K, NaN or Inf."""
    label = f"{name!r}" if name else "input"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {label} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (F8E4M3_DTYPE, torch.float8_e5m2):
        raise TypeError(f"{fn}: {label} must be float32/bfloat16/float16/float64, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{fn}: {label} must be {ndim}-D, got shape {tuple(x.shape)}")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"{fn}: {label} needs a non-empty last dimension, got shape {tuple(x.shape)}")
    if torch.isfinite(x.sum()):  # one reduction, no temporaries: NaN and Inf reach the sum (every call in serving)
        return
    bad = (~torch.isfinite(x)).sum().item()  # or a finite sum overflowed: count exactly
    if bad:
        raise ValueError(
            f"{fn}: {label} of shape {tuple(x.shape)} has {bad} non-finite value(s) (NaN/Inf); refusing to quantize"
        )


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn: round to nearest even, saturate at +-448."""
    return y.clamp(-F8E4M3_MAX, F8E4M3_MAX).to(F8E4M3_DTYPE)


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Decode scale amax / 448 (float32); 1.0 where that is 0 (all-zero block/row, or underflow)."""
    scale = amax.float() / F8E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def expand_block_scales(
    scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """A grid of block scales (R, C) -> one scale per element: each entry repeated over its block of
    block[0] rows x block[1] columns, (R * block[0], C * block[1]), cropped to `shape` (rows, cols) when given
    (partial edge blocks)."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full if shape is None else full[: shape[0], : shape[1]]


def to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """(N, K) -> (ceil(N/b), ceil(K/b), b, b), zero-padded."""
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    w = torch.nn.functional.pad(w, (0, kb * block - k, 0, nb * block - n))
    return w.reshape(nb, block, kb, block).transpose(1, 2)


def _from_blocks(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    nb, kb, b, _ = blocks.shape
    return blocks.transpose(1, 2).reshape(nb * b, kb * b)[:n, :k]


def quantize_fp8_block(
    w: torch.Tensor, *, block: int = FP8_WEIGHT_BLOCK, name: str | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight (N, K) -> (q float8_e4m3fn (N, K), scale float32 (ceil(N/block), ceil(K/block))): the given decode
    `scale` per block, else amax / 448 (min-max)."""
    check_quantizable(w, "quantize_fp8_block", name=name, ndim=2)
    n, k = w.shape
    blocks = to_blocks(w.float(), block)
    if scale is None:
        scale = fp8_scale_from_amax(blocks.abs().amax(dim=(-2, -1)))
    scaled = _from_blocks(blocks / scale[..., None, None], n, k)
    return to_e4m3(scaled), scale


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, *, block: int = FP8_WEIGHT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(q (N, K) float8_e4m3fn, scale (ceil(N/block), ceil(K/block))) -> q * scale, (N, K) in `dtype`."""
    if q.dtype != F8E4M3_DTYPE or q.ndim != 2:
        raise ValueError(f"dequantize_fp8_block: q must be 2-D float8_e4m3fn, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    want = (math.ceil(n / block), math.ceil(k / block))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_fp8_block: scale shape {tuple(scale.shape)} != {want} for q {(n, k)}")
    return (q.float() * expand_block_scales(scale.float(), (block, block), (n, k))).to(dtype)


def quantize_fp8_per_token(
    x: torch.Tensor, *, row_amax: torch.Tensor | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (..., K) -> (q float8_e4m3fn (..., K), scale float32 (..., 1)), one scale per row.

    row_amax (..., 1): max |x| of each whole row when x holds only a slice of it (a tensor-parallel shard
    of K); default: computed from x.
    """
    check_quantizable(x, "quantize_fp8_per_token", name=name)
    xf = x.float()
    scale = fp8_scale_from_amax(xf.abs().amax(dim=-1, keepdim=True) if row_amax is None else row_amax.float())
    return to_e4m3(xf / scale), scale


def dequantize_fp8_per_token(
    q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(q (..., K) float8_e4m3fn, scale (..., 1)) -> q * scale in `dtype`."""
    if q.dtype != F8E4M3_DTYPE:
        raise ValueError(f"dequantize_fp8_per_token: q must be float8_e4m3fn, got {q.dtype}")
    if tuple(scale.shape) != (*q.shape[:-1], 1):
        raise ValueError(
            f"dequantize_fp8_per_token: scale shape {tuple(scale.shape)} != {(*q.shape[:-1], 1)} for q {tuple(q.shape)}"
        )
    return (q.float() * scale.float()).to(dtype)
