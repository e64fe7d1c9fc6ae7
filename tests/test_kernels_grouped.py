"""Grouped (MoE) GEMMs (quantkit.kernels.grouped_gemm, expert_sort, schemes.grouped_quantized_linear) through
the Triton interpreter, against the per-expert fake-quant reference.

Reference, per expert e over its sorted rows: the scheme's activation quantize-dequantize (per token, or NVFP4
static with e's scale), then float32 matmul with e's decoded weight. Quantizers are held bit-exact (the
dispatch's activation operands must equal `Scheme.quantize_activation`'s on every expert's rows); the GEMMs to
`test_kernels_gemm.assert_gemm_close`, per expert segment:

    |y - ref| <= r * |ref| + K * 2**-21 * |x_deq| @ |w_deq|^T     r = 2**-8 (bf16 out), 2**-11 (fp16), 0 (fp32)

the bound derived there: both sides form the same exact products (E4M3 x E4M3 products and E2M1 x E4M3 group
values are exact in float32 / bf16) and differ only by float32 summation order (each within ~K 2**-24 of the
sum of |products|, so < K 2**-22 apart; allowed twice that) plus one rounding of the output (r). A grouped
kernel reading a wrong expert's weight, a wrong row of a gather, or a row across an expert's edge is off by
whole quantization steps or by the weights' difference, orders of magnitude above it. Run natively on a GPU,
the FP8 GEMMs get the FP8 tensor cores' term of that bound too (2**-6 * |x_deq| @ |w_deq|^T, derived there).

Expert row counts cover an expert with no rows (first, middle and last), one row, several BLOCK_M tiles with a
partial last one, and uneven counts; N = 136 and K = 200 are off the 128 grid (partial scale blocks, K padded
to 208 for NVFP4). About 40 s on 2 shared CPU cores: ~20 s of interpreter runs, ~17 s compiling for sm90.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernels_gemm import assert_gemm_close

from quantkit import formats
from quantkit.formats.constants import FP8_WEIGHT_BLOCK
from quantkit.formats.fp8 import expand_block_scales
from quantkit.formats.hadamard import block_hadamard
from quantkit.formats.schemes import FP8_BLOCK, NVFP4
from quantkit.kernels.expert_sort import combine_expert_rows, sort_by_expert
from quantkit.kernels.gemm_tiles import GemmTiles
from quantkit.kernels.grouped_gemm import expert_tiles, fp8_block_grouped_gemm, nvfp4_grouped_gemm
from quantkit.kernels.interpreter_quirks import interpreting
from quantkit.kernels.quantize_nvfp4 import quantize_nvfp4_per_token
from quantkit.kernels.schemes import grouped_quantized_linear

COUNTS = (0, 1, 37, 5, 0, 18, 0)  # rows per expert: none, one, 3 tiles of 16 (last partial), uneven; E = 7
N, K = 136, 200


def _offsets(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def _weights(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-3, 0, e)[:, None, None]  # experts of different scale
    w[:, : n // 3] *= 10  # weight blocks of different scale within an expert
    return w


def _rows(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]  # rows of very different scale


def _segments(offsets):
    return [(e, int(offsets[e]), int(offsets[e + 1])) for e in range(len(offsets) - 1)]


# --- sorting and tiles ------------------------------------------------------------------------------------


def test_sort_by_expert_groups_pairs_stably_and_drops_other_ranks_ids():
    topk = torch.tensor([[2, 0], [5, 2], [-1, 2], [0, 7], [2, 3]])  # -1 and 7: experts of no rank here (E = 6)
    sort = sort_by_expert(topk, 6)
    assert sort.expert_offsets.tolist() == [0, 2, 2, 6, 7, 7, 8]  # counts 2, 0, 4, 1, 0, 1; 2 pairs of no expert
    flat = topk.flatten()
    assert torch.equal(sort.token_index.long(), sort.flat_index // 2)
    for e, lo, hi in _segments(sort.expert_offsets):
        rows = sort.flat_index[lo:hi]
        assert (flat[rows] == e).all() and torch.equal(rows, rows.sort().values)  # stable: tokens in order
    assert sorted(flat[sort.flat_index[8:]].tolist()) == [-1, 7]
    with pytest.raises(ValueError, match="2-D integer"):
        sort_by_expert(topk.float(), 6)


def test_combine_expert_rows_weights_and_sums_each_tokens_slots():
    topk = torch.tensor([[1, 0], [1, -1], [0, 1]])
    weights = torch.tensor([[0.5, 0.25], [2.0, 8.0], [1.0, 4.0]])
    sort = sort_by_expert(topk, 2)
    y = torch.arange(6.0)[:, None].repeat(1, 3) + 1  # sorted row s holds s + 1
    y[5] = float("nan")  # the pair of no expert: never written by a GEMM, must add nothing
    out = combine_expert_rows(y, sort, weights)
    per_pair = {int(f): float(y[s, 0]) for s, f in enumerate(sort.flat_index.tolist())}
    expected = [
        [sum(weights.flatten()[f] * per_pair[f] for f in (2 * t, 2 * t + 1) if topk.flatten()[f] >= 0)] * 3
        for t in range(3)
    ]
    assert torch.equal(out, torch.tensor(expected))  # small integers times powers of two: exact


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_expert_tiles_cover_each_experts_rows_once(block_m):
    counts = (0, 1, 37, 5, 0, 18, 64, 0)
    offsets = _offsets(counts)
    rows = sum(counts) + 20  # 20 rows of no expert: group E
    ends, tile_group, tile_row = expert_tiles(offsets, rows, block_m)
    assert ends.tolist() == [*offsets.tolist(), rows]
    seen = torch.zeros(rows, dtype=torch.int64)
    for g, r in zip(tile_group.tolist(), tile_row.tolist()):
        if g == len(counts) + 1:
            continue  # a spare tile
        hi = min(r + block_m, int(ends[g + 1]))
        assert ends[g] <= r < hi
        seen[r:hi] += 1
    assert (seen == 1).all()
    assert (tile_group <= len(counts)).sum() == sum(-(-c // block_m) for c in (*counts, 20))


# --- the grouped GEMMs on their own ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "gather,per_row_scales,out_dtype",
    [(False, False, torch.bfloat16), (True, False, torch.float32), (False, True, torch.float16)],
)
def test_fp8_block_grouped_gemm(gather, per_row_scales, out_dtype):
    offsets = _offsets(COUNTS)
    s, e = sum(COUNTS), len(COUNTS)
    w = [formats.quantize_fp8_block(we) for we in _weights(e, N, K, seed=1)]
    w_q = torch.stack([q for q, _ in w])
    w_scale = torch.stack([sc for _, sc in w])
    if per_row_scales:
        w_scale = expand_block_scales(w_scale, (1, FP8_WEIGHT_BLOCK, 1))[:, :N]
    tokens, spare = 11, 5  # spare: sorted rows of no expert (another rank's), after offsets[E]
    x = _rows(tokens if gather else s + spare, K, seed=2)
    row_index = torch.randint(0, tokens, (s + spare,), generator=torch.Generator().manual_seed(3)) if gather else None
    x_q, x_scale = formats.quantize_fp8_per_token(x)
    y = fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale, offsets, row_index=row_index, out_dtype=out_dtype)
    assert y.shape == (s + spare, N) and y.dtype == out_dtype
    assert (y[s:] == 0).all()
    x_deq = formats.dequantize_fp8_per_token(x_q, x_scale)
    x_deq = x_deq if row_index is None else x_deq[row_index]
    for i, lo, hi in _segments(offsets):
        assert_gemm_close(y[lo:hi], x_deq[lo:hi], formats.dequantize_fp8_block(*w[i]), fp8_mma=True)


def _operands(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An NVFP4 tensor's GEMM operands: (packed, block_scale, global_scale)."""
    return t.packed, t.block_scale, t.global_scale


