"""Reference numeric formats (plain torch, CPU-friendly): FP8 E4M3 W8A8 and NVFP4 W4A4 (paper 000, App. A.4.2).

One module a format, each opening with the docstring that fixes its conventions (decode scales, rounding,
saturation, zero handling, padding, nibble order); constants live in `constants`. Kernels and the serving
path import these constants and are tested against these functions. `schemes` is the registry of the
quantization schemes built on them (checkpoint contract, encode/decode, activation fake-quant).
"""

from quantkit.formats.constants import (
    E2M1_VALUES,
    F4E2M1_MAX,
    F8E4M3_MAX,
    FP8_WEIGHT_BLOCK,
    NVFP4_GROUP,
)
from quantkit.formats.fp8 import (
    dequantize_fp8_block,
    dequantize_fp8_per_token,
    expand_block_scales,
    quantize_fp8_block,
    quantize_fp8_per_token,
)
from quantkit.formats.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    nvfp4_global_scale,
    pack_fp4,
    quantize_nvfp4,
    quantize_nvfp4_activation,
    quantize_nvfp4_weight,
    unpack_fp4,
)

__all__ = [
    "E2M1_VALUES",
    "F4E2M1_MAX",
    "F8E4M3_MAX",
    "FP8_WEIGHT_BLOCK",
    "NVFP4_GROUP",
    "NVFP4Tensor",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token",
    "dequantize_nvfp4",
    "expand_block_scales",
    "nvfp4_global_scale",
    "pack_fp4",
    "quantize_fp8_block",
    "quantize_fp8_per_token",
    "quantize_nvfp4",
    "quantize_nvfp4_activation",
    "quantize_nvfp4_weight",
    "unpack_fp4",
]
