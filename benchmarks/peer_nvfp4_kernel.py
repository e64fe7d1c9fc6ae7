"""What decoding each NVFP4 weight once saves when a peer's checkpoint is served on CPU
(`quantkit.serve.cpu.peer_kernels.DecodedOnceNvFp4LinearKernel` against vLLM's `EmulationNvFp4LinearKernel`, which
dequantizes the weight at every call).

For each rows count M and weight shape (N, K): milliseconds per call of both kernels on the same random layer (bf16
activations, as a served row) and their ratio (vLLM's / ours; > 1: ours is faster). Both compute the same bits
(tests/test_serve_quantized.py). Same process, alternating, each timed for SECONDS. Default shapes: Qwen2.5-0.5B's
qkv, gate_up and down; M = 1 is a decode step of one sequence, 256 a prefill chunk.
Usage: python benchmarks/peer_nvfp4_kernel.py [--rows 1 8 64 256] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch

SHAPES = [(1152, 896), (9728, 896), (896, 4864)]  # (N, K)


def seconds_per_call(fn: Callable[[], object], seconds: float) -> float:
    fn()  # warm-up (and our kernel's one decode)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def random_layer(n: int, k: int) -> torch.nn.Module:
    """A compressed-tensors NVFP4 layer as vLLM holds it: packed E2M1 codes, E4M3 group scales, global scales."""
    layer = torch.nn.Module()
    parameters = dict(
        weight=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
        weight_scale=(torch.rand(n, k // 16) * 4 + 0.25).to(torch.float8_e4m3fn),
        weight_global_scale=torch.tensor(0.02),
        input_global_scale_inv=torch.tensor(300.0),
    )
    for name, value in parameters.items():
        setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

    from quantkit.serve.cpu.peer_kernels import DecodedOnceNvFp4LinearKernel

    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| N x K | M | vLLM emulation (ms) | decoded once (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    theirs, ours = (
        EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig()),
        DecodedOnceNvFp4LinearKernel(NvFp4LinearLayerConfig()),
    )
    torch.manual_seed(0)
    for n, k in SHAPES:
        layer = random_layer(n, k)
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            t_theirs = seconds_per_call(lambda: theirs.apply_weights(layer, x), args.seconds)
            t_ours = seconds_per_call(lambda: ours.apply_weights(layer, x), args.seconds)
            print(f"| {n} x {k} | {m} | {1e3 * t_theirs:.3f} | {1e3 * t_ours:.3f} | {t_theirs / t_ours:.2f} |")


if __name__ == "__main__":
    main()
