"""ModelOpt's NVFP4 fake quantization on a CPU, so that its AWQ and MSE calibrations run where no GPU is.

nvidia-modelopt 0.42 fake-quantizes NVFP4 during its searches (`awq_lite`, `awq_clip`, `awq_full`, `mse`) with two
Triton kernels that it loads only on a CUDA device of compute capability >= 8.9
(`modelopt.torch.quantization.triton.fp4_kernel`); without one its dynamic-block path asserts
"amax must be a CUDA tensor". This module transcribes the two kernels into torch, operation for operation in
float32, and `modelopt_fp4_on_cpu()` hands them to ModelOpt for the duration of a calibration. ModelOpt's own
algorithms, calibrators and export run unchanged; only the elementwise kernel is ours.

    fp4_fake_quant_block            fp4_fake_quant_kernel: per 16-element group along the last axis, the decode
                                    scale E4M3(max|x| / (6 s)) x s with s = global_amax / (6 x 448), then x / scale
                                    rounded to E2M1 (ties to even) and multiplied back
    static_blockwise_fp4_fake_quant static_blockwise_fp4_fake_quant_kernel with its wrapper: given per-group scales
                                    (or amax / 6), E4M3-rounded through ModelOpt's own `scaled_e4m3_impl`

Both keep the kernels' quirks: a decode scale under 1e-5 becomes 1, and a zero global scale divides by 1e-12. The
E4M3 rounding is torch's (round to nearest, ties to even), which is what the GPU's cvt.rn does; Triton's CPU
interpreter rounds ties away from zero (`kernels.interpreter_quirks`), so the tests compare with the interpreted
kernels where no tie occurs, and with ModelOpt's pure-torch `NVFP4QTensor` everywhere (tests/test_modelopt_cpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
TINY_SCALE = 1e-5  # the kernels' floor: a decode scale below it is replaced by 1
ZERO_GLOBAL_SCALE = 1e-12  # fp4_fake_quant_kernel's stand-in for a zero global scale


def _round_to_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """|x| / scale (float32, >= 0) -> the nearest E2M1 magnitude, ties to even, saturating at 6 (the kernels'
    comparison chain, in its order)."""
    m = magnitude
    return torch.where(
        m <= 0.25, 0.0,
        torch.where(m < 0.75, 0.5,
        torch.where(m <= 1.25, 1.0,
        torch.where(m < 1.75, 1.5,
        torch.where(m <= 2.5, 2.0,
        torch.where(m < 3.5, 3.0,
        torch.where(m <= 5.0, 4.0, 6.0)))))))  # fmt: skip


def fp4_fake_quant_block(x: torch.Tensor, global_amax: torch.Tensor, block_size: int = 16, **_) -> torch.Tensor:
    """NVFP4 fake quantization with dynamic per-group scales: x (..., N), groups of `block_size` along the last
    axis (a ragged last group is zero-padded, as the kernel's boundary check pads); global_amax a scalar tensor.
    Returns x's shape and dtype."""
    shape, dtype = x.shape, x.dtype
    rows = x.reshape(-1, shape[-1]).float()
    pad = -rows.shape[1] % block_size
    groups = torch.nn.functional.pad(rows, (0, pad)).reshape(rows.shape[0], -1, block_size)
    global_scale = global_amax.float() / (E2M1_MAX * E4M3_MAX)
    safe = torch.where(global_scale > 0.0, global_scale, ZERO_GLOBAL_SCALE)
    magnitude = groups.abs()
    scaled = torch.clamp(magnitude.amax(dim=2, keepdim=True) / (E2M1_MAX * safe), max=E4M3_MAX)
    scale = scaled.to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= TINY_SCALE, scale, 1.0)
    value = _round_to_e2m1(magnitude / scale) * scale
    out = torch.where(groups >= 0, value, -value).reshape(rows.shape[0], -1)[:, : shape[-1]]
    return out.to(dtype).reshape(shape)


def static_blockwise_fp4_fake_quant(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    scale_fp8_quant_amax: torch.Tensor | None = None,
    skip_scale_quant: bool = False,
    out_dtype: torch.dtype | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 fake quantization with given per-group scales: x (G, B) groups of B; scale or amax (G,) or (G, 1)
    (scale = amax / 6), E4M3-rounded against `scale_fp8_quant_amax` (default: the scales' max) unless
    `skip_scale_quant`. ModelOpt's wrapper and kernel, same arguments."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl
    from modelopt.torch.quantization.utils import reduce_amax

    if (scale is None) == (amax is None):
        raise ValueError("give exactly one of scale and amax")
    if amax is not None:
        scale = amax / E2M1_MAX
    assert scale is not None and x.ndim == 2
    if not skip_scale_quant:
        if scale_fp8_quant_amax is None:
            scale_fp8_quant_amax = reduce_amax(scale, axis=None, keepdims=False, squeeze_scalar=True)
        scale = scaled_e4m3_impl(scale, scale_fp8_quant_amax)
    groups = x.float()
    safe = scale.reshape(-1, 1).float()
    safe = torch.where(safe >= TINY_SCALE, safe, 1.0)
    value = _round_to_e2m1(groups.abs() / safe) * safe
    return torch.where(groups >= 0, value, -value).to(out_dtype or x.dtype)


@contextmanager
def modelopt_fp4_on_cpu() -> Iterator[None]:
    """Within the block, ModelOpt's NVFP4 fake quantization runs on this module's kernels where its Triton kernels
    are not loaded (no CUDA device of capability >= 8.9); elsewhere nothing changes. Restores ModelOpt on exit."""
    import modelopt.torch.quantization.tensor_quant as tensor_quant
    import modelopt.torch.quantization.triton as triton_kernel

    if triton_kernel.IS_AVAILABLE:
        yield
        return
    original_op = tensor_quant.dynamic_block_quantize_op

    def dynamic_block_quantize(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4)  # E2M1, E4M3 scales
        if nvfp4 and amax is not None:  # ModelOpt's own branch for NVFP4, with its kernel's default group of 16
            return fp4_fake_quant_block(inputs, amax if amax.numel() == 1 else amax.amax())
        return original_op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)

    tensor_quant.dynamic_block_quantize_op = dynamic_block_quantize
    triton_kernel.static_blockwise_fp4_fake_quant = static_blockwise_fp4_fake_quant  # type: ignore[attr-defined]
    try:
        yield
    finally:
        tensor_quant.dynamic_block_quantize_op = original_op
        del triton_kernel.static_blockwise_fp4_fake_quant  # type: ignore[attr-defined]
