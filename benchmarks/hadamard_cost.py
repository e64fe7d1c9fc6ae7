"""The online Hadamard's cost on CUDA, for each activation quantizer (fp8_block, nvfp4 per token),
triton.testing.do_bench medians:

- a large dense down_proj (Llama-3-8B: K = 14336, block 2048, N = 4096): the torch transform
  (`quantkit.formats.hadamard.block_hadamard`, float32 out) then our quantizer, against the fused quantizer that
  transforms each tile as it loads it (`quantize(x, hadamard=block)`, `quantkit.kernels.hadamard`), the quantizer
  alone and torch's bf16 x @ W^T. Checks first that the fused quantizer's bytes equal the reference's (the pure-torch
  quantizer of the CPU transform, on up to 2048 rows).
- the routed experts' down projection of a rotated MoE (bench_grouped_gemm's configs: hidden 2048, expert FFN 512,
  block 512; rows sorted by expert): the whole `grouped_quantized_linear` call with the torch transform first,
  with the fused one (`hadamard=block`) and without a transform. Checks first that the fused call's output equals
  the torch-transformed call's, bit for bit (same operands, same GEMM).

Exits 1 if any check fails.

  python3 benchmarks/hadamard_cost.py     # prints one line per (scheme, M) and per (config, scheme, tokens)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
from bench_grouped_gemm import CONFIGS, activations, expert_weights
from trained_kernels import ensure_quantkit, mismatches  # noqa: F401  (benchmarks/ is sys.path[0])

from quantkit.formats.hadamard import block_hadamard, online_block
from quantkit.formats.schemes import FP8_BLOCK, NVFP4
from quantkit.kernels.schemes import KERNELS, grouped_quantized_linear

EXPERT_TOKENS = (16, 2048, 8192)


def _bench(f: Callable[[], object]) -> float:
    """do_bench's median of f, microseconds."""
    return 1e3 * triton.testing.do_bench(f, return_mode="median")


def dense() -> int:
    """The dense down_proj lines; returns the number of failed bit checks."""
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
            t_unfused = _bench(lambda: quantize(block_hadamard(xd, block), None))
            t_fused = _bench(lambda: quantize(xd, None, hadamard=block))
            t_plain = _bench(lambda: quantize(xd, None))
            t_mm = _bench(lambda: xd @ w.T)
            print(
                f"{scheme.name} M={m} K={k} block={block}: torch Hadamard + quantize {t_unfused:.1f} us, fused "
                f"{t_fused:.1f} us ({t_unfused / t_fused:.1f}x faster), quantize alone {t_plain:.1f} us, bf16 mm "
                f"(N={n}) {t_mm:.1f} us; fused / mm {t_fused / t_mm:.3f}; fused bytes != reference: {bad}"
            )
    return failed


def experts(
    configs: dict[str, tuple[int, int, int, int]],
    tokens: tuple[int, ...],
    device: torch.device,
    bench: Callable[[Callable[[], object]], float] = _bench,
) -> int:
    """The routed experts' down projection lines (config: experts, top_k, hidden, expert FFN); returns the number of
    failed bit checks."""
    gen = torch.Generator(device).manual_seed(0)
    failed = 0
    for config, (e, top_k, hidden, inter) in configs.items():
        block = online_block(inter)
        w = expert_weights(e, hidden, inter, device, gen)  # down: N = hidden, K = inter
        weights = {FP8_BLOCK: [w["wq_block"], w["ws_block"]], NVFP4: [w["w_packed"], w["w_block_scale"], w["w_global"]]}
        for t in tokens:
            a = activations(t, top_k, e, inter, False, device, gen)
            x, offsets = a["x_sorted"], a["sort"].expert_offsets
            for scheme, ws in weights.items():

                def call(rows: torch.Tensor, hadamard: int = 0, scheme=scheme, ws=ws) -> torch.Tensor:
                    return grouped_quantized_linear(
                        scheme, rows, offsets, ws, hadamard=hadamard, out_dtype=torch.bfloat16
                    )

                ok = torch.equal(call(x, block), call(block_hadamard(x, block)))
                failed += not ok
                t_unfused = bench(lambda: call(block_hadamard(x, block)))
                t_fused = bench(lambda: call(x, block))
                t_plain = bench(lambda: call(x))
                print(
                    f"experts {config} {scheme.name} tokens={t} rows={x.shape[0]} K={inter} N={hidden} "
                    f"block={block}: torch Hadamard + grouped {t_unfused:.1f} us, fused {t_fused:.1f} us "
                    f"({t_unfused / t_fused:.2f}x faster), no transform {t_plain:.1f} us (fused / none "
                    f"{t_fused / t_plain:.3f}); fused == torch-transformed: {ok}"
                )
    return failed


def main() -> int:
    if not torch.cuda.is_available():
        print("hadamard_cost: needs CUDA", file=sys.stderr)
        return 2
    failed = dense() + experts(CONFIGS, EXPERT_TOKENS, torch.device("cuda"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