def _stacked(experts) -> tuple[torch.Tensor, ...]:
    """Per-expert NVFP4 weights stacked into the grouped GEMM's (E, ...) operands."""
    return tuple(torch.stack(parts) for parts in zip(*map(_operands, experts)))


@pytest.mark.parametrize("static,w_global_per_row,gather", [(False, False, True), (True, True, False)])
def test_nvfp4_grouped_gemm(static, w_global_per_row, gather):
    offsets = _offsets(COUNTS)
    s, e = sum(COUNTS), len(COUNTS)
    w = [formats.quantize_nvfp4_weight(we) for we in _weights(e, N, K, seed=4)]
    w_packed, w_block_scale, w_global = _stacked(w)  # w_global (E,)
    if w_global_per_row:  # two shards of rows with their own scales, as fused gate/up hold them
        w_global = w_global[:, None] * torch.where(torch.arange(N) < 72, 1.0, 0.5)
    tokens, spare = 9, 3  # spare: sorted rows of no expert, after offsets[E]
    x = _rows(tokens if gather else s + spare, K, seed=5)
    a = (
        formats.quantize_nvfp4_activation(x, "static", torch.tensor(0.01))
        if static
        else formats.quantize_nvfp4_activation(x)
    )
    row_index = torch.randint(0, tokens, (s + spare,), generator=torch.Generator().manual_seed(6)) if gather else None
    y = nvfp4_grouped_gemm(*_operands(a), w_packed, w_block_scale, w_global, offsets, row_index=row_index)
    assert y.shape == (s + spare, N) and (y[s:] == 0).all()
    x_deq = formats.dequantize_nvfp4(a)
    x_deq = x_deq if row_index is None else x_deq[row_index]
    for i, lo, hi in _segments(offsets):
        w_deq = formats.dequantize_nvfp4(w[i])
        if w_global_per_row:
            w_deq = w_deq * torch.where(torch.arange(N) < 72, 1.0, 0.5)[:, None]  # exact: a power of two
        assert_gemm_close(y[lo:hi], x_deq[lo:hi], w_deq)


