"""Properties of the reference formats (quantkit.formats): FP8 E4M3 W8A8 and NVFP4 W4A4.

Error bounds checked per element (up to float32 rounding, a slack of 2**-20 of the magnitudes involved):
- FP8: |x - deq| <= 2**-4 * |x| + 2**-10 * scale (half an E4M3 step: 3 mantissa bits; subnormal step 2**-9).
- NVFP4, S = float(block_scale) * global_scale, y = x / S: |x - deq| <= S * h(|y|), h = 1/4 (|y| <= 2),
  1/2 (|y| <= 4), 1 (|y| <= 6), i.e. half the E2M1 grid step at the element's magnitude; S * (|y| - 6) beyond 6
  (saturation), and |y| <= 6.4 whenever the group's E4M3 scale is a normal number.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantkit.formats import (
    E2M1_VALUES,
    F8E4M3_MAX,
    NVFP4_GROUP,
    NVFP4Tensor,
    dequantize_fp8_block,
    dequantize_fp8_per_token,
    dequantize_nvfp4,
    nvfp4_global_scale,
    pack_fp4,
    quantize_fp8_block,
    quantize_fp8_per_token,
    quantize_nvfp4,
    quantize_nvfp4_activation,
    quantize_nvfp4_weight,
    unpack_fp4,
)
from quantkit.formats.constants import E2M1_BOUNDS, E2M1_POSITIVE_VALUES, F8E4M3_MIN_NORMAL, F8E4M3_MIN_SUBNORMAL
from quantkit.formats.nvfp4 import e2m1_round, e2m1_to_float, round_to_e2m1

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

FAST = settings(max_examples=60, deadline=None)
SLACK = 2.0**-20


# Element values: exact zeros, "nice" multiples of 1/8 (they hit rounding ties), and a wide range of magnitudes
# (kept in [1e-30, 1e30] so that no scale becomes a float32 subnormal).
def element_values(tiny: float = 1e-30, huge: float = 1e30) -> st.SearchStrategy[float]:
    """Exact zeros, multiples of 1/8 in [-8, 8], and float32 magnitudes in [tiny, huge] of either sign."""
    tiny, huge = float(np.float32(tiny)), float(np.float32(huge))
    return st.one_of(
        st.just(0.0),
        st.integers(-64, 64).map(lambda i: i / 8),
        st.floats(tiny, huge, width=32),
        st.floats(-huge, -tiny, width=32),
    )


@st.composite
def matrices(draw, max_rows=5, max_cols=40, k_multiple=1, elements=None):
    """(rows <= max_rows, cols <= max_cols, a multiple of k_multiple) float32 of `elements` (element_values())."""
    shape = (draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols // k_multiple)) * k_multiple)
    return torch.from_numpy(draw(hnp.arrays(np.float32, shape, elements=elements or element_values())))


@st.composite
def gaussian(draw, max_rows=6, max_cols=300, lead_dims=False):
    """Seeded Gaussian data with per-row magnitudes, outliers and exact zeros: cheap to draw at larger sizes."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols)))
    if lead_dims:
        shape = (draw(st.integers(1, 3)), *shape)
    x = torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-6, 6))
    x = x * torch.exp(2 * torch.randn((*shape[:-1], 1), generator=gen))
    x = torch.where(torch.rand(shape, generator=gen) < 0.02, x * 100, x)
    return torch.where(torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.1, 0.5])), 0.0, x)


def _blockwise(scale, n, k, block):
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]


def _check_fp8_bound(x, deq, scale_full):
    err = (x - deq).abs()
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale_full + SLACK * (x.abs() + scale_full)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


# ---------------------------------------------------------------------------------------------------- FP8


