"""The CPU cost of NVFP4 activation fake-quantization, the step the served CPU emulation runs on every activation:
E2M1 rounding through the codes (`e2m1_to_float(round_to_e2m1(y))`) against `e2m1_round` (the same values bit for
bit, checked here first: exits 1 if any differs), the whole `fake_quant_nvfp4_activation` of a bf16 activation eager
and as the served emulation runs it from 16 rows (`emulated_activation`: compiled by inductor; bit-equality checked,
exits 1 if any differs), next to the float32 matmul that consumes it. Activation shapes: Qwen2.5-Coder-0.5B's linear
inputs (K = 896 for q/k/v, o, gate/up; 4864 for down) at 1, 16, 256 and 4096 tokens (a prefill chunk); one thread;
best of --repeats. The first compiled call of each shape class compiles (not timed: one warm-up call).

  python3 benchmarks/fake_quant_cost.py     # one line per shape, ratios against the codes path in the same process
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from quantkit.formats.constants import ActivationScale
from quantkit.formats.nvfp4 import e2m1_round, e2m1_to_float, fake_quant_nvfp4_activation, round_to_e2m1
from quantkit.formats.schemes import NVFP4
from quantkit.serve.method_parts import emulated_activation


def best_ms(repeats: int, fn: Callable[..., object], *args: object) -> float:
    """The fastest of `repeats` calls fn(*args) after one warm-up, in milliseconds."""
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, best of {args.repeats}")
    for tokens in (1, 16, 256, 4096):
        for k, n in ((896, 9728), (4864, 896)):
            x = torch.randn(tokens, k, generator=generator).bfloat16()
            w = torch.randn(n, k, generator=generator)
            y = torch.randn(tokens, k, generator=generator) * 3
            if not torch.equal(e2m1_round(y).view(torch.int32), e2m1_to_float(round_to_e2m1(y)).view(torch.int32)):
                print(f"e2m1_round differs from the codes at {tokens} x {k}")
                return 1
            codes = best_ms(args.repeats, lambda t: e2m1_to_float(round_to_e2m1(t)), y)
            direct = best_ms(args.repeats, e2m1_round, y)
            fake = best_ms(args.repeats, fake_quant_nvfp4_activation, x, ActivationScale.PER_TOKEN)
            served = best_ms(args.repeats, emulated_activation, NVFP4, x, None, None)
            if not torch.equal(
                emulated_activation(NVFP4, x, None, None).view(torch.int32),
                NVFP4.fake_quant_activation(x).view(torch.int32),
            ):
                print(f"the served fake-quant differs from the eager one at {tokens} x {k}")
                return 1
            matmul = best_ms(args.repeats, torch.nn.functional.linear, x.float(), w)
            print(
                f"{tokens:4d} x {k:5d}: E2M1 codes {codes:7.3f} ms, e2m1_round {direct:7.3f} ms "
                f"({codes / direct:4.1f}x); fake-quant {fake:7.3f} ms, served {served:7.3f} ms "
                f"({fake / served:4.1f}x); float32 matmul to N={n} {matmul:7.3f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
