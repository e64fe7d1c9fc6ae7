"""Bit-exact parity of quantkit.formats with the peers' reference numerics, where the formats coincide.

- NVFP4 weights vs nvidia-modelopt 0.42 `NVFP4QTensor.quantize` / `.dequantize` (pure torch). Its only CUDA
  call on that path is `fp4_compatible()` (torch.cuda.get_device_capability, which asserts on CPU-only torch,
  before it would try TensorRT-LLM's kernel): patched to False here, which is the path it takes on any GPU
  below Blackwell. Its fake-quant (`TensorQuantizer`) path needs CUDA extensions and is not tested.
- NVFP4 weights and static-scale activations vs compressed-tensors 0.17 (TENSOR_GROUP, group 16, E4M3
  scales: `calculate_qparams` + `quantize` + `pack_fp4_to_uint8`; `compute_dynamic_scales_and_zp` for
  activations) for the same global scale. compressed-tensors keeps the ENCODE global scale g = 2688 / amax
  and divides by `scale / g`; we keep the DECODE scale 1 / g and divide by `scale * (1 / g)`. For a
  power-of-two g both are exact, so parity holds by construction (tested on arbitrary values); for g from
  data the two float32 roundings may differ in the last bit, which can flip an element sitting exactly on
  a rounding bound: tested bit-exact on fixed seeded data where no flip occurs. That fact is about exact bits,
  so the data must be the same bits on every machine: it is drawn with torch.rand (integer-based, identical on
  every ISA), NOT torch.randn, whose float32 Box-Muller has a vectorized AVX2 path (Sleef log/sin/cos) and a
  scalar path (AVX-512 and older machines) that differ in the last bit (check: ATEN_CPU_CAPABILITY=default vs
  avx2). Every later step on both sides is elementwise IEEE arithmetic or a max (correctly rounded, no
  summation), so the outcome is the same on every machine.
  Its `cast_to_fp4` is `torch.compile`d; the property tests run it eagerly (`force_eager`: same ops,
  and inductor costs ~6 s a shape on 2 cores), one test runs the compiled function.
- FP8 128x128 block weights vs compressed-tensors' FP8_BLOCK (`calculate_qparams` + `quantize`) and
  ModelOpt's `FP8QTensor.quantize(block_sizes={-1: 128, -2: 128})`; per-token activations vs
  compressed-tensors' dynamic TOKEN strategy.

Where the peers differ from us by convention (compared only where they do not):
- all-zero groups/blocks/rows: our scale 1.0; compressed-tensors eps (0.125 for E4M3 scales, float32 eps for
  FP8), ModelOpt NaN for FP8 blocks and for an all-zero NVFP4 tensor. Codes agree (all zero).
- NVFP4 groups whose E4M3 scale underflows (group amax < ~2e-6 x tensor amax): we store 2**-9, ModelOpt
  divides by 0 (inf codes), compressed-tensors stores 0.125. Excluded from the generated data.
- -0.0 inputs: compressed-tensors adds its zero point (+0.0), turning them into +0 FP8; we keep -0 (as
  torch's cast and ModelOpt do). The compressed-tensors FP8 tests canonicalize -0.0 to +0.0.
- ModelOpt's `dequantize` cannot crop a K that is not a multiple of 16 (reshape error): compared on K % 16 == 0.
"""

import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_formats import element_values
from test_formats import matrices as formats_matrices

from quantkit.formats import (
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_fp8_per_token,
    quantize_nvfp4,
    quantize_nvfp4_activation,
    quantize_nvfp4_weight,
)
from quantkit.formats.constants import F8E4M3_MIN_SUBNORMAL, NVFP4_GROUP

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # modelopt warns about the transformers version
    import modelopt.torch.quantization.qtensor.nvfp4_tensor as modelopt_nvfp4
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.quant_scheme import FP8_BLOCK, FP8_DYNAMIC, NVFP4
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    compute_dynamic_scales_and_zp,
    generate_gparam,
)

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

PARITY = settings(max_examples=30, deadline=None)


def matrices(max_rows=5, max_cols=48, k_multiple=1):
    """test_formats' matrices, magnitudes in [1e-20, 1e20]."""
    return formats_matrices(max_rows, max_cols, k_multiple, element_values(1e-20, 1e20))


@st.composite
def gaussian(draw, max_rows=200, max_cols=300, k_multiple=1):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols // k_multiple)) * k_multiple)
    x = torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-4, 4))
    x = x * torch.exp(torch.randn(shape[0], 1, generator=gen))
    return torch.where(torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3])), 0.0, x)


