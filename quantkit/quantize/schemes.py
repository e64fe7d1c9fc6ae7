"""The two quantkit schemes as checkpoint tensors and as fake-quant operations.

For a quantized Linear `<name>` (weight (N, K)), the checkpoint holds (docs/checkpoint-format.md):

fp8_block  <name>.weight                float8_e4m3fn (N, K)
           <name>.weight_scale          float32 (ceil(N/128), ceil(K/128))   decode scale per 128x128 block
nvfp4      <name>.weight_packed         uint8 (N, K_pad/2)                   E2M1 codes, low nibble first
           <name>.weight_scale          float8_e4m3fn (N, K_pad/16)          decode scale per group of 16
           <name>.weight_global_scale   float32 (1,)                         per-tensor decode scale
           <name>.input_global_scale    float32 (1,)   static activation scale only (decode, amax / 2688)

All scales are DECODE scales (value = code * scale), unlike compressed-tensors' `*_global_scale`
(encode, the reciprocal). Activations are quantized at run time: FP8 per token; NVFP4 per token
(the paper's) or with the static `input_global_scale`.
"""

from __future__ import annotations

import torch

from quantkit.formats import (
    NVFP4Tensor,
    dequantize_fp8_block,
    dequantize_fp8_per_token,
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_fp8_per_token,
    quantize_nvfp4_activation,
    quantize_nvfp4_weight,
)

SCHEMES = ("fp8_block", "nvfp4")


def encode_weight(scheme: str, weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """Weight (N, K) -> {tensor suffix: tensor} for the checkpoint."""
    if scheme == "fp8_block":
        q, scale = quantize_fp8_block(weight, name=name)
        return {"weight": q, "weight_scale": scale}
    if scheme == "nvfp4":
        t = quantize_nvfp4_weight(weight, name=name)
        return {"weight_packed": t.packed, "weight_scale": t.block_scale, "weight_global_scale": t.global_scale.reshape(1)}
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {list(SCHEMES)}")


def decode_weight(scheme: str, tensors: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """Checkpoint tensors of one Linear -> float32 weight (N, K)."""
    if scheme == "fp8_block":
        return dequantize_fp8_block(tensors["weight"], tensors["weight_scale"])
    if scheme == "nvfp4":
        t = NVFP4Tensor(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"].reshape(()), in_features)
        return dequantize_nvfp4(t)
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {list(SCHEMES)}")


def fake_quant_activation(
    scheme: str, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize-dequantize activations (..., K) as the scheme does at run time; float32 result.

    row_amax (..., 1): per-token scales from the whole row when x is a tensor-parallel slice of it.
    """
    if scheme == "fp8_block":
        return dequantize_fp8_per_token(*quantize_fp8_per_token(x, row_amax=row_amax))
    if scheme == "nvfp4":
        if input_global_scale is None:
            return dequantize_nvfp4(quantize_nvfp4_activation(x, "per_token", row_amax=row_amax))
        return dequantize_nvfp4(quantize_nvfp4_activation(x, "static", input_global_scale.reshape(())))
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {list(SCHEMES)}")
