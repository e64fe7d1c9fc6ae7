"""Triton GEMMs (quantkit.kernels) through the interpreter, against the dequantized float32 product.

Tolerance (`assert_gemm_close`), elementwise, with ref = x_deq @ w_deq.T (+ bias) in float32 and
S = |x_deq| @ |w_deq|.T:

    |y - ref| <= r * |ref| + K * 2**-21 * S        r = 2**-8 (bf16 output), 2**-11 (fp16), 0 (fp32)

Justification: kernel and reference compute the same exact products and differ only in rounding.
(1) Output rounding: round to nearest into p significant bits moves a value by at most 2**-p of it
(bf16 p = 8, fp16 p = 11; a float32 output is the accumulator itself), so r * |ref| is that bound.
(2) float32 summation order: each side's sum of K products is within ~K * 2**-24 * S of the exact
value (the kernel adds scaled per-block partial sums, NVFP4's second-stage scales multiply in the
epilogue, the reference rounds each dequantized element once or twice: a few more 2**-24 * S), so the
two sides differ by less than 4 * K * 2**-24 * S = K * 2**-22 * S for K >= 2; the bound allows twice
that, which also covers (1) applied to this difference. Anything structurally wrong (a scale on the
wrong block, a nibble swapped, a masked edge read as nonzero) moves results by whole quantization
steps, orders of magnitude above this.

On a GPU (`benchmarks/native_kernel_tests.py` sets QUANTKIT_NATIVE_KERNELS=1) the FP8 GEMMs' block dots
run on Hopper's FP8 tensor cores, which do not accumulate in float32: their accumulator keeps 13 fraction
bits and truncates (e8m13, "FP22"; DeepSeek-V3 report Sec. 3.3.2, and the reason the kernels promote each
128-wide K block's partial sum to a float32 accumulator). Each of the <= 128 additions of a block's sum
loses less than 2**-13 of the running partial sum, itself <= that block's share of S, so the block is within
128 * 2**-13 * S_block = 2**-6 * S_block of its exact sum; over all blocks that adds 2**-6 * S (`fp8_mma=True`
call sites). Seen on an H100 (2026-11-25): errors of ~2**-13 * S at the worst element with non-default
tiles, over the float32 bound, inside this one. The interpreter runs keep the float32 bound.
"""

import dataclasses
import os

import pytest
import torch

from quantkit.formats import (
    dequantize_fp8_block,
    dequantize_fp8_per_token,
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_fp8_per_token,
    quantize_nvfp4_activation,
    quantize_nvfp4_weight,
)
from quantkit.formats.constants import F8E4M3_DTYPE
from quantkit.formats.schemes import FP8_BLOCK, NVFP4
from quantkit.kernels.fp8_gemm import fp8_block_gemm
from quantkit.kernels.gemm_tiles import GemmTiles
from quantkit.kernels.nvfp4_gemm import DEQUANTIZE_FIRST_MIN_M, nvfp4_dequantize, nvfp4_gemm
from quantkit.kernels.quantize_fp8 import quantize_fp8_per_token as kernel_quantize_fp8
from quantkit.kernels.quantize_nvfp4 import quantize_nvfp4_per_token as kernel_quantize_nvfp4

OUTPUT_REL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}

# (M, N, K): M = 1 (decode), M not a multiple of any tile; K and N not multiples of 128 (partial scale
# blocks), K = 200 -> Kp = 208 for NVFP4 (not a multiple of the K tile); K = 7 -> one padded group.
SHAPES = [(1, 136, 200), (37, 136, 200), (70, 256, 384), (3, 24, 7)]


# Added to the bound where FP8 block dots ran on FP8 tensor cores (module docstring).
FP8_MMA_REL = 128 * 2.0**-13


def assert_gemm_close(y, x_deq, w_deq, bias=None, fp8_mma=False):
    """The bound of the module docstring; fp8_mma: y came from an FP8 GEMM (its block dots on FP8 tensor cores
    when the kernels run natively)."""
    ref = x_deq @ w_deq.T + (0.0 if bias is None else bias.float())
    summed = x_deq.abs() @ w_deq.abs().T
    tol = OUTPUT_REL[y.dtype] * ref.abs() + x_deq.shape[1] * 2.0**-21 * summed
    if fp8_mma and os.environ.get("QUANTKIT_NATIVE_KERNELS") == "1":
        tol = tol + FP8_MMA_REL * summed
    err = (y.float() - ref).abs()
    assert y.shape == ref.shape and bool((err <= tol).all()), f"max err/tol {(err / tol.clamp_min(1e-30)).max():.3g}"


def _data(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]  # rows of very different scale
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 2] *= 40  # weight blocks of different scale
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return x, w, bias


