"""quantkit.report: results validation, paper 000's Table 2 reproduced from its own numbers, the four outputs."""

from __future__ import annotations

import argparse
import copy
import csv
import html
import json
import math
import re
from pathlib import Path

import pytest

from quantkit.report.benchmarks import resolve
from quantkit.report.cli import add_report_parser
from quantkit.report.render import render_report, to_markdown
from quantkit.report.results import ResultsError, load_results
from quantkit.report.table import build_table

PAPER = Path(__file__).parent / "fixtures" / "paper000_table2.json"
PAPER_COLUMNS = ["MMLU-R", "MMLU-P", "S-GPQA", "GPQA-D", "GSM8k", "Math", "Crux", "MultiPL_E", "MBPP", "MMMLU", "MGSM"]


def mini_results() -> dict:
    """A mini-suite study: suite column names, an unknown benchmark, every optional figure."""
    bf16 = {"MMLU": 40.0, "MMMLU": 30.0, "GSM8k": 10.0, "MGSM": 8.0, "HumanEval": 12.0, "my_bench": 50.0}
    w4a4 = {"MMLU": 36.0, "MMMLU": 29.0, "GSM8k": 9.0, "MGSM": 5.0, "HumanEval": 12.0, "my_bench": 48.0}
    outliers = {"max_abs_residual": 9.87, "max_abs_linear_input": 15.03}
    return {
        "schema_version": 1,
        "study": "default",
        "suite": "mini",
        "suite_version": "1",
        "created": "2026-01-01",
        "rows": [
            {
                "variant": "ga",
                "model": "zoo:ga",
                "recipe": "bf16",
                "scores": bf16,
                "ci95": {"MMLU": [35.0, 45.0]},
                "outliers": outliers,
            },
            {
                "variant": "ga",
                "model": "zoo:ga",
                "recipe": "w4a4_nvfp4",
                "precision": "W4A4",
                "scores": w4a4,
                "ci95": {"MMLU": [31.0, 41.0]},
                "noise_floor": {"GSM8k": 1.5, "MGSM": 2.5},
                "flips": {"MMLU": 0.1, "GSM8k": 0.3},
                "kl": 0.0104,
                "outliers": outliers,
                "size": {"bytes": 116_000_000, "bf16_ratio": 0.43},
            },
        ],
    }


def test_paper_fixture_reproduces_every_printed_avg():
    doc = json.loads(PAPER.read_text())
    table = build_table(load_results(PAPER))
    assert len(table.rows) == 12 and [b.label for b in table.columns] == PAPER_COLUMNS
    for raw, row in zip(doc["rows"], table.rows):
        assert len(row.row.scores) == 11
        printed = raw["meta"]["paper_avg"]
        assert f"{row.avg:.{len(printed.split('.')[1])}f}" == printed, raw["id"]
    assert f"{table.rows[0].avg:.2f}" == "41.73"  # DESIGN.md: row (1)


def test_paper_fixture_markdown_looks_like_table2():
    md = to_markdown(build_table(load_results(PAPER)))
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| # | Type | Add |"))
    groups = [c.strip() for c in header.strip("|").split("|") if c.strip()]
    assert groups == ["#", "Type", "Add", "Knowledge", "STEM", "Code", "Multilingual", "Avg", "ΔAvg"]
    # each group heads as many columns as the paper's: 4 + 2 + 3 + 2
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[3:14] == ["Knowledge", "", "", "", "STEM", "", "Code", "", "", "Multilingual", ""]
    assert f"|  |  |  | {' | '.join(f'**{c}**' for c in PAPER_COLUMNS)} |" in md
    row1 = (
        "| (1) | BF16 | GA | 59.59 | 31.91 | 16.39 | 26.93 | 66.22 | 45.36 | 44.38 | 34.63 | 50.04 | 46.16 "
        "| 37.40 | 41.73 |  |"
    )
    assert row1 in lines
    assert lines.index("| *24B-A3B, 500B tokens, FP4 Quantization* |" + "  |" * 15) < lines.index(
        next(line for line in lines if line.startswith("| (7) | W4A4 | GA |"))
    )
    # the paper's text: FP4 costs PreAffine -2.76 and GatedNorm -1.23 points (rows (10), (12) vs (5), (6))
    assert re.search(r"^\| \(10\) \| W4A4\+SQ \| GA, PreAffine \|.* \| 50\.23 \| -2\.76 \|$", md, re.M)
    assert re.search(r"^\| \(12\) \| W4A4\+SQ \| GA, GatedNorm \|.* \| 53\.56 \| -1\.23 \|$", md, re.M)
    assert "| (11) | W4A4 | GA, GatedNorm | -2.78 | -0.77 |" in md  # per-benchmark delta table: 66.92 - 69.70