def test_grouped_gemms_with_other_tiles():
    """Tiles change speed only: a thin tile with a short K step, and tiles wider than every expert's rows."""
    offsets = _offsets(COUNTS)
    s, e = sum(COUNTS), len(COUNTS)
    x = _rows(s, K, seed=7)
    w = _weights(e, N, K, seed=8)
    fp8 = [formats.quantize_fp8_block(we) for we in w]
    x_q, x_scale = formats.quantize_fp8_per_token(x)
    y = fp8_block_grouped_gemm(
        x_q,
        x_scale,
        torch.stack([q for q, _ in fp8]),
        torch.stack([sc for _, sc in fp8]),
        offsets,
        out_dtype=torch.float32,
        tiles=GemmTiles(64, 256, 128),
    )
    nv = [formats.quantize_nvfp4_weight(we) for we in w]
    a = formats.quantize_nvfp4_activation(x)
    z = nvfp4_grouped_gemm(
        *_operands(a), *_stacked(nv), offsets, out_dtype=torch.float32, tiles=GemmTiles(32, 64, 32, 2)
    )
    x_fp8, x_nv = formats.dequantize_fp8_per_token(x_q, x_scale), formats.dequantize_nvfp4(a)
    for i, lo, hi in _segments(offsets):
        assert_gemm_close(y[lo:hi], x_fp8[lo:hi], formats.dequantize_fp8_block(*fp8[i]), fp8_mma=True)
        assert_gemm_close(z[lo:hi], x_nv[lo:hi], formats.dequantize_nvfp4(nv[i]))


def test_grouped_gemms_refuse_bad_operands():
    offsets = _offsets((2, 1))
    x_q, x_scale = formats.quantize_fp8_per_token(torch.randn(3, 200))
    w = [formats.quantize_fp8_block(torch.randn(136, 200)) for _ in range(2)]
    w_q, w_scale = torch.stack([q for q, _ in w]), torch.stack([s for _, s in w])
    with pytest.raises(ValueError, match=r"w_q must be 3-D \(E, N, K\)"):
        fp8_block_grouped_gemm(x_q, x_scale, w_q[0], w_scale, offsets)
    with pytest.raises(ValueError, match=r"expert_offsets must be int32/int64 of shape \(E \+ 1,\) = \(3,\)"):
        fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale, offsets[:2])
    with pytest.raises(ValueError, match=r"w_scale must be float32 of shape \(2, 2, 2\)"):
        fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale[:, :1], offsets)
    with pytest.raises(ValueError, match="row_index must be 1-D"):
        fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale, offsets, row_index=torch.zeros(3, 1, dtype=torch.int32))
    a = formats.quantize_nvfp4_activation(torch.randn(3, 200))
    nv = [formats.quantize_nvfp4_weight(torch.randn(136, 200)) for _ in range(2)]
    w_args = (torch.stack([t.packed for t in nv]), torch.stack([t.block_scale for t in nv]))
    with pytest.raises(ValueError, match=r"w_global must be float32 \(E,\), \(E, 1\) or \(E, N\)"):
        nvfp4_grouped_gemm(a.packed, a.block_scale, a.global_scale, *w_args, torch.ones(3), offsets)
    with pytest.raises(ValueError, match="disagree on Kp/2"):
        nvfp4_grouped_gemm(a.packed[:, :96], a.block_scale[:, :12], a.global_scale, *w_args, torch.ones(2), offsets)


