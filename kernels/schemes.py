"""The kernels of each scheme of `quantkit.formats.schemes`, keyed by scheme name: what serves a quantized
Linear on CUDA (`quantkit.serve.quant_method`). A scheme's entry holds

    quantize(x (M, K), input_global_scale or None, *, hadamard=0) -> its activation operands, bit-exact with
                                                      `Scheme.quantize_activation` (of x's online block
                                                      Hadamard transform when hadamard > 0)
    gemm(*activation operands, *weight tensors (in `Scheme.tensors` order), bias, out_dtype=...) -> (M, N)
    grouped_gemm(*activation operands, *stacked weight tensors, expert_offsets, row_index=..., out_dtype=...)
                                                   -> (S, N)  (`quantkit.kernels.grouped_gemm`)

`quantized_linear` serves a quantized Linear, `grouped_quantized_linear` one projection of a MoE layer's
routed experts (gate_up or down) over rows sorted by expert (`quantkit.kernels.expert_sort`). A FusedMoE
forward (x (T, H), topk_ids / topk_weights (T, k), w13 = gate rows then up rows, per-expert tensors stacked):

    sort = sort_by_expert(topk_ids, E)
    h = grouped_quantized_linear(scheme, x, sort.expert_offsets, w13, token_index=sort.token_index,
                                 input_global_scale=w13_input_scale)          # (T*k, 2I), sorted rows
    a = silu(h[:, :I]) * h[:, I:]                                             # the model's activation
    y = grouped_quantized_linear(scheme, a, sort.expert_offsets, w2, input_global_scale=w2_input_scale)
    out = combine_expert_rows(y, sort, topk_weights)                          # float32 (T, H)

Rows from offsets[E] on (pairs routed to no expert of this rank) are zeros in h and y; the combine skips them.
The FusedMoE reference (`quantkit.quantize.fake_quant.FakeQuantExperts`) quantizes the same inputs per expert:
the block input before gate/up, the intermediate before down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantkit.formats.constants import ActivationScale
from quantkit.formats.schemes import FP8_BLOCK, NVFP4, NVFP4_FOUR_OVER_SIX, Scheme
from quantkit.kernels.fp8_gemm import fp8_block_gemm
from quantkit.kernels.grouped_gemm import fp8_block_grouped_gemm, nvfp4_grouped_gemm
from quantkit.kernels.nvfp4_gemm import nvfp4_gemm
from quantkit.kernels.quantize_fp8 import quantize_fp8_per_token
from quantkit.kernels.quantize_nvfp4 import quantize_nvfp4_four_over_six, quantize_nvfp4_per_token


@dataclass(frozen=True)
class SchemeKernels:
    """A scheme's fused activation quantizer, GEMM and grouped GEMM (signatures in the module docstring)."""

    quantize: Callable[..., tuple[torch.Tensor, ...]]
    gemm: Callable[..., torch.Tensor]
    grouped_gemm: Callable[..., torch.Tensor]


