"""quantkit's float32 compute for unquantized bf16 Linears on CPUs without a bf16 matmul (`quantkit.serve.cpu_linear`),
through vLLM's own CPU GEMM dispatch, against PyTorch's bf16 `F.linear` (what vLLM falls back to there).

Tolerance (derived): both form each output as the float32 sum of K exact products x_k w_k (bf16 x bf16 fits float32)
and round it to bf16 once; only the summation order differs. Each float32 sum is within (K - 1) 2^-24 sum|x_k w_k|
of the exact one (first order), so the two sums differ by at most 2 (K - 1) 2^-24 sum|x_k w_k|; rounding each to bf16
moves it by at most half a bf16 step, <= 2^-8 of its magnitude (8 significant bits), so both roundings together
<= 2^-7 max(|ours|, |ref|). Bound per element (the bias add folded into the sum):
|ours - ref| <= 2^-7 max(|ours|, |ref|) + 2 K 2^-24 (sum_k |x_k w_k| + |b|).
A wrong weight layout, a missing bias or a float32 output would break it by orders of magnitude (checked below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vllm.model_executor.layers import utils

from quantkit.serve import cpu_linear

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)



def layer_with(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    return layer


def test_installs_exactly_where_the_cpu_lacks_bf16_matmul(monkeypatch):
    """The one ISA-dependent decision: on this machine's CPU, installed iff it has neither AVX-512 BF16 nor Arm BF16
    (and no GPU). The tests below force it, so the float32 path is tested on every CPU."""
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)
    lacks = not (torch.cuda.is_available() or torch.cpu._is_avx512_bf16_supported()
                 or torch.cpu.get_capabilities().get("bf16", False))
    assert cpu_linear.cpu_lacks_bf16_matmul() == lacks
    assert cpu_linear.install() == lacks
    assert getattr(utils.dispatch_cpu_unquantized_gemm, "quantkit_float32", False) == lacks


@pytest.fixture
def installed(monkeypatch):
    """vLLM's dispatch wrapped by cpu_linear, installed as on a CPU without a bf16 matmul whatever this CPU has."""
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)
    monkeypatch.setattr(cpu_linear, "cpu_lacks_bf16_matmul", lambda: True)
    assert cpu_linear.install()
    assert cpu_linear.install()  # idempotent: wraps once
    assert getattr(utils.dispatch_cpu_unquantized_gemm, "quantkit_float32", False)
    return utils.dispatch_cpu_unquantized_gemm


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
    magnitude = x.float().abs() @ weight.float().abs().T + (0 if bias is None else bias.float().abs())
    bound = 2**-7 * torch.maximum(got.float().abs(), want.float().abs()) + 2 * k * 2**-24 * magnitude
    assert ((got.float() - want.float()).abs() <= bound).all()
    # the bound is tight enough to catch a layout slip
    wrong = F.linear(x, weight.view(k, n).T.contiguous(), bias) if n != k else None
    assert wrong is not None and not ((wrong.float() - want.float()).abs() <= bound).all()


def test_layers_it_leaves_alone(installed):
    """Float32 weights (oneDNN takes them), 3-D MoE / conv weights and layers whose weight another path already
    dropped keep vLLM's own dispatch."""
    # the conv weight has 64 channels: on AVX-512 BF16 CPUs vLLM's own dispatch prepacks it, and its packer refuses 8
    for weight in (torch.randn(8, 4), torch.randn(64, 1, 4).bfloat16(), torch.empty(0, dtype=torch.bfloat16)):
        layer = layer_with(weight, None)
        installed(layer, remove_weight=True)
        linear = getattr(layer, "cpu_linear", None)
        assert linear is None or "float32_linear" not in linear.__qualname__, weight.shape