@FAST
@given(st.one_of(matrices(max_rows=9, max_cols=9), gaussian(max_rows=20, max_cols=20)), st.sampled_from([2, 4, 128]))
def test_fp8_block_roundtrip_bound_and_scales(w, block):
    n, k = w.shape
    q, scale = quantize_fp8_block(w, block=block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (math.ceil(n / block), math.ceil(k / block))
    amax = torch.zeros_like(scale)
    for i in range(scale.shape[0]):  # independent reference: one amax per (partial) block
        for j in range(scale.shape[1]):
            amax[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max()
            assert scale[i, j] == (amax[i, j] / F8E4M3_MAX if amax[i, j] > 0 else 1.0)
    deq = dequantize_fp8_block(q, scale, block=block)
    _check_fp8_bound(w, deq, _blockwise(scale, n, k, block))
    hit = (w.abs() == _blockwise(amax, n, k, block)) & (w != 0)  # a block's amax element lands on +-448
    assert bool((q.float()[hit].abs() == F8E4M3_MAX).all())


def test_fp8_block_not_divisible_by_128_is_zero_padding():
    w = torch.randn(130, 257, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_block(w)
    assert q.shape == (130, 257) and scale.shape == (2, 3)
    padded = torch.nn.functional.pad(w, (0, 384 - 257, 0, 256 - 130))
    q_pad, scale_pad = quantize_fp8_block(padded)
    assert torch.equal(q.view(torch.uint8), q_pad[:130, :257].view(torch.uint8))
    assert torch.equal(scale, scale_pad)
    assert dequantize_fp8_block(q, scale).shape == (130, 257)


@FAST
@given(st.one_of(matrices(), gaussian(lead_dims=True)))
def test_fp8_per_token_bound_and_row_independence(x):
    q, scale = quantize_fp8_per_token(x)
    assert q.shape == x.shape and scale.shape == (*x.shape[:-1], 1)
    _check_fp8_bound(x, dequantize_fp8_per_token(q, scale), scale.expand_as(x))
    rows = x.reshape(-1, x.shape[-1])
    q_rows, s_rows = q.reshape(-1, x.shape[-1]), scale.reshape(-1, 1)
    for r in range(rows.shape[0]):  # each row alone gives the same bits: scales are independent across rows
        q_r, s_r = quantize_fp8_per_token(rows[r : r + 1])
        assert torch.equal(q_r.view(torch.uint8), q_rows[r : r + 1].view(torch.uint8))
        assert torch.equal(s_r, s_rows[r : r + 1])
    hit = (x.abs() == x.abs().amax(dim=-1, keepdim=True)) & (x != 0)
    assert bool((q.float()[hit].abs() == F8E4M3_MAX).all())


@FAST
@given(st.one_of(matrices(), gaussian(max_cols=40)))
def test_fp8_sign_symmetry(x):
    q, s = quantize_fp8_block(x, block=4)
    qn, sn = quantize_fp8_block(-x, block=4)
    assert torch.equal(s, sn)
    assert torch.equal(qn.view(torch.uint8), q.view(torch.uint8) ^ 0x80)  # the sign bit, zeros included
    q, s = quantize_fp8_per_token(x)
    qn, sn = quantize_fp8_per_token(-x)
    assert torch.equal(s, sn) and torch.equal(qn.view(torch.uint8), q.view(torch.uint8) ^ 0x80)


def test_fp8_zeros_give_scale_one_and_zeros():
    w = torch.zeros(200, 300)
    w[150:, 260:] = torch.randn(50, 40)
    q, scale = quantize_fp8_block(w)
    assert torch.equal(scale[0], torch.ones(3)) and scale[1, 2] != 1.0
    deq = dequantize_fp8_block(q, scale)
    assert not deq.isnan().any() and torch.equal(deq[:128], torch.zeros(128, 300))
    x = torch.zeros(3, 8)
    x[1] = torch.arange(8.0)
    q, scale = quantize_fp8_per_token(x)
    assert scale[0].item() == 1.0 and scale[2].item() == 1.0 and scale[1].item() == 7.0 / 448
    assert torch.equal(dequantize_fp8_per_token(q, scale)[0], torch.zeros(8))


def test_fp8_ties_round_to_even_and_saturate():
    # a block whose amax is 448 has scale 1: the values pass through the E4M3 cast unchanged
    x = torch.tensor([[448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 240.0 + 8.0, -1.0625, 0.0]])
    q, scale = quantize_fp8_per_token(x)
    assert scale.item() == 1.0
    expect = [448.0, 1.0, 1.25, 0.0, 2.0**-8, 256.0, -1.0, 0.0]  # ties to even mantissa; 248 -> 256
    assert q.float()[0].tolist() == expect
    from quantkit.formats.fp8 import to_e4m3

    assert to_e4m3(torch.tensor([448.0, 464.0, 1e30, -1e30])).float().tolist() == [448.0, 448.0, 448.0, -448.0]


# ---------------------------------------------------------------------------------------------------- E2M1


def _quarter(i: int) -> float:
    return i / 4


def _even(n: int) -> bool:
    return n % 2 == 0


def _e2m1_reference(y: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest of the 8 magnitudes, ties to the even index (= even mantissa), saturate."""
    mags = torch.tensor(E2M1_POSITIVE_VALUES)
    dist = (y.abs().unsqueeze(-1) - mags).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    even = candidates & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.int().argmax(-1), candidates.int().argmax(-1))
    return idx + 8 * (y < 0)


@FAST
@given(
    hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-8, 8, width=32) | st.integers(-32, 32).map(_quarter))
)
def test_e2m1_rounding_matches_brute_force(y):
    y = torch.from_numpy(y)
    assert torch.equal(round_to_e2m1(y).long(), _e2m1_reference(y))


def test_e2m1_round_equals_the_codes_decoded_bit_for_bit():
    """`e2m1_round` (no codes) = `e2m1_to_float(round_to_e2m1(y))` on every float32 bit pattern of |y| in [0, 8]
    sampled every 2**8 ulps, each rounding midpoint and its float32 neighbours, +-0, huge values and both signs:
    equal bits (int32 views), so the signed zeros match too. Exact arithmetic on both sides: no tolerance."""
    patterns = torch.arange(0, int(torch.tensor(8.0).view(torch.int32)) + 1, 256, dtype=torch.int32).view(torch.float32)
    mids = torch.tensor(E2M1_BOUNDS + (2.0, 4.0, 6.0))
    neighbours = torch.cat((mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)))
    y = torch.cat((patterns, neighbours, torch.tensor([0.0, 1e30, 3.4e38, 7.0])))
    y = torch.cat((y, -y))
    got, expected = e2m1_round(y), e2m1_to_float(round_to_e2m1(y))
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_e2m1_ties_to_even_and_saturation():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_to_float(round_to_e2m1(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_to_float(round_to_e2m1(-mids)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    # just off the midpoints
    assert e2m1_to_float(round_to_e2m1(torch.tensor([0.2501, 2.4999, 5.0001, 7.0, 1e30]))).tolist() == [
        0.5,
        2.0,
        6.0,
        6.0,
        6.0,
    ]
    # sign bit: set exactly for y < 0 (a negative that rounds to zero is -0, code 8); +0.0 and -0.0 give 0
    assert round_to_e2m1(torch.tensor([0.0, -0.0, -0.1, 0.1])).tolist() == [0, 0, 8, 0]
    assert [e2m1_to_float(torch.tensor(c)).item() for c in range(16)] == list(E2M1_VALUES)


@FAST
@given(
    hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.integers(2, 24).filter(_even)), elements=st.integers(0, 15))
)
def test_pack_unpack_round_trip(codes):
    codes = torch.from_numpy(codes)
    packed = pack_fp4(codes)
    assert packed.shape == (codes.shape[0], codes.shape[1] // 2)
    assert torch.equal(unpack_fp4(packed), codes)


def test_nibble_order_low_first():
    assert pack_fp4(torch.tensor([1, 2, 0xF, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    assert unpack_fp4(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------- NVFP4


def _nvfp4_parts(t: NVFP4Tensor):
    """Per element (cropped to k): codes' values v, the decode scale S."""
    v = e2m1_to_float(unpack_fp4(t.packed))[..., : t.k]
    S = (t.block_scale.float() * t.global_scale).repeat_interleave(NVFP4_GROUP, dim=-1)[..., : t.k]
    return v, S


def _check_nvfp4_bound(x, t):
    v, S = _nvfp4_parts(t)
    deq = dequantize_nvfp4(t)
    assert torch.equal(deq, v * S)
    y = x / S
    a = y.abs()
    half_step = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    allowed = torch.where(a <= 6, S * half_step, S * (a - 6)) + SLACK * (x.abs() + S * v.abs())
    err = (x - deq).abs()
    assert bool((err <= allowed).all()), f"max excess {(err - allowed).max().item()}"
    normal = (t.block_scale.float() >= F8E4M3_MIN_NORMAL).repeat_interleave(NVFP4_GROUP, dim=-1)[..., : t.k]
    assert bool((a[normal] <= 6.4).all())


@FAST
@given(st.one_of(matrices(), gaussian()))
def test_nvfp4_weight_roundtrip_bound(w):
    t = quantize_nvfp4_weight(w)
    k_pad = math.ceil(w.shape[1] / 16) * 16
    assert t.packed.shape == (w.shape[0], k_pad // 2) and t.block_scale.shape == (w.shape[0], k_pad // 16)
    assert t.global_scale.shape == () and t.shape == tuple(w.shape)
    amax = w.abs().max()
    assert t.global_scale.item() == (amax / 2688 if amax > 0 else 1.0)
    _check_nvfp4_bound(w, t)
    if amax > 0:  # the group holding the tensor's amax gets the largest E4M3 scale
        assert t.block_scale.float().max().item() == F8E4M3_MAX


@FAST
@given(st.one_of(matrices(), gaussian(lead_dims=True)))
def test_nvfp4_per_token_bound_and_row_independence(x):
    t = quantize_nvfp4_activation(x)
    assert t.global_scale.shape == (*x.shape[:-1], 1)
    assert torch.equal(t.global_scale, nvfp4_global_scale(x.abs().amax(dim=-1, keepdim=True)))
    _check_nvfp4_bound(x, t)
    rows = x.reshape(-1, x.shape[-1])
    packed, scales = t.packed.reshape(rows.shape[0], -1), t.block_scale.reshape(rows.shape[0], -1)
    for r in range(rows.shape[0]):
        tr = quantize_nvfp4_activation(rows[r : r + 1])
        assert torch.equal(tr.packed, packed[r : r + 1])
        assert torch.equal(tr.block_scale.view(torch.uint8), scales[r : r + 1].view(torch.uint8))


@FAST
@given(st.one_of(matrices(), gaussian(max_cols=40)))
def test_nvfp4_sign_symmetry(x):
    for quant in (quantize_nvfp4_weight, quantize_nvfp4_activation):
        t, tn = quant(x), quant(-x)
        assert torch.equal(t.block_scale.view(torch.uint8), tn.block_scale.view(torch.uint8))
        assert torch.equal(t.global_scale, tn.global_scale)
        codes, codes_n = unpack_fp4(t.packed)[..., : x.shape[-1]], unpack_fp4(tn.packed)[..., : x.shape[-1]]
        # sign bit = (x / S < 0): zeros, and values whose x / S underflows float32 to +-0, encode as +0
        nz = (x.abs() / _nvfp4_parts(t)[1]) > 0
        assert torch.equal(codes_n[nz], codes[nz] ^ 8) and torch.equal(codes_n[~nz], codes[~nz])


@FAST
@given(st.integers(1, 4), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_nvfp4_padding(n, k, seed):
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    k_pad = math.ceil(k / 16) * 16
    padded = torch.nn.functional.pad(x, (0, k_pad - k))
    for gs in (0.01, nvfp4_global_scale(x.abs().max())):
        t, tp = quantize_nvfp4(x, gs), quantize_nvfp4(padded, gs)
        assert t.k == k and tp.k == k_pad
        assert torch.equal(t.packed, tp.packed)  # the padding encodes as zero codes
        assert torch.equal(t.block_scale.view(torch.uint8), tp.block_scale.view(torch.uint8))
        assert torch.equal(dequantize_nvfp4(t), dequantize_nvfp4(tp)[:, :k])
        assert (unpack_fp4(t.packed)[:, k:] == 0).all()


def test_nvfp4_ties_through_the_whole_path():
    # global scale 1 and a group holding 6: block scale 6 / (6 * 1) = 1, so y = x exactly
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]])
    t = quantize_nvfp4(x, 1.0)
    assert t.block_scale.float().item() == 1.0
    expect = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 0.0]
    assert dequantize_nvfp4(t)[0].tolist() == expect


def test_nvfp4_zeros():
    t = quantize_nvfp4_weight(torch.zeros(3, 20))
    assert t.global_scale.item() == 1.0 and (t.block_scale.float() == 1.0).all() and (t.packed == 0).all()
    assert torch.equal(dequantize_nvfp4(t), torch.zeros(3, 20))
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-3, 3, 16)
    t = quantize_nvfp4_activation(x)
    assert t.global_scale[0].item() == 1.0 and t.global_scale[1].item() == (torch.tensor(3.0) / 2688).item()
    assert t.block_scale.float().tolist() == [[1.0, 1.0], [1.0, 448.0]]  # zero groups get block scale 1
    assert not dequantize_nvfp4(t).isnan().any() and (dequantize_nvfp4(t)[0] == 0).all()


def test_nvfp4_underflowing_group_scale_gets_smallest_subnormal():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0  # global scale 1 / 2688
    x[0, 16:] = 1e-7  # group scale 1e-7 * 448 ~ 4.5e-5 < 2**-10: would round to 0 in E4M3
    t = quantize_nvfp4_weight(x)
    assert t.block_scale.float()[0, 1].item() == F8E4M3_MIN_SUBNORMAL
    deq = dequantize_nvfp4(t)
    assert torch.isfinite(deq).all()
    _check_nvfp4_bound(x, t)


def test_nvfp4_static_activation_mode_saturates_beyond_calibrated_amax():
    x = torch.linspace(-10, 10, 32).reshape(1, 32)
    calibrated = torch.tensor(5.0) / 2688  # the calibration saw amax 5, this batch reaches 10
    t = quantize_nvfp4_activation(x, mode="static", global_scale=calibrated)
    assert torch.equal(t.packed, quantize_nvfp4(x, calibrated).packed) and t.global_scale.shape == ()
    assert t.block_scale.float().max().item() == F8E4M3_MAX
    assert dequantize_nvfp4(t).abs().max().item() == pytest.approx(5.0, rel=1e-6)  # 6 * 448 * 5 / 2688


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "fn",
    [
        quantize_fp8_block,
        quantize_fp8_per_token,
        quantize_nvfp4_weight,
        quantize_nvfp4_activation,
        lambda x, name: quantize_nvfp4(x, 1.0, name=name),
    ],
)
def test_non_finite_inputs_refused(fn, bad):
    x = torch.ones(4, 32)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=r"'layers\.0\.w' of shape \(4, 32\) has 1 non-finite"):
        fn(x, name="layers.0.w")