@pytest.fixture(scope="module", autouse=True)
def _cpu_paths():
    """ModelOpt on CPU: no FP4 hardware (its check asserts without CUDA). compressed-tensors: eager."""
    with pytest.MonkeyPatch.context() as mp, torch.compiler.set_stance("force_eager"):
        mp.setattr(modelopt_nvfp4, "fp4_compatible", lambda: False)
        yield


def _group_scale_underflows(x: torch.Tensor, global_decode: torch.Tensor) -> bool:
    k_pad = -(-x.shape[-1] // NVFP4_GROUP) * NVFP4_GROUP
    amax = torch.nn.functional.pad(x, (0, k_pad - x.shape[-1])).unflatten(-1, (-1, NVFP4_GROUP)).abs().amax(-1)
    scale = amax / (6.0 * global_decode)
    return bool(((amax > 0) & (scale <= F8E4M3_MIN_SUBNORMAL / 2)).any())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (fp8 -> uint8, float32 -> int32): exact comparison, -0 != +0, NaN == NaN."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = _bits(a), _bits(b)
    return torch.equal(a, b) if mask is None else torch.equal(a[mask], b[mask])


# ---------------------------------------------------------------------------------------------------- NVFP4 / ModelOpt


def _modelopt_nvfp4(w):
    qt, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), NVFP4_GROUP)
    return qt, scale, scale_2


@PARITY
@given(st.one_of(matrices(), gaussian(max_rows=64, max_cols=200)))
def test_nvfp4_weight_bit_exact_vs_modelopt(w):
    assume(w.abs().max() > 0)  # ModelOpt: all-zero tensor -> NaN scales
    ours = quantize_nvfp4_weight(w)
    assume(not _group_scale_underflows(w, ours.global_scale))
    qt, scale, scale_2 = _modelopt_nvfp4(w)
    assert _same_bits(ours.global_scale, scale_2)
    assert _same_bits(ours.block_scale, scale)
    assert torch.equal(ours.packed, qt._quantized_data)
    if w.shape[1] % NVFP4_GROUP == 0:
        deq = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: NVFP4_GROUP})
        assert torch.equal(dequantize_nvfp4(ours), deq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_weight_bit_exact_vs_modelopt_half_inputs(dtype):
    w = (torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    w[3, :16] = 0  # a zero group: both give block scale 1.0
    ours = quantize_nvfp4_weight(w)
    qt, scale, scale_2 = _modelopt_nvfp4(w)
    assert _same_bits(ours.global_scale, scale_2) and _same_bits(ours.block_scale, scale)
    assert torch.equal(ours.packed, qt._quantized_data)


# ---------------------------------------------------------------------------------------------------- NVFP4 / c-t


def _ct_nvfp4(x: torch.Tensor, encode_global: torch.Tensor, activation: bool = False):
    """compressed-tensors' NVFP4: (packed uint8, E4M3 group scales). K must be a multiple of 16 (it refuses others)."""
    if activation:
        args = NVFP4["input_activations"]
        scale, zp = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=encode_global)
    else:
        args = NVFP4["weights"]
        groups = x.unflatten(-1, (-1, NVFP4_GROUP))
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=encode_global)
    q = ct_quantize(x=x, scale=scale, zero_point=zp, args=args, global_scale=encode_global)
    return pack_fp4_to_uint8(q), scale.to(torch.float8_e4m3fn)


def _assert_nvfp4_matches_ct(x, ours, packed, scale):
    assert torch.equal(ours.packed, packed)
    nonzero = x.unflatten(-1, (-1, NVFP4_GROUP)).abs().amax(-1) > 0  # c-t: zero groups get scale eps (0.125)
    assert _same_bits(ours.block_scale, scale, nonzero)


