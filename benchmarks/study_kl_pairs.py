"""Paired KL comparison of a study's rows against one of them, from the engine logprobs the study recorded.

    python benchmarks/study_kl_pairs.py RUN_DIR [--model LABEL] [--baseline RECIPE]

Each row's held-out KL(bf16 || row) per token (`evals.degradation.topk_kl` on the eval directories'
heldout_logprobs, as the study's KL column), averaged per window; against the baseline row (default: plain W4A4,
`w4a4_nvfp4`): the ratio of the means, the mean per-window difference with its standard error (windows paired: the
same held-out tokens), and how many windows the row is better on. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from quantkit.evals.degradation import load_heldout_logprobs, topk_kl


def window_kl(bf16_dir: Path, row_dir: Path) -> torch.Tensor:
    """(N,) mean KL(bf16 || row) of each held-out window (top-k mode: `topk_kl`'s estimate)."""
    ref, _ = load_heldout_logprobs(bf16_dir)
    test, _ = load_heldout_logprobs(row_dir)
    kl, _ = topk_kl(ref["topk_ids"], ref["topk_logprobs"], test["topk_ids"], test["topk_logprobs"])
    return kl.double().reshape(ref["tokens"].shape[0], -1).mean(-1)


def study_rows(description: str, extra: tuple[str, ...] = ()) -> tuple[argparse.Namespace, str, Path, list[str]]:
    """The command line of a paired comparison of a study's rows (RUN_DIR [--model LABEL] [--baseline RECIPE]):
    (args, model label, the run's evals/ directory, the rows evaluated there: `extra` then the spec's recipes,
    bf16 left out)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--model", default=None, help="model label (default: the spec's only model)")
    parser.add_argument("--baseline", default="w4a4_nvfp4")
    args = parser.parse_args()
    spec = json.loads((args.run_dir / "spec.json").read_text())
    label = args.model or next(iter(spec["models"]))
    evals = args.run_dir / "evals"
    rows = [r for r in [*extra, *spec["recipes"]] if r != "bf16" and (evals / f"{label}-{r}").is_dir()]
    return args, label, evals, rows


def main() -> None:
    args, label, evals, rows = study_rows(__doc__.splitlines()[0])
    kl = {r: window_kl(evals / f"{label}-bf16", evals / f"{label}-{r}") for r in rows}
    base = kl[args.baseline]
    print(f"| {label} | KL | vs {args.baseline} | paired diff per window (SE) | windows better |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        diff = kl[r] - base
        se = diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        better = f"{int((diff < 0).sum())}/{len(diff)}"
        ratio = kl[r].mean() / base.mean()
        print(f"| {r} | {kl[r].mean():.4f} | {ratio:.2f}x | {diff.mean():+.4f} ({se:.4f}) | {better} |")


if __name__ == "__main__":
    main()
