"""CPU kernels for the peers' checkpoints (compressed-tensors FP8_BLOCK and NVFP4 from llmcompressor).

vLLM's CPU backend has an FP8-block kernel only on AMX CPUs (Sapphire Rapids+) and no NVFP4 kernel at
all, so without these the comparison rows could not be served here. `register_cpu_emulation_kernels()`
(called by the plugin in every vLLM process) appends, as the LAST choice on the CPU platform:

- `EmulationFp8BlockScaledMMKernel` (ours): vLLM's own activation quantizer (QuantFP8, the checkpoint's
  1x128 activation groups) runs unchanged; the GEMM decodes A and B with their block scales and
  multiplies in float32. vLLM logs "Using EmulationFp8BlockScaledMMKernel" for each such layer.
- `DecodedOnceNvFp4LinearKernel` (ours): vLLM's `EmulationNvFp4LinearKernel` (activation quantize-dequantize
  with the checkpoint's static global scale, then matmul with the dequantized weight; registered by vLLM for
  CUDA/ROCm only) with each weight dequantized once, at its first call, instead of at every call: the same vLLM
  functions on the same tensors, so the same bits. Decoding every weight at every decode step made a peer's
  NVFP4 row ~2x slower to serve than quantkit's own (docs/results/methods-study-coder.md). It keeps a decoded
  copy of each NVFP4 weight in the activation dtype: the BF16 model's weight memory.

Both sum in the process's summation order, read per layer at load (`quantkit.serve.cpu.linear.summation_order`:
the numerics stage's second order), through `ordered_linear`: the default order is the code above, unchanged; a
second order takes the same operands (the activation quantized first, so its codes are unchanged). The FP8-block
GEMM decodes its weight at every call, so a second order permutes or splits it at every call too (one more gather
of the weight a call, about the cost of its decode).

On CUDA nothing changes: vLLM's own kernels serve these checkpoints.
"""

from __future__ import annotations

from typing import cast

import torch
from vllm.logger import init_logger
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
    ref_nvfp4_quant_dequant,
)
from vllm.platforms import PlatformEnum, current_platform

from quantkit.formats.constants import NVFP4_GROUP
from quantkit.formats.fp8 import expand_block_scales
from quantkit.serve.cpu.linear import Linear, ordered_linear, summation_order

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM configures that logger tree


class EmulationFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
    """W8A8 FP8 with block-scaled weights in plain torch: decode, float32 matmul (CPU fallback)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.activation_group_shape = config.activation_quant_key.scale.group_shape  # (1, 128) per token group
        self.summation_order = "default"  # read at load (process_weights_after_loading)
        logger.info_once("Using EmulationFp8BlockScaledMMKernel (quantkit, CPU) for FP8 block-scaled GEMM")

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        """vLLM: (True, None) on the CPU platform, else (False, why)."""
        return (True, None) if current_platform.is_cpu() else (False, "quantkit's FP8-block emulation is for CPU")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM: keep the checkpoint layout (weight (N, K) E4M3, block scales (ceil(N/bn), ceil(K/bk))), decoded
        by the GEMM; note the summation order of this load."""
        self.summation_order = summation_order()

    def apply_block_scaled_mm(
        self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor
    ) -> torch.Tensor:
        """A (M, K) E4M3 with As (M, ceil(K/g)) per-group decode scales; B (N, K) E4M3 with Bs block scales."""
        a = A.float() * expand_block_scales(As.float(), tuple(self.activation_group_shape), A.shape)
        b = B.float() * expand_block_scales(Bs.float(), tuple(self.weight_group_shape), B.shape)
        if self.summation_order == "default":
            return a @ b.T
        return ordered_linear(b, self.summation_order, gemm="torch")(a, b, None)


class DecodedOnceNvFp4LinearKernel(EmulationNvFp4LinearKernel):
    """vLLM's NVFP4 emulation with the weight dequantized once per activation dtype (kept on the layer as
    `quantkit_dequantized_weight`, (N, K)) instead of at every call; otherwise `run_nvfp4_emulations` step by step.
    In a second summation order (read at load) the matmul is `ordered_linear`'s on the same operands, the bias added
    after it as in the default order."""

    def __init__(self, config) -> None:
        super().__init__(config)
        logger.info_once("Using DecodedOnceNvFp4LinearKernel (quantkit, CPU) for NVFP4 GEMM")
        self.summation_order = "default"  # read at load (process_weights_after_loading)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM's (the E2M1 table to the weight's device); note the summation order of this load."""
        super().process_weights_after_loading(layer)
        self.summation_order = summation_order()

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM: x (M, K) -> (M, N), as `EmulationNvFp4LinearKernel.apply_weights` computes it."""
        weight = getattr(layer, "quantkit_dequantized_weight", None)
        if weight is None or weight.dtype != x.dtype:
            codes, scales = cast(torch.Tensor, layer.weight).data, cast(torch.Tensor, layer.weight_scale).data
            weight = dequantize_to_dtype(
                codes.view(torch.uint8),
                scales,
                layer.weight_global_scale,
                x.dtype,
                NVFP4_GROUP,
                swizzle=False,
            )
            layer.quantkit_dequantized_weight = weight
            layer.quantkit_ordered_linear = ordered_linear(  # type: ignore[assignment]
                weight, self.summation_order, gemm="torch"
            )
        x_dq = ref_nvfp4_quant_dequant(x, layer.input_global_scale_inv, block_size=NVFP4_GROUP)
        if self.summation_order == "default":
            out = torch.matmul(x_dq, weight.t())
        else:
            out = cast(Linear, layer.quantkit_ordered_linear)(x_dq, weight, None)
        return out if bias is None else out + bias


def register_cpu_emulation_kernels() -> None:
    """Append the emulation kernels to vLLM's CPU kernel lists (idempotent)."""
    for table, kernel in (
        (linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS, EmulationFp8BlockScaledMMKernel),
        (linear_kernels._POSSIBLE_NVFP4_KERNELS, DecodedOnceNvFp4LinearKernel),
    ):
        kernels = table.setdefault(PlatformEnum.CPU, [])
        if kernel not in kernels:
            kernels.append(kernel)
