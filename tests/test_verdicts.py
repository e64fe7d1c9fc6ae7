"""quantkit.evals.verdicts on constructed evaluation runs with known answers: item pairing across runs (also across
differently named tasks of one benchmark), Holm families, the two floors, the reference gap split, and rows that
moved between runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.evals import verdicts as v
from quantkit.models.trained import PublishedScore


def write_run(root: Path, name: str, benchmarks: dict[str, dict[str, list[float]]]) -> Path:
    """A `suite.evaluate`-shaped directory: benchmark -> {task: per-item scores}, doc_ids 0..n-1."""
    out = root / name
    (out / "samples").mkdir(parents=True)
    summary = {}
    for bench, tasks in benchmarks.items():
        all_scores = [s for scores in tasks.values() for s in scores]
        summary[bench] = dict(score=sum(all_scores) / len(all_scores), tasks=list(tasks))
        for task, scores in tasks.items():
            lines = [json.dumps(dict(doc_id=i, score=s, answer=str(s))) for i, s in enumerate(scores)]
            (out / "samples" / f"{task}.jsonl").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(dict(benchmarks=summary)))
    return out


def test_compare_runs_pairs_items_per_benchmark_and_pools_flips(tmp_path):
    """Two benchmarks, 100 items each: B loses 20 HumanEval items and 10 MBPP items, gains none -> ΔAvg = (-20 - 10) / 2
    = -15 points, recovery (60/80 + 40/50) / 2 = 77.5%, 30 of 200 items flipped. The test run names its HumanEval
    task differently (another prompt form): items pair by position within the benchmark."""
    he = [1.0] * 80 + [0.0] * 20
    mbpp = [1.0] * 50 + [0.0] * 50
    a = write_run(tmp_path, "a", {"HumanEval": {"he_instruct": he}, "MBPP": {"mbpp": mbpp}})
    b = write_run(
        tmp_path,
        "b",
        {"HumanEval": {"he_evalplus": [1.0] * 60 + [0.0] * 40}, "MBPP": {"mbpp": [1.0] * 40 + [0.0] * 60}},
    )
    c = v.compare_runs(a, b, seed=0)
    assert c["delta"] == pytest.approx(-15.0) and c["recovery"] == pytest.approx(77.5) and c["n"] == 200
    assert c["flip_rate"] == pytest.approx(30 / 200) and c["flips"]["right_to_wrong"] == 30
    assert c["ci_high"] < 0 < c["p_two_sided"] < 0.01
    only = v.compare_runs(a, b, ["MBPP"], seed=0)
    assert only["delta"] == pytest.approx(-10.0) and only["benchmarks"] == ["MBPP"]
    short = write_run(tmp_path, "short", {"MBPP": {"mbpp": mbpp[:99]}})
    with pytest.raises(ValueError, match="MBPP: 100 items"):
        v.compare_runs(a, short)


def comparison(delta: float, p: float, low: float | None = None, high: float | None = None) -> dict:
    return dict(
        delta=delta,
        ci_low=delta - 2 if low is None else low,
        ci_high=delta + 2 if high is None else high,
        p_two_sided=p,
        recovery=90.0,
        recovery_low=85.0,
        recovery_high=95.0,
        n=600,
    )


def test_judge_applies_holm_and_both_floors():
    """Family of 3, p = (0.001, 0.02, 0.04): Holm multiplies by 3, 2, 1 -> 0.003, 0.04, 0.04: all beyond the items at
    0.05 (the third only because the step-down keeps it at 0.04). Numerics floor 3 points: the -2.5 delta is within it,
    so only the -10 and -4 rows are real. Unmeasured floor: nothing is claimed beyond the items."""
    family = {"w4a4": comparison(-10.0, 0.001), "w8a8": comparison(-2.5, 0.04), "sq": comparison(-4.0, 0.02)}
    judged = v.judge(family, floor=3.0)
    assert [judged[k]["p_holm"] for k in family] == pytest.approx([0.003, 0.04, 0.04])
    assert all(judged[k]["beyond_items"] for k in family) and judged["w4a4"]["family"] == 3
    assert [judged[k]["beyond_both"] for k in family] == [True, False, True]
    unmeasured = v.judge(family, floor=None)
    assert [unmeasured[k]["beyond_both"] for k in family] == [None, None, None]
    weak = v.judge({"a": comparison(-1.0, 0.3), "b": comparison(-8.0, 0.03)}, floor=None)
    assert weak["a"]["beyond_both"] is False and weak["b"]["p_holm"] == pytest.approx(0.06)
    assert v.numerics_floor(comparison(0.5, 1.0, low=-1.25, high=2.0)) == 2.0 and v.numerics_floor(None) is None


def test_each_delta_is_held_to_the_larger_of_its_rows_floors():
    """Rows' floors: BF16 0.75 and W4A4 2.7 measured. A row's own floor where measured; a quantized row not re-run
    (gptq) takes the largest measured quantized row's (2.7, not BF16's 0.75: BF16's did not bound W4A4's on two
    machine kinds); with no quantized row measured, BF16's; nothing measured: None. A delta of 2.0 between BF16 and
    W4A4 is then within the numerics floor (2.7), though beyond BF16's."""
    floors = {"bf16": 0.75, "w4a4_nvfp4": 2.7}
    assert v.row_floor(floors, "w4a4_nvfp4", "bf16") == 2.7 and v.row_floor(floors, "w4a4_nvfp4_gptq", "bf16") == 2.7
    assert v.row_floor({"bf16": 0.75}, "w4a4_nvfp4_gptq", "bf16") == 0.75 and v.row_floor({}, "x", "bf16") is None
    assert v.pair_floor(floors, "bf16", "w4a4_nvfp4", "bf16") == 2.7 and v.pair_floor({}, "bf16", "x", "bf16") is None
    assert v.pair_floor({"bf16": 0.75, "w4a4_nvfp4": 0.5}, "bf16", "w4a4_nvfp4", "bf16") == 0.75
    judged = v.judge(
        {"w4a4_nvfp4": comparison(-2.0, 0.001), "fp8": comparison(-2.0, 0.001)}, {"w4a4_nvfp4": 2.7, "fp8": 0.75}
    )
    assert judged["w4a4_nvfp4"]["beyond_numerics"] is False and judged["w4a4_nvfp4"]["numerics_floor"] == 2.7
    assert judged["fp8"]["beyond_both"] is True
    assert "within the numerics floor ±2.70" in v.model_sentences("c", dict(vs_bf16=judged), {})[1]


