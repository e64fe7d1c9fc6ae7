"""The online Hadamard's cost at a large down_proj (Llama-3-8B: K = 14336, block 2048, N = 4096) on CUDA: the
transform of a bf16 x (M, K) (`quantkit.formats.hadamard.block_hadamard`, float32 out) against torch's bf16
x @ W^T, triton.testing.do_bench medians; and its error against a float64 dense product (relative Frobenius).

  python3 benchmarks/hadamard_cost.py     # prints one line per M
"""

from __future__ import annotations

import sys

import torch
import triton

from trained_kernels import ensure_quantkit  # noqa: F401  (benchmarks/ is sys.path[0]; makes quantkit importable)

from quantkit.formats.hadamard import block_hadamard, hadamard_matrix, online_block  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("hadamard_cost: needs CUDA", file=sys.stderr)
        return 2
    k, n = 14336, 4096
    block = online_block(k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in (16, 2048, 8192):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x.double().view(m, k // block, block) @ hadamard_matrix(block).cuda()).view(m, k)
        err = ((block_hadamard(x, block).double() - ref).norm() / ref.norm()).item()
        t_h = triton.testing.do_bench(lambda: block_hadamard(x, block), return_mode="median")
        t_mm = triton.testing.do_bench(lambda: x @ w.T, return_mode="median")
        print(f"M={m} K={k} block={block}: Hadamard {t_h * 1e3:.1f} us, bf16 mm (N={n}) {t_mm * 1e3:.1f} us, "
              f"ratio {t_h / t_mm:.3f}; rel err vs float64 {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