def test_benchmark_table_maps_suite_names_and_keeps_unknown():
    assert resolve("MMLU-R") == resolve("mmlu_r") == resolve("mmlu_redux")
    assert (resolve("GSM8k").group, resolve("gsm8k").label) == ("STEM", "GSM8k")
    assert (resolve("humaneval").group, resolve("MGSM").group) == ("Code", "Multilingual")
    assert (resolve("my_bench").group, resolve("my_bench").label) == ("Other", "my_bench")
    # every set of the commonsense suites sits in its group, whatever the suite calls it
    assert {resolve(n).group for n in ("ARC-E", "ARC-C", "arc_challenge", "HellaSwag", "Winogrande", "PIQA")} == {
        "Commonsense"
    }
    table = build_table(load_results(mini_results()))
    assert [(b.group, b.label) for b in table.columns] == [
        ("Knowledge", "MMLU"),
        ("STEM", "GSM8k"),
        ("Code", "HumanEval"),
        ("Multilingual", "MMMLU"),
        ("Multilingual", "MGSM"),
        ("Other", "my_bench"),
    ]


def test_mini_results_degradation_noise_and_optional_columns():
    table = build_table(load_results(mini_results()))
    base, w4 = table.rows
    assert base.degradation is None and base.flips_mean is None
    d = w4.degradation
    assert d.delta == pytest.approx(
        {"mmlu": -4.0, "mmmlu": -1.0, "gsm8k": -1.0, "mgsm": -3.0, "humaneval": 0.0, "my_bench": -2.0}
    )
    assert d.delta_avg == pytest.approx(w4.avg - base.avg) == pytest.approx(-11 / 6)
    # noise_floor where given; from the two CIs (half-widths 5 and 5) where not; unknown elsewhere
    assert d.noise == pytest.approx({"gsm8k": 1.5, "mgsm": 2.5, "mmlu": math.hypot(5, 5)})
    assert d.noise_avg is None  # not every benchmark has a noise floor
    # recovery as the verdicts define it: the mean over benchmarks (BF16 above 0) of score / BF16 score, not the
    # ratio of the averages (92.67 here: a large benchmark's ratio would weigh more)
    ratios = [w4.row.scores[b] / base.row.scores[b] for b in base.row.scores if base.row.scores[b] > 0]
    assert d.recovery == pytest.approx(100 * sum(ratios) / len(ratios)) != pytest.approx(100 * w4.avg / base.avg)
    assert w4.flips_mean == pytest.approx(0.2)
    md = to_markdown(table)
    # Table 2 ends at ΔAvg; flips, KL and the outlier figures are the diagnostics table's
    assert "| Type | Add | Knowledge | STEM | Code | Multilingual |  | Other | Avg | ΔAvg |" in md
    assert "| W4A4 | ga | 36.00 | 9.00 | 12.00 | 29.00 | 5.00 | 48.00 | 23.17 | -1.83 |" in md
    # Recovery = 100 x Avg / Avg(BF16): 23.1667 / 25.0 = 92.67%
    assert "| Type | Add | Size | Recovery | Flips | KL | max_abs_residual | max_abs_linear_input |" in md
    assert "| W4A4 | ga | 116 MB (0.43x) | 89.2% | 20.0% | 0.0104 | 9.87 | 15.03 |" in md
    # |delta| <= noise is inside the noise floor: 4 <= 7.07 and 1 <= 1.5 are n.s., 3 > 2.5 is not
    assert "| W4A4 | ga | -4.00 ±7.07 n.s. | -1.00 ±1.50 n.s. | +0.00 | -1.00 | -3.00 ±2.50 | -2.00 | -1.83 |" in md


