"""`quantkit report` and `quantkit gate` subcommands; quantkit/cli.py wires them with add_*_parser(subparsers)."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantkit.errors import print_error
from quantkit.report.gate import Thresholds, load_thresholds, run_gate
from quantkit.report.results import ResultsError


def _report(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(args.results).parent / "report"
    try:
        from quantkit.report.render import render_report  # matplotlib: only for this command

        paths = render_report(args.results, out)
    except ResultsError as err:
        return print_error("report", err)
    print(f"{args.results} -> {', '.join(str(p) for p in paths.values())}")
    return 0


def _gate(args: argparse.Namespace) -> int:
    try:
        thresholds = load_thresholds(
            args.config,
            max_drop=args.max_drop,
            max_avg_drop=args.max_avg_drop,
            max_kl_ratio=args.max_kl_ratio,
            min_kl_increase=args.min_kl_increase,
        )
    except ResultsError as err:
        return print_error("gate", err)
    return run_gate(args.baseline, args.current, thresholds, verbose=args.verbose)


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`quantkit report RESULTS.json [--out DIR]`: Table 2 as report.{md,csv,json,html}; exit 2 on bad input."""
    parser = subparsers.add_parser(
        "report", help="render a results JSON as paper 000's Table 2 (Markdown, CSV, JSON, HTML)"
    )
    parser.add_argument("results", help="results JSON (docs/report-format.md)")
    parser.add_argument("--out", help="output directory (default: report/ beside RESULTS)")
    parser.set_defaults(func=_report)
    return parser


def add_gate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`quantkit gate --baseline B --current C`: exit 0 pass, 1 regression, 2 malformed input."""
    d = Thresholds()
    parser = subparsers.add_parser(
        "gate",
        help="fail (exit 1) when quantization degrades more vs BF16 in CURRENT than in BASELINE",
        description="Compares Delta = score(recipe) - score(BF16) per benchmark and for Avg (points), and KL, between "
        "two results JSON files. A regression counts only beyond max(threshold, noise floor). "
        "Precedence: defaults < --config YAML < flags.",
    )
    parser.add_argument("--baseline", required=True, help="results JSON of the reference run")
    parser.add_argument("--current", required=True, help="results JSON of the run under test")
    parser.add_argument("--config", help="YAML of thresholds (configs/gate.yaml lists them with their defaults)")
    parser.add_argument(
        "--max-drop", type=float, help=f"extra degradation allowed per benchmark, points (default {d.max_drop})"
    )
    parser.add_argument(
        "--max-avg-drop", type=float, help=f"extra degradation allowed for Avg, points (default {d.max_avg_drop})"
    )
    parser.add_argument("--max-kl-ratio", type=float, help=f"KL may grow by this factor (default {d.max_kl_ratio})")
    parser.add_argument(
        "--min-kl-increase",
        type=float,
        help=f"... or by this much, nats/token, whichever allows more (default {d.min_kl_increase})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every check, not only the failing ones")
    parser.set_defaults(func=_gate)
    return parser
