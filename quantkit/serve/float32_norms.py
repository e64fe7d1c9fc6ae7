"""SmoothQuant's folded norm weights served in float32, as the checkpoint stores them.

SmoothQuant divides a norm's weight by its factors s (`quantkit.calibrate.smoothquant`); w / s is not a bf16
number, so quantized checkpoints keep those norms float32 (docs/checkpoint-format.md) and every other unquantized
tensor in the source's dtype. vLLM creates a norm's weight in the served dtype and its default loader copies the
checkpoint into it: served in bf16, each smoothed channel would move by up to 2^-9 relative (KL shifts of the order
of SmoothQuant's own effect on small models).

`install()` (called by the plugin in every vLLM process) gives the weight of vLLM's `RMSNorm` and `GemmaRMSNorm`
(and quantkit's own residual norms, `quantkit.serve.models` / `.hybrid`), when the model is served under
quantkit's quant method from a SmoothQuant checkpoint, the loader `keep_float32`: a float32 checkpoint tensor
becomes the parameter's data as it is. Such a checkpoint of a float32 source also keeps its unsmoothed norms (the
final one) float32, and they are served so (the loader cannot tell them apart); a bf16 source stores them bf16.
vLLM's native rms_norm computes `normalized.to(weight.dtype) * weight` in float32 then rounds once to the served
dtype (`vllm.ir.ops.layernorm`; its C kernels accept only matching dtypes, so mixed dtypes take that path);
GemmaRMSNorm already forms 1 + w in float32. GatedNorm's gate_down, whose columns SmoothQuant multiplies by s, gets
the same loader and runs in its weight's dtype (`quantkit.serve.models.gated_norm_gate`).
"""

from __future__ import annotations

import torch


def keep_float32(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """weight_loader: a float32 checkpoint tensor of the parameter's shape replaces its data unrounded; anything
    else is copied as vLLM's `default_weight_loader` does."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    if loaded_weight.dtype == torch.float32 and param.dtype != torch.float32 and loaded_weight.shape == param.shape:
        param.data = loaded_weight.to(param.device)
    else:
        default_weight_loader(param, loaded_weight)


def serving_smoothed_checkpoint() -> bool:
    """True while vLLM builds a model under quantkit's quant method (`quant_method: quantkit`) from a checkpoint
    SmoothQuant folded its factors into (`quantization_config.smoothquant` set). Without SmoothQuant nothing needs
    float32: a float32 source's norms are then served as the unquantized BF16 row serves them, rounded."""
    from vllm.config import get_current_vllm_config

    from quantkit.serve.quant_method import QuantkitQuantConfig

    try:
        quant_config = get_current_vllm_config().quant_config
    except AssertionError:  # no vLLM config: a module built outside an engine
        return False
    return isinstance(quant_config, QuantkitQuantConfig) and quant_config.smoothquant is not None


def mark_float32_loadable(*params: torch.Tensor | None) -> None:
    """Give `params` the `keep_float32` loader when the model is served from a SmoothQuant checkpoint under
    quantkit's quant method."""
    if not serving_smoothed_checkpoint():
        return
    for param in params:
        if isinstance(param, torch.nn.Parameter):
            # vLLM's loading protocol: a weight_loader attribute on the Parameter (no such attribute in torch's stub)
            param.weight_loader = keep_float32  # type: ignore[attr-defined]


def install() -> bool:
    """Wrap the constructors of vLLM's RMSNorm and GemmaRMSNorm to mark their weight (idempotent); True if done now."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    installed = False
    for cls in (RMSNorm, GemmaRMSNorm):
        init = cls.__init__
        if getattr(init, "quantkit_float32", False):
            continue

        def wrapped(self, *args, _init=init, **kwargs) -> None:
            _init(self, *args, **kwargs)
            mark_float32_loadable(getattr(self, "weight", None))

        wrapped.quantkit_float32 = True  # type: ignore[attr-defined]  # a function attribute (the install mark)
        cls.__init__ = wrapped
        installed = True
    return installed
