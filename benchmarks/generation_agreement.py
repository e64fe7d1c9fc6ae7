"""Free-running generation agreement: how close each study row's generated answers stay to BF16's.

    python benchmarks/generation_agreement.py RUN_DIR [--model LABEL] [--baseline RECIPE]

Pass@1 counts right answers; KL and top-1 agreement (`quantkit quality`) compare next-token distributions on a
shared prefix. Neither says whether a quantized model, decoding greedily on its own, writes what BF16 writes. Per
row, over every item of the study's generative tasks (the eval directories' samples, paired by task and doc_id):

- identical: the fraction of items whose whole answer text equals BF16's;
- shared prefix: the mean over items of (characters before the first difference) / len(BF16's answer), 1 for an
  identical answer (an empty BF16 answer counts 1 when the row's is empty too, else 0);
- vs the baseline row (default plain W4A4): the mean per-item difference of the shared prefix with its standard
  error (items paired), and how many items the row's prefix is longer / shorter on.

The `bf16-numerics` row (BF16 re-run in a second summation order, where the study ran it) is the floor: what
agreement last-bit changes alone leave. Prints a Markdown table.
"""

from __future__ import annotations

import math
from pathlib import Path

from study_kl_pairs import study_rows  # benchmarks/ is sys.path[0]

from quantkit.evals.degradation import read_samples


def shared_prefix(reference: str, test: str) -> float:
    """Characters of `test` equal to `reference` before the first difference, over len(reference); 0-1."""
    if not reference:
        return float(not test)
    n = 0
    for a, b in zip(reference, test, strict=False):
        if a != b:
            break
        n += 1
    return n / len(reference)


def answers(eval_dir: Path) -> dict[tuple[str, int], str]:
    """{(task, doc_id): answer text} of one eval directory's samples."""
    return {(task, doc): str(r["answer"]) for task, docs in read_samples(eval_dir).items() for doc, r in docs.items()}


def main() -> None:
    args, label, evals, rows = study_rows(__doc__.splitlines()[0], extra=("bf16-numerics",))
    reference = answers(evals / f"{label}-bf16")
    prefix = {}
    identical = {}
    for row in rows:
        test = answers(evals / f"{label}-{row}")
        if test.keys() != reference.keys():
            raise SystemExit(f"{row} answered other items than bf16 ({len(test.keys() ^ reference.keys())} differ)")
        prefix[row] = [shared_prefix(reference[k], test[k]) for k in reference]
        identical[row] = sum(reference[k] == test[k] for k in reference) / len(reference)
    base = prefix.get(args.baseline)
    head = f"| {label} ({len(reference)} items) | identical | shared prefix"
    print(head + f" | vs {args.baseline} (SE) | longer/shorter |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        cells = f"| {row} | {100 * identical[row]:.1f}% | {100 * sum(prefix[row]) / len(prefix[row]):.1f}% |"
        if base is None or row == args.baseline:
            print(cells + " | |")
            continue
        diff = [a - b for a, b in zip(prefix[row], base, strict=True)]
        mean = sum(diff) / len(diff)
        se = math.sqrt(sum((d - mean) ** 2 for d in diff) / (len(diff) - 1) / len(diff)) if len(diff) > 1 else math.nan
        longer, shorter = sum(d > 0 for d in diff), sum(d < 0 for d in diff)
        print(cells + f" {100 * mean:+.1f} ({100 * se:.1f}) | {longer}/{shorter} |")


if __name__ == "__main__":
    main()