# --- FP8 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_block_gemm(m, n, k):
    x, w, bias = _data(m, n, k, seed=m + n + k)
    xq, xs = quantize_fp8_per_token(x)
    wq, ws = quantize_fp8_block(w)
    x_deq, w_deq = dequantize_fp8_per_token(xq, xs), dequantize_fp8_block(wq, ws)
    assert_gemm_close(fp8_block_gemm(xq, xs, wq, ws), x_deq, w_deq, fp8_mma=True)
    y = fp8_block_gemm(xq, xs, wq, ws, bias=bias)
    assert y.dtype == torch.bfloat16
    assert_gemm_close(y, x_deq, w_deq, bias, fp8_mma=True)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_fp8_block_gemm_out_dtypes_and_tiles(out_dtype):
    x, w, _ = _data(37, 136, 200, seed=5)
    xq, xs = quantize_fp8_per_token(x)
    wq, ws = quantize_fp8_block(w)
    x_deq, w_deq = dequantize_fp8_per_token(xq, xs), dequantize_fp8_block(wq, ws)
    for tiles in (None, GemmTiles(16, 32, 128, group_m=2), GemmTiles(64, 256, 128)):
        y = fp8_block_gemm(xq, xs, wq, ws, out_dtype=out_dtype, tiles=tiles)
        assert y.dtype == out_dtype
        assert_gemm_close(y, x_deq, w_deq, fp8_mma=True)


def test_fp8_block_gemm_zeros_and_saturation():
    m, n, k = 5, 136, 200
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
    x[0] = 0.0  # an all-zero row: scale 1.0, codes 0 -> exactly bias
    x[1] = 1e4  # every element at the row amax: all codes 448
    x[2, ::2] = -3e4  # half the row saturating at -448
    w = torch.full((n, k), 0.02)
    w[:, ::3] = -0.02
    w[128:] = 0.0  # an all-zero partial weight block (rows 128..135)
    xq, xs = quantize_fp8_per_token(x)
    wq, ws = quantize_fp8_block(w)
    assert (xq[1].view(torch.uint8) == 0x7E).all()
    bias = torch.arange(n, dtype=torch.float32)
    y = fp8_block_gemm(xq, xs, wq, ws, bias=bias, out_dtype=torch.float32)
    assert torch.equal(y[0], bias) and torch.equal(y[:, 128:], bias[128:].expand(m, -1))
    assert_gemm_close(y, dequantize_fp8_per_token(xq, xs), dequantize_fp8_block(wq, ws), bias, fp8_mma=True)
    # the largest codes everywhere, scales 1: y = K * 448**2, exact in float32 and in bf16 (2**x * 1.53..)
    ones = torch.ones
    full = torch.full((m, k), 448.0).to(F8E4M3_DTYPE)
    y = fp8_block_gemm(full, ones(m, 1), torch.full((n, k), -448.0).to(F8E4M3_DTYPE), ones(2, 2))
    assert torch.equal(y.float(), torch.full((m, n), -k * 448.0**2).to(torch.bfloat16).float())


def test_fp8_block_gemm_refuses_bad_operands():
    xq, xs = quantize_fp8_per_token(torch.randn(4, 200))
    wq, ws = quantize_fp8_block(torch.randn(136, 200))
    with pytest.raises(ValueError, match="x_q must be 2-D float8_e4m3fn"):
        fp8_block_gemm(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="disagree on K"):
        fp8_block_gemm(xq[:, :128], xs, wq, ws)
    with pytest.raises(ValueError, match=r"w_scale must be float32 of shape \(2, 2\)"):
        fp8_block_gemm(xq, xs, wq, ws[:1])
    with pytest.raises(ValueError, match=r"x_scale must be float32 of shape \(4, 1\)"):
        fp8_block_gemm(xq, xs.flatten(), wq, ws)
    with pytest.raises(ValueError, match="bias"):
        fp8_block_gemm(xq, xs, wq, ws, bias=torch.zeros(135))
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_block_gemm(xq, xs, wq, ws, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="block_k must be the scale block"):
        fp8_block_gemm(xq, xs, wq, ws, tiles=GemmTiles(16, 64, 64))


# --- NVFP4 ----------------------------------------------------------------------------------------------


def _nvfp4_operands(x, w, static=None):
    a = quantize_nvfp4_activation(x, "per_token") if static is None else quantize_nvfp4_activation(x, "static", static)
    wt = quantize_nvfp4_weight(w)
    return a, wt