# --- the dispatch: quantizer kernels + grouped GEMM == per-expert fake quant ------------------------------


def _routing(tokens, top_k, num_experts, seed):
    """Random top-k routing with expert 1 unused, expert 4 hit by exactly one pair and one pair routed to
    expert 6, of another (expert-parallel) rank."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([0, 2, 3, 5])
    topk = choices[torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)])]
    topk[tokens // 2, 0] = 4
    topk[1, 1] = 6
    assert topk.shape == (tokens, top_k) and num_experts == 6
    return topk


def _stack(scheme, weights):
    tensors = [scheme.encode(w, f"expert{i}") for i, w in enumerate(weights)]
    return [torch.stack([t[name] for t in tensors]) for name in scheme.tensors], tensors


@pytest.mark.parametrize("scheme,static", [(FP8_BLOCK, False), (NVFP4, False), (NVFP4, True)])
def test_grouped_quantized_linear_matches_per_expert_fake_quant(scheme, static):
    """Both expert inputs: the gate_up projection (layer input, one row per token, gathered) and the down
    projection (sorted rows); bf16 activations and output, as vLLM runs them."""
    tokens, top_k, e = 13, 2, 6
    sort = sort_by_expert(_routing(tokens, top_k, e, seed=10), e)
    offsets = sort.expert_offsets
    assert [int(offsets[i + 1] - offsets[i]) for i in (1, 4)] == [0, 1]
    weights, tensors = _stack(scheme, _weights(e, N, K, seed=11))
    scales = torch.logspace(-3, -1, e) if static else None  # each expert's static decode scale
    stages = {
        "gate_up": (_rows(tokens, K, seed=12).to(torch.bfloat16), sort.token_index),
        "down": (_rows(tokens * top_k, K, seed=13).to(torch.bfloat16), None),
    }
    for x, token_index in stages.values():
        y = grouped_quantized_linear(scheme, x, offsets, weights, token_index=token_index, input_global_scale=scales)
        assert y.shape == (tokens * top_k, N) and y.dtype == torch.bfloat16
        assert int(offsets[-1]) == tokens * top_k - 1 and (y[-1] == 0).all()  # the other rank's pair
        rows = x if token_index is None else x[token_index]
        for i, lo, hi in _segments(offsets):
            if hi == lo:
                continue
            scale = None if scales is None else scales[i]
            x_fq = scheme.fake_quant_activation(rows[lo:hi], scale)
            assert_gemm_close(y[lo:hi], x_fq, scheme.decode(tensors[i], K), fp8_mma=scheme is FP8_BLOCK)


@pytest.mark.parametrize("scheme", [FP8_BLOCK, NVFP4])
def test_grouped_quantized_linear_fused_gate_up_and_tp_slice(scheme):
    """Served layouts: gate and up (I = 72 rows each, not a multiple of 128) encoded apart and fused per expert
    with per-row scales (FP8 block rows repeated, NVFP4 one global per row); then a K slice under TP, per-token
    scales from the whole row's amax (row_amax)."""
    tokens, e, inter = 7, 3, 72  # top-2 routing below
    sort = sort_by_expert(torch.tensor([[0, 2]] * 3 + [[2, 1]] * 4), e)
    gate, up = _weights(e, inter, K, seed=20), _weights(e, inter, K, seed=21) * 3
    encoded = [(scheme.encode(gate[i], "g"), scheme.encode(up[i], "u")) for i in range(e)]
    if scheme is FP8_BLOCK:
        weights = [
            torch.stack([torch.cat([g["weight"], u["weight"]]) for g, u in encoded]),
            torch.stack(
                [
                    torch.cat([expand_block_scales(t["weight_scale"], (FP8_WEIGHT_BLOCK, 1))[:inter] for t in (g, u)])
                    for g, u in encoded
                ]
            ),
        ]
    else:
        weights = [
            torch.stack([torch.cat([g[name], u[name]]) for g, u in encoded])
            for name in ("weight_packed", "weight_scale")
        ]
        weights.append(
            torch.stack([torch.cat([t["weight_global_scale"].expand(inter) for t in (g, u)]) for g, u in encoded])
        )
    w_deq = [torch.cat([scheme.decode(g, K), scheme.decode(u, K)]) for g, u in encoded]
    x = _rows(tokens, 2 * K, seed=22).to(torch.bfloat16)
    x_slice, row_amax = x[:, K:], x.float().abs().amax(dim=1, keepdim=True)  # this rank's half of K
    y = grouped_quantized_linear(
        scheme,
        x_slice,
        sort.expert_offsets,
        weights,
        token_index=sort.token_index,
        row_amax=row_amax,
        out_dtype=torch.float32,
    )
    rows, amax = x_slice[sort.token_index], row_amax[sort.token_index]
    for i, lo, hi in _segments(sort.expert_offsets):
        assert_gemm_close(
            y[lo:hi],
            scheme.fake_quant_activation(rows[lo:hi], row_amax=amax[lo:hi]),
            w_deq[i],
            fp8_mma=scheme is FP8_BLOCK,
        )