def test_sentences_say_the_verdict_in_words():
    names = {"w4a4_nvfp4": "W4A4", "w4a4_nvfp4_sq": "W4A4+SQ"}
    vs_bf16 = v.judge({"w4a4_nvfp4": comparison(-10.0, 0.0001), "w4a4_nvfp4_sq": comparison(-6.0, 0.001)}, 2.0)
    methods = v.judge({"w4a4_nvfp4_sq": comparison(4.0, 0.2)}, 2.0)
    entry = dict(
        numerics=dict(comparison(0.3, 0.8, -1.5, 1.8), flip_rate=0.06),
        numerics_floor=1.8,
        vs_bf16=vs_bf16,
        vs_baseline={"w4a4_nvfp4": methods},
    )
    lines = v.model_sentences("coder", entry, names)
    assert lines[0].startswith("coder: numerics floor ±1.80 points") and "flips 6.0% of 600 items" in lines[0]
    assert "coder W4A4: ΔAvg -10.00" in lines[1] and "loss real (beyond both floors" in lines[1]
    assert "recovery 90.0% (CI 85.0..95.0)" in lines[1]
    assert "least loss measured: W4A4+SQ" in lines[3]
    assert (
        "W4A4+SQ vs W4A4: +4.00" in lines[4] and "not resolved by the items" in lines[4] and "not separable" in lines[4]
    )
    assert "numerics floor not measured" in v.model_sentences("x", dict(vs_bf16={}), names)[0]
    assert "the verdicts below use BF16's, which need not bound a quantized row's" in lines[0]
    own = dict(comparison(-0.5, 0.7, -2.5, 1.5), flip_rate=0.12)
    with_own = v.model_sentences("coder", dict(entry, row_numerics={"w4a4_nvfp4": own}), names)
    assert "need not bound" not in with_own[0]
    assert with_own[1].startswith("coder W4A4: its own numerics floor ±2.50 points") and "flips 12.0%" in with_own[1]


