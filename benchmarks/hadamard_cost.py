"""The online Hadamard's cost at a large down_proj (Llama-3-8B: K = 14336, block 2048, N = 4096) on CUDA, for each
activation quantizer (fp8_block, nvfp4 per token): the torch transform (`quantkit.formats.hadamard.block_hadamard`,
float32 out) then our quantizer, against the fused quantizer that transforms each tile as it loads it
(`quantize(x, hadamard=block)`, `quantkit.kernels.hadamard`), the quantizer alone and torch's bf16 x @ W^T
(triton.testing.do_bench medians). Checks first that the fused quantizer's bytes equal the reference's (the pure-
torch quantizer of the CPU transform, on up to 2048 rows): exits 1 if any differs.

  python3 benchmarks/hadamard_cost.py     # prints one line per (scheme, M)
"""

from __future__ import annotations

import sys

import torch
import triton

from trained_kernels import ensure_quantkit, mismatches  # noqa: F401  (benchmarks/ is sys.path[0])

from quantkit.formats.hadamard import block_hadamard, online_block  # noqa: E402
from quantkit.formats.schemes import FP8_BLOCK, NVFP4  # noqa: E402
from quantkit.kernels.schemes import KERNELS  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("hadamard_cost: needs CUDA", file=sys.stderr)
        return 2
    k, n = 14336, 4096
    block = online_block(k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    failed = 0
    for scheme in (FP8_BLOCK, NVFP4):
        quantize = KERNELS[scheme.name].quantize
        for m in (16, 2048, 8192):
            x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).to(torch.bfloat16)  # channel scales over 4 decades
            xd = x.cuda()
            head = slice(0, 2048)  # the bit check on at most 2048 rows (the CPU reference's time)
            want = scheme.quantize_activation(block_hadamard(x[head], block))
            bad = mismatches(quantize(xd[head], None, hadamard=block), want)
            failed += bad > 0
            bench = lambda f: 1e3 * triton.testing.do_bench(f, return_mode="median")  # noqa: E731
            t_unfused = bench(lambda: quantize(block_hadamard(xd, block), None))
            t_fused = bench(lambda: quantize(xd, None, hadamard=block))
            t_plain = bench(lambda: quantize(xd, None))
            t_mm = bench(lambda: xd @ w.T)
            print(f"{scheme.name} M={m} K={k} block={block}: torch Hadamard + quantize {t_unfused:.1f} us, fused "
                  f"{t_fused:.1f} us ({t_unfused / t_fused:.1f}x faster), quantize alone {t_plain:.1f} us, bf16 mm "
                  f"(N={n}) {t_mm:.1f} us; fused / mm {t_fused / t_mm:.3f}; fused bytes != reference: {bad}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