@pytest.mark.parametrize("mode", ["per_token", "static"])
def test_activation_fake_quant_equals_dequantize_of_quantize_bit_for_bit(mode):
    """`fake_quant_nvfp4_activation` (the served emulation's path: no packing) is the same arithmetic as
    dequantize(quantize(x)) minus the pack/unpack round trip: equal bit for bit, signed zeros included, on inputs
    with exact rounding ties (E2M1_BOUNDS x the group scale), zeros, -0.0, a padded last group and 10 decades of
    row magnitudes."""
    from quantkit.formats.nvfp4 import fake_quant_nvfp4_activation

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(7, 45, generator=generator) * 10 ** (torch.rand(7, 1, generator=generator) * 10 - 6)
        x[0, :16] = torch.tensor((*E2M1_BOUNDS, *(-b for b in E2M1_BOUNDS), 6.0, -6.0)) * 3.0
        x[1, :7] = 0.0
        x[2, 3] = -0.0
        scale = (x.abs().max() / 2688 * 0.7).reshape(()) if mode == "static" else None
        expected = dequantize_nvfp4(quantize_nvfp4_activation(x, mode, scale))
        got = fake_quant_nvfp4_activation(x, mode, scale)
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_weight_fake_quant_equals_dequantize_of_quantize_bit_for_bit():
    """`fake_quant_nvfp4_weight` (SmoothQuant's alpha search) is dequantize(quantize_nvfp4_weight(w)) minus the
    pack/unpack round trip: equal bit for bit, signed zeros included, on weights with exact rounding ties, zeros,
    -0.0, a padded last group and rows 10 decades apart (the per-tensor scale then sends small rows' groups to
    E4M3's subnormal scales); the scheme's `fake_quant_weight` is the same, and FP8 block's default is
    decode(encode(w))."""
    from quantkit.formats.nvfp4 import fake_quant_nvfp4_weight
    from quantkit.formats.schemes import get_scheme

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        w = torch.randn(7, 45, generator=generator) * 10 ** (torch.rand(7, 1, generator=generator) * 10 - 6)
        w[0, :16] = torch.tensor((*E2M1_BOUNDS, *(-b for b in E2M1_BOUNDS), 6.0, -6.0)) * w[0].abs().max()
        w[1, :7] = 0.0
        w[2, 3] = -0.0
        expected = dequantize_nvfp4(quantize_nvfp4_weight(w))
        got = fake_quant_nvfp4_weight(w)
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())
        assert torch.equal(get_scheme("nvfp4").fake_quant_weight(w, "w"), expected)
        fp8 = get_scheme("fp8_block")
        assert torch.equal(fp8.fake_quant_weight(w, "w"), fp8.decode(fp8.encode(w, "w"), 45))