def _quantize_fp8(
    x: torch.Tensor, _input_global_scale: torch.Tensor | None, *, hadamard: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 scheme's quantizer in the common signature (per token only: no input scale to use)."""
    return quantize_fp8_per_token(x, hadamard=hadamard)


KERNELS: dict[str, SchemeKernels] = {
    FP8_BLOCK.name: SchemeKernels(_quantize_fp8, fp8_block_gemm, fp8_block_grouped_gemm),
    NVFP4.name: SchemeKernels(quantize_nvfp4_per_token, nvfp4_gemm, nvfp4_grouped_gemm),
    NVFP4_FOUR_OVER_SIX.name: SchemeKernels(quantize_nvfp4_four_over_six, nvfp4_gemm, nvfp4_grouped_gemm),
}


def quantized_linear(
    scheme: Scheme,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    input_global_scale: torch.Tensor | None = None,
    row_amax: torch.Tensor | None = None,
    hadamard: int = 0,
) -> torch.Tensor:
    """y (..., N) = quantize(x) @ W^T (+ bias) in x's dtype, x (..., K), `weights` in `scheme.tensors` order.

    row_amax (..., 1): the whole row's max |x| when x is a tensor-parallel slice of K; the activations are then
    quantized by the reference (`scheme.quantize_activation`, pure torch), else by the fused kernel.
    hadamard > 0: a rotated down_proj's online block Hadamard, applied to x inside the fused quantizer
    (`quantkit.kernels.hadamard`; the weights are stored transformed); not with row_amax (the caller
    transforms a TP slice itself)."""
    kernels = KERNELS[scheme.name]
    x2 = x.reshape(-1, x.shape[-1])
    if row_amax is None:
        activation = kernels.quantize(x2, input_global_scale, hadamard=hadamard)
    elif hadamard:
        raise ValueError("quantized_linear: transform a tensor-parallel slice before quantizing it (row_amax)")
    else:
        activation = scheme.quantize_activation(x2, row_amax=row_amax.reshape(-1, 1))
    out = kernels.gemm(*activation, *weights, bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def grouped_quantized_linear(
    scheme: Scheme,
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    token_index: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
    row_amax: torch.Tensor | None = None,
    hadamard: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One projection of a MoE layer's routed experts, y (S, N) in sorted-row order (`out_dtype`, default x's):

        y[s] = quantize(x_s) @ W_e^T    for offsets[e] <= s < offsets[e + 1]; zeros from offsets[E] on

    x_s = x[token_index[s]] when token_index (S,) is given (x (T, K): the layer input, one row per token; the
    gate_up projection, `ExpertSort.token_index`), else x[s] (x (S, K) already sorted: the down projection's
    input). expert_offsets (E + 1,) int32/int64 (`ExpertSort.expert_offsets`). weights: the scheme's
    `tensors`, in that order, each stacked over the E experts of this rank (`quantkit.kernels.grouped_gemm`):
    fp8_block weight (E, N, K), weight_scale (E, ceil(N/128), ceil(K/128)) or (E, N, ceil(K/128)); nvfp4
    weight_packed (E, N, Kp/2), weight_scale (E, N, Kp/16), weight_global_scale (E,) / (E, 1) / (E, N).

    Activations are quantized as `scheme.quantize_activation` does each expert's rows (bit-exact), by the
    fused quantizer kernels: per token (input_global_scale None), each row of x once, the GEMM gathering the
    sorted rows; NVFP4 static (input_global_scale (E,) float32, each expert's decode scale): the sorted rows
    x_s, each with its expert's scale. row_amax (rows of x, 1): each row's whole max |x| when x holds a
    tensor-parallel slice of K (per token only): the reference quantizer (pure torch) then quantizes.
    hadamard > 0: a rotated down projection's online block Hadamard, applied to each row inside the fused quantizer
    (as `quantized_linear`'s; the weights are stored transformed); not with row_amax (the caller transforms a TP
    slice itself)."""
    kernels = KERNELS[scheme.name]
    num_experts = weights[0].shape[0]
    if hadamard and row_amax is not None:
        raise ValueError("grouped_quantized_linear: transform a tensor-parallel slice before quantizing it (row_amax)")
    row_index = token_index  # the GEMM gathers x's rows; None once the sorted rows are quantized themselves
    if input_global_scale is not None:
        if ActivationScale.STATIC not in scheme.activation_scales:
            raise ValueError(f"grouped_quantized_linear: scheme {scheme.name} has no static activation scale")
        if input_global_scale.shape != (num_experts,):
            raise ValueError(
                f"grouped_quantized_linear: input_global_scale must be ({num_experts},), one per expert, "
                f"got {tuple(input_global_scale.shape)}"
            )
        rows = x if token_index is None else x[token_index]
        sorted_row = torch.arange(rows.shape[0], device=x.device)
        expert = torch.searchsorted(expert_offsets[1:].to(torch.int64), sorted_row, right=True).clamp(
            max=num_experts - 1
        )
        activation = kernels.quantize(rows, input_global_scale.float()[expert], hadamard=hadamard)
        row_index = None
    elif row_amax is None:
        activation = kernels.quantize(x, None, hadamard=hadamard)
    else:
        activation = scheme.quantize_activation(x, row_amax=row_amax)
    return kernels.grouped_gemm(
        *activation, *weights, expert_offsets, row_index=row_index, out_dtype=out_dtype or x.dtype
    )