def test_render_writes_four_self_contained_files(tmp_path):
    out = tmp_path / "report"
    paths = render_report(mini_results(), out)
    assert sorted(p.name for p in out.iterdir()) == ["report.csv", "report.html", "report.json", "report.md"]
    assert set(paths.values()) == set(out.iterdir())
    rows = list(csv.DictReader(paths["report.csv"].open()))
    assert [r["recipe"] for r in rows] == ["bf16", "w4a4_nvfp4"]
    assert float(rows[1]["my_bench"]) == 48.0 and float(rows[1]["delta_avg"]) == pytest.approx(-11 / 6)
    assert rows[0]["delta_avg"] == "" and float(rows[1]["kl"]) == 0.0104 and float(rows[1]["flips_gsm8k"]) == 0.3
    doc = json.loads(paths["report.json"].read_text())
    assert [c["group"] for c in doc["columns"]][-1] == "Other" and doc["rows"][1]["delta"]["mgsm"] == -3.0
    page = paths["report.html"].read_text()
    assert page.count("<svg") == 3 and "<?xml" not in page  # per benchmark; per variant: ΔAvg and KL side by side
    assert '<div class="figs">' in page and "KL vs BF16 per variant" in page
    assert page.count('<td class="ns">') == 2  # MMLU -4.00 ±7.07 and GSM8k -1.00 ±1.50 greyed
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|[\w./-]+\.(css|js|png|svg))""", page)
    assert "<script" not in page and "<link" not in page
    assert '<th colspan="4" style="text-align:center">Multilingual</th>' not in page  # 2 Multilingual columns
    assert '<th colspan="2" style="text-align:center">Multilingual</th>' in page
    assert "my_bench" in page


def test_sensitivity_tables_render_and_malformed_ones_are_skipped(tmp_path):
    """meta.sensitivity (free-form meta, written by a study): each model's table renders in report.md and .html,
    kinds in the order given, "mean (min @ layer)"; a table with a cell missing a figure is left out, not a
    traceback; no section at all without a valid table. The block section (meta.checkpoint_block_sensitivity) heads
    its first column "block", the projection sections "projection (kind)"."""
    from quantkit.report.render import BLOCK_SENSITIVITY_TITLE, SENSITIVITY_TITLE

    results = mini_results()
    good = {
        "self_attn.o_proj": {"mean_db": 17.11, "min_db": 14.67, "worst_layer": 14},
        "mlp.up_proj": {"mean_db": 18.03, "min_db": 16.93, "worst_layer": 0},
    }
    results["meta"] = {
        "sensitivity": {"ga": {"w4a4_nvfp4": good, "w8a8_fp8_block": {"mlp.up_proj": {"mean_db": 29.0}}}}
    }
    paths = render_report(results, tmp_path / "r")
    md = paths["report.md"].read_text()
    assert f"## {SENSITIVITY_TITLE}" in md and "| projection (kind) | w4a4_nvfp4: mean dB (min @ layer) |" in md
    assert md.index("| self_attn.o_proj | 17.1 (14.7 @ 14) |") < md.index("| mlp.up_proj | 18.0 (16.9 @ 0) |")
    assert "w8a8_fp8_block" not in md  # its cell lacks min_db / worst_layer
    page = paths["report.html"].read_text()
    assert html.escape(SENSITIVITY_TITLE) in page and "<td>17.1 (14.7 @ 14)</td>" in page
    blocks = {"self_attn": {"mean_db": 13.2, "min_db": 9.0, "worst_layer": 16}}
    results["meta"] = {"checkpoint_block_sensitivity": {"ga": {"w4a4_nvfp4": blocks}}}
    paths = render_report(results, tmp_path / "blocks")
    md = paths["report.md"].read_text()
    assert f"## {BLOCK_SENSITIVITY_TITLE}" in md and "| block | w4a4_nvfp4: mean dB (min @ layer) |" in md
    assert "projection (kind)" not in md and "| self_attn | 13.2 (9.0 @ 16) |" in md
    assert ">block</th>" in paths["report.html"].read_text()
    results["meta"] = {"sensitivity": {"ga": {"w4a4_nvfp4": {"x": "not a cell"}}, "gn": "not tables"}}
    assert SENSITIVITY_TITLE not in render_report(results, tmp_path / "bad")["report.md"].read_text()


def test_verdicts_open_the_report_in_words(tmp_path):
    """meta.verdicts (written by a study, quantkit.evals.verdicts): the rule, then one bullet per sentence, before the
    summary paragraph and Table 2, in report.md and report.html (escaped); no section without sentences."""
    from quantkit.report.render import VERDICTS_TITLE

    results = mini_results()
    results["meta"] = {
        "verdicts": {
            "rule": "Holm over k <= 0.05 and beyond the numerics floor",
            "sentences": ["ga W4A4: ΔAvg -10.00 (95% CI -13.00..-7.00); loss real", "x < y"],
        }
    }
    paths = render_report(results, tmp_path / "r")
    md = paths["report.md"].read_text()
    assert md.index(f"## {VERDICTS_TITLE}") < md.index("Rule: Holm over k") < md.index("- ga W4A4: ΔAvg -10.00")
    assert md.index("- x < y") < md.index("Summary") < md.index("| Type |")
    page = paths["report.html"].read_text()
    assert "<li>x &lt; y</li>" in page and page.index(VERDICTS_TITLE) < page.index("<table>")
    results["meta"] = {"verdicts": {"rule": "r", "sentences": []}}
    assert VERDICTS_TITLE not in render_report(results, tmp_path / "none")["report.md"].read_text()


def test_render_replaces_atomically_and_leaves_no_temp_files(tmp_path):
    render_report(mini_results(), tmp_path)
    render_report(PAPER, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.csv", "report.html", "report.json", "report.md"]
    assert "(12)" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "report.md").stat().st_mode & 0o644 == 0o644


def test_bf16_only_results_render_without_plots(tmp_path):
    doc = mini_results()
    doc["rows"] = doc["rows"][:1]
    paths = render_report(doc, tmp_path)
    assert "<svg" not in paths["report.html"].read_text()
    assert "Degradation vs BF16" not in paths["report.md"].read_text()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=2), "unknown schema_version 2"),
        (lambda d: d.pop("schema_version"), "unknown schema_version None"),
        (lambda d: d.update(rows=[]), "'rows' must be a non-empty list"),
        (lambda d: d["rows"].pop(0), "variant 'ga' has no 'bf16' row"),
        (lambda d: d["rows"][1]["scores"].update(GSM8k=float("nan")), "scores['GSM8k']: nan is not a finite number"),
        (lambda d: d["rows"][1]["scores"].update(GSM8k=0.5e3), "scores['GSM8k']: 500.0 is outside [0.0, 100.0]"),
        (lambda d: d["rows"][1]["scores"].update(gsm8k=9.0), "'scores' names benchmark 'gsm8k' twice"),
        (lambda d: d["rows"][1].update(noise=1.0), "unknown field(s) 'noise'"),
        (lambda d: d["rows"][1]["noise_floor"].update(Math=1.0), "'noise_floor' has benchmarks without a score: math"),
        (lambda d: d["rows"][1].update(kl=-0.1), "'kl'"),
        (lambda d: d["rows"][1].update(size={"bytes": 1}), '\'size\': expected {"bytes": ..., "bf16_ratio": ...}'),
        (lambda d: d["rows"][1]["ci95"].update(MMLU=[41.0, 31.0]), "low 41.0 > high 31.0"),
        (
            lambda d: d["rows"].append(copy.deepcopy(d["rows"][1])),
            "rows[2]: duplicate row for variant 'ga', recipe 'w4a4_nvfp4'",
        ),
        (lambda d: d["rows"][1].pop("variant"), "rows[1]: 'variant' must be a non-empty string"),
    ],
)
def test_malformed_results_are_rejected_with_the_problem_named(mutate, message):
    doc = mini_results()
    mutate(doc)
    with pytest.raises(ResultsError) as err:
        load_results(doc)
    assert message in str(err.value)


def test_report_cli_exit_codes(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="quantkit")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(PAPER), "--out", str(tmp_path / "out")])
    assert args.func(args) == 0 and (tmp_path / "out" / "report.html").exists()
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "rows": [{"variant": "ga", "recipe": "w4a4", "scores": {"mmlu": NaN}}]}')
    args = parser.parse_args(["report", str(bad)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "quantkit report: error:" in err and "nan is not a finite number" in err
    assert not (tmp_path / "report").exists()
    (tmp_path / "broken.json").write_text("{")
    args = parser.parse_args(["report", str(tmp_path / "broken.json")])
    assert args.func(args) == 2 and "not valid JSON" in capsys.readouterr().err
