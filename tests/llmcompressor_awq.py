"""llm-compressor's AWQ grid and weight means on given weights (run by tests/test_awq.py in .venv-llmcompressor).

    python llmcompressor_awq.py CASES.pt OUT.pt

CASES.pt: a list of dicts {scheme: "fp8_block" | "nvfp4", weights: [(N, K) float32, ...]} (the consumers of one
mapping). OUT.pt: {"grid": AWQModifier(n_grid=20, duo_scaling=True)._get_grid_search_params(), "means": [w_mean
(K,) per case from AWQModifier._compute_layer_means]}, the layers carrying compressed-tensors' weight args for our
grids: FP8 E4M3 in 128x128 blocks (strategy "block"), NVFP4 (strategy "tensor_group", groups of 16).
"""

import sys

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor.modifiers.transform.awq import AWQModifier


def args_of(scheme: str) -> QuantizationArgs:
    if scheme == "fp8_block":
        return QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True)
    return QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)


def layer_means(case: dict) -> torch.Tensor:
    layers = []
    for w in case["weights"]:
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w.clone()
        layer.quantization_scheme = QuantizationScheme(targets=["Linear"], weights=args_of(case["scheme"]))
        layers.append(layer)
    return AWQModifier._compute_layer_means(layers)


if __name__ == "__main__":
    cases = torch.load(sys.argv[1])
    grid = AWQModifier(n_grid=20, duo_scaling=True)._get_grid_search_params()
    torch.save({"grid": grid, "means": [layer_means(case) for case in cases]}, sys.argv[2])
