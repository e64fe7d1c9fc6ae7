"""Verdicts a user can act on: is a row's loss real, which method is separable from its baseline, where the BF16 row
stands against its makers' published score, and why a row moved between runs.

Every comparison pairs two evaluation runs item by item (`quantkit.metrics.stratified_bootstrap`: items resampled
within each benchmark, the same draws for both runs) over the benchmarks in Avg (the suite's `avg` set, else all),
giving Delta Avg (points), its 95% CI, a two-sided bootstrap p and the recovery (mean over benchmarks of
100 x test / reference) with its CI. Three kinds, each a family per model:

- each quantized row against BF16: "is the loss real?";
- each method row against its own baseline (`method_baseline`: the plain round-to-nearest recipe of its scheme in
  the same study, e.g. plain W4A4 for W4A4+GPTQ): "does the method help?";
- a row against itself evaluated in a second, equally valid summation order (the study's numerics stage, for the
  rows `eval.numerics` names: BF16 at least): that row's numerics floor = the largest |Delta Avg| that comparison's
  95% CI admits, and its answer flips.

The rule (stated in the report): a delta is beyond the item-sampling floor when Holm's adjusted p <= ALPHA over the
k comparisons of its family (Holm 1979: family-wise error <= ALPHA under any dependence), and beyond the numerics
floor when |delta| exceeds the larger of its two rows' floors (`pair_floor`: each row's own where measured; a
quantized row without one takes the largest measured quantized row's, else BF16's). BF16's floor need not bound a
quantized row's (docs/verdicts.md: W4A4 moved 3.6x BF16's floor between two machine kinds), so the report says
when quantized rows borrow it. "Real" (a loss) and "separable" (a method) are said only beyond both; without a
numerics run the report says the numerics floor is unmeasured and claims nothing past the item floor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from quantkit.metrics import answer_flips, holm, stratified_bootstrap, total_flips

ALPHA = 0.05  # family-wise error rate of each family of comparisons (Holm)
RULE = (
    f"a delta is beyond the item-sampling floor when its paired-bootstrap p, Holm-adjusted over the k comparisons of "
    f"its family (one model's quantized rows vs BF16; one model's methods vs their plain baseline), is <= {ALPHA}, "
    "and beyond the numerics floor when |ΔAvg| exceeds the larger of its two rows' numerics floors (a row's floor: "
    "the largest |ΔAvg| that the row re-run in a second summation order admits, 95% CI; a quantized row not re-run "
    "takes the largest measured quantized row's, else BF16's); a loss is called real, and a method separable, only "
    "beyond both floors"
)


def _run(eval_dir: Path) -> tuple[dict[str, list[str]], dict[str, dict[int, dict]]]:
    """(benchmark -> its tasks, task -> {doc_id: sample record}) of a `suite.evaluate` output directory."""
    from quantkit.evals.degradation import read_samples

    benchmarks = json.loads((eval_dir / "results.json").read_text())["benchmarks"]
    return {b: info["tasks"] for b, info in benchmarks.items()}, read_samples(eval_dir)


def compare_runs(
    reference_dir: str | Path, test_dir: str | Path, benchmarks: Sequence[str] | None = None, seed: int = 0
) -> dict[str, Any]:
    """Delta Avg of `test_dir` against `reference_dir` over `benchmarks` (None: every benchmark both ran), each
    benchmark's items paired by position in its tasks (tasks in order, doc_ids sorted; the two runs may name their
    tasks differently, e.g. two prompt forms of HumanEval): AvgDelta's fields (points / %), the benchmarks, and
    the pooled answer flips (`flip_rate`: fraction of items whose correctness changed). ValueError when a
    benchmark's items differ between the runs."""
    (ref_tasks, ref), (test_tasks, test) = _run(Path(reference_dir)), _run(Path(test_dir))
    names = [b for b in (benchmarks or ref_tasks) if b in ref_tasks and b in test_tasks]
    if not names:
        raise ValueError(f"{reference_dir} and {test_dir} share no benchmark")
    strata, flips = [], []
    for b in names:
        a = [ref[t][i] for t in ref_tasks[b] for i in sorted(ref[t])]
        c = [test[t][i] for t in test_tasks[b] for i in sorted(test[t])]
        if len(a) != len(c):
            raise ValueError(f"benchmark {b}: {len(a)} items in {reference_dir}, {len(c)} in {test_dir}")
        strata.append(([r["score"] for r in a], [r["score"] for r in c]))
        flips.append(answer_flips(dict(enumerate(a)), dict(enumerate(c))))
    out = asdict(stratified_bootstrap(strata, seed=seed))
    pooled = total_flips(flips)
    return dict(out, benchmarks=names, flip_rate=pooled.flip_rate, flips=asdict(pooled))


def numerics_floor(comparison: Mapping[str, Any] | None) -> float | None:
    """The numerics floor (points) of a row-vs-row' `compare_runs` result: max(|CI low|, |CI high|); None without."""
    return None if comparison is None else max(abs(comparison["ci_low"]), abs(comparison["ci_high"]))


