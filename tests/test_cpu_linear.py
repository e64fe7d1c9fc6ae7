"""quantkit's float32 compute for unquantized bf16 Linears (`quantkit.serve.cpu.linear`), through vLLM's own CPU GEMM
dispatch: on CPUs without a bf16 matmul for every call, on AVX-512 BF16 CPUs without AMX for calls of at least
`FLOAT32_MIN_ROWS` rows; against PyTorch's bf16 `F.linear`.

Tolerance (derived): both form each output as the float32 sum of K exact products x_k w_k (bf16 x bf16 fits float32)
and round it to bf16 once; only the summation order differs. Each float32 sum is within (K - 1) 2^-24 sum|x_k w_k|
of the exact one (first order), so the two sums differ by at most 2 (K - 1) 2^-24 sum|x_k w_k|; rounding each to bf16
moves it by at most half a bf16 step, <= 2^-8 of its magnitude (8 significant bits), so both roundings together
<= 2^-7 max(|ours|, |ref|). Bound per element (the bias add folded into the sum):
|ours - ref| <= 2^-7 max(|ours|, |ref|) + 2 K 2^-24 (sum_k |x_k w_k| + |b|).
A wrong weight layout, a missing bias or a float32 output would break it by orders of magnitude (checked below).
Which kernel a call took is asserted bit for bit: the same function on the same input is deterministic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vllm.model_executor.layers import utils

from quantkit.serve.cpu import linear as cpu_linear

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)


def layer_with(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    return layer


def test_installs_where_float32_is_the_faster_matmul(monkeypatch):
    """The one ISA-dependent decision, on this machine's CPU: always float32 without AVX-512 BF16 / Arm BF16, from
    FLOAT32_MIN_ROWS rows on AVX-512 BF16 without AMX (unless switched off), never with a GPU or AMX. The tests below
    force each mode, so both are tested on every CPU."""
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", cpu_linear.vllm_dispatch())  # unwrapped
    monkeypatch.delenv(cpu_linear.SWITCH_ENV, raising=False)
    lacks = not (
        torch.cuda.is_available()
        or torch.cpu._is_avx512_bf16_supported()
        or torch.cpu.get_capabilities().get("bf16", False)
    )
    avx512_bf16_only = (
        not torch.cuda.is_available()
        and torch.cpu._is_avx512_bf16_supported()
        and not torch.cpu._is_amx_tile_supported()
    )
    amd = avx512_bf16_only and cpu_linear.cpu_vendor() == "AuthenticAMD"
    assert cpu_linear.amd_avx512_bf16() == amd
    want = 0 if lacks else cpu_linear.FLOAT32_MIN_ROWS if avx512_bf16_only and not amd else None
    assert cpu_linear.cpu_lacks_bf16_matmul() == lacks
    assert cpu_linear.float32_min_rows() == want
    assert cpu_linear.install() == (want is not None)
    # wrapped on every CPU (each layer's path is read when it is dispatched: a later engine may ask for split-k)
    assert getattr(utils.dispatch_cpu_unquantized_gemm, "quantkit_float32", False) == (not torch.cuda.is_available())
    monkeypatch.setenv(cpu_linear.SWITCH_ENV, "on")  # the Intel rule on an AMD CPU (reproduces earlier evaluations)
    assert cpu_linear.float32_min_rows() == (0 if lacks else cpu_linear.FLOAT32_MIN_ROWS if avx512_bf16_only else None)
    monkeypatch.setenv(cpu_linear.SWITCH_ENV, "off")
    assert cpu_linear.float32_min_rows() == (0 if lacks else None)  # the switch never turns the AVX2 case off


def test_recorded_kernels_name_this_machines_choice(monkeypatch):
    """`cpu_kernels` (recorded beside every vLLM evaluation) says what the switches choose: the half Linears' path
    from `float32_min_rows` and the emulated GEMM from `float32_gemm`; without the AMD preference, what quantkit chose
    before it (the same except on AMD AVX-512 BF16 CPUs). A misspelt GEMM choice is refused by name."""
    for name in (cpu_linear.SWITCH_ENV, cpu_linear.GEMM_ENV, cpu_linear.SUMMATION_ENV):
        monkeypatch.delenv(name, raising=False)
    if torch.cuda.is_available():
        assert cpu_linear.cpu_kernels() == {"half_linear": "cuda", "float32_gemm": "cuda"}
        return
    rows = cpu_linear.float32_min_rows()
    half = "vllm" if rows is None else "float32" if rows == 0 else f"float32>={rows}"
    assert cpu_linear.cpu_kernels() == {"half_linear": half, "float32_gemm": cpu_linear.float32_gemm()}
    assert cpu_linear.float32_gemm() == ("onednn" if cpu_linear.amd_avx512_bf16() else "torch")
    legacy = cpu_linear.cpu_kernels(amd_preference=False)
    assert legacy["float32_gemm"] == "torch"
    assert (legacy == cpu_linear.cpu_kernels()) == (not cpu_linear.amd_avx512_bf16())
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "torch")
    monkeypatch.setenv(cpu_linear.SWITCH_ENV, "on")
    assert cpu_linear.cpu_kernels() == legacy  # the switches reproduce an earlier evaluation's kernels
    monkeypatch.setenv(cpu_linear.SUMMATION_ENV, "split-k")  # the numerics stage's order is recorded elsewhere
    assert cpu_linear.cpu_kernels() == legacy and cpu_linear.float32_min_rows() == 0
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="QUANTKIT_CPU_FLOAT32_GEMM='mkl': expected one of torch, onednn"):
        cpu_linear.float32_gemm()


@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_float32_gemm_sums_the_same_products(monkeypatch, with_bias):
    """The emulated rows' float32 GEMM on oneDNN (`default_linear` with QUANTKIT_CPU_FLOAT32_GEMM=onednn; the default
    on AMD AVX-512 BF16 CPUs), forced here so it is tested on every x86 CPU: float32 operands x (3, 40, K), weight
    (384, K), K = 1001. It forms the same exact products as F.linear (float32 x float32, accumulated in float32)
    in its own blocking, so the two are within 2 (K + 1) 2^-24 S (two float32 orders of K + 1 terms, Higham's
    gamma_n; S = |x| @ |w|.T + |bias|); the check allows (K + 1) 2^-22 S, and a transposed weight layout breaks it.
    Deterministic: the same call twice is bit for bit. A bf16 input falls back to F.linear bit for bit; permute-k
    runs this kernel on the permuted operands (the same kernel, another order), bit for bit with that definition."""
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN ops (not an x86 CPU build)")
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "onednn")
    n, k = 384, 1001
    weight, bias, x = float32_operands(11, n, k, (3, 40), with_bias)
    linear = cpu_linear.default_linear(weight)
    assert (
        hasattr(linear, "onednn") and cpu_linear.ordered_linear(weight, "default").__qualname__ == linear.__qualname__
    )
    got = linear(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (3, 40, n) and torch.equal(got, linear(x, weight, bias))
    summed = x.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    within = (k + 1) * 2.0**-22 * summed
    assert bool(((got - F.linear(x, weight, bias)).abs() <= within).all())
    assert not bool(
        ((cpu_linear.default_linear(weight.T.contiguous().view(n, k))(x, weight, bias) - got).abs() <= within).all()
    )
    half = x.bfloat16()
    assert torch.equal(linear(half, weight.bfloat16(), None), F.linear(half, weight.bfloat16()))
    permutation = cpu_linear.k_permutation(k)
    permuted = weight[:, permutation].contiguous()
    want = cpu_linear.default_linear(permuted)(x[..., permutation], permuted, bias)
    assert torch.equal(cpu_linear.ordered_linear(weight, "permute-k")(x, weight, bias), want)
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "torch")
    assert cpu_linear.default_linear(weight) is F.linear


def installed_with(monkeypatch, min_rows: int):
    """vLLM's dispatch wrapped by cpu_linear as `float32_min_rows() == min_rows` would, whatever this CPU has."""
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", cpu_linear.vllm_dispatch())  # unwrapped
    monkeypatch.setattr(cpu_linear, "float32_min_rows", lambda: min_rows)
    monkeypatch.delenv(cpu_linear.SUMMATION_ENV, raising=False)
    assert cpu_linear.install()
    assert cpu_linear.install()  # idempotent: wraps once
    assert getattr(utils.dispatch_cpu_unquantized_gemm, "quantkit_float32", False)
    return utils.dispatch_cpu_unquantized_gemm


