"""vLLM serves ModelOpt's NVFP4 AWQ exports (`quant_algo: NVFP4_AWQ`), which vLLM itself refuses.

ModelOpt's AWQ divides each linear's input channels by per-channel scales and multiplies its weight columns by them.
Its export folds the input side into the preceding norm where one feeds the linear alone (q/k/v, gate/up); where none
can take it, it stores the factor as `<linear>.pre_quant_scale` (K,) and the checkpoint's quant_algo becomes
NVFP4_AWQ: the served layer computes y = Q(W') Q(pre_quant_scale * x), with the activation global scale calibrated
on the scaled input (TensorRT-LLM's semantics). Under grouped-query attention o_proj keeps one: a factor per query
head's channel cannot fold into v_proj, whose rows several query heads share (SmolLM2-135M, 2026-12-01).

`install()` adds NVFP4_AWQ to vLLM's ModelOpt table as vLLM's own extension seam asks (modelopt.LINEAR_ALGOS, the
algo validation list, LINEAR_METHOD_BUILDERS): vLLM's generic `ModelOptLinearMethod` for NVFP4 with a `FormatScheme`
that registers `pre_quant_scale` (ones where the checkpoint stores none: the folded layers) and multiplies the input
by it before the NVFP4 kernel (the same kernel as NVFP4's). Dense linears only: vLLM's NVFP4 MoE method reads no
pre_quant_scale, so an AWQ export with quantized experts fails to load in vLLM rather than serve without it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.parameter import RowvLLMParameter

ALGO = "NVFP4_AWQ"
SCALE = "pre_quant_scale"


class PreQuantScaleParameter(RowvLLMParameter):
    """The (K,) input-channel factor of one served linear: split along K for a row-parallel layer; for a fused
    column-parallel one (q/k/v, gate/up) every projection must store the same factor (they read the same input)."""

    def _load_shared(self, loaded_weight: torch.Tensor) -> None:
        first = not getattr(self, "quantkit_loaded", False)
        if not first and not torch.equal(self.data, loaded_weight.to(self.data.dtype)):
            raise ValueError(
                f"ModelOpt {ALGO}: the fused projections of one layer store different {SCALE} tensors; they read the "
                "same input, so one factor must serve them all"
            )
        self.data.copy_(loaded_weight)
        self.quantkit_loaded = True

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self._load_shared(loaded_weight)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self._load_shared(loaded_weight)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self._load_shared(loaded_weight)


class PreQuantScale(modelopt.FormatScheme):
    """NVFP4 with AWQ's unfolded input factor: x -> pre_quant_scale * x (in x's dtype), then the NVFP4 kernel."""

    def extra_weights(self, layer, shapes, ctx, wl) -> None:
        data = torch.ones(shapes.input_size_per_partition, dtype=shapes.params_dtype)
        layer.register_parameter(SCALE, PreQuantScaleParameter(data=data, input_dim=0, weight_loader=wl))

    def post_process(self, layer) -> None:
        scale = getattr(layer, SCALE)
        layer.quantkit_pre_quant_scale = None if bool((scale.data == 1).all()) else scale.data  # folded: nothing to do

    def apply(self, layer, x, bias, kernel_apply):
        scale = layer.quantkit_pre_quant_scale
        return kernel_apply(layer, x if scale is None else x * scale.to(x.dtype), bias)


def build_awq_linear_method(config, prefix: str) -> modelopt.ModelOptLinearMethod:
    """vLLM's NVFP4 linear method for `prefix`, with the AWQ input factor."""
    spec, ctx, _ = modelopt.resolve("NVFP4", config, prefix)
    return modelopt.ModelOptLinearMethod(spec, ctx, PreQuantScale())


def install() -> None:
    """Teach vLLM's ModelOpt support the NVFP4_AWQ algo (idempotent)."""
    modelopt.LINEAR_ALGOS.setdefault(ALGO, modelopt.LINEAR_ALGOS["NVFP4"])
    if ALGO not in modelopt.QUANT_ALGOS:
        modelopt.QUANT_ALGOS.append(ALGO)
    modelopt.LINEAR_METHOD_BUILDERS.setdefault(ALGO, build_awq_linear_method)
