"""ModelOpt's NVFP4 fake quantization on CPU (`quantkit.quantize.modelopt_cpu`) against ModelOpt's own code.

- the static kernel (`static_blockwise_fp4_fake_quant_kernel`, plain pointers) against ModelOpt's own wrapper and
  kernel, run by Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1): the kernel casts nothing to E4M3 (the
  wrapper does, in torch), so its float32 arithmetic must match ours bit for bit;
- the dynamic kernel (`fp4_fake_quant_kernel`) uses block pointers, which Triton 3.9's interpreter no longer runs
  ("Block pointers have been removed in favor of the tensor descriptor API"), and its E4M3 cast would round ties
  away from zero there anyway (`kernels.interpreter_quirks`); it is checked against ModelOpt's pure-torch
  `NVFP4QTensor` (quantize, then dequantize: the same scale rule, E4M3 ties to even like the GPU's cvt.rn), bit for
  bit (but for the sign of zero) wherever the kernel's own quirk (a decode scale under 1e-5 becomes 1) does not apply.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from quantkit.quantize.modelopt_cpu import (
    TINY_SCALE,
    fp4_fake_quant_block,
    modelopt_fp4_on_cpu,
    static_blockwise_fp4_fake_quant,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # modelopt warns about the transformers version
    import modelopt.torch.quantization.qtensor.nvfp4_tensor as modelopt_nvfp4
    import modelopt.torch.quantization.tensor_quant as tensor_quant
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from modelopt.torch.quantization.triton import fp4_kernel  # interpreted: conftest set TRITON_INTERPRET=1

pytestmark = pytest.mark.cpu_isa
KERNELS = settings(max_examples=25, deadline=None)


@st.composite
def gaussian(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (draw(st.integers(1, 64)), 16 * draw(st.integers(1, 12)))
    x = torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-2, 3))
    x = x * torch.exp(2 * torch.randn(shape[0], 1, generator=gen))  # rows of different scale: groups far under the max
    return torch.where(torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3])), 0.0, x)


@KERNELS
@given(gaussian())
def test_dynamic_kernel_is_modelopts_nvfp4_tensor(x):
    """fp4_fake_quant_block(x, max|x|) vs ModelOpt's NVFP4QTensor quantize -> dequantize (pure torch, E4M3 ties to
    even like the GPU), equal on every group whose decode scale is at least the kernel's 1e-5 floor: bit for bit but
    for the sign of a zero (a negative x rounded to zero is -0.0 from the kernel, +0.0 from an E2M1 code)."""
    assume(x.abs().max() > 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modelopt_nvfp4, "fp4_compatible", lambda: False)
        qt, scale, scale_2 = NVFP4QTensor.quantize(x.clone(), 16)
        deq = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    decode = (scale.float() * scale_2.float()).repeat_interleave(16, 1)
    keep = decode >= TINY_SCALE
    assume(bool(keep.any()))
    ours = fp4_fake_quant_block(x, x.abs().amax())
    assert torch.equal(ours[keep], deq[keep])  # as numbers: the kernel keeps x's sign on a zero (-0.0), E2M1 codes not


@KERNELS
@given(gaussian(), st.booleans())
def test_static_kernel_is_modelopts(x, by_amax):
    """static_blockwise_fp4_fake_quant vs ModelOpt's wrapper and Triton kernel (interpreted; the wrapper's CUDA device
    context is the one CUDA call, made a no-op), bit for bit: per-group scales given (skip_scale_quant) or derived
    from per-group amax and E4M3-rounded by ModelOpt's own scaled_e4m3_impl (the kernel itself casts to no E4M3)."""
    groups = x.reshape(-1, 16)
    amax = groups.abs().amax(1)
    assume(bool(amax.max() > 0))
    kwargs = {"amax": amax} if by_amax else {"scale": amax / 5.0, "skip_scale_quant": True}
    ours = static_blockwise_fp4_fake_quant(groups, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp4_kernel.torch.cuda, "device", lambda _device: nullcontext())
        theirs = fp4_kernel.static_blockwise_fp4_fake_quant(groups, **kwargs)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_modelopt_runs_on_cpu_inside_the_block_only():
    """Inside `modelopt_fp4_on_cpu` ModelOpt's NVFP4 dynamic-block op computes fp4_fake_quant_block; outside it is
    ModelOpt's own again (which asserts on CPU), and the static kernel is unset as before."""
    import modelopt.torch.quantization.triton as triton_kernel

    x, amax = torch.randn(4, 32), torch.tensor(3.0)
    args = (x, 16, amax, 4, 2, 8, 4)  # E2M1 values, E4M3 scales: NVFP4
    with modelopt_fp4_on_cpu():
        assert torch.equal(tensor_quant.dynamic_block_quantize_op(*args), fp4_fake_quant_block(x, amax))
        assert triton_kernel.static_blockwise_fp4_fake_quant is static_blockwise_fp4_fake_quant
    with pytest.raises(AssertionError, match="amax must be a CUDA tensor"):
        tensor_quant.dynamic_block_quantize_op(*args)
    assert not hasattr(triton_kernel, "static_blockwise_fp4_fake_quant")