def test_finite_inputs_whose_sum_overflows_are_quantized():
    """The finiteness check sums the input (NaN and Inf reach any sum) and counts exactly only when that sum is not
    finite: finite values near float32's maximum whose sum overflows to Inf must still quantize."""
    x = torch.full((2, 32), 3.0e38)
    q, scale = quantize_fp8_per_token(x, name="big")
    assert torch.isinf(x.sum()) and torch.equal(q.float() * scale, x.new_full(x.shape, 448.0) * scale)
    assert torch.isfinite(dequantize_nvfp4(quantize_nvfp4_activation(x))).all()


def test_shape_dtype_and_argument_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_block(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4_weight(torch.ones(16))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        quantize_fp8_per_token(torch.ones(3, 0))
    with pytest.raises(TypeError, match="float32"):
        quantize_fp8_per_token(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_block(quantize_fp8_block(torch.ones(130, 4))[0], torch.ones(1, 1))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_per_token(quantize_fp8_per_token(torch.ones(3, 4))[0], torch.ones(3))
    with pytest.raises(ValueError, match="mode"):
        quantize_nvfp4_activation(torch.ones(2, 16), mode="per_tensor")
    with pytest.raises(ValueError, match="needs the calibrated global_scale"):
        quantize_nvfp4_activation(torch.ones(2, 16), mode="static")
    with pytest.raises(ValueError, match="pass no global_scale"):
        quantize_nvfp4_activation(torch.ones(2, 16), global_scale=1.0)
    for gs in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            quantize_nvfp4(torch.ones(2, 16), gs)
    with pytest.raises(ValueError, match=r"scalar or of shape \(2, 1\)"):
        quantize_nvfp4(torch.ones(2, 16), torch.ones(3, 1))
    t = quantize_nvfp4_weight(torch.ones(2, 16))
    with pytest.raises(ValueError, match="disagree"):
        NVFP4Tensor(t.packed, t.block_scale[:, :0], t.global_scale, 16)
    with pytest.raises(ValueError, match="does not pad"):
        NVFP4Tensor(t.packed, t.block_scale, t.global_scale, 17)


def test_four_over_six_keeps_the_candidate_of_least_squared_error():
    """4/6 (`fake_quant_nvfp4_four_over_six`): every group of 16 is, bit for bit, one of its two NVFP4 encodings on
    the row's scale amax / 1536 -- max to 6 (`quantize_nvfp4` with that global scale) or max to 4 (block scales of
    1.5 x the group max) -- and it is the one of smaller squared error (`group_squared_error`'s fixed order; a tie
    keeps 6), so its error is
    min(err6, err4) exactly; checked on rows spanning 10 decades with a padded last group and a zero row. Then two
    exact cases on the row's largest group, where both block scales are exact E4M3 values (256 and 384): [6, 4.62]
    -> [6, 4.5] (4 wins: 4.62 sits in E2M1's widest step, 4 -> 6) and [6, 1] -> [6, 1] (6 wins)."""
    from quantkit.formats.nvfp4 import (
        _quantize_nvfp4,
        fake_quant_nvfp4_four_over_six,
        group_squared_error,
        nvfp4_block_scales,
        nvfp4_groups,
    )

    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        x = torch.randn(6, 45, generator=generator) * 10 ** (torch.rand(6, 1, generator=generator) * 10 - 6)
        x[5] = 0.0
        gs = x.abs().amax(dim=-1, keepdim=True) / (6 * 256)
        gs = torch.where(gs == 0, torch.ones_like(gs), gs)
        six = dequantize_nvfp4(quantize_nvfp4(x, gs))
        four = dequantize_nvfp4(_quantize_nvfp4(x, gs, nvfp4_block_scales(1.5 * nvfp4_groups(x).abs().amax(-1), gs)))
        got = fake_quant_nvfp4_four_over_six(x)
        groups = [nvfp4_groups(t) for t in (x, six, four, got)]
        err_six, err_four, err_got = (group_squared_error(c, groups[0]) for c in groups[1:])
        is_four = err_four < err_six
        assert torch.equal(groups[3], torch.where(is_four.unsqueeze(-1), groups[2], groups[1]))
        assert torch.equal(err_got, torch.minimum(err_six, err_four))
        assert is_four.any() and (~is_four).any()
        assert torch.equal(got[5], torch.zeros(45))
    x = torch.zeros(2, 16)
    x[0, :2] = torch.tensor([6.0, 4.62])
    x[1, :2] = torch.tensor([6.0, 1.0])
    got = fake_quant_nvfp4_four_over_six(x * 2**-10) * 2**10  # powers of two: every scale and product exact
    assert torch.equal(got[0, :2], torch.tensor([6.0, 4.5])) and torch.equal(got[1, :2], torch.tensor([6.0, 1.0]))


def test_four_over_six_weights_encode_the_same_choice_per_tensor():
    """`weight_scales: four_over_six` (`quantize_nvfp4_weight_four_over_six`): the same per-group choice as the
    activation reference, on one global scale per tensor (amax / 1536): every group decodes, bit for bit, to the
    candidate of least squared error among max-to-6 and max-to-4 on that scale, so the tensor's squared error is
    at most the min-max encoding's on the same global scale, group by group; the block scales are finite E4M3 (the
    1.5x candidate of the largest group is 384 <= 448) and the scheme encodes it into the usual NVFP4 tensors."""
    from quantkit.formats.nvfp4 import (
        _quantize_nvfp4,
        four_over_six_global_scale,
        group_squared_error,
        nvfp4_block_scales,
        nvfp4_groups,
        quantize_nvfp4_weight_four_over_six,
    )
    from quantkit.formats.schemes import NVFP4

    generator = torch.Generator().manual_seed(1)
    w = torch.randn(24, 80, generator=generator) * torch.logspace(-3, 1, 80)[torch.randperm(80, generator=generator)]
    gs = four_over_six_global_scale(w.abs().amax())
    t = quantize_nvfp4_weight_four_over_six(w)
    assert torch.equal(t.global_scale, gs) and torch.isfinite(t.block_scale.float()).all()
    six = dequantize_nvfp4(_quantize_nvfp4(w, gs))
    four = dequantize_nvfp4(_quantize_nvfp4(w, gs, nvfp4_block_scales(1.5 * nvfp4_groups(w).abs().amax(-1), gs)))
    groups = [nvfp4_groups(c) for c in (w, six, four, t.dequantize())]
    err_six, err_four, err_got = (group_squared_error(c, groups[0]) for c in groups[1:])
    assert torch.equal(groups[3], torch.where((err_four < err_six).unsqueeze(-1), groups[2], groups[1]))
    assert (err_got <= err_six).all() and (err_four < err_six).any()
    tensors = NVFP4.encode(w, "w", "four_over_six")
    assert torch.equal(NVFP4.decode(tensors, 80), t.dequantize())


def test_group_squared_error_adds_in_its_stated_tree():
    """`group_squared_error` sums each group's 16 squared errors as the tree (0+1)+(2+3), ... in float32, the order
    the fused quantizer reproduces: compared with that tree written out; values spanning 2**-60..2**60 make a
    left-to-right order give other float32 sums (asserted), so the order is what is checked, not only the total."""
    from quantkit.formats.nvfp4 import group_squared_error

    g = torch.Generator().manual_seed(3)
    decoded = torch.randn(5, 3, 16, generator=g) * 2.0 ** torch.randint(-30, 30, (5, 3, 16), generator=g).float()
    groups = torch.zeros_like(decoded)
    e = decoded.square()
    level = [e[..., i] for i in range(16)]
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    assert torch.equal(group_squared_error(decoded, groups), level[0])
    sequential = e[..., 0]
    for i in range(1, 16):
        sequential = sequential + e[..., i]
    assert not torch.equal(level[0], sequential)  # on these values another order gives other sums (the test's power)
