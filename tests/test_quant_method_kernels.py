"""The vLLM quant method's Triton path (`QUANTKIT_KERNEL=triton`, what CUDA runs) equals its torch-emulation
path (what CPU runs, held against the fake-quant reference in tests/test_serve_quantized.py), layer by layer.

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

from quantkit.formats.schemes import SCHEMES
from quantkit.serve.quant_method import KERNEL_ENV, QuantkitLinearMethod, QuantkitQuantConfig

N, K = 136, 200  # neither a multiple of 128 nor (K) of the NVFP4 K tile


def _layer(scheme, activation_scale, kernel, weight, monkeypatch):
    config = QuantkitQuantConfig({"format_version": 1, "scheme": scheme, "activation_scale": activation_scale,
                                  "quantized_modules": ["proj"]})
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


@pytest.mark.parametrize("scheme, activation_scale", [("fp8_block", "per_token"), ("nvfp4", "per_token"), ("nvfp4", "static")])
def test_triton_path_equals_torch_emulation(scheme, activation_scale, monkeypatch):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(2, 3, K, generator=g) * torch.tensor([0.1, 1.0, 30.0])[:, None]
    bias = torch.randn(N, generator=g)
    emulation, emulation_layer = _layer(scheme, activation_scale, "torch", weight, monkeypatch)
    triton, triton_layer = _layer(scheme, activation_scale, "triton", weight, monkeypatch)
    want = emulation.apply(emulation_layer, x, bias)
    got = triton.apply(triton_layer, x, bias)
    assert got.shape == want.shape == (2, 3, N) and got.dtype == torch.float32
    static = emulation_layer.input_global_scale if activation_scale == "static" else None
    xq = SCHEMES[scheme].fake_quant_activation(x, static)
    summed = xq.abs() @ emulation_layer.weight_dequantized.abs().T + bias.abs()
    tol = (K + 1) * 2.0**-21 * summed  # see the module docstring
    assert bool(((got - want).abs() <= tol).all()), f"max err/tol {((got - want).abs() / tol).max():.3g}"


def test_kernel_choice_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="QUANTKIT_KERNEL='cuda'"):
        _layer("fp8_block", "per_token", "cuda", torch.randn(N, K), monkeypatch)
