"""What Four Over Six (4/6, Cook et al. 2025, arXiv 2512.02010) on NVFP4 activations would buy a quantized
checkpoint: its KL to the source (`quantkit quality`: the fake-quant reference, paired held-out windows) with the
activations of its NVFP4 modules encoded as plain NVFP4 (per token, max to 6) and then as 4/6
(`fake_quant_nvfp4_four_over_six`: each group of 16 max to 6 or to 4, the smaller squared error kept), the weights
as the checkpoint stores them. Both rows run in this process on the same windows; the ratio is 4/6 over plain.

4/6 is a what-if here: quantkit's vLLM methods and Triton quantizers serve plain NVFP4 activations only, so a
checkpoint's served numbers are the first row's. Static activation scales (`activation_scale: static`) are refused.

  python3 benchmarks/four_over_six_kl.py SOURCE_DIR QUANTIZED_DIR [QUANTIZED_DIR ...] [--num-sequences 8 --seq-len 256]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from quantkit.formats.nvfp4 import fake_quant_nvfp4_four_over_six
from quantkit.formats.schemes import NVFP4Scheme
from quantkit.quantize.quality import quality_table


def four_over_six_activation(
    self: NVFP4Scheme,
    x: torch.Tensor,
    input_global_scale: torch.Tensor | None = None,
    row_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """`NVFP4Scheme.fake_quant_activation` with 4/6 in place of min-max group scales (per token only)."""
    if input_global_scale is not None or row_amax is not None:
        raise SystemExit("four_over_six_kl: static activation scales and tensor-parallel shards are not supported")
    return fake_quant_nvfp4_four_over_six(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("quantized", nargs="+")
    parser.add_argument("--num-sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    _, plain = quality_table(args.source, args.quantized, args.num_sequences, args.seq_len)
    with mock.patch.object(NVFP4Scheme, "fake_quant_activation", four_over_six_activation):
        _, fos = quality_table(args.source, args.quantized, args.num_sequences, args.seq_len)
    print(f"\nKL(source || quantized), nats/token, {args.num_sequences} x {args.seq_len} held-out tokens")
    print("| checkpoint | NVFP4 activations | 4/6 activations | ratio | min layer SNR (dB) plain / 4/6 |")
    print("|---|---:|---:|---:|---|")
    for p, f in zip(plain, fos, strict=True):
        snr = f"{p['min_snr_db']:.1f} / {f['min_snr_db']:.1f}" if p["layer_snr_db"] else "- (rotated)"
        print(f"| {p['recipe']} | {p['kl']:.4f} | {f['kl']:.4f} | {f['kl'] / p['kl']:.2f}x | {snr} |")


if __name__ == "__main__":
    main()
