"""Triton activation quantizers (quantkit.kernels) through the interpreter: bit-exact with quantkit.formats.

Every comparison is torch.equal on uint8 views (codes, packed bytes, E4M3 block scales) and on the float32
scales: rounding ties, -0.0, saturation, all-zero rows and groups, scale underflow and padding included.
The E4M3/E2M1 device functions are checked on their own first, on every tie and its float32 neighbours.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantkit.formats import (
    E2M1_VALUES,
    F8E4M3_MAX,
    quantize_fp8_per_token,
    quantize_nvfp4_activation,
)
from quantkit.formats.constants import E2M1_BOUNDS, F8E4M3_DTYPE
from quantkit.formats.fp8 import to_e4m3
from quantkit.formats.hadamard import block_hadamard
from quantkit.formats.nvfp4 import (
    e2m1_to_float,
    nvfp4_block_scales,
    nvfp4_groups,
    quantize_nvfp4_activation_four_over_six,
    round_to_e2m1,
)
from quantkit.kernels import quantize_fp8 as kfp8
from quantkit.kernels import quantize_nvfp4 as knvfp4
from quantkit.kernels.fp_codes import e2m1_code, e2m1_value, e4m3_code, e4m3_positive_value
from quantkit.kernels.hadamard import hadamard_scale, hadamard_tile

# --- the device functions --------------------------------------------------------------------------------


@triton.jit
def _codes_kernel(y_ptr, e4m3_ptr, e2m1_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs, mask=offs < n)
    tl.store(e4m3_ptr + offs, e4m3_code(y), mask=offs < n)
    tl.store(e2m1_ptr + offs, e2m1_code(y), mask=offs < n)


@triton.jit
def _values_kernel(code_ptr, e4m3_ptr, e2m1_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    code = tl.load(code_ptr + offs)
    tl.store(e4m3_ptr + offs, e4m3_positive_value(code))
    tl.store(e2m1_ptr + offs, e2m1_value(code))


def _neighbours(v: torch.Tensor) -> torch.Tensor:
    """float32 values and their two float32 neighbours (nextafter), both signs."""
    v = v.float()
    up, down = torch.nextafter(v, torch.full_like(v, np.inf)), torch.nextafter(v, torch.full_like(v, -np.inf))
    both = torch.cat([v, up, down])
    return torch.cat([both, -both])


def _e4m3_probe_values() -> torch.Tensor:
    grid = torch.arange(0, 127, dtype=torch.uint8).view(F8E4M3_DTYPE).float()  # every finite E4M3 value >= 0
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact in float32: ties
    beyond = torch.tensor([464.0, 480.0, 500.0, 1e4, 3e38, 2.0**-10, 2.0**-11, 1e-30, 1e-44])
    random_bits = torch.randint(0x2D000000, 0x44000000, (1 << 16,), generator=torch.Generator().manual_seed(0))
    random = random_bits.int().view(torch.float32)  # 7e-12 .. 512, all mantissas
    return torch.cat([_neighbours(torch.cat([grid, midpoints, beyond])), random, -random])


def test_e4m3_and_e2m1_codes_match_torch_on_every_tie():
    y = torch.cat([_e4m3_probe_values(), _neighbours(torch.tensor(E2M1_BOUNDS + (0.0, 6.0, 6.5, 100.0)))])
    e4m3, e2m1 = torch.empty(y.shape, dtype=torch.int32), torch.empty(y.shape, dtype=torch.int32)
    _codes_kernel[(triton.cdiv(y.numel(), 1 << 14),)](y, e4m3, e2m1, y.numel(), BLOCK=1 << 14)
    assert torch.equal(e4m3.to(torch.uint8), to_e4m3(y).view(torch.uint8))
    assert torch.equal(e2m1.to(torch.uint8), round_to_e2m1(y))
    # the cases the interpreter's own float8 cast gets wrong, spelled out
    spelled_out = ((1.9375, 0x40), (1.0625, 0x38), (3 * 2.0**-10, 0x02), (-0.0, 0x80), (-1e-30, 0x80), (500.0, 0x7E))
    for value, code in spelled_out:
        assert int(e4m3[(y == value) & (torch.signbit(y) == (code >= 0x80))][0]) == code, value


def test_e4m3_and_e2m1_values_match_torch():
    codes = torch.arange(128, dtype=torch.int32)
    e4m3, e2m1 = torch.empty(128), torch.empty(128)
    _values_kernel[(1,)](codes, e4m3, e2m1, BLOCK=128)
    assert torch.equal(e4m3[:127], codes[:127].to(torch.uint8).view(F8E4M3_DTYPE).float())
    # low 4 bits are the code; -0.0 (code 8) must come back with its sign bit
    want = e2m1_to_float(codes & 0xF)
    assert torch.equal(e2m1.view(torch.int32), want.view(torch.int32))
    assert e2m1[:16].tolist() == list(E2M1_VALUES)


# --- FP8 per token --------------------------------------------------------------------------------------


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 1000, generator=g) * torch.logspace(-6, 6, 37)[:, None]
    x[0] = 0.0  # all-zero row: scale 1.0
    x[1, :5] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, -448.0])  # -0.0 stays 0x80; tiny negatives -> 0x80
    x[2] = 1e-44  # amax / 448 underflows float32: scale 1.0, codes 0
    x[3] = torch.arange(1000) * 2.0**-6 - 7.0  # amax 8.6 ...: many exact ties after scaling
    x[4, :] = 0.0
    x[4, :127] = torch.arange(127, dtype=torch.uint8).view(F8E4M3_DTYPE).float()  # amax 448 -> scale 1.0:
    x[4, 127:253] = (x[4, 1:127] + x[4, :126]) / 2  # every E4M3 value and every tie between two of them
    x[5] = 3e38  # huge, near float32 max
    return [x, x[:1, :16].clone(), x[5:9, :200].clone(), x[6:7, :7].clone()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_per_token_bit_exact(dtype):
    for x in _fp8_cases():
        x = x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)
        q, scale = kfp8.quantize_fp8_per_token(x)
        want_q, want_scale = quantize_fp8_per_token(x)
        assert q.dtype == F8E4M3_DTYPE and scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
        assert torch.equal(_u8(q), _u8(want_q)), (dtype, tuple(x.shape))
        assert torch.equal(scale, want_scale), (dtype, tuple(x.shape))


def test_fp8_per_token_zero_rows_and_tiles():
    x = torch.zeros(3, 300)
    x[1, 299] = -2.0
    q, scale = kfp8.quantize_fp8_per_token(x, block_m=2, block_k=128)  # several programs and K steps
    assert torch.equal(scale.flatten(), torch.tensor([1.0, 2.0 / F8E4M3_MAX, 1.0]))  # float32 division
    assert torch.equal(_u8(q), _u8(quantize_fp8_per_token(x)[0]))
    assert _u8(q)[1, 299] == 0xFE and int(_u8(q)[0].max()) == 0  # -448, and zeros


# --- NVFP4 ----------------------------------------------------------------------------------------------


def _nvfp4_equal(x: torch.Tensor, global_scale=None, hadamard: int = 0, **tiles) -> None:
    packed, block_scale, global_ = knvfp4.quantize_nvfp4_per_token(x, global_scale, hadamard=hadamard, **tiles)
    xt = block_hadamard(x, hadamard) if hadamard else x
    if global_scale is None:
        want = quantize_nvfp4_activation(xt, "per_token")
    else:
        want = quantize_nvfp4_activation(xt, "static", global_scale)
    k_pad = -(-x.shape[1] // 16) * 16
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], k_pad // 2)
    assert block_scale.dtype == F8E4M3_DTYPE and block_scale.shape == (x.shape[0], k_pad // 16)
    assert global_.dtype == torch.float32 and global_.shape == (x.shape[0], 1)
    assert torch.equal(packed, want.packed), (tuple(x.shape), global_scale)
    assert torch.equal(_u8(block_scale), _u8(want.block_scale)), (tuple(x.shape), global_scale)
    assert torch.equal(global_, want.global_scale.expand(x.shape[0], 1)), (tuple(x.shape), global_scale)


def _nvfp4_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(21, 1000, generator=g) * torch.logspace(-5, 5, 21)[:, None]
    x[0] = 0.0  # all-zero row: global 1.0, block scales 1.0, codes 0
    x[1, 16:48] = 0.0  # two all-zero groups: block scale 1.0
    x[1, 48:51] = torch.tensor([-0.0, 0.0, -1e-9])  # +0 codes for +-0.0; sign kept for a tiny negative (0x8)
    x[2, :16] = torch.tensor(E2M1_BOUNDS + (6.0,) + tuple(-b for b in E2M1_BOUNDS) + (-6.0,))  # group amax 6:
    x[2, 16:32] = torch.tensor(E2M1_VALUES) * 0.75  # ties after scaling (block scale 1 if global = 6/2688)
    x[3, :16] = 1e-9  # a nonzero group far below the row amax: block scale clamps up to 2**-9
    x[3, 16] = 1e3
    x[4, :] = torch.arange(1000) / 64 - 7.8  # many exact ties
    return [x, x[:1, :16].clone(), x[2:5, :200].clone(), x[5:7, :7].clone(), x[6:9, :33].clone()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_per_token_bit_exact(dtype):
    for x in _nvfp4_cases():
        _nvfp4_equal(x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype))


@pytest.mark.parametrize(
    "global_scale",
    [
        6.0 / 2688,  # block scale 1 for a group of amax 6: the ties of row 2 stay ties
        0.37,  # a typical calibrated scale
        1e-6,  # far too small for most rows: block scales saturate at 448, codes at +-6
        1e3,  # far too large: block scales clamp up to 2**-9, most codes 0 or -0
        torch.tensor([0.01]),  # the checkpoint's (1,) input_global_scale
    ],
)
def test_nvfp4_static_bit_exact(global_scale):
    for x in _nvfp4_cases():
        _nvfp4_equal(x, global_scale)


def test_nvfp4_tiles_do_not_change_the_result():
    x = _nvfp4_cases()[0]
    for tiles in ({"block_m": 4, "block_k": 32}, {"block_m": 32, "block_k": 1024}):
        _nvfp4_equal(x[:9, :200], **tiles)  # Kp = 208, a multiple of neither block_k
        _nvfp4_equal(x[:9, :200], 0.05, **tiles)


def _four_over_six_equal(x: torch.Tensor, hadamard: int = 0, **tiles) -> None:
    """The fused Four Over Six quantizer's operands equal the reference's bit for bit (packed codes, E4M3 block
    scales, global scales)."""
    packed, block_scale, global_ = knvfp4.quantize_nvfp4_four_over_six(x, hadamard=hadamard, **tiles)
    want = quantize_nvfp4_activation_four_over_six(block_hadamard(x, hadamard) if hadamard else x)
    assert torch.equal(packed, want.packed), tuple(x.shape)
    assert torch.equal(_u8(block_scale), _u8(want.block_scale)), tuple(x.shape)
    assert torch.equal(global_, want.global_scale), tuple(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_four_over_six_bit_exact(dtype):
    """Four Over Six (per token, each group's max to 6 or to 4, the smaller squared error in
    `group_squared_error`'s order): every byte and scale as the reference's, on the NVFP4 cases (ties, zero rows
    and groups, clamped scales, padding); in float32 also under another tiling and an online Hadamard. Both
    candidates occur (block scales equal to and different from max-to-6 on the same global scale)."""
    chose_four = chose_six = False
    for x in _nvfp4_cases():
        x = x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)
        _four_over_six_equal(x)
        want = quantize_nvfp4_activation_four_over_six(x)
        six = nvfp4_block_scales(nvfp4_groups(x).abs().amax(-1), want.global_scale).float()
        chose_four |= bool((want.block_scale.float() != six).any())
        chose_six |= bool((want.block_scale.float() == six).any())
    assert chose_four and chose_six
    if dtype == torch.float32:
        x = _nvfp4_cases()[0]
        _four_over_six_equal(x[:9, :200], block_m=4, block_k=32)  # Kp = 208: a multiple of neither block_k
        _four_over_six_equal(x[:7, :256], hadamard=16, block_m=8, block_k=64)


def test_nvfp4_four_over_six_is_per_token_only():
    with pytest.raises(ValueError, match="per token"):
        knvfp4.quantize_nvfp4_four_over_six(torch.ones(2, 16), 0.5)


_TINY, _HUGE = float(np.float32(1e-30)), float(np.float32(1e30))
_elements = st.one_of(
    st.just(0.0),
    st.integers(-96, 96).map(lambda i: i / 16),  # multiples of 1/16: rounding ties
    st.floats(_TINY, _HUGE, width=32),
    st.floats(-_HUGE, -_TINY, width=32),
)


@settings(max_examples=25, deadline=None)
@given(
    x=st.tuples(st.integers(1, 6), st.integers(1, 70)).flatmap(
        lambda shape: hnp.arrays(np.float32, shape, elements=_elements)
    ),
    static=st.one_of(st.none(), st.floats(2.0**-20, 1024.0, width=32)),
)
def test_quantizers_bit_exact_property(x, static):
    x = torch.from_numpy(x)
    q, scale = kfp8.quantize_fp8_per_token(x)
    want_q, want_scale = quantize_fp8_per_token(x)
    assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(scale, want_scale)
    _nvfp4_equal(x, static)
    _four_over_six_equal(x)


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [kfp8.quantize_fp8_per_token, knvfp4.quantize_nvfp4_per_token])
def test_refuses_nan_inf_and_bad_inputs(fn):
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(2, 32)
        x[1, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            fn(x)
    for dtype in (torch.float64, torch.int32, F8E4M3_DTYPE):
        x = torch.ones(4, 8).to(dtype)
        with pytest.raises(TypeError, match="float32/bfloat16/float16"):
            fn(x)
    for x in (torch.ones(8), torch.ones(2, 3, 8), torch.ones(3, 0)):
        with pytest.raises(ValueError, match="shape"):
            fn(x)
    for tiles in ({"block_m": 3}, {"block_k": 24}, {"block_k": 0}):
        with pytest.raises(ValueError, match="must be a power of two"):
            fn(torch.ones(2, 32), **tiles)


def test_nvfp4_refuses_bad_static_scales_and_short_tiles():
    x = torch.ones(2, 32)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and > 0"):
            knvfp4.quantize_nvfp4_per_token(x, bad)
    with pytest.raises(ValueError, match="one number"):
        knvfp4.quantize_nvfp4_per_token(x, torch.ones(2, 1))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        knvfp4.quantize_nvfp4_per_token(x, block_k=8)  # a tile holds whole groups


# --- the online Hadamard inside the quantizers (a rotated checkpoint's down_proj input) ------------------


@triton.jit
def _hadamard_kernel(
    x_ptr, y_ptr, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HADAMARD: tl.constexpr, SCALE: tl.constexpr
):
    rows = tl.arange(0, BLOCK_M)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        y = hadamard_tile(tl.load(x_ptr + rows + cols).to(tl.float32), HADAMARD, SCALE)
        tl.store(y_ptr + rows + cols, y)


@pytest.mark.parametrize("block", [1, 2, 16, 128, 512])
def test_hadamard_tile_is_the_reference_butterfly_bit_for_bit(block):
    """The tile transform takes each element through the same float32 additions in the same order as
    `block_hadamard` and one multiply by the same float32 1/sqrt(block): equal bits, also with several blocks
    to a tile (BLOCK_K = 4 blocks) and for inputs whose sums round (float32 values of 24 significant bits)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 8 * block, generator=g) * torch.logspace(-3, 3, 8 * block)
    y = torch.empty_like(x)
    _hadamard_kernel[(1,)](x, y, x.shape[1], BLOCK_M=4, BLOCK_K=4 * block, HADAMARD=block, SCALE=hadamard_scale(block))
    assert torch.equal(y, block_hadamard(x, block))