def row_floor(floors: Mapping[str, float], row: str, baseline: str) -> float | None:
    """The numerics floor (points) a verdict uses for `row`, from `floors` (recipe -> floor, the rows measured): its
    own; a quantized row without one the largest measured quantized row's (the conservative choice), else the
    `baseline` (BF16) row's; None where no row was measured."""
    if row in floors:
        return floors[row]
    quantized = [f for r, f in floors.items() if r != baseline]
    return max(quantized) if row != baseline and quantized else floors.get(baseline)


def pair_floor(floors: Mapping[str, float], a: str, b: str, baseline: str) -> float | None:
    """The numerics floor of a delta between rows `a` and `b`: the larger of their `row_floor`s (each row's score
    carries its own summation-order noise); None where neither has one."""
    found = [f for f in (row_floor(floors, a, baseline), row_floor(floors, b, baseline)) if f is not None]
    return max(found) if found else None


def judge(
    comparisons: Mapping[str, dict[str, Any]], floor: float | Mapping[str, float | None] | None
) -> dict[str, dict[str, Any]]:
    """Each comparison of one family (label -> `compare_runs` result) with Holm's adjusted p and the verdict
    fields: `numerics_floor` (the floor it is held to: `floor`, or `floor[label]` where a mapping gives one per
    comparison), `beyond_items` (adjusted p <= ALPHA), `beyond_numerics` (|delta| > that floor; None: unmeasured),
    `beyond_both` (True / False; None when the items say yes and the numerics floor is unmeasured)."""
    labels = list(comparisons)
    adjusted = holm([comparisons[k]["p_two_sided"] for k in labels], ALPHA)
    out = {}
    for label, (p_holm, beyond_items) in zip(labels, adjusted):
        c = comparisons[label]
        f = floor.get(label) if isinstance(floor, Mapping) else floor
        beyond_numerics = None if f is None else abs(c["delta"]) > f
        both = False if not beyond_items or beyond_numerics is False else beyond_numerics
        out[label] = dict(
            c,
            p_holm=p_holm,
            family=len(labels),
            numerics_floor=f,
            beyond_items=beyond_items,
            beyond_numerics=beyond_numerics,
            beyond_both=both,
        )
    return out


def _ci(c: Mapping[str, Any]) -> str:
    return f"{c['delta']:+.2f} (95% CI {c['ci_low']:+.2f}..{c['ci_high']:+.2f})"


def _recovery(c: Mapping[str, Any]) -> str:
    if c.get("recovery") is None:
        return "recovery undefined (BF16 scores 0)"
    return f"recovery {c['recovery']:.1f}% (CI {c['recovery_low']:.1f}..{c['recovery_high']:.1f})"


def _verdict(c: Mapping[str, Any], real: str, noun: str) -> str:
    if c["beyond_both"]:
        return f"{real} (beyond both floors; Holm p {c['p_holm']:.3g} of {c['family']})"
    if not c["beyond_items"]:
        return f"not resolved by the items (Holm p {c['p_holm']:.2g} of {c['family']}): {noun}"
    if c["beyond_numerics"] is False:
        floor = f" ±{c['numerics_floor']:.2f}" if c.get("numerics_floor") is not None else ""
        return f"beyond the items (Holm p {c['p_holm']:.3g}) but within the numerics floor{floor}: {noun}"
    return f"beyond the items (Holm p {c['p_holm']:.3g}); numerics floor unmeasured, so not claimed"


