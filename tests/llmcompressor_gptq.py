"""llm-compressor's GPTQ on given weights, Hessians and scales (run by tests/test_gptq.py in .venv-llmcompressor).

    python llmcompressor_gptq.py CASES.pt OUT.pt

CASES.pt: a list of dicts {scheme: "fp8_block" | "nvfp4", actorder: None | "weight", w (N, K) float64, h (K, K)
float64, weight_scale (decode scales as quantkit's GPTQ returns them), weight_global_scale (nvfp4: decode, (1,))}.
OUT.pt: the list of llm-compressor's dequantized weights (N, K), float64, from `quantize_weight` (llmcompressor
0.14.0.1) with compressed-tensors' args for our grids: FP8 E4M3 in 128x128 blocks (strategy "block"), NVFP4
(strategy "tensor_group", groups of 16, its global scale an ENCODE scale: 1 / our decode one). Its working
precision GPTQ_PRECISION is set to float64, as quantkit's reference tests run GPTQ.
"""

import sys

import llmcompressor.modifiers.gptq.gptq_quantize as gptq_quantize
import llmcompressor.modifiers.gptq.helpers as gptq_helpers
import torch
from compressed_tensors.quantization import QuantizationArgs

gptq_quantize.GPTQ_PRECISION = gptq_helpers.GPTQ_PRECISION = torch.float64


def quantize(case: dict) -> torch.Tensor:
    if case["scheme"] == "fp8_block":
        args = QuantizationArgs(
            num_bits=8,
            type="float",
            strategy="block",
            block_structure=[128, 128],
            symmetric=True,
            actorder=case["actorder"],
        )
        global_scale = None
    else:
        args = QuantizationArgs(
            num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, actorder=case["actorder"]
        )
        global_scale = 1.0 / case["weight_global_scale"].double()
    scale = case["weight_scale"].double()[None]
    q, _, rtn_fallback = gptq_quantize.quantize_weight(
        case["w"].clone()[None], case["h"].clone()[None], scale, torch.zeros_like(scale), global_scale, args
    )
    assert not rtn_fallback.any(), "llm-compressor fell back to round to nearest (Hessian not positive definite)"
    return q[0]


if __name__ == "__main__":
    cases = torch.load(sys.argv[1])
    torch.save([quantize(case) for case in cases], sys.argv[2])
