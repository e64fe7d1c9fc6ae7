"""The kernels of each scheme of `quantkit.formats.schemes`, keyed by scheme name: what serves a quantized
Linear on CUDA (`quantkit.serve.quant_method`). A scheme's entry holds

    quantize(x (M, K), input_global_scale or None) -> its activation operands, bit-exact with
                                                      `Scheme.quantize_activation`
    gemm(*activation operands, *weight tensors (in `Scheme.tensors` order), bias, out_dtype=...) -> (M, N)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantkit.formats.schemes import FP8_BLOCK, NVFP4, Scheme
from quantkit.kernels.fp8_gemm import fp8_block_gemm
from quantkit.kernels.nvfp4_gemm import nvfp4_gemm
from quantkit.kernels.quantize_fp8 import quantize_fp8_per_token
from quantkit.kernels.quantize_nvfp4 import quantize_nvfp4_per_token


@dataclass(frozen=True)
class SchemeKernels:
    """A scheme's fused activation quantizer and GEMM (signatures in the module docstring)."""

    quantize: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, ...]]
    gemm: Callable[..., torch.Tensor]


KERNELS: dict[str, SchemeKernels] = {
    FP8_BLOCK.name: SchemeKernels(lambda x, _input_global_scale: quantize_fp8_per_token(x), fp8_block_gemm),
    NVFP4.name: SchemeKernels(quantize_nvfp4_per_token, nvfp4_gemm),
}


def quantized_linear(scheme: Scheme, x: torch.Tensor, weights: Sequence[torch.Tensor], bias: torch.Tensor | None,
                     input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """y (..., N) = quantize(x) @ W^T (+ bias) in x's dtype, x (..., K), `weights` in `scheme.tensors` order.

    row_amax (..., 1): the whole row's max |x| when x is a tensor-parallel slice of K; the activations are then
    quantized by the reference (`scheme.quantize_activation`, pure torch), else by the fused kernel."""
    kernels = KERNELS[scheme.name]
    x2 = x.reshape(-1, x.shape[-1])
    if row_amax is None:
        activation = kernels.quantize(x2, input_global_scale)
    else:
        activation = scheme.quantize_activation(x2, row_amax=row_amax.reshape(-1, 1))
    out = kernels.gemm(*activation, *weights, bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])
