"""The vLLM quant method's Triton path (`QUANTKIT_KERNEL=triton`, what CUDA runs) equals its torch-emulation
path (what CPU runs, held against the fake-quant reference in tests/test_serve_quantized.py), layer by layer:
quantized Linears (below) and routed experts (`quantkit.serve.moe_method`, grouped GEMMs; the bound per GEMM is
the one below, the re-quantized down input handled in that test's docstring).

The Triton kernels run through the interpreter here. Both paths quantize activations bit-identically
(the kernel quantizers are bit-exact with quantkit.formats) and multiply the same decoded values in
float32, so they differ by rounding only. Tolerance, elementwise (derived, not measured; the same argument as
tests/test_kernels_gemm.py): with xq the fake-quantized activation, w the decoded weight and
S = |xq| @ |w|.T + |bias|, each side's float32 sum of the K products and the bias is within (K + 1) * 2**-24 * S
of the exact value in ANY summation order (Higham's worst-case bound gamma_n ~ n u, u = 2**-24), plus a few
more 2**-24 * S for the dequantization products and the epilogue's per-block scales; the two sides therefore
differ by less than 4 (K + 1) 2**-24 S, and the bound allows (K + 1) 2**-21 S, twice that. It holds on every
ISA and for any blocking. A structural error (a scale on the wrong block, a nibble swapped, a wrong global
scale) moves outputs by whole quantization steps (>= 2**-4 relative), orders of magnitude above it.
"""

import pytest
import torch
import torch.nn.functional as F

from quantkit.formats.hadamard import block_hadamard
from quantkit.formats.schemes import SCHEMES
from quantkit.kernels.expert_sort import sort_by_expert
from quantkit.serve.method_parts import CAPTURE_ENV, KERNEL_ENV
from quantkit.serve.moe_method import QuantkitExperts, QuantkitGLUExpertsMethod
from quantkit.serve.quant_method import QuantkitLinearMethod, QuantkitQuantConfig

N, K = 136, 200  # neither a multiple of 128 nor (K) of the NVFP4 K tile


def _layer(scheme, activation_scale, kernel, weight, monkeypatch, hadamard=0):
    qc = {"format_version": 1, "scheme": scheme, "activation_scale": activation_scale, "quantized_modules": ["proj"]}
    if hadamard:  # a rotated checkpoint's down_proj: its input through the online block Hadamard
        qc["rotation"] = {"online_hadamard": {"proj": hadamard}}
    config = QuantkitQuantConfig(qc)
    method = QuantkitLinearMethod(config, "proj")
    layer = torch.nn.Module()
    method.create_weights(layer, K, [N], K, N, torch.float32)
    tensors = SCHEMES[scheme].encode(weight, "proj")
    if activation_scale == "static":
        tensors["input_global_scale"] = torch.tensor([0.004])
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    monkeypatch.setenv(KERNEL_ENV, kernel)
    method.process_weights_after_loading(layer)
    assert method.kernel == ("triton" if kernel == "triton" else "torch-emulation")
    return method, layer


