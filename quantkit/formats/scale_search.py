"""Weight scales chosen by search: per 128x128 FP8 block and per 16-element NVFP4 group, the decode scale that
minimises the block's squared quantization error (MSE clipping), instead of the one that maps max |w| to the
format's maximum (round to nearest on min-max scales, `WeightScales.MINMAX`).

Why it can help: a min-max scale spends the format's range on the block's largest element. Shrinking the scale
clips that element (saturates it at the format's maximum) and gives every other element finer steps; where the
block holds one large value among many small ones, the total squared error falls. The search includes the
min-max scale itself and keeps it on ties, so the chosen scale is never worse, block by block, in this measure.

Candidates (searched in this order; the first of equal errors wins):
- FP8 block (`fp8_block_scales_mse`): decode scale c * amax / 448 for c in FP8_CLIP_GRID = 1.0, 0.95, ..., 0.5
  (float32 scales: a grid of shrink factors; 0.5 is where clipping a Gaussian block stops paying off).
- NVFP4 group (`nvfp4_block_scales_mse`): the group's E4M3 decode scale is itself a code: the min-max code b0
  (`nvfp4_block_scales`), then b0 + 1, b0 - 1, ..., b0 - 8 (NVFP4_SCALE_CODE_STEPS), i.e. every representable
  scale from about 1.1x down to about 0.5x the min-max one (E4M3 codes step by 2**-3 relative), clamped to
  the positive finite codes. The second-stage (per-tensor) scale stays amax / 2688.
The error measure is plain weight MSE, sum over the block of (w - decode(encode(w)))^2; the checkpoint format,
decoding and serving do not change: only the stored scales differ, so every served path and the fake-quant
reference read them as they read min-max ones. llm-compressor's MSE observer (0.14, defaults) is a different search:
it minimises sum |w - q|^2.4 over shrink factors 1.00, 0.99, ..., 0.81 of the min-max range, stopping once 5
factors in a row improve no group, so its scales are not these and are not reused.
"""

from __future__ import annotations

import torch

from quantkit.formats.constants import F8E4M3_DTYPE, FP8_WEIGHT_BLOCK
from quantkit.formats.fp8 import fp8_scale_from_amax, quantize_fp8_block, to_blocks, to_e4m3
from quantkit.formats.nvfp4 import (
    NVFP4Tensor,
    e2m1_round,
    nvfp4_block_scales,
    nvfp4_global_scale,
    nvfp4_groups,
    quantize_nvfp4_weight,
)

FP8_CLIP_GRID = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5
NVFP4_SCALE_CODE_STEPS = (0, 1, *range(-1, -9, -1))  # min-max code first, then one up, then down to -8
_E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN in float8_e4m3fn
_E4M3_MIN_CODE = 0x01  # the smallest positive subnormal


def fp8_block_scales_mse(w: torch.Tensor, block: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """Weight (N, K) -> float32 decode scales (ceil(N/block), ceil(K/block)) minimising each block's squared error
    over FP8_CLIP_GRID (module docstring)."""
    blocks = to_blocks(w.float(), block)  # zero padding: exact under every candidate, adds no error
    amax = blocks.abs().amax(dim=(-2, -1))
    best_scale = fp8_scale_from_amax(amax)
    best_error = _fp8_block_error(blocks, best_scale)
    for clip in FP8_CLIP_GRID[1:]:
        scale = fp8_scale_from_amax(amax * clip)
        error = _fp8_block_error(blocks, scale)
        better = error < best_error  # strict: the earlier candidate (min-max first) keeps ties
        best_scale, best_error = torch.where(better, scale, best_scale), torch.where(better, error, best_error)
    return best_scale


def _fp8_block_error(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Squared error per block (nb, kb) of blocks (nb, kb, b, b) encoded with decode scales (nb, kb)."""
    decoded = to_e4m3(blocks / scale[..., None, None]).float() * scale[..., None, None]
    return (decoded - blocks).pow(2).sum(dim=(-2, -1))


def nvfp4_block_scales_mse(groups: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Weight groups (..., G, 16) float32 and the per-tensor decode global scale () -> E4M3 block decode scales
    (..., G) minimising each group's squared error over NVFP4_SCALE_CODE_STEPS (module docstring)."""
    base = nvfp4_block_scales(groups.abs().amax(dim=-1), global_scale).view(torch.uint8).int()
    best_codes, best_error = base, _nvfp4_group_error(groups, base, global_scale)
    for step in NVFP4_SCALE_CODE_STEPS[1:]:
        codes = (base + step).clamp(_E4M3_MIN_CODE, _E4M3_MAX_CODE)
        error = _nvfp4_group_error(groups, codes, global_scale)
        better = error < best_error  # strict: the earlier candidate (min-max first) keeps ties, all-zero groups too
        best_codes, best_error = torch.where(better, codes, best_codes), torch.where(better, error, best_error)
    return best_codes.to(torch.uint8).view(F8E4M3_DTYPE)


def _nvfp4_group_error(groups: torch.Tensor, codes: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Squared error per group (..., G) of groups (..., G, 16) under the E4M3 block-scale codes (..., G) (int)."""
    scale = (codes.to(torch.uint8).view(F8E4M3_DTYPE).float() * global_scale).unsqueeze(-1)
    decoded = e2m1_round(groups / scale) * scale
    return (decoded - groups).pow(2).sum(dim=-1)


def quantize_fp8_block_mse(w: torch.Tensor, *, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_block` with the searched block scales: (q float8_e4m3fn (N, K), decode scale float32
    (ceil(N/128), ceil(K/128)))."""
    return quantize_fp8_block(w, name=name, scale=fp8_block_scales_mse(w))


def quantize_nvfp4_weight_mse(w: torch.Tensor, *, name: str | None = None) -> NVFP4Tensor:
    """`quantize_nvfp4_weight` with the searched E4M3 group scales (the per-tensor scale stays amax / 2688)."""
    global_scale = nvfp4_global_scale(w.float().abs().amax())
    return quantize_nvfp4_weight(w, name=name, block_scale=nvfp4_block_scales_mse(nvfp4_groups(w), global_scale))
