"""quantkit gate: exit 1 on an injected regression, 0 on improvements and within-noise changes, 2 on bad input."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest

from quantkit.configs import GATE_YAML
from quantkit.report.cli import add_gate_parser
from quantkit.report.gate import Thresholds, compare, load_thresholds
from quantkit.report.results import ResultsError, load_results

PAPER = Path(__file__).parent / "fixtures" / "paper000_table2.json"


def gate(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="quantkit")
    add_gate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gate", *argv])
    return args.func(args)


def mini() -> dict:
    bf16 = {"mmlu": 40.0, "gsm8k": 10.0, "mgsm": 8.0}
    return {
        "schema_version": 1,
        "rows": [
            {"variant": "ga", "recipe": "bf16", "scores": dict(bf16)},
            {
                "variant": "ga",
                "recipe": "w4a4_nvfp4",
                "scores": {"mmlu": 38.0, "gsm8k": 9.0, "mgsm": 7.0},
                "noise_floor": {"mmlu": 4.0, "gsm8k": 0.5, "mgsm": 0.5},
                "kl": 0.02,
            },
            {
                "variant": "ga",
                "recipe": "w8a8_fp8_block",
                "scores": {"mmlu": 40.0, "gsm8k": 10.0, "mgsm": 8.0},
                "kl": 0.001,
            },
        ],
    }


def write(tmp_path: Path, name: str, doc: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def paper_with(tmp_path: Path, row_id: str, benchmark: str, change: float) -> str:
    doc = json.loads(PAPER.read_text())
    row = next(r for r in doc["rows"] if r["id"] == row_id)
    row["scores"][benchmark] = round(row["scores"][benchmark] + change, 2)
    return write(tmp_path, f"current{row_id}.json", doc)


def test_injected_w4a4_regression_fails_with_a_readable_diff(tmp_path, capsys):
    current = paper_with(tmp_path, "(11)", "MGSM", -2.5)  # W4A4 GA+GatedNorm: MGSM degradation -2.94 -> -5.44
    assert gate("--baseline", str(PAPER), "--current", current) == 1
    out = capsys.readouterr().out
    header, _rule, line, *rest = out.splitlines()
    assert header.split() == ["variant", "recipe", "benchmark", "baseline", "current", "change", "allowed", "verdict"]
    assert line.split() == [
        "moe-24b-a3b/ga+gatednorm",
        "w4a4_nvfp4",
        "MGSM",
        "-2.94",
        "-5.44",
        "-2.50",
        "-2.00",
        "REGRESSION",
    ]
    assert rest[0].startswith("gate: FAIL: 1 regression(s) in 72 checks of 6 quantized row(s)")


def test_improvement_and_small_changes_pass(tmp_path, capsys):
    assert gate("--baseline", str(PAPER), "--current", paper_with(tmp_path, "(11)", "MGSM", +5.0)) == 0
    assert gate("--baseline", str(PAPER), "--current", paper_with(tmp_path, "(7)", "MGSM", -1.9)) == 0
    assert capsys.readouterr().out.count("gate: PASS: 72 checks of 6 quantized row(s)") == 2
    # the same -1.9 fails a tighter flag, and a YAML per-benchmark limit loosens it again
    assert (
        gate("--baseline", str(PAPER), "--current", paper_with(tmp_path, "(7)", "MGSM", -1.9), "--max-drop", "1.5") == 1
    )
    config = tmp_path / "gate.yaml"
    config.write_text("max_drop: 1.5\nbenchmarks: {MGSM: 2.0}\n")
    assert (
        gate("--baseline", str(PAPER), "--current", paper_with(tmp_path, "(7)", "MGSM", -1.9), "--config", str(config))
        == 0
    )


def test_avg_threshold_catches_spread_out_regressions(tmp_path):
    doc = json.loads(PAPER.read_text())
    row = next(r for r in doc["rows"] if r["id"] == "(8)")
    row["scores"] = {k: v - 1.5 for k, v in row["scores"].items()}  # each within 2.0, Avg beyond 1.0
    result = compare(load_results(PAPER), load_results(doc), Thresholds())
    assert [(c.variant, c.recipe, c.what) for c in result.failures] == [("moe-24b-a3b/ga", "w4a4_nvfp4_sq", "Avg")]


def test_drop_within_the_noise_floor_passes_and_beyond_it_fails():
    base, cur = mini(), mini()
    cur["rows"][1]["scores"]["mmlu"] = 35.0  # degradation -2 -> -5: 3 points worse, noise floor 4
    result = compare(load_results(base), load_results(cur), Thresholds())
    check = next(c for c in result.checks if c.what == "MMLU")
    assert (check.allowed, check.failed, check.verdict) == (4.0, False, "ok (within noise)")
    cur["rows"][1]["scores"]["mmlu"] = 33.0  # 5 points worse > max(2, 4)
    assert [c.what for c in compare(load_results(base), load_results(cur), Thresholds()).failures] == ["MMLU", "Avg"]
    cur["rows"][1]["scores"]["mmlu"] = 35.0
    del cur["rows"][1]["noise_floor"]  # the baseline's noise floor still counts
    assert not compare(load_results(base), load_results(cur), Thresholds()).failures
    del base["rows"][1]["noise_floor"]  # no noise floor anywhere: 3 points > 2
    assert [c.what for c in compare(load_results(base), load_results(cur), Thresholds()).failures] == ["MMLU", "Avg"]


def test_kl_ratio_and_floor():
    base, cur = mini(), mini()
    cur["rows"][1]["kl"] = 0.024  # x1.2 <= 1.25
    cur["rows"][2]["kl"] = 0.0019  # x1.9 but only +0.0009 nats <= min_kl_increase
    assert not compare(load_results(base), load_results(cur), Thresholds()).failures
    cur["rows"][1]["kl"] = 0.03  # x1.5
    failures = compare(load_results(base), load_results(cur), Thresholds()).failures
    assert [(c.recipe, c.what) for c in failures] == [("w4a4_nvfp4", "KL")]
    assert not compare(load_results(base), load_results(cur), load_thresholds(max_kl_ratio=2.0)).failures


def test_rows_only_in_current_are_reported_not_gated(tmp_path, capsys):
    base, cur = mini(), mini()
    del base["rows"][2]
    cur["rows"][2]["scores"]["mmlu"] = 0.0
    assert gate("--baseline", write(tmp_path, "b.json", base), "--current", write(tmp_path, "c.json", cur)) == 0
    assert "not gated (only in current): ga/w8a8_fp8_block" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["rows"].pop(2), "missing row variant 'ga', recipe 'w8a8_fp8_block'"),
        (lambda d: d["rows"].pop(0), "variant 'ga' has no 'bf16' row"),
        (lambda d: d["rows"][1]["scores"].update(mmlu=float("nan")), "nan is not a finite number"),
        (lambda d: d.update(schema_version="2"), "unknown schema_version '2'"),
        (
            lambda d: [r[k].pop("mgsm", None) for r in d["rows"] for k in ("scores", "noise_floor") if k in r],
            "ga/w4a4_nvfp4 lacks benchmark(s) MGSM",
        ),
        (lambda d: d["rows"][1].pop("kl"), "ga/w4a4_nvfp4 has no 'kl'"),
    ],
)
def test_malformed_current_exits_2(tmp_path, capsys, mutate, message):
    cur = copy.deepcopy(mini())
    mutate(cur)
    assert gate("--baseline", write(tmp_path, "b.json", mini()), "--current", write(tmp_path, "c.json", cur)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and captured.err.startswith("quantkit gate: error:")


def test_thresholds_yaml_defaults_and_errors(tmp_path):
    assert load_thresholds(GATE_YAML) == Thresholds()
    assert load_thresholds(GATE_YAML, max_drop=3.0).max_drop == 3.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_dorp: 1.0\n")
    with pytest.raises(ResultsError, match="unknown threshold"):
        load_thresholds(bad)
    bad.write_text("max_drop: -1\n")
    with pytest.raises(ResultsError, match="max_drop: expected a finite number >= 0"):
        load_thresholds(bad)
    assert gate("--baseline", str(PAPER), "--current", str(PAPER), "--config", str(bad)) == 2