@PARITY
@given(st.one_of(matrices(k_multiple=16), gaussian(max_rows=64, k_multiple=16)), st.integers(-12, 12))
def test_nvfp4_bit_exact_vs_compressed_tensors_power_of_two_global_scale(x, log2_global):
    encode = torch.tensor([2.0**log2_global])
    assume(not _group_scale_underflows(x, 1 / encode))
    packed, scale = _ct_nvfp4(x, encode)
    _assert_nvfp4_matches_ct(x, quantize_nvfp4(x, 1 / encode), packed, scale)
    packed, scale = _ct_nvfp4(x, encode, activation=True)
    _assert_nvfp4_matches_ct(x, quantize_nvfp4_activation(x, "static", 1 / encode), packed, scale)


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_bit_exact_vs_compressed_tensors_data_global_scale(seed):
    gen = torch.Generator().manual_seed(seed)
    w = (
        (torch.rand(128, 512, generator=gen) * 2 - 1) * torch.rand(128, 1, generator=gen) * 0.05
    )  # same bits on every ISA
    encode = generate_gparam(w.min(), w.max())  # c-t's weight_global_scale: 2688 / amax
    packed, scale = _ct_nvfp4(w, encode)
    ours = quantize_nvfp4(w, 1 / encode)
    _assert_nvfp4_matches_ct(w, ours, packed, scale)
    assert torch.equal(ours.packed, quantize_nvfp4_weight(w).packed)  # and 1/(2688/amax) ~ amax/2688 here
    x = (torch.rand(64, 256, generator=gen) * 2 - 1) * 6
    calibrated = generate_gparam(x.min() * 0.8, x.max() * 0.8)  # calibration saw a smaller range: saturation
    packed, scale = _ct_nvfp4(x, calibrated, activation=True)
    _assert_nvfp4_matches_ct(x, quantize_nvfp4_activation(x, "static", 1 / calibrated), packed, scale)


def test_nvfp4_vs_compressed_tensors_compiled_cast():
    w = torch.rand(32, 64, generator=torch.Generator().manual_seed(7)) * 2 - 1  # same bits on every ISA
    encode = generate_gparam(w.min(), w.max())
    with torch.compiler.set_stance("default"):
        packed, scale = _ct_nvfp4(w, encode)
    _assert_nvfp4_matches_ct(w, quantize_nvfp4(w, 1 / encode), packed, scale)


# ---------------------------------------------------------------------------------------------------- FP8


def _ct_fp8_block(w: torch.Tensor):
    args = FP8_BLOCK["weights"]
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    blocks = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).reshape(nb, 128, kb, 128)
    scale, zp = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
    return ct_quantize(x=w, scale=scale, zero_point=zp, args=args, dtype=torch.float8_e4m3fn), scale


def _nonzero_blocks(w):
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128))
    return padded.reshape(padded.shape[0] // 128, 128, -1, 128).abs().amax(dim=(1, 3)) > 0


@PARITY
@given(st.one_of(matrices(max_rows=20, max_cols=20), gaussian(max_rows=300, max_cols=300)))
def test_fp8_block_bit_exact_vs_compressed_tensors(w):
    w = w + 0.0  # -0.0 -> +0.0: c-t adds its zero point
    q, scale = quantize_fp8_block(w)
    q_ct, scale_ct = _ct_fp8_block(w)
    assert _same_bits(q, q_ct)
    nz = _nonzero_blocks(w)  # c-t: all-zero block -> scale eps
    assert _same_bits(scale, scale_ct, nz)


@PARITY
@given(st.one_of(matrices(max_rows=20, max_cols=20), gaussian(max_rows=300, max_cols=300)))
def test_fp8_block_bit_exact_vs_modelopt(w):
    q, scale = quantize_fp8_block(w)
    qt, scale_mo = FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})
    nz = _nonzero_blocks(w)  # ModelOpt: all-zero block -> scale 0, q NaN
    assert _same_bits(scale, scale_mo, nz)
    in_nz = nz.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    assert _same_bits(q, qt._quantized_data, in_nz)


@PARITY
@given(st.one_of(matrices(max_cols=20), gaussian(max_rows=64)), st.sampled_from([1, 2]))
def test_fp8_per_token_bit_exact_vs_compressed_tensors(x, batch):
    # (batch, tokens, K): c-t's TOKEN strategy reduces all but dims 0 and 1 (on a 2-D input it is per tensor)
    x = x.repeat(batch, 1).reshape(batch, x.shape[0], x.shape[1]) + 0.0
    args = FP8_DYNAMIC["input_activations"]
    scale_ct, zp = compute_dynamic_scales_and_zp(x, args, module=None)
    q_ct = ct_quantize(x=x, scale=scale_ct, zero_point=zp, args=args, dtype=torch.float8_e4m3fn)
    q, scale = quantize_fp8_per_token(x)
    assert _same_bits(q, q_ct)
    nz = x.abs().amax(-1, keepdim=True) > 0  # c-t: all-zero row -> scale float32 eps
    assert _same_bits(scale, scale_ct, nz)
