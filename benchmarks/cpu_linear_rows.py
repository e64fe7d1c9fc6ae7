"""Where a float32 matmul beats vLLM's oneDNN bf16 kernel on this CPU (the row threshold of
`quantkit.serve.cpu.linear`, benchmarks/README.md "Measurements behind design choices").

For each rows count M and weight shape (N, K): GFLOP/s of vLLM's `onednn_mm` on a prepacked bf16 weight, of
`F.linear(x.float(), w32).to(bfloat16)` (what cpu_linear computes, the conversions included), and their ratio
(float32 / bf16 speed; > 1: float32 is faster); then the emulated rows' float32 GEMM on float32 operands:
`F.linear` (PyTorch: MKL) against vLLM's `onednn_mm` on a prepacked float32 weight (`default_linear`'s two kernels).
Same process, alternating, each timed for SECONDS. Default shapes: Qwen2.5-0.5B's qkv, gate_up, down and LM head.
Usage: python benchmarks/cpu_linear_rows.py [--rows 1 16 32 64 128 256 1024 4096] [--seconds 0.4]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(1152, 896), (9728, 896), (896, 4864), (151936, 896)]  # (N, K)


def seconds_per_call(fn: Callable[[], object], seconds: float) -> float:
    fn()  # warm-up (oneDNN creates its primitive on the first call of a shape)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 1024, 4096])
    parser.add_argument("--seconds", type=float, default=0.4)
    args = parser.parse_args()
    from vllm import _custom_ops as ops

    from quantkit.serve.cpu.linear import cpu_vendor

    print(
        f"{platform.machine()} {cpu_vendor()}, {torch.get_num_threads()} threads, AVX-512 BF16 "
        f"{torch.cpu._is_avx512_bf16_supported()}, AMX {torch.cpu._is_amx_tile_supported()}, torch {torch.__version__}"
    )
    print(
        "| rows | N x K | oneDNN bf16 GFLOP/s | float32 GFLOP/s | float32 / bf16 "
        "| float32 GEMM: F.linear GFLOP/s | oneDNN float32 GFLOP/s | oneDNN / F.linear |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, k in SHAPES:
        weight = torch.randn(n, k).bfloat16()
        handle, weight32 = ops.create_onednn_mm(weight.t(), 32), weight.float()
        handle32 = ops.create_onednn_mm(weight32.t(), 32)
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            x32 = x.float()
            bf16 = seconds_per_call(lambda: ops.onednn_mm(handle, x, None), args.seconds)
            fp32 = seconds_per_call(lambda: F.linear(x.float(), weight32).to(x.dtype), args.seconds)
            torch32 = seconds_per_call(lambda: F.linear(x32, weight32), args.seconds)
            onednn32 = seconds_per_call(lambda: ops.onednn_mm(handle32, x32, None), args.seconds)
            gflop = 2 * rows * n * k / 1e9
            print(
                f"| {rows} | {n} x {k} | {gflop / bf16:.0f} | {gflop / fp32:.0f} | {bf16 / fp32:.2f} "
                f"| {gflop / torch32:.0f} | {gflop / onednn32:.0f} | {torch32 / onednn32:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