@pytest.mark.parametrize("scheme,static", [(FP8_BLOCK, False), (NVFP4, False), (NVFP4, True)])
def test_grouped_quantized_linear_online_hadamard_is_the_transformed_input(scheme, static):
    """A rotated down projection (hadamard = 8, dividing K = 200): the fused quantizer transforms each sorted row
    as it loads it, so the output equals, bit for bit, the same call on `block_hadamard(x, 8)` without the option
    (identical operands, identical GEMM). A TP slice (row_amax) is refused: its caller transforms it first."""
    e = len(COUNTS)
    offsets = _offsets(COUNTS)
    weights, _ = _stack(scheme, _weights(e, N, K, seed=25))
    scales = torch.logspace(-3, -1, e) if static else None
    x = _rows(sum(COUNTS), K, seed=26).to(torch.bfloat16)
    fused = grouped_quantized_linear(
        scheme, x, offsets, weights, input_global_scale=scales, hadamard=8, out_dtype=torch.float32
    )
    transformed = grouped_quantized_linear(
        scheme, block_hadamard(x, 8), offsets, weights, input_global_scale=scales, out_dtype=torch.float32
    )
    assert torch.equal(fused, transformed)
    plain = grouped_quantized_linear(scheme, x, offsets, weights, input_global_scale=scales, out_dtype=torch.float32)
    assert not torch.equal(fused, plain)  # the option is not ignored
    if not static:
        with pytest.raises(ValueError, match="transform a tensor-parallel slice"):
            grouped_quantized_linear(
                scheme, x, offsets, weights, row_amax=x.float().abs().amax(1, keepdim=True), hadamard=8
            )


def test_nvfp4_quantizer_per_row_static_scales_bit_exact():
    """Rows sorted by expert, each with its expert's static scale (one launch): the codes, block scales and
    globals of each expert's rows equal the reference's for that expert's scale, bit for bit."""
    offsets = _offsets(COUNTS)
    x = _rows(sum(COUNTS), K, seed=30).to(torch.bfloat16)
    scales = torch.logspace(-3, 0, len(COUNTS))
    per_row = torch.repeat_interleave(scales, torch.tensor(COUNTS))
    packed, block_scale, global_ = quantize_nvfp4_per_token(x, per_row)
    for i, lo, hi in _segments(offsets):
        want = NVFP4.quantize_activation(x[lo:hi], scales[i])
        assert torch.equal(packed[lo:hi], want[0])
        assert torch.equal(block_scale[lo:hi].view(torch.uint8), want[1].view(torch.uint8))
        assert torch.equal(global_[lo:hi], want[2].expand(hi - lo, 1))
    with pytest.raises(ValueError, match=r"per-row global_scale must be float32 \(61,\)"):
        quantize_nvfp4_per_token(x, per_row[1:])


def test_grouped_quantized_linear_refuses_static_scales_it_cannot_use():
    weights, _ = _stack(FP8_BLOCK, _weights(2, 8, 16, seed=0))
    x, offsets = torch.randn(3, 16), _offsets((1, 2))
    with pytest.raises(ValueError, match="fp8_block has no static activation scale"):
        grouped_quantized_linear(FP8_BLOCK, x, offsets, weights, input_global_scale=torch.ones(2))
    weights, _ = _stack(NVFP4, _weights(2, 8, 16, seed=0))
    with pytest.raises(ValueError, match=r"input_global_scale must be \(2,\), one per expert"):
        grouped_quantized_linear(NVFP4, x, offsets, weights, input_global_scale=torch.ones(1))


