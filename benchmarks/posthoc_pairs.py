"""Post hoc paired comparisons between rows of one study run directory, Holm-corrected as one family.

    python benchmarks/posthoc_pairs.py RUN_DIR MODEL BASE_RECIPE OTHER_RECIPE [OTHER_RECIPE ...]

For each OTHER_RECIPE: ΔAvg of OTHER against BASE (points; items paired per benchmark, `evals.verdicts.compare_runs`,
the study's own stratified paired bootstrap), its 95% CI, raw two-sided p and Holm-adjusted p over the OTHER rows
given (`quantkit.metrics.holm`). ΔAvg is over the benchmarks the study's report averages: MODEL's suite's `avg` set
(the `code` suite's HE+MBPP, not HumanEval and MBPP beside it), the suite named by RUN_DIR/spec.json; every
benchmark both rows ran where the run directory has no spec.json. A comparison the report did not plan is post
hoc: say so, and count every post hoc comparison made on the run directory in its family (more comparisons only
raise the adjusted p).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantkit.evals.suite import load_suite
from quantkit.evals.verdicts import compare_runs
from quantkit.metrics import holm


def avg_benchmarks(run_dir: Path, model: str) -> list[str] | None:
    """The benchmarks of MODEL's Avg in the study of `run_dir` (its spec.json: eval.suites[model], else eval.suite;
    the suite's `avg` set, else all its benchmarks); None without a spec.json (every benchmark both rows ran)."""
    spec_file = run_dir / "spec.json"
    if not spec_file.exists():
        return None
    spec_eval = json.loads(spec_file.read_text())["eval"]
    suite = load_suite((spec_eval.get("suites") or {}).get(model, spec_eval["suite"]))
    return list(suite.avg or suite.benchmarks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("model", help="the model label of the study spec, e.g. smollm")
    parser.add_argument("base", help="the recipe compared against")
    parser.add_argument("others", nargs="+", help="the recipes compared with it")
    args = parser.parse_args()
    evals = args.run_dir / "evals"
    missing = [r for r in (args.base, *args.others) if not (evals / f"{args.model}-{r}" / "results.json").exists()]
    if missing:
        parser.exit(2, f"error: no finished evaluation in {evals} for {', '.join(missing)}\n")
    in_avg = avg_benchmarks(args.run_dir, args.model)
    base = evals / f"{args.model}-{args.base}"
    rows = [compare_runs(base, evals / f"{args.model}-{r}", in_avg) for r in args.others]
    adjusted = holm([row["p_two_sided"] for row in rows])
    print(
        f"{args.model}: each row minus {args.base} (points, ΔAvg over {', '.join(rows[0]['benchmarks'])}), "
        f"Holm over {len(rows)}"
    )
    for recipe, row, (p_holm, rejected) in zip(args.others, rows, adjusted, strict=True):
        print(
            f"  {recipe}: {row['delta']:+.2f} (95% CI {row['ci_low']:+.2f}..{row['ci_high']:+.2f}), "
            f"p {row['p_two_sided']:.4f}, Holm p {p_holm:.3f}{' (separable by items)' if rejected else ''}"
        )


if __name__ == "__main__":
    main()
