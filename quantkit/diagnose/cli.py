"""`quantkit diagnose MODEL_DIR`: outlier diagnostics; quantkit/cli.py wires it with add_diagnose_parser(subparsers)."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantkit.checkpoints import check_checkpoint_dir
from quantkit.diagnose.defaults import DEFAULT_NUM_SEQUENCES, DEFAULT_RECIPES, DEFAULT_SEQ_LEN, MASSIVE_RATIO
from quantkit.errors import BAD_INPUT, print_error


def _diagnose(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path("diagnostics") / Path(args.model).resolve().name
    try:
        check_checkpoint_dir(args.model)
        from quantkit.diagnose.run import (  # torch: after the checks
            diagnose,
            sensitivity_markdown,
            summary_markdown,
            write_diagnostics,
        )

        result = diagnose(
            args.model,
            args.num_sequences,
            args.seq_len,
            recipes=args.recipes,
            batch_size=args.batch_size,
            massive_ratio=args.massive_ratio,
        )
    except BAD_INPUT as err:  # bad input or NaN statistics: the message names it
        return print_error("diagnose", err)
    paths = write_diagnostics(result, out)
    print(summary_markdown([result]))
    print(sensitivity_markdown(result))
    for skipped in result["attention"]["skipped"]:
        print(f"attention-sink statistics skip layer {skipped['layer']}: {skipped['reason']}")
    print(f"{args.model} -> {out} ({len(paths)} files)")
    return 0


def add_diagnose_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`quantkit diagnose MODEL_DIR [--out DIR] [--num-sequences N] [--seq-len T] [--recipes R ...]`; exit 2 on
    bad input."""
    parser = subparsers.add_parser(
        "diagnose",
        help="outlier diagnostics of a checkpoint: residual/attention sinks, massive activations, "
        "norm weights, kurtosis, per-layer quantization SNR (JSON + figures)",
        description="Runs held-out calibration windows through the model with temporary hooks and writes "
        "diagnostics.json, summary.md and PNG/SVG figures (definitions: docs/diagnostics.md).",
    )
    parser.add_argument(
        "model", help="checkpoint directory (quantkit dense or hybrid family, Qwen3, Qwen3-Next, Llama)"
    )
    parser.add_argument("--out", help="output directory (default: diagnostics/<model dir name>)")
    parser.add_argument("--num-sequences", type=int, default=DEFAULT_NUM_SEQUENCES)
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    parser.add_argument(
        "--recipes",
        nargs="*",
        default=list(DEFAULT_RECIPES),
        help="recipes whose quantization error to emulate (quantkit backend, no SmoothQuant)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--massive-ratio",
        type=float,
        default=MASSIVE_RATIO,
        help="a token is massive when its max |h| exceeds this multiple of its sequence's median |h|",
    )
    parser.set_defaults(func=_diagnose)
    return parser