@pytest.mark.parametrize("hadamard", [0, 8])  # 8: K = 200's online block (a rotated down_proj)
@pytest.mark.parametrize(
    "scheme, activation_scale",
    [("fp8_block", "per_token"), ("nvfp4", "per_token"), ("nvfp4", "static"), ("nvfp4_four_over_six", "per_token")],
)
def test_triton_path_equals_torch_emulation(scheme, activation_scale, hadamard, monkeypatch):
    """hadamard: emulation transforms x by the torch butterfly, the Triton path inside its fused quantizer; both
    then quantize the same bits (tests/test_kernels_quantize.py), so the bound below is unchanged."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(2, 3, K, generator=g) * torch.tensor([0.1, 1.0, 30.0])[:, None]
    bias = torch.randn(N, generator=g)
    emulation, emulation_layer = _layer(scheme, activation_scale, "torch", weight, monkeypatch, hadamard)
    triton, triton_layer = _layer(scheme, activation_scale, "triton", weight, monkeypatch, hadamard)
    want = emulation.apply(emulation_layer, x, bias)
    got = triton.apply(triton_layer, x, bias)
    assert got.shape == want.shape == (2, 3, N) and got.dtype == torch.float32
    static = emulation_layer.input_global_scale if activation_scale == "static" else None
    xq = SCHEMES[scheme].fake_quant_activation(block_hadamard(x, hadamard) if hadamard else x, static)
    summed = xq.abs() @ emulation_layer.weight_dequantized.abs().T + bias.abs()
    tol = (K + 1) * 2.0**-21 * summed  # see the module docstring
    assert bool(((got - want).abs() <= tol).all()), f"max err/tol {((got - want).abs() / tol).max():.3g}"


@pytest.mark.parametrize("order", ["permute-k", "split-k"])
@pytest.mark.parametrize("scheme", ["fp8_block", "nvfp4"])
def test_emulation_sums_in_the_summation_order_of_its_load(scheme, order, monkeypatch):
    """The numerics stage's second order reaches the emulated quantized Linears: a layer loaded with
    QUANTKIT_CPU_SUMMATION set computes `ordered_linear(weight_dequantized, order)` of the same quantized
    activation, bit for bit (deterministic functions on equal inputs); a layer loaded without it, the default
    order's kernel (`default_linear`: F.linear, or oneDNN's on AMD AVX-512 BF16 CPUs), bit for bit. The two differ
    by summation order only: within the module docstring's bound, and not equal (float32 sums
    of K = 200 products carry order-dependent rounding in some of the 816 outputs; fixed seed, deterministic)."""
    from quantkit.serve.cpu.linear import SUMMATION_ENV, default_linear, ordered_linear
    from quantkit.serve.method_parts import emulated_activation

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(6, K, generator=g)
    bias = torch.randn(N, generator=g)
    monkeypatch.delenv(SUMMATION_ENV, raising=False)
    default, default_layer = _layer(scheme, "per_token", "torch", weight, monkeypatch)
    monkeypatch.setenv(SUMMATION_ENV, order)
    ordered, ordered_layer = _layer(scheme, "per_token", "torch", weight, monkeypatch)
    monkeypatch.delenv(SUMMATION_ENV)
    w = ordered_layer.weight_dequantized
    assert torch.equal(w, default_layer.weight_dequantized)
    xq = emulated_activation(SCHEMES[scheme], x, None, None)
    got, got_default = ordered.apply(ordered_layer, x, bias), default.apply(default_layer, x, bias)
    assert torch.equal(got, ordered_linear(w, order)(xq, w, bias))
    assert torch.equal(got_default, default_linear(w)(xq, w, bias))
    tol = (K + 1) * 2.0**-21 * (xq.abs() @ w.abs().T + bias.abs())  # see the module docstring
    assert bool(((got - got_default).abs() <= tol).all()) and not torch.equal(got, got_default)


def test_kernel_choice_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="QUANTKIT_KERNEL='cuda'"):
        _layer("fp8_block", "per_token", "cuda", torch.randn(N, K), monkeypatch)


# ---------------------------------------------------------------------------------------- routed experts

E, H, I = 4, 40, 72  # noqa: E741 (I: the intermediate size, as the MoE papers write it); w13 (E, 144, 40): the up shard starts off the 128 grid; NVFP4 pads H to 48, I to 80
# (scheme, activation scale, GLU experts, online Hadamard block of the down inputs: 8 for I = 72, a rotated checkpoint)
EXPERTS_CASES = [
    ("fp8_block", "per_token", False, 0),
    ("nvfp4", "per_token", False, 0),
    ("nvfp4", "static", False, 0),
    ("nvfp4", "per_token", True, 0),
    ("nvfp4", "per_token", False, 8),
    ("fp8_block", "per_token", True, 8),
    ("nvfp4_four_over_six", "per_token", False, 8),
]
ROUTING = torch.tensor([[2, 3], [3, 2], [2, -1], [1, 2], [2, 3], [3, 2], [2, -1], [3, 2]])  # -1: another rank's
# tokens per expert: 0 (none), 1 (one), 8, 5 (uneven); two pairs of no local expert


def _experts(scheme, activation_scale, kernel, weights, glu, monkeypatch, capture_dir=None, hadamard=0):
    """(QuantkitExperts, layer, run(x, ids, topk_weights)): E experts loaded from per-expert `Scheme.encode` tensors
    through vLLM's expert weight_loader; glu: through `QuantkitGLUExpertsMethod` (sigmoid), else silu (FusedMoE);
    hadamard: a rotated checkpoint's online block on every expert's down input."""
    qc = {
        "format_version": 1,
        "scheme": scheme,
        "activation_scale": activation_scale,
        "quantized_modules": [f"experts.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")],
    }
    if hadamard:
        qc["rotation"] = {"online_hadamard": {f"experts.{e}.down_proj": hadamard for e in range(E)}}
    config = QuantkitQuantConfig(qc)
    if capture_dir is None:
        monkeypatch.delenv(CAPTURE_ENV, raising=False)
    else:
        monkeypatch.setenv(CAPTURE_ENV, str(capture_dir))
    layer = torch.nn.Module()
    if glu:
        method = QuantkitGLUExpertsMethod(config, "experts")
        method.create_weights(layer, E, H, I)
        experts = method.experts
    else:
        method = experts = QuantkitExperts(config, "experts")
        experts.create_weights(layer, E, H, I, lambda e: e)
    for (e, proj, shard), (weight, static_scale) in weights.items():
        stem = "w2" if shard == "w2" else "w13"
        tensors = SCHEMES[scheme].encode(weight, f"experts.{e}.{proj}")
        if activation_scale == "static":
            tensors["input_global_scale"] = torch.tensor([static_scale])
        for suffix, tensor in tensors.items():
            param = getattr(layer, f"{stem}_{suffix}")
            param.weight_loader(param, tensor, f"experts.{e}.{proj}.{suffix}", shard, e)
    monkeypatch.setenv(KERNEL_ENV, kernel)
    method.process_weights_after_loading(layer)
    assert experts.kernel == ("triton" if kernel == "triton" else "torch-emulation")

    def run(x, ids, topk_weights):
        if glu:
            return method.apply(layer, x, ids, topk_weights)
        return experts.forward(layer, x, ids, topk_weights, F.silu)

    return experts, layer, run


@pytest.mark.parametrize("scheme, activation_scale, glu, hadamard", EXPERTS_CASES)
def test_experts_triton_path_equals_torch_emulation(scheme, activation_scale, glu, hadamard, monkeypatch, tmp_path):
    """The routed experts' "triton" kernel (grouped GEMMs, interpreter) vs their torch emulation, per token.

    Both quantize the block input identically (bit-exact quantizers) and multiply decoded values in float32, so
    the w13 outputs [gate | up] of every (token, expert) pair differ by float32 rounding only: within
    (H + 1) 2**-21 S1, S1 = |xq| @ |w13_e|^T (the Linear test's bound, module docstring), checked first -- a wrong
    scale, expert or row there is off by quantization steps. The down input a = act(gate) * up is then
    re-quantized from values that differ by that rounding, and an element of a within it of a rounding midpoint
    (or a block amax at one of an NVFP4 group scale) gets the neighbouring code on one side: a "flip", a whole
    quantization step, legitimate and rare (probability ~ rounding / step per element). The test finds the flips:
    the two paths' down-input codes (every quantizer operand but the row's float32 scale) compared, the
    emulation's a captured (QUANTKIT_CAPTURE_DIR), the triton path's act applied to its [gate | up]. Tokens with a
    flip are left out: at most 2 of the 8 may be (flips are rare, ~2**-24 sqrt(H) / 2**-4 per element for the
    typical rounding; an error upstream, which the w13 check would already catch, flips nearly all). For the
    others, per pair s of token t with routing weight p_s, xq_t / xq_e the two dequantized down inputs (same
    codes; the row scales may differ by the rounding of the row amax) and w2 the expert's decoded down weight:

        |y_t - y_e| <= |xq_t - xq_e| @ |w2|^T + (I + 1) 2**-21 S2,    S2 = max(|xq_t|, |xq_e|) @ |w2|^T

    (the first term exact for the operand difference, the second the Linear bound), and each path's combine of
    k weighted rows in float32 adds at most (k + 1) 2**-24 sum_s |p_s| S2_s:

        |out_t - out_e| <= sum_s |p_s| (|xq_t - xq_e| @ |w2|^T + ((I + 1) 2**-21 + (k + 1) 2**-23) S2)_s

    Routing: an expert with no token, one with one token, uneven counts, pairs of another rank's expert (-1).
    glu: the same code through `QuantkitGLUExpertsMethod` (act = sigmoid). hadamard: both paths transform the down
    input before quantizing it (the emulation by the torch butterfly, captured transformed; the triton path inside
    its fused quantizer, bit-exact with the butterfly), so the argument is unchanged.
    2-3 s a case on 2 shared cores.
    """
    g = torch.Generator().manual_seed(1)
    down_scales = torch.tensor([0.002, 0.0005, 0.001, 0.004])  # NVFP4 static decode scales of the down inputs
    x = torch.randn(len(ROUTING), H, generator=g) * torch.tensor([0.1, 1.0, 30.0, 3.0] * 2)[:, None]
    block_scales = x.abs().amax() / 2688 * torch.tensor([1.0, 0.5, 2.0, 1.0])  # static: expert 1's inputs clip
    weights = {}
    for e in range(E):
        for proj, shard, shape, scale in (
            ("gate_proj", "w1", (I, H), block_scales[e]),
            ("up_proj", "w3", (I, H), block_scales[e]),
            ("down_proj", "w2", (H, I), down_scales[e]),
        ):
            weights[e, proj, shard] = (torch.randn(shape, generator=g) * 0.05 * (e + 1), float(scale))
    topk_weights = torch.rand(ROUTING.shape, generator=g) + 0.1
    _, emulation_layer, run_emulation = _experts(
        scheme, activation_scale, "torch", weights, glu, monkeypatch, tmp_path, hadamard
    )
    triton, triton_layer, run_triton = _experts(
        scheme, activation_scale, "triton", weights, glu, monkeypatch, hadamard=hadamard
    )
    want = run_emulation(x, ROUTING, topk_weights)
    got = run_triton(x, ROUTING, topk_weights)
    assert got.shape == want.shape == (len(ROUTING), H) and got.dtype == torch.float32

    captured = {}
    for path in tmp_path.glob("*.pt"):
        record = torch.load(path)
        _, expert, which = record["prefix"].split(".")
        captured[int(expert), which] = record
    scheme_ = SCHEMES[scheme]
    act = torch.sigmoid if glu else F.silu
    sort = sort_by_expert(ROUTING, E)
    offsets = sort.expert_offsets.tolist()
    h = triton.triton_gate_up(triton_layer, x, sort)
    assert not h[offsets[E] :].any(), "pairs of no local expert must be zeros"
    top_k = ROUTING.shape[1]
    pair_weight = topk_weights.reshape(-1)[sort.flat_index].double().abs()
    tol = torch.zeros(len(ROUTING), H, dtype=torch.float64)
    flipped = torch.zeros(len(ROUTING), dtype=torch.bool)
    assert {e for e, _ in captured} == {1, 2, 3}  # expert 0 has no token
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        if rows.start == rows.stop:
            continue
        w13, w2 = emulation_layer.w13_dequantized[e], emulation_layer.w2_dequantized[e]
        xq_in = captured[e, "gate_up"]["xq"]
        h_bound = (H + 1) * 2.0**-21 * (xq_in.abs() @ w13.abs().T)
        h_err = (h[rows] - F.linear(xq_in, w13)).abs()
        assert bool((h_err <= h_bound).all()), f"expert {e} gate_up: max err/bound {(h_err / h_bound).max():.3g}"
        gate, up = h[rows].chunk(2, dim=-1)
        a_triton, a_emulation = act(gate) * up, captured[e, "down"]["x"]
        if hadamard:
            a_triton = block_hadamard(a_triton, hadamard)
        static = down_scales[e] if activation_scale == "static" else None
        codes = [scheme_.quantize_activation(a, static)[:-1] for a in (a_triton, a_emulation)]
        row_flips = torch.stack(
            [(c_t.float() != c_e.float()).reshape(len(a_triton), -1).any(-1) for c_t, c_e in zip(*codes)]
        ).any(0)
        tokens = sort.token_index[rows].long()
        flipped[tokens[row_flips]] = True
        xq_triton = scheme_.fake_quant_activation(a_triton, static).double()
        xq_emulation = captured[e, "down"]["xq"].double()
        w2_abs = w2.double().abs()
        summed = torch.maximum(xq_triton.abs(), xq_emulation.abs()) @ w2_abs.T
        row_tol = (xq_triton - xq_emulation).abs() @ w2_abs.T + ((I + 1) * 2.0**-21 + (top_k + 1) * 2.0**-23) * summed
        tol.index_add_(0, tokens, pair_weight[rows, None] * row_tol)
    compared = ~flipped
    assert compared.sum() >= len(ROUTING) - 2, f"{int(flipped.sum())} of {len(ROUTING)} tokens with a code flip"
    err = (got - want).double().abs()[compared]
    assert bool((err <= tol[compared]).all()), f"max err/tol {(err / tol[compared]).max():.3g}"


@pytest.mark.parametrize("scheme", ["fp8_block", "nvfp4"])
def test_experts_triton_tp_slice_transforms_before_the_reference_quantizer(scheme, monkeypatch):
    """Under tensor parallelism the "triton" path cannot fuse a rotated down input's Hadamard (the per-token scale
    needs the whole row's amax, all-reduced over the ranks): it transforms the slice with the torch butterfly, then
    the reference quantizer takes the all-reduced amax. Run as one rank whose slice is the whole row (the all-reduce
    an identity), that path must equal the fused one bit for bit: the same transform (the fused quantizer is
    bit-exact with the butterfly), the same codes (the fused quantizer is bit-exact with the reference), the same
    GEMM."""
    import types

    import quantkit.serve.moe_method as moe_method

    g = torch.Generator().manual_seed(3)
    weights = {
        (e, proj, shard): (torch.randn(shape, generator=g) * 0.05, 1.0)
        for e in range(E)
        for proj, shard, shape in (("gate_proj", "w1", (I, H)), ("up_proj", "w3", (I, H)), ("down_proj", "w2", (H, I)))
    }
    experts, _, run = _experts(scheme, "per_token", "triton", weights, False, monkeypatch, hadamard=8)
    x = torch.randn(len(ROUTING), H, generator=g)
    topk_weights = torch.rand(ROUTING.shape, generator=g) + 0.1
    fused = run(x, ROUTING, topk_weights)
    reduced = []
    monkeypatch.setattr(moe_method, "get_tp_group", lambda: types.SimpleNamespace(device_group=None))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op, group: reduced.append(t.shape))
    experts.tp_size = 2
    sliced = run(x, ROUTING, topk_weights)
    assert reduced == [(ROUTING.numel(), 1)]  # the down input's per-token amax (every sorted pair), once
    assert torch.equal(sliced, fused)


def _experts_by_definition(x, topk_weights, layer, scheme, glu, scales, hadamard, order="default"):
    """The routed experts one expert at a time (the definition the emulation must equal), for ROUTING: expert e's
    routed rows x_e quantized alone (static scale `scales["gate_up"][e]`, None: per token), gate/up, act, the down
    input (transformed by `block_hadamard` first when `hadamard`) quantized alone (`scales["down"][e]`), down, the
    weighted rows added to each token in expert order. Each product is `ordered_linear(weight, order)` (F.linear in
    the default order) on the layer's decoded weights."""
    from quantkit.serve.cpu.linear import ordered_linear

    scheme_, act = SCHEMES[scheme], (torch.sigmoid if glu else F.silu)
    want = torch.zeros(len(ROUTING), H)
    for e in range(E):
        tokens, slot = torch.where(e == ROUTING)
        if not len(tokens):
            continue
        w13, w2 = layer.w13_dequantized[e], layer.w2_dequantized[e]
        rows = scheme_.fake_quant_activation(x[tokens], scales["gate_up"][e])
        gate, up = ordered_linear(w13, order)(rows, w13, None).chunk(2, -1)
        down_input = act(gate) * up if not hadamard else block_hadamard(act(gate) * up, hadamard)
        y = ordered_linear(w2, order)(scheme_.fake_quant_activation(down_input, scales["down"][e]), w2, None)
        want.index_put_((tokens,), y * topk_weights[tokens, slot, None], accumulate=True)
    return want