@pytest.fixture
def installed(monkeypatch):
    """Installed as on a CPU without a bf16 matmul: float32 for every call."""
    return installed_with(monkeypatch, 0)


def float32_operands(
    seed: int, n: int, k: int, rows: tuple[int, ...], with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Seeded float32 weight (n, k) x 0.05, bias (n,) or None, input (*rows, k): an emulated GEMM's operands."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) if with_bias else None
    return weight, bias, torch.randn(*rows, k, generator=g)


def within_bound(
    got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """The module docstring's per-element bound between two float32-accumulated bf16 results."""
    k = x.shape[-1]
    magnitude = x.float().abs() @ weight.float().abs().T + (0 if bias is None else bias.float().abs())
    bound = 2**-7 * torch.maximum(got.float().abs(), want.float().abs()) + 2 * k * 2**-24 * magnitude
    return bool(((got.float() - want.float()).abs() <= bound).all())


@pytest.mark.parametrize("remove_weight", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_float32_linear_matches_bf16_fallback(installed, remove_weight, with_bias):
    g = torch.Generator().manual_seed(0)
    n, k, m = 384, 200, 37  # K off any block size, M a decode-ish batch
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(m, k, generator=g).bfloat16()
    want = F.linear(x, weight, bias)  # PyTorch's bf16 CPU path: what vLLM's dispatch falls back to here
    layer = layer_with(weight.clone(), None if bias is None else bias.clone())
    installed(layer, remove_weight=remove_weight)
    got = layer.cpu_linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert layer.weight.numel() == (0 if remove_weight else n * k)  # dropped as vLLM's oneDNN path drops it
    assert within_bound(got, want, x, weight, bias)
    # the bound is tight enough to catch a layout slip
    wrong = F.linear(x, weight.view(k, n).T.contiguous(), bias) if n != k else None
    assert wrong is not None and not within_bound(wrong, want, x, weight, bias)


def test_layers_it_leaves_alone(installed):
    """Float32 weights (oneDNN takes them), 3-D MoE / conv weights and layers whose weight another path already
    dropped keep vLLM's own dispatch."""
    # the conv weight has 64 channels: on AVX-512 BF16 CPUs vLLM's own dispatch prepacks it, and its packer refuses 8
    for weight in (torch.randn(8, 4), torch.randn(64, 1, 4).bfloat16(), torch.empty(0, dtype=torch.bfloat16)):
        layer = layer_with(weight, None)
        installed(layer, remove_weight=True)
        linear = getattr(layer, "cpu_linear", None)
        assert linear is None or "float32_linear" not in linear.__qualname__, weight.shape


@pytest.mark.parametrize("remove_weight", [True, False])
def test_large_batches_in_float32_small_ones_on_vllms_kernel(monkeypatch, remove_weight):
    """The AVX-512 BF16 mode: a call of FLOAT32_MIN_ROWS rows or more computes exactly F.linear in float32 from the
    float32 copy; a call of fewer rows exactly what vLLM's own dispatch computes (bit for bit); both within the
    derived bound of PyTorch's bf16 F.linear. Leading dimensions count as rows."""
    min_rows = cpu_linear.FLOAT32_MIN_ROWS
    g = torch.Generator().manual_seed(1)
    n, k = 320, 136
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    native = layer_with(weight.clone(), bias.clone())
    cpu_linear.vllm_dispatch()(native, remove_weight=remove_weight)  # vLLM's own
    dispatch = installed_with(monkeypatch, min_rows)
    layer = layer_with(weight.clone(), bias.clone())
    dispatch(layer, remove_weight=remove_weight)
    for shape in [(1, k), (min_rows - 1, k), (min_rows, k), (3, min_rows // 2, k), (min_rows + 37, k)]:
        x = torch.randn(*shape, generator=g).bfloat16()
        got = layer.cpu_linear(x, layer.weight, layer.bias)
        assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], n)
        rows = x.numel() // k
        if rows >= min_rows:
            want = F.linear(x.float(), weight.float(), bias.float()).bfloat16()
        else:
            want = native.cpu_linear(x, native.weight, native.bias)
        assert torch.equal(got, want), shape
        reference = F.linear(x, weight, bias)
        assert within_bound(got.reshape(rows, n), reference.reshape(rows, n), x.reshape(rows, k), weight, bias)


def test_large_batch_mode_leaves_other_weights_alone(monkeypatch):
    """Float32 weights, 3-D MoE / conv weights and empty weights keep vLLM's own dispatch in that mode too."""
    dispatch = installed_with(monkeypatch, cpu_linear.FLOAT32_MIN_ROWS)
    for weight in (torch.randn(8, 4), torch.randn(64, 1, 4).bfloat16(), torch.empty(0, dtype=torch.bfloat16)):
        layer = layer_with(weight, None)
        dispatch(layer, remove_weight=True)
        linear = getattr(layer, "cpu_linear", None)
        assert linear is None or not hasattr(linear, "large"), weight.shape


def test_split_k_summation_order_is_another_valid_order(monkeypatch):
    """The numerics floor's second order (QUANTKIT_CPU_SUMMATION=split-k): on every CPU every half Linear takes it;
    it is exactly the sum of the two half-K float32 products (bit for bit: the same function on the same input),
    within the module docstring's bound of PyTorch's bf16 F.linear and of the default float32 order, and it is a
    different order: on 64 x 512 outputs at least one element differs in its last bf16 bit from the one-call
    float32 product (a float32 sum of 2 x 512 terms in two halves agrees in every bit with the one-call sum only by
    coincidence; the seed is fixed, so the check is deterministic). A misspelt order is refused by name."""
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", cpu_linear.vllm_dispatch())  # unwrapped
    monkeypatch.setenv(cpu_linear.SUMMATION_ENV, "split-k")
    assert cpu_linear.float32_min_rows() == 0 and cpu_linear.install()
    g = torch.Generator().manual_seed(2)
    n, k = 512, 1001  # odd K: the halves are 500 and 501 columns
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    layer = layer_with(weight.clone(), bias.clone())
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight.numel() == 0
    x = torch.randn(64, k, generator=g).bfloat16()
    got = layer.cpu_linear(x, layer.weight, layer.bias)
    x32, w32 = x.float(), weight.float()
    want = (F.linear(x32[:, :500], w32[:, :500]) + F.linear(x32[:, 500:], w32[:, 500:]) + bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    one_call = F.linear(x32, w32, bias.float()).bfloat16()
    assert within_bound(got, F.linear(x, weight, bias), x, weight, bias) and within_bound(
        got, one_call, x, weight, bias
    )
    assert not torch.equal(got, one_call)
    monkeypatch.setenv(cpu_linear.SUMMATION_ENV, "reversed")
    with pytest.raises(ValueError, match="split-k"):
        cpu_linear.summation_order()


@pytest.mark.parametrize("min_rows", [cpu_linear.FLOAT32_MIN_ROWS, 0, None])
@pytest.mark.parametrize("remove_weight", [True, False])
def test_permute_k_summation_order_is_the_default_kernel_on_permuted_columns(monkeypatch, min_rows, remove_weight):
    """The study's second order (QUANTKIT_CPU_SUMMATION=permute-k), in each mode the default order has (float32 from
    FLOAT32_MIN_ROWS rows, float32 always, vLLM's kernel always): bit for bit what the default order's kernel
    computes from the columns in `k_permutation`'s order (the same function on the same input is deterministic);
    within the module docstring's bound of PyTorch's bf16 F.linear; and a different order: on 63 x 512 and
    64 x 512 outputs (either side of FLOAT32_MIN_ROWS) at least one element differs in its last bf16 bit from the
    default order. Why that is safe: the float32 sums differ by ~sqrt(K) 2^-24 of their size, a bf16 rounding
    boundary lies within that of ~2^-24 sqrt(K) / 2^-9, i.e. ~1 in 1000 outputs at K = 1001, so ~30 of 32k
    differ; the seed is fixed, so the check is deterministic. A tied embedding (remove_weight False) keeps its own
    unpermuted weight object for its lookups."""
    g = torch.Generator().manual_seed(3)
    n, k = 512, 1001
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    permutation = cpu_linear.k_permutation(k)
    assert torch.equal(permutation.sort().values, torch.arange(k))
    assert torch.equal(permutation, cpu_linear.k_permutation(k))  # seeded: the same order every time
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", cpu_linear.vllm_dispatch())  # unwrapped
    monkeypatch.setattr(cpu_linear, "float32_min_rows", lambda: min_rows)
    monkeypatch.delenv(cpu_linear.SUMMATION_ENV, raising=False)
    assert cpu_linear.install() == (min_rows is not None)  # wrapped in every mode (None: vLLM's kernel always)
    dispatch = utils.dispatch_cpu_unquantized_gemm
    default = layer_with(weight.clone(), bias.clone())  # the default order, on the columns as they are
    dispatch(default, remove_weight=remove_weight)
    on_permuted = layer_with(weight[:, permutation].contiguous(), bias.clone())  # ... on the permuted columns
    dispatch(on_permuted, remove_weight=remove_weight)
    monkeypatch.setenv(cpu_linear.SUMMATION_ENV, "permute-k")
    layer = layer_with(weight.clone(), bias.clone())
    original = layer.weight
    dispatch(layer, remove_weight=remove_weight)
    assert (layer.weight is original) == (not remove_weight)
    if not remove_weight:
        assert torch.equal(layer.weight, weight)
    for rows in (1, 63, 64, 100):
        x = torch.randn(rows, k, generator=g).bfloat16()
        got = layer.cpu_linear(x, layer.weight, layer.bias)
        want = on_permuted.cpu_linear(x[:, permutation], on_permuted.weight, on_permuted.bias)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), rows
        assert within_bound(got, F.linear(x, weight, bias), x, weight, bias), rows
        if rows in (63, 64):
            assert not torch.equal(got, default.cpu_linear(x, default.weight, default.bias)), rows


def test_summation_order_names():
    """Every order the study may set is known; a misspelt one is refused naming the choices."""
    assert set(cpu_linear.SUMMATION_ORDERS) == {"default", "permute-k", "split-k"}


@pytest.mark.parametrize("order", ["default", "permute-k", "split-k"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_ordered_linear_sums_the_same_products_in_its_order(order, with_bias, monkeypatch):
    """The emulated quantized Linears' orders (`ordered_linear`, float32 operands x (2, 32, K), weight
    (512, K), K = 1001 odd): default is F.linear on the weight it is called with; permute-k is F.linear on both
    operands' columns in `k_permutation`'s order, split-k the two half-K products (500 and 501 columns) added, then
    the bias -- each bit for bit (the same functions on the same inputs are deterministic). Every order is within
    the float32 bound of the default: any order's float32 sum of the K products (and the bias) is within
    (K + 1) 2^-24 S of the exact sum (Higham, gamma_n ~ n u), S = |x| @ |w|.T + |bias|, so two orders differ by
    at most 2 (K + 1) 2^-24 S; the check allows (K + 1) 2^-22 S. The second orders are different orders: of the
    32k float32 outputs at least one differs in its last bits from the default (each float32 sum of 1001 terms
    carries ~sqrt(K) ulps of order-dependent rounding, so all agreeing is out of reach; the seed is fixed, so the
    check is deterministic). An unknown order is refused by name. On F.linear (QUANTKIT_CPU_FLOAT32_GEMM=torch;
    oneDNN's kernel is the test above)."""
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "torch")
    n, k = 512, 1001
    weight, bias, x = float32_operands(4, n, k, (2, 32), with_bias)
    linear = cpu_linear.ordered_linear(weight, order)
    got = linear(x, weight, bias)
    assert (
        got.dtype == torch.float32
        and got.shape == (2, 32, n)
        and torch.equal(got, _ordered_definition(order, x, weight, bias))
    )
    default = F.linear(x, weight, bias)
    summed = x.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    assert bool(((got - default).abs() <= (k + 1) * 2.0**-22 * summed).all())
    assert torch.equal(got, default) == (order == "default")
    with pytest.raises(ValueError, match="expected one of default, permute-k, split-k"):
        cpu_linear.ordered_linear(weight, "reversed")


@pytest.mark.parametrize("order", ["default", "permute-k", "split-k"])
def test_ordered_linear_on_half_operands_rounds_once(order):
    """`ordered_linear` on bf16 operands (the peers' NVFP4 emulation multiplies in the activation dtype): default and
    permute-k are bf16 F.linear on the operands as called / on both operands' permuted columns; split-k sums the two
    half-K products and the bias in float32 and rounds to bf16 once -- bit for bit with those definitions, output
    bf16. Within the module docstring's bound of the default (both roundings to bf16 plus two float32 orders of
    K + 1 terms). That the orders differ is checked where operands make inexact sums (tests/test_serve_quantized.py,
    tests/test_quant_method_kernels.py): a product of two bf16 numbers is exact in float32, so many sums agree."""
    g = torch.Generator().manual_seed(7)
    n, k = 256, 1001
    weight, bias = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(64, k, generator=g).bfloat16()
    got = cpu_linear.ordered_linear(weight, order)(x, weight, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _ordered_definition(order, x, weight, bias))
    ours, default = got.float(), F.linear(x, weight, bias).float()
    summed = x.float().abs() @ weight.float().abs().T + bias.float().abs()
    bound = 2.0**-7 * torch.maximum(ours.abs(), default.abs()) + 2 * (k + 1) * 2.0**-24 * summed
    assert bool(((ours - default).abs() <= bound).all())


def _ordered_definition(order: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `ordered_linear(weight, order)(x, weight, bias)` computes, written out (K = 1001: halves 500 / 501)."""
    if order == "default":
        return F.linear(x, weight, bias)
    if order == "permute-k":
        permutation = cpu_linear.k_permutation(x.shape[-1])
        return F.linear(x[..., permutation], weight[:, permutation].contiguous(), bias)
    x32, w32 = x.float(), weight.float()
    out = F.linear(x32[..., :500], w32[:, :500].contiguous()) + F.linear(x32[..., 500:], w32[:, 500:].contiguous())
    return (out if bias is None else out + bias.float()).to(x.dtype)