def _nvfp4_gemm(a, wt, **kwargs):
    w_global = wt.global_scale.reshape(1)
    return nvfp4_gemm(a.packed, a.block_scale, a.global_scale, wt.packed, wt.block_scale, w_global, **kwargs)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_nvfp4_gemm(m, n, k):
    x, w, bias = _data(m, n, k, seed=m * n + k)
    a, wt = _nvfp4_operands(x, w)
    x_deq, w_deq = dequantize_nvfp4(a), dequantize_nvfp4(wt)
    assert_gemm_close(_nvfp4_gemm(a, wt), x_deq, w_deq)
    y = _nvfp4_gemm(a, wt, bias=bias)
    assert y.dtype == torch.bfloat16
    assert_gemm_close(y, x_deq, w_deq, bias)


@pytest.mark.parametrize("static", [0.05, torch.tensor([0.05]), torch.tensor(0.05)])
def test_nvfp4_gemm_static_activation_scale(static):
    x, w, bias = _data(37, 136, 200, seed=9)
    a, wt = _nvfp4_operands(x, w, static=static)
    assert a.global_scale.shape == ()  # one number; the GEMM takes it as a Python float or any 1-element tensor
    y = nvfp4_gemm(a.packed, a.block_scale, static, wt.packed, wt.block_scale, wt.global_scale, bias=bias)
    assert_gemm_close(y, dequantize_nvfp4(a), dequantize_nvfp4(wt), bias)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_nvfp4_gemm_out_dtypes_and_tiles(out_dtype):
    x, w, _ = _data(37, 136, 200, seed=6)
    a, wt = _nvfp4_operands(x, w)
    x_deq, w_deq = dequantize_nvfp4(a), dequantize_nvfp4(wt)
    thin = GemmTiles(16, 32, 32, group_m=2)
    # the fused kernel, then the dequantize-first path (its bf16 GEMM's tiles must fit Hopper's shared memory)
    for tiles, dequantize_first in (
        (None, False),
        (thin, False),
        (GemmTiles(64, 256, 256), False),
        (None, True),
        (thin, True),
    ):
        y = _nvfp4_gemm(a, wt, out_dtype=out_dtype, tiles=tiles, dequantize_first=dequantize_first)
        assert y.dtype == out_dtype
        assert_gemm_close(y, x_deq, w_deq)


def test_nvfp4_dequantize_is_exact_and_paths_switch_at_65_rows():
    """nvfp4_dequantize == formats' dequantize without the second-stage scale, bit for bit (the products of
    E2M1 and E4M3 values are exact in bf16 and float32); M = 64 and 65, either side of the switch between the
    fused kernel and the dequantize-first path, both within the bound."""
    x, w, bias = _data(65, 136, 200, seed=8)
    a, wt = _nvfp4_operands(x, w)
    for dtype in (torch.float32, torch.bfloat16):
        got = nvfp4_dequantize(wt.packed, wt.block_scale, dtype)
        want = dequantize_nvfp4(dataclasses.replace(wt, global_scale=torch.ones_like(wt.global_scale)))
        assert got.dtype == dtype and torch.equal(got[:, : wt.k].float(), want) and (got[:, wt.k :] == 0).all()
    assert DEQUANTIZE_FIRST_MIN_M == 65
    for m in (64, 65):
        y = nvfp4_gemm(
            a.packed[:m],
            a.block_scale[:m],
            a.global_scale[:m],
            wt.packed,
            wt.block_scale,
            wt.global_scale.reshape(1),
            bias=bias,
        )
        assert_gemm_close(y, dequantize_nvfp4(a)[:m], dequantize_nvfp4(wt), bias)


