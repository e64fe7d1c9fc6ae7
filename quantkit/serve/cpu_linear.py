"""Unquantized bf16/fp16 Linears computed in float32 on CPUs without a native bf16 matmul.

vLLM 0.32's CPU GEMM dispatch for unquantized layers (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`)
tries oneDNN, whose bf16 matmul primitive needs AVX-512 BF16 / AMX / Arm BF16 (on this project's AVX2 machine
`create_onednn_mm` refuses), then falls back to `F.linear` in bf16, which PyTorch's CPU backend runs far slower than a
float32 matmul of the same shape there (figures: benchmarks/README.md, "Measurements behind design
choices"). Every served model's unquantized layers take that path: embeddings'
tied LM heads, routers, the bf16 rows of a study, the layers a recipe leaves unquantized.

`install()` (called by the plugin in every vLLM process) wraps the dispatch: a layer left on that fallback gets a
float32 copy of its weight (and bias), and computes `F.linear(x.float(), w32, b32)` rounded to the input dtype
once. Same products (a product of two bf16 numbers is exact in float32) and float32 accumulation as PyTorch's bf16
fallback, only another summation order; tests/test_cpu_linear.py bounds the difference. Memory: the float32 copy
replaces the bf16 weight where vLLM would drop it (`remove_weight`, all Linear layers), else sits beside it
(embeddings, which still look rows up in their weight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.bfloat16, torch.float16)


def float32_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """A `layer.cpu_linear(x, weight, bias)` computing in float32 with copies of `weight` (N, K) and `bias` (N,)
    made now; its output has x's dtype. The `weight`/`bias` arguments it is called with are ignored."""
    weight32 = weight.detach().float().contiguous()
    bias32 = None if bias is None else bias.detach().float()

    def linear(x: torch.Tensor, _weight: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.float(), weight32, bias32).to(x.dtype)

    # for inspection (benchmarks/ab_hybrid_cpu.py); attributes of a function, which mypy does not model
    linear.weight32, linear.bias32 = weight32, bias32  # type: ignore[attr-defined]
    return linear


def _needs_float32(layer: torch.nn.Module) -> bool:
    """True for a 2-D half-precision weight that vLLM's dispatch left on the bf16 `F.linear` fallback (the paths
    that took the layer elsewhere -- oneDNN, sgl, zentorch -- drop or repack the weight when allowed to)."""
    weight = cast(torch.Tensor, layer.weight)
    return not weight.is_meta and weight.ndim == 2 and weight.numel() > 0 and weight.dtype in HALF_DTYPES


def cpu_lacks_bf16_matmul() -> bool:
    """True on a CPU-only machine whose CPU has neither AVX-512 BF16 nor Arm BF16: where vLLM's CPU backend takes its
    slow bf16 fallbacks (this module's Linears, `gdn_cpu`'s Gated DeltaNet prefill)."""
    if torch.cuda.is_available():
        return False
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    return not (torch.cpu._is_avx512_bf16_supported() or is_arm_bf16())


def install() -> bool:
    """Make vLLM's CPU unquantized GEMM dispatch compute half-precision Linears in float32 where the CPU has no
    bf16 matmul (no AVX-512 BF16, no Arm BF16); True if installed (idempotent)."""
    if not cpu_lacks_bf16_matmul():
        return False  # a GPU, or oneDNN runs bf16 matmuls natively
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "quantkit_float32", False):
        return True

    def dispatch_float32(layer: torch.nn.Module, remove_weight: bool) -> None:
        linear = layer.weight.ndim == 2  # before dispatch: on BF16 CPUs it repacks (E, 1, 4) conv weights into 2-D
        dispatch(layer, remove_weight)
        if not (linear and _needs_float32(layer)):
            return
        weight = cast(torch.Tensor, layer.weight)
        # nn.Module.__setattr__ takes any value; torch's stub admits only tensors and modules
        layer.cpu_linear = float32_linear(weight, getattr(layer, "bias", None))  # type: ignore[assignment]
        if remove_weight:  # as vLLM's oneDNN path does: the layer computes from its own copy only
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)

    dispatch_float32.quantkit_float32 = True  # type: ignore[attr-defined]  # a function attribute (the install mark)
    utils.dispatch_cpu_unquantized_gemm = dispatch_float32
    return True