def _hadamard_quantizer_cases() -> list[tuple[torch.Tensor, int]]:
    """(x, block): heavy-tailed rows (channel scales over six decades, one massive channel), zeros and -0.0,
    an all-zero row; M not a multiple of block_m; blocks below a NVFP4 group (2, 8), a tile's width (32..128)
    and above it (1024 > block_k)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(19, 2048, generator=g) * torch.logspace(-3, 3, 2048)[torch.randperm(2048, generator=g)]
    x[:, 5] = 3e3  # a massive activation channel (SmolLM2's down_proj inputs reach 3e3)
    x[0] = 0.0
    x[1, :64] = -0.0
    return [(x[:, :96], 2), (x[:, :96], 8), (x[:5, :384], 32), (x, 128), (x[:7], 1024)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizers_with_online_hadamard_bit_exact(dtype):
    """quantize(x, hadamard=b) == quantize_reference(block_hadamard(x, b)), every byte and scale: the kernel's
    transform has the reference's bits (test above), after which both quantize the same float32 values."""
    for x, block in _hadamard_quantizer_cases():
        x = x.to(dtype)
        q, scale = kfp8.quantize_fp8_per_token(x, hadamard=block, block_m=8, block_k=64)
        want_q, want_scale = quantize_fp8_per_token(block_hadamard(x, block))
        assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(scale, want_scale), (dtype, block)
        for global_scale in (None, 0.05):
            _nvfp4_equal(x, global_scale, hadamard=block, block_m=8, block_k=64)


@pytest.mark.parametrize("block", [0.5, 3, 48, 8192])
def test_quantizers_refuse_bad_hadamard_blocks(block):
    x = torch.randn(2, 96)
    for fn in (kfp8.quantize_fp8_per_token, knvfp4.quantize_nvfp4_per_token):
        with pytest.raises(ValueError, match=r"[hH]adamard"):
            fn(x, hadamard=block)