@pytest.mark.parametrize("scheme, activation_scale, glu, hadamard", EXPERTS_CASES)
def test_experts_emulation_equals_per_expert_loop(scheme, activation_scale, glu, hadamard, monkeypatch):
    """The torch emulation quantizes each expert input once per layer over all (token, expert) rows
    (`QuantkitExperts._fake_quant`; static scales once per expert): it must equal, bit for bit, the definition
    computed here one expert at a time -- expert e's routed rows x_e quantized alone (its static scale), gate/up,
    act, the down input quantized alone, down, the weighted rows added to each token in expert order. Exact, not
    within a tolerance: per-token quantization has no statistic across rows, the matmuls get the same operands and
    shapes, and the float32 additions happen in the same order. Routing as above (an expert with no token, -1
    pairs); hadamard: the down input transformed (`block_hadamard`) before it is quantized. ~1 s a case."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(ROUTING), H, generator=g) * torch.tensor([0.1, 1.0, 30.0, 3.0] * 2)[:, None]
    static = {
        "gate_up": x.abs().amax() / 2688 * torch.tensor([1.0, 0.5, 2.0, 1.0]),
        "down": torch.tensor([0.002, 0.0005, 0.001, 0.004]),
    }
    weights = {}
    for e in range(E):
        for proj, shard, shape, key in (
            ("gate_proj", "w1", (I, H), "gate_up"),
            ("up_proj", "w3", (I, H), "gate_up"),
            ("down_proj", "w2", (H, I), "down"),
        ):
            weights[e, proj, shard] = (torch.randn(shape, generator=g) * 0.05 * (e + 1), float(static[key][e]))
    topk_weights = torch.rand(ROUTING.shape, generator=g) + 0.1
    _, layer, run = _experts(scheme, activation_scale, "torch", weights, glu, monkeypatch, hadamard=hadamard)
    got = run(x, ROUTING, topk_weights)
    scales = {k: v if activation_scale == "static" else [None] * E for k, v in static.items()}
    want = _experts_by_definition(x, topk_weights, layer, scheme, glu, scales, hadamard)
    assert torch.equal(got, want)


@pytest.mark.parametrize("order", ["permute-k", "split-k"])
@pytest.mark.parametrize("scheme, glu", [("fp8_block", False), ("nvfp4", True)])
def test_experts_emulation_sums_in_the_summation_order_of_its_load(scheme, glu, order, monkeypatch):
    """The numerics stage's second order reaches the routed experts' emulation: experts loaded with
    QUANTKIT_CPU_SUMMATION set compute the per-expert definition above with each product in that order
    (`ordered_linear(w13_dequantized[e], order)`, `ordered_linear(w2_dequantized[e], order)`), bit for bit (the same
    deterministic functions on equal operands, the float32 additions in the same order); the order is read at load.
    And they differ from experts loaded in the default order (the per-expert loop with F.linear, the test above):
    fixed seed, FP8's float32-scaled operands make inexact sums; NVFP4's outputs differ through its re-quantized down
    input. No tolerance against the default: a last-bit change of act(gate) * up can move a code of the re-quantized
    down input, a whole quantization step."""
    from quantkit.serve.cpu.linear import SUMMATION_ENV

    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(ROUTING), H, generator=g) * torch.tensor([0.1, 1.0, 30.0, 3.0] * 2)[:, None]
    weights = {}
    for e in range(E):
        for proj, shard, shape in (("gate_proj", "w1", (I, H)), ("up_proj", "w3", (I, H)), ("down_proj", "w2", (H, I))):
            weights[e, proj, shard] = (torch.randn(shape, generator=g) * 0.05 * (e + 1), 0.0)
    topk_weights = torch.rand(ROUTING.shape, generator=g) + 0.1
    monkeypatch.delenv(SUMMATION_ENV, raising=False)
    _, _, run_default = _experts(scheme, "per_token", "torch", weights, glu, monkeypatch)
    monkeypatch.setenv(SUMMATION_ENV, order)
    _, layer, run = _experts(scheme, "per_token", "torch", weights, glu, monkeypatch)
    monkeypatch.delenv(SUMMATION_ENV)  # read at load, not per call
    got = run(x, ROUTING, topk_weights)
    want = _experts_by_definition(
        x, topk_weights, layer, scheme, glu, {"gate_up": [None] * E, "down": [None] * E}, 0, order
    )
    assert torch.equal(got, want)
    assert not torch.equal(got, run_default(x, ROUTING, topk_weights))


@pytest.mark.parametrize("order", ["permute-k", "split-k"])
def test_unquantized_glu_experts_sum_in_the_summation_order_of_their_first_call(order, monkeypatch):
    """The BF16 row of a GLU hybrid checkpoint (`quantkit.serve.hybrid.GLUExperts`, unquantized: vLLM's fused MoE has
    no sigmoid gate) takes the numerics stage's second order too: per expert, gate/up and down are
    `ordered_linear`'s products on the bf16 rows and weights (float32 halves rounded once in split-k), bit for bit
    with that definition; and they differ from the default order's. A product of two bf16 numbers is exact in float32
    (16 bits), so sums of a few dozen of them are exact in any order unless their magnitudes spread: the inputs span
    16 binades, so that some of the float32 sums are inexact and some of those straddle a bf16 rounding boundary
    (1024 tokens: 18 and 14 of the 40k outputs differ here; fixed seed, deterministic)."""
    from quantkit.serve.cpu.linear import SUMMATION_ENV, ordered_linear
    from quantkit.serve.hybrid import GLUExperts

    g = torch.Generator().manual_seed(6)
    routing = torch.randint(0, E, (1024, 2), generator=g)
    topk_weights = torch.rand(routing.shape, generator=g) + 0.1
    x = (torch.randn(len(routing), H, generator=g) * 2.0 ** (torch.rand(len(routing), H, generator=g) * 16 - 8)).to(
        torch.bfloat16
    )
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(torch.bfloat16)
    outputs = {}
    for summation in ("default", order):
        experts = GLUExperts(E, H, I)
        experts.w13.data, experts.w2.data = w13.clone(), w2.clone()
        monkeypatch.setenv(SUMMATION_ENV, summation)
        outputs[summation] = experts(x, routing, topk_weights)
        monkeypatch.delenv(SUMMATION_ENV)
    want = torch.zeros(len(routing), H)
    for e in range(E):
        tokens, slot = torch.where(e == routing)
        gate, up = ordered_linear(w13[e], order)(x[tokens], w13[e], None).chunk(2, -1)
        y = ordered_linear(w2[e], order)(torch.sigmoid(gate) * up, w2[e], None)
        want.index_put_((tokens,), y * topk_weights[tokens, slot, None].float(), accumulate=True)
    assert outputs[order].dtype == torch.bfloat16 and torch.equal(outputs[order], want.to(torch.bfloat16))
    assert not torch.equal(outputs[order], outputs["default"])