# --- benchmarks/native_kernel_tests.py: the harness that runs these tests natively on a GPU ---------------


@pytest.mark.skipif(not interpreting(), reason="checks the harness through the interpreter (CI); on a GPU it is in use")
def test_native_launch_harness_keeps_views_and_writes_back(monkeypatch):
    """The plugin's launch wrapper, aimed at a second CPU copy here (no GPU in CI): operands that are views at
    storage offsets, sharing storages, and an output view land bit-identical to a plain launch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from native_kernel_tests import launch_on
    finally:
        sys.path.pop(0)
    from triton.runtime.interpreter import InterpretedFunction

    offsets = _offsets((3, 0, 4))
    fp8 = [formats.quantize_fp8_block(w) for w in _weights(3, N, K, seed=40)]
    both = torch.cat(
        [
            torch.stack([q.view(torch.uint8) for q, _ in fp8]).flatten(),
            torch.stack([sc for _, sc in fp8]).flatten().view(torch.uint8),
        ]
    )  # one storage for w_q and w_scale
    n_q = 3 * N * K
    w_q = both[:n_q].view(torch.float8_e4m3fn).view(3, N, K)
    w_scale = both[n_q:].view(torch.float32).view(3, 2, 2)
    x_q, x_scale = formats.quantize_fp8_per_token(_rows(12, K, seed=41))
    row_index = torch.arange(12, dtype=torch.int32).flip(0)[2:9]  # a view at an offset
    want = fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale, offsets, row_index=row_index, out_dtype=torch.float32)
    plain, launches = InterpretedFunction.run, []

    def counted(*args, **kwargs):
        launches.append(args[1:])
        return plain(*args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", launch_on("cpu", counted))
    got = fp8_block_grouped_gemm(x_q, x_scale, w_q, w_scale, offsets, row_index=row_index, out_dtype=torch.float32)
    assert launches and torch.equal(got, want)
    copied = [a for a in launches[0] if isinstance(a, torch.Tensor)]
    assert all(
        a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for a in copied for b in (x_q, w_q, got)
    )


# --- Hopper: the grouped kernels compile to wgmma ------------------------------------------------------------

COMPILE = r"""
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantkit.kernels import gemm_tiles, grouped_gemm

# 16-divisible at real shapes
ALIGNED = {"N", "K", "K_BYTES", "stride_xm", "stride_am", "stride_we", "stride_wn", "stride_ym"}

def ptx(kernel, types, constexprs, tiles):
    constexprs = {**constexprs, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
                  "GROUP_M": tiles.group_m}
    sig = {n: types.get(n, "constexpr" if n in constexprs else "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n in ALIGNED}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    text = compiled.asm["ptx"]
    return {"wgmma": "wgmma.mma_async" in text, "cp_async": "cp.async" in text}

index = {"ends_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "row_index_ptr": "*i32",
         "y_ptr": "*bf16"}
out = {}
for m in (1, 4096):
    for gather in (False, True):
        out[f"fp8 M={m} gather={gather}"] = ptx(grouped_gemm._fp8_block_grouped_kernel,
            {**index, "x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"},
            {"GATHER": gather, "ROUND_BF16": False, "SCALE_BLOCK": 128},
            gemm_tiles.default_tiles(m, 128, "fp8_block_grouped"))
        out[f"nvfp4 M={m} gather={gather}"] = ptx(grouped_gemm._nvfp4_grouped_kernel,
            {**index, "a_ptr": "*u8", "a_scale_ptr": "*fp8e4nv", "a_global_ptr": "*fp32", "w_ptr": "*u8",
             "w_scale_ptr": "*fp8e4nv", "w_global_ptr": "*fp32"},
            {"GATHER": gather, "TILE": tl.bfloat16, "ROUND_BF16": False},
            gemm_tiles.default_tiles(m, 128, "nvfp4_grouped"))
print(json.dumps(out))
"""


def test_grouped_kernels_compile_to_wgmma_for_hopper():
    """Ahead of time for sm90 (Triton ships ptxas): prefill tiles use Hopper's wgmma and cp.async pipelining,
    with and without the row gather; decode tiles compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out) == 8
    for name, found in out.items():
        if "M=4096" in name:
            assert found["wgmma"] and found["cp_async"], (name, found)
