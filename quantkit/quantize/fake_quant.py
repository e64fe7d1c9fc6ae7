"""Fake-quant forward in transformers: the numerical reference the vLLM serving path is held against.

`load_fake_quant_model(dir)` rebuilds the model from a quantkit checkpoint: every quantized Linear
becomes a `FakeQuantLinear` whose weight is the checkpoint's decoded weight (exact) and whose input is
quantized-dequantized per token (FP8, NVFP4) or with the static NVFP4 scale, then multiplied in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import quantkit.models  # noqa: F401
from quantkit.formats.schemes import Scheme, checkpoint_suffixes, get_scheme, scheme_from_config


class FakeQuantLinear(torch.nn.Module):
    """y = fake_quant(x) @ W_decoded^T + b, in float32, cast to the input dtype."""

    def __init__(self, scheme: Scheme, weight: torch.Tensor, bias: torch.Tensor | None, input_global_scale: torch.Tensor | None,
                 quantize_activations: bool = True) -> None:
        super().__init__()
        self.scheme = scheme
        self.quantize_activations = quantize_activations
        self.register_buffer("weight", weight.float())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.register_buffer("input_global_scale", input_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.scheme.fake_quant_activation(x, self.input_global_scale) if self.quantize_activations else x.float()
        return torch.nn.functional.linear(xq, self.weight, self.bias).to(x.dtype)


def read_quantization_config(model_dir: str | Path) -> dict:
    """config.json's quantization_config, checked (quant_method quantkit, `scheme_from_config`)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    qc = json.loads(config_path.read_text()).get("quantization_config")
    if qc is None:
        raise ValueError(f"{model_dir}: config.json has no quantization_config (not a quantized checkpoint)")
    if qc.get("quant_method") != "quantkit":
        raise ValueError(f"{model_dir}: quant_method {qc.get('quant_method')!r} is not 'quantkit'")
    scheme_from_config(qc, f"{config_path} quantization_config")
    return qc


def load_fake_quant_model(model_dir: str | Path, quantize_activations: bool = True) -> torch.nn.Module:
    """Model with FakeQuantLinear modules, from a quantkit-quantized checkpoint (float32, eval mode).

    quantize_activations=False gives the weight-only ablation (decoded weights, float32 activations)."""
    model_dir = Path(model_dir)
    qc = read_quantization_config(model_dir)
    scheme = get_scheme(qc["scheme"])
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_file(str(model_dir / "model.safetensors"))
    for name in qc["quantized_modules"]:
        linear = model.get_submodule(name)
        tensors = {s: state.pop(f"{name}.{s}") for s in checkpoint_suffixes() if f"{name}.{s}" in state}
        weight = scheme.decode(tensors, linear.in_features)
        if tuple(weight.shape) != tuple(linear.weight.shape):
            raise ValueError(f"{model_dir}: {name} decodes to {tuple(weight.shape)}, the model expects {tuple(linear.weight.shape)}")
        bias = state.pop(f"{name}.bias", None)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, FakeQuantLinear(scheme, weight, bias, tensors.get("input_global_scale"), quantize_activations))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in qc["quantized_modules"]]  # those are set above
    if missing or unexpected:
        raise ValueError(f"{model_dir}: checkpoint inconsistent with its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model