def test_reference_gap_split_into_prompt_format_and_the_rest():
    """Published 61.6, ours 57.3, the makers' prompt +2.5 (judged beyond both floors) -> 59.8 in their protocol,
    1.8 points left for the GGUF rounding, numerics and harness, said to be inseparable without the weights."""
    published = PublishedScore("HumanEval", 61.6, "EvalPlus prompt", "model card", "code-evalplus")
    prompt = v.judge({"prompt": comparison(2.5, 0.001)}, 1.0)["prompt"]
    ref = v.reference_sentence("coder", published, 57.3, prompt, 1.0)
    assert ref["makers_protocol"] == pytest.approx(59.8) and ref["remaining_gap"] == pytest.approx(1.8)
    assert "cannot be separated without the original weights" in ref["sentence"]
    assert "a real part of the gap" in ref["sentence"]
    assert "unexplained" in v.reference_sentence("coder", published, 57.3, None, None)["sentence"]
    assert "did not run" in v.reference_sentence("coder", published, None, None, None)["sentence"]


def test_moved_rows_are_explained_against_the_numerics_floor():
    """A row re-evaluated on another host: -3.66 points is beyond a 2-point floor (not explained by numerics), -1.0
    within it (summation-order noise); a row evaluated under two versions of its suite is not compared (records
    without a suite are); a row whose Avg did not change, or evaluated once, is not listed."""
    xeon = dict(cpu_model="Intel Xeon", isa="AVX512")
    epyc = dict(cpu_model="AMD EPYC", isa="AVX2")
    history = {
        "coder w4a4_nvfp4": [dict(avg=46.95, date="d1", host=xeon), dict(avg=43.29, date="d2", host=epyc)],
        "coder w4a4_nvfp4_sq": [dict(avg=50.0, date="d1", host=xeon), dict(avg=49.0, date="d2", host=xeon)],
        "coder bf16": [dict(avg=57.0, date="d1", host=xeon), dict(avg=57.0, date="d2", host=epyc)],
        "smollm bf16": [dict(avg=60.0, date="d1", host=xeon)],
        "coder w4a4_nvfp4_gptq": [
            dict(avg=36.15, date="d1", host=epyc, suite="code v3"),
            dict(avg=32.53, date="d2", host=epyc, suite="code v4"),
        ],
    }
    floors = {"coder w4a4_nvfp4": 2.0, "coder w4a4_nvfp4_sq": 2.0, "coder w4a4_nvfp4_gptq": 2.0, "coder bf16": 2.0}
    moved = {m["row"]: m for m in v.moved_rows(history, floors)}
    assert set(moved) == {"coder w4a4_nvfp4", "coder w4a4_nvfp4_sq", "coder w4a4_nvfp4_gptq"}
    assert (
        "the suite changed (code v3 then code v4): the two figures are not comparable"
        in (moved["coder w4a4_nvfp4_gptq"]["sentence"])
    )
    assert moved["coder w4a4_nvfp4"]["delta"] == pytest.approx(-3.66)
    assert "beyond the numerics floor" in moved["coder w4a4_nvfp4"]["sentence"]
    assert "hosts differ (Intel Xeon AVX512 then AMD EPYC AVX2)" in moved["coder w4a4_nvfp4"]["sentence"]
    assert "summation-order noise" in moved["coder w4a4_nvfp4_sq"]["sentence"]