def test_nvfp4_gemm_zeros_and_saturation():
    m, n, k = 5, 136, 200
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[0] = 0.0  # all-zero row
    x[1, 32:64] = 0.0  # all-zero groups (block scale 1.0, codes 0)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    w[7] = 0.0
    # static activation scale far too small: block scales saturate at 448, codes at +-6
    a, wt = _nvfp4_operands(x, w, static=1e-5)
    assert (a.block_scale[1:].view(torch.uint8) == 0x7E).float().mean() > 0.9
    bias = torch.arange(n, dtype=torch.float32)
    y = _nvfp4_gemm(a, wt, bias=bias, out_dtype=torch.float32)
    assert torch.equal(y[0], bias) and torch.equal(y[:, 7], bias[7].expand(m))
    assert_gemm_close(y, dequantize_nvfp4(a), dequantize_nvfp4(wt), bias)
    # the largest codes and block scales everywhere: y = Kp * (6 * 448)**2 * a_global * w_global
    k_pad = 208
    packed = torch.full((m, k_pad // 2), 0x77, dtype=torch.uint8)  # +6, +6
    scales = torch.full((m, k_pad // 16), 448.0).to(F8E4M3_DTYPE)
    w_packed = torch.full((n, k_pad // 2), 0xFF, dtype=torch.uint8)  # -6, -6
    w_scales = torch.full((n, k_pad // 16), 448.0).to(F8E4M3_DTYPE)
    y = nvfp4_gemm(packed, scales, torch.full((m, 1), 0.5), w_packed, w_scales, torch.tensor([0.25]))
    assert torch.equal(y.float(), torch.full((m, n), -k_pad * 2688.0**2 / 8).to(torch.bfloat16).float())


def test_nvfp4_gemm_refuses_bad_operands():
    a, wt = _nvfp4_operands(torch.randn(4, 200), torch.randn(136, 200))
    args = [a.packed, a.block_scale, a.global_scale, wt.packed, wt.block_scale, wt.global_scale]

    def call(i, value):
        return nvfp4_gemm(*(value if j == i else t for j, t in enumerate(args)))

    with pytest.raises(ValueError, match="a_packed must be 2-D uint8"):
        call(0, a.packed.float())
    with pytest.raises(ValueError, match="disagree on Kp/2"):
        call(3, wt.packed[:, :96])
    with pytest.raises(ValueError, match=r"a_block_scale must be float8_e4m3fn of shape \(4, 13\)"):
        call(1, a.block_scale.float())
    with pytest.raises(ValueError, match=r"a_global must be float32 \(M, 1\)"):
        call(2, torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"w_global must be float32 \(N,\) = \(136,\) or one number"):
        call(5, torch.ones(2))
    with pytest.raises(ValueError, match="packed rows must hold Kp/2 bytes"):
        nvfp4_gemm(a.packed[:, :100], a.block_scale, 1.0, wt.packed[:, :100], wt.block_scale, 1.0)
    with pytest.raises(ValueError, match="power of two >= 32"):
        nvfp4_gemm(*args, tiles=GemmTiles(16, 64, 48))


# --- end to end: quantizer kernel -> GEMM kernel == the fake-quant reference -----------------------------


@pytest.mark.parametrize("static", [False, True])
def test_quantized_linear_end_to_end_matches_fake_quant(static):
    m, n, k = 37, 136, 200
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    if not static:  # FP8 has one activation mode: per token
        tensors = FP8_BLOCK.encode(w, "layer")
        y = fp8_block_gemm(*kernel_quantize_fp8(x), tensors["weight"], tensors["weight_scale"], bias=bias)
        assert_gemm_close(y, FP8_BLOCK.fake_quant_activation(x), FP8_BLOCK.decode(tensors, k), bias, fp8_mma=True)
    tensors = NVFP4.encode(w, "layer")
    input_global_scale = torch.tensor([x.float().abs().amax().item() / 2688 * 0.7]) if static else None
    packed, block_scale, global_ = kernel_quantize_nvfp4(x, input_global_scale)
    weight = (tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"])
    y = nvfp4_gemm(packed, block_scale, global_, *weight, bias=bias)
    x_fq = NVFP4.fake_quant_activation(x, input_global_scale)
    assert_gemm_close(y, x_fq, NVFP4.decode(tensors, k), bias)


# --- fused vLLM layers: per-row weight scales -----------------------------------------------------------


def test_gemms_with_per_row_weight_scales_of_fused_shards():
    """vLLM fuses q/k/v (gate/up) into one layer whose shards keep their own scales: FP8 block scales repeated
    per row (shards not 128-row aligned) and one NVFP4 global scale per shard, given per row."""
    x, _, _ = _data(5, 8, 200, seed=3)
    shards = [
        torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)) * s for rows, s in ((72, 0.05), (40, 3.0))
    ]
    n = sum(w.shape[0] for w in shards)

    fp8 = [quantize_fp8_block(w) for w in shards]
    w_q = torch.cat([q for q, _ in fp8])
    row_scales = torch.cat([s.repeat_interleave(128, 0)[: q.shape[0]] for q, s in fp8])
    w_deq = torch.cat([dequantize_fp8_block(q, s) for q, s in fp8])
    xq, xs = quantize_fp8_per_token(x)
    y = fp8_block_gemm(xq, xs, w_q, row_scales, out_dtype=torch.float32)
    assert_gemm_close(y, dequantize_fp8_per_token(xq, xs), w_deq, fp8_mma=True)

    nv = [quantize_nvfp4_weight(w) for w in shards]
    w_global = torch.cat([t.global_scale.reshape(1).expand(t.packed.shape[0]) for t in nv])
    assert len(set(w_global.tolist())) == 2 and w_global.shape == (n,)
    a = quantize_nvfp4_activation(x)
    y = nvfp4_gemm(
        a.packed,
        a.block_scale,
        a.global_scale,
        torch.cat([t.packed for t in nv]),
        torch.cat([t.block_scale for t in nv]),
        w_global,
        out_dtype=torch.float32,
    )
    assert_gemm_close(y, dequantize_nvfp4(a), torch.cat([dequantize_nvfp4(t) for t in nv]))