def model_sentences(label: str, verdicts: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    """The report's opening lines for one model, in words, from its `verdicts` entry (study_verdicts); `names`:
    recipe -> row label (e.g. "W4A4+SQ")."""
    lines = []
    numerics = verdicts.get("numerics")
    if numerics is not None:
        order = f" ({numerics['order']})" if numerics.get("order") else ""  # records before 2026-11-29 lack it
        lines.append(
            f"{label}: numerics floor ±{verdicts['numerics_floor']:.2f} points: BF16 re-run in a second summation "
            f"order{order} flips {100 * numerics['flip_rate']:.1f}% of {numerics['n']} items, ΔAvg {_ci(numerics)}."
        )
    else:
        lines.append(f"{label}: numerics floor not measured (set eval.numerics: true); verdicts rest on items alone.")
    row_numerics = verdicts.get("row_numerics") or {}
    if numerics is not None and not row_numerics and verdicts.get("vs_bf16"):
        lines[-1] += (
            " No quantized row's own floor was measured (eval.numerics: [bf16, <a quantized recipe>] measures one): "
            "the verdicts below use BF16's, which need not bound a quantized row's."
        )
    for recipe, c in row_numerics.items():
        lines.append(
            f"{label} {names.get(recipe, recipe)}: its own numerics floor ±{numerics_floor(c):.2f} points: re-run in "
            f"the second order flips {100 * c['flip_rate']:.1f}% of {c['n']} items, ΔAvg {_ci(c)}."
        )
    ref = verdicts.get("reference")
    if ref is not None:
        lines.append(ref["sentence"])
    rows = verdicts.get("vs_bf16", {})
    for recipe, c in rows.items():
        lines.append(
            f"{label} {names.get(recipe, recipe)}: ΔAvg {_ci(c)}, {_recovery(c)}; loss "
            + _verdict(c, "real", "no loss shown")
            + "."
        )
    if rows:
        best = max(rows, key=lambda r: rows[r]["delta"])
        lines.append(f"{label}: least loss measured: {names.get(best, best)} (ΔAvg {rows[best]['delta']:+.2f}).")
    for baseline, family in verdicts.get("vs_baseline", {}).items():
        for recipe, c in family.items():
            lines.append(
                f"{label} {names.get(recipe, recipe)} vs {names.get(baseline, baseline)}: {_ci(c)}; "
                + _verdict(c, "separable", "not separable")
                + "."
            )
    lines += [m["sentence"] for m in verdicts.get("moved", [])]
    return lines


def reference_sentence(
    label: str, published: Any, ours: float | None, prompt: Mapping[str, Any] | None, floor: float | None
) -> dict[str, Any]:
    """Where the BF16 row stands against the makers' `published` score (`trained.PublishedScore`): our BF16 score on
    that benchmark (`ours`, points), and with `prompt` (`compare_runs` of our protocol against the makers', on the
    same checkpoint and items) how much of the gap the prompt format explains, measured; the rest is the GGUF
    source's 4-bit rounding and the machine's numerics, which cannot be separated without the original weights."""
    out: dict[str, Any] = dict(
        benchmark=published.benchmark,
        published=published.score,
        protocol=published.protocol,
        source=published.source,
        ours=ours,
    )
    head = f"{label}: published {published.benchmark} {published.score:.1f} ({published.source}; {published.protocol})"
    if ours is None:
        out["sentence"] = head + "; this study did not run that benchmark."
        return out
    gap = published.score - ours
    if prompt is None:
        out["sentence"] = (
            f"{head}; our BF16 {ours:.2f} ({gap:+.2f} below). The makers' prompt protocol was not run "
            "(eval.reference: true runs it), so the gap is unexplained."
        )
        return out
    makers = ours + prompt["delta"]
    rest = published.score - makers
    out.update(makers_protocol=makers, prompt_effect=prompt, remaining_gap=rest)
    prompt_word = (
        "a real part of the gap" if prompt["beyond_both"] else "not resolved from zero by the items and numerics"
    )
    out["sentence"] = (
        f"{head}; our BF16 {ours:.2f} in our prompt form, {makers:.2f} in the makers' (prompt format "
        f"{_ci(prompt)} points, {prompt_word}). The remaining {rest:+.2f} points are the GGUF source's 4-bit "
        "rounding (the BF16 row is a dequantized Q4 file, not the original weights), the machine's numerics"
        + (f" (floor ±{floor:.2f})" if floor is not None else "")
        + " and the makers' harness; they cannot be separated without the original weights."
    )
    return out


def moved_rows(history: Mapping[str, Sequence[Mapping[str, Any]]], floor: Mapping[str, float | None]) -> list[dict]:
    """Rows whose Avg changed between their last two recorded evaluations, each explained: `history`:
    {"<model> <recipe>": [{avg, date, host, suite}, ...] oldest first; suite "<name> v<version>", absent in records
    before 2026-11-29}; `floor`: "<model> <recipe>" -> that row's numerics floor (points, `row_floor`). Under two
    suite versions: not comparable (the suite changed). Else within the floor: consistent with summation-order noise
    (the hosts named when they differ); beyond it: not explained by numerics."""
    out = []
    for key, runs in history.items():
        if len(runs) < 2 or math.isclose(runs[-2]["avg"], runs[-1]["avg"]):
            continue
        before, now = runs[-2], runs[-1]
        delta, f = now["avg"] - before["avg"], floor.get(key)
        hosts = (
            f"; hosts differ ({_host(before.get('host'))} then {_host(now.get('host'))})"
            if _host(before.get("host")) != _host(now.get("host"))
            else "; same kind of host"
        )
        suites = before.get("suite"), now.get("suite")
        why = (
            f"the suite changed ({suites[0]} then {suites[1]}): the two figures are not comparable"
            if None not in suites and suites[0] != suites[1]
            else "not explained (numerics floor unmeasured)"
            if f is None
            else "within the numerics floor: consistent with summation-order noise"
            if abs(delta) <= f
            else "beyond the numerics floor: not explained by numerics (compare the two checkpoints' provenance)"
        )
        out.append(
            dict(
                row=key,
                before=before,
                after=now,
                delta=delta,
                sentence=f"{key} moved {before['avg']:.2f} -> {now['avg']:.2f} ({delta:+.2f}) since the evaluation of "
                f"{before.get('date')}: {why}{hosts}.",
            )
        )
    return out


def _host(host: Mapping[str, Any] | None) -> str:
    if not host:
        return "unknown host"
    return f"{host.get('cpu_model') or host.get('processor') or '?'} {host.get('isa', '?')}".strip()
