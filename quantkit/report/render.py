"""Render a results file as paper 000's Table 2: Markdown, CSV, JSON and a self-contained HTML page.

Layout, what is significant first: a study's verdicts in words (`meta.verdicts`, quantkit.evals.verdicts: the
numerics floor, the BF16 row against the published score, each row's loss and each method against its baseline,
with the Holm rule stated); a one-paragraph summary (per precision, the variants ordered by Delta
Avg, each step marked significant or not against the paired-bootstrap noise floors: table.rank_variants);
Table 2 (rows in file order under their `section` headings; the benchmarks present, grouped Knowledge /
STEM / Code / Multilingual / Other (quantkit.report.benchmarks), then Avg, Delta Avg vs the BF16 row of
the same variant and its noise floor); a diagnostics table (mean flip rate, KL, the calibration set, the
checkpoint's outlier figures, each only when some row has it), so Table 2 fits a page width; then Delta
per benchmark. A delta inside its noise floor is marked "n.s." (greyed in HTML). Units: points 0-100;
Delta = recipe - BF16, negative = worse. Markdown/HTML round to 2 decimals (as the paper), CSV/JSON keep
full precision. Every file is written atomically (temporary file, then os.replace).
"""

from __future__ import annotations

import csv
import html
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from quantkit.atomic import write_text_atomic
from quantkit.report.benchmarks import Benchmark
from quantkit.report.plots import plot_benchmark_degradation, plot_variant_degradation, plot_variant_kl
from quantkit.report.results import Results, load_results
from quantkit.report.table import Degradation, Table, TableRow, build_table, rank_variants, significant

DASH = "–"
REPORT_FILES = ("report.md", "report.csv", "report.json", "report.html")


def _score(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}"


def _delta(x: float | None) -> str:
    return DASH if x is None else f"{x:+.2f}"


def _noise(x: float | None) -> str:
    return DASH if x is None else f"±{x:.2f}"


def _pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def _size(size: dict[str, float]) -> str:
    """'116 MB (0.43x)': the checkpoint's weight files and their ratio to the model in bf16."""
    return f"{size['bytes'] / 1e6:.0f} MB ({size['bf16_ratio']:.2f}x)"


def _kl(x: float | None) -> str:
    return DASH if x is None else f"{x:.4f}"


def _outlier(x: float | None) -> str:
    return DASH if x is None else f"{x:.4g}"


def describe_calibration(sets: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str:
    """A row's calibration sets as a cell: "4096x512 SQ", "64x512 scales", "none" (N sequences x T tokens per
    use; docs/calibration.md)."""
    short = {"smoothquant": "SQ", "activation scales": "scales"}  # a set several uses share: "gptq+scales"

    def uses(use: str) -> str:
        return "+".join(short.get(u, u) for u in use.split(" and "))

    return ", ".join(f"{s['num_sequences']}x{s['seq_len']} {uses(s['use'])}" for s in sets) or "none"


NS = "n.s."


def _delta_ns(delta: float | None, noise: float | None, with_noise: bool = False) -> str:
    """A delta, with its noise floor when `with_noise` and known, marked n.s. when inside it."""
    text = _delta(delta) + (f" ±{noise:.2f}" if with_noise and noise is not None else "")
    return text + (f" {NS}" if significant(delta, noise) is False else "")


def _extra_columns(table: Table) -> list[tuple[str, Callable[[TableRow], str]]]:
    """(header, cell) of Table 2's columns after the benchmarks: Avg, Delta Avg (n.s. inside its noise floor),
    and its noise floor when some row has one."""
    cols: list[tuple[str, Callable[[TableRow], str]]] = [
        ("Avg", lambda r: _score(r.avg)),
        ("ΔAvg", lambda r: _delta_ns(r.degradation.delta_avg, r.degradation.noise_avg) if r.degradation else ""),
    ]
    if table.has_noise:
        cols.append(("Noise", lambda r: _noise(r.degradation.noise_avg) if r.degradation else ""))
    return cols


def _diagnostic_columns(table: Table) -> list[tuple[str, Callable[[TableRow], str]]]:
    """(header, cell) of the diagnostics table: size, flips, KL, calibration set, outlier figures (those some row
    has)."""
    cols: list[tuple[str, Callable[[TableRow], str]]] = []
    if table.has_size:
        cols.append(("Size", lambda r: DASH if r.row.size is None else _size(r.row.size)))
    if any(r.degradation and r.degradation.recovery is not None for r in table.rows):
        cols.append(("Recovery", lambda r: _recovery(r.degradation.recovery) if r.degradation else ""))
    if table.has_flips:
        cols.append(("Flips", lambda r: _pct(r.flips_mean) if r.degradation else ""))
    if table.has_kl:
        cols.append(("KL", lambda r: _kl(r.row.kl) if r.degradation else ""))
    if table.has_calibration:
        cols.append(
            ("Calibration", lambda r: DASH if r.row.calibration is None else describe_calibration(r.row.calibration))
        )
    for key in table.outlier_keys:
        cols.append((key, _keyed(lambda r, k: _outlier(r.row.outliers.get(k)), key)))
    return cols


def _recovery(recovery: float | None) -> str:
    """'97.3%' (100 x Avg / Avg(BF16)), a dash when BF16's Avg is 0."""
    return DASH if recovery is None else f"{recovery:.1f}%"


def _row_name(r: TableRow) -> str:
    return " ".join(p for p in (r.row.row_id, r.row.label) if p)


STEP = {True: ">", False: "≈", None: "?"}


def summary(table: Table) -> str | None:
    """One paragraph: per precision, the variants ordered by ΔAvg (least loss first), each step marked
    significant (">") or inside the combined noise floors ("≈"), each ΔAvg marked n.s. when inside its own;
    None without quantized rows."""
    ranked = rank_variants(table)
    if not ranked:
        return None
    parts = []
    for rank in ranked:
        chain = _row_name(rank.rows[0]) + _summary_delta(rank.rows[0])
        for step, r in zip(rank.steps, rank.rows[1:]):
            chain += f" {STEP[step]} {_row_name(r)}{_summary_delta(r)}"
        parts.append(f"{rank.precision}: {chain}.")
    steps = [s for rank in ranked for s in rank.steps]
    verdict = (
        ""
        if not steps
        else "No noise floors: the ordering's significance is unknown."
        if all(s is None for s in steps)
        else "No step of the ordering is significant."
        if all(s is False for s in steps)
        else "Every step of the ordering is significant."
        if all(steps)
        else ""
    )
    return (
        'Summary (ΔAvg vs BF16 ± noise floor, variants ordered least loss first; ">": the step exceeds '
        'the two noise floors combined, "≈": it does not, "?": no noise floor; n.s.: inside its own noise '
        "floor). " + " ".join(parts) + (f" {verdict}" if verdict else "")
    )


def _summary_delta(r: TableRow) -> str:
    d = cast(Degradation, r.degradation)  # a ranked row (rank_variants): it has one
    return f" ({_delta_ns(d.delta_avg, d.noise_avg, with_noise=True)})"


_T = TypeVar("_T")


def _keyed(cell: Callable[[TableRow, str], _T], key: str) -> Callable[[TableRow], _T]:
    """The column of one benchmark / outlier key: cell(row, key)."""
    return lambda r: cell(r, key)


def _lead_columns(table: Table) -> list[tuple[str, Callable[[TableRow], str]]]:
    cols: list[tuple[str, Callable[[TableRow], str]]] = [("#", lambda r: r.row.row_id or "")] if table.has_ids else []
    return cols + [("Type", lambda r: r.row.precision), ("Add", lambda r: r.row.label)]


def _group_spans(columns: tuple[Benchmark, ...]) -> list[tuple[str, int]]:
    spans: list[tuple[str, int]] = []
    for b in columns:
        if spans and spans[-1][0] == b.group:
            spans[-1] = (b.group, spans[-1][1] + 1)
        else:
            spans.append((b.group, 1))
    return spans


def _title(results: Results) -> str:
    parts = [
        f"study {results.study}" if results.study else None,
        f"suite {results.suite}" + (f" v{results.suite_version}" if results.suite_version else "")
        if results.suite
        else None,
        results.created,
    ]
    return "; ".join(p for p in parts if p)


NOTES = (
    "Scores in points (0-100). Avg: plain mean of the row's benchmark columns{avg}. ΔAvg and Δ: score minus the "
    "BF16 row of the same variant (negative = worse). Noise: half-width of the 95% paired-bootstrap CI of "
    "the delta (noise floor). Flips: mean over the Avg's benchmarks of the fraction of items whose correctness "
    "changed vs BF16. KL: nats/token vs BF16 on held-out text."
)


def notes(table: Table) -> str:
    """NOTES, naming the columns kept out of Avg (the suite's `avg` set) when there are any."""
    out = table.not_in_avg
    return NOTES.format(
        avg=f" except {', '.join(b.label for b in out)} (shown, not in Avg or ΔAvg: outside the suite's Avg set)"
        if out
        else ""
    )


def timing_line(timings: Any) -> str | None:
    """ "Time: checkpoint 12 s, quantize 30 s, ... (total 342 s); peak memory: quantize 1.9 GiB, eval 6.9 GiB" from a
    results file's `meta.timings` (the study's wall seconds per stage; its largest peak memory per stage where
    measured), or None when there are none."""
    stages = timings.get("stages") if isinstance(timings, dict) else None
    if not isinstance(stages, dict) or not stages:
        return None
    peaks = timings.get("peak_gib") or {}
    memory = "; peak memory: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in peaks.items()) if peaks else ""
    return (
        "Time: "
        + ", ".join(f"{k} {_seconds(v)}" for k, v in stages.items())
        + f" (total {_seconds(sum(stages.values()))})"
        + memory
    )


def pending_line(results: Results | dict | str | Path) -> str | None:
    """ "Pending: 2 rows (ga w4a4_nvfp4, ga w4a4_nvfp4_sq): the study is still running or was stopped" from a
    results file's `meta.pending` (rows not measured yet), or None when every row is in."""
    pending = _meta(results).get("pending")
    if not pending:
        return None
    rows = f"{len(pending)} row{'s' if len(pending) > 1 else ''}"
    return f"Pending: {rows} ({', '.join(pending)}): the study is still running or was stopped."


def _seconds(x: float) -> str:
    return f"{x:.0f} s" if x >= 10 else f"{x:.1f} s"


def _meta(results: Results | dict | str | Path) -> dict[str, Any]:
    """`meta` of a results document ({} when absent; a parsed Results keeps no meta)."""
    if isinstance(results, Results):
        return {}
    doc = results if isinstance(results, dict) else json.loads(Path(results).read_text(encoding="utf-8"))
    return doc["meta"] if isinstance(doc.get("meta"), dict) else {}


def sensitivity_cells(
    sensitivity: dict[str, dict[str, dict[str, Any]]], unit: str = "projection (kind)"
) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a per-kind SNR table (`quantkit diagnose`'s `sensitivity`: recipe -> kind ->
    {mean_db, min_db, worst_layer}; a kind is a projection, or a block: `unit` heads its column): one row per kind,
    most sensitive first by the first recipe with a table, per recipe "mean (min @ layer)" in dB; ([], []) when no
    recipe has one."""
    recipes = [r for r, table in sensitivity.items() if table]
    if not recipes:
        return [], []
    kinds = list(sensitivity[recipes[0]])
    kinds += [k for r in recipes[1:] for k in sensitivity[r] if k not in kinds]
    head = [unit] + [f"{r}: mean dB (min @ layer)" for r in recipes]
    return head, [[kind] + [_sensitivity_cell(sensitivity[r].get(kind)) for r in recipes] for kind in kinds]


def _sensitivity_cell(cell: dict[str, Any] | None) -> str:
    return DASH if cell is None else f"{cell['mean_db']:.1f} ({cell['min_db']:.1f} @ {cell['worst_layer']})"


def sensitivity_table(sensitivity: dict[str, dict[str, dict[str, Any]]], unit: str = "projection (kind)") -> str:
    """`sensitivity_cells` as a Markdown table ("" when empty)."""
    head, rows = sensitivity_cells(sensitivity, unit)
    if not head:
        return ""
    return "\n".join([_md_row(head), _md_row(["---"] + ["---:"] * (len(head) - 1)), *map(_md_row, rows)])


SensitivitySection = tuple[str, str, str, dict[str, Any]]  # (title, note, unit, {model: {recipe: {kind: cell}}})


def sensitivity_sections(results: Results | dict | str | Path) -> list[SensitivitySection]:
    """The report's SNR sections, in order: the source's per projection (`meta.sensitivity`, diagnose), then each
    row's checkpoint's per projection (`meta.checkpoint_sensitivity`) and per block
    (`meta.checkpoint_block_sensitivity`), both from the quality stage."""
    return [
        (SENSITIVITY_TITLE, SENSITIVITY_NOTE, "projection (kind)", _sensitivities(results, "sensitivity")),
        (
            CHECKPOINT_SENSITIVITY_TITLE,
            CHECKPOINT_SENSITIVITY_NOTE,
            "projection (kind)",
            _sensitivities(results, "checkpoint_sensitivity"),
        ),
        (
            BLOCK_SENSITIVITY_TITLE,
            BLOCK_SENSITIVITY_NOTE,
            "block",
            _sensitivities(results, "checkpoint_block_sensitivity"),
        ),
    ]


def _sensitivities(results: Results | dict | str | Path, key: str) -> dict[str, Any]:
    """`meta.<key>` of a results document ({model: {recipe: {kind: {mean_db, min_db, worst_layer}}}}: `sensitivity`
    the source's per-projection SNR tables, `checkpoint_sensitivity` each row's checkpoint's); {} when absent. meta
    is free-form: tables not of that shape are skipped."""

    def cell_ok(cell: Any) -> bool:
        return isinstance(cell, dict) and all(isinstance(cell.get(k), (int, float)) for k in SENSITIVITY_KEYS)

    found = _meta(results).get(key)
    return {
        model: {r: t for r, t in tables.items() if isinstance(t, dict) and all(map(cell_ok, t.values()))}
        for model, tables in (found.items() if isinstance(found, dict) else ())
        if isinstance(tables, dict)
    }


SENSITIVITY_KEYS = ("mean_db", "min_db", "worst_layer")


SENSITIVITY_TITLE = "Quantization noise by projection (source checkpoint, fake-quant output SNR; lowest first)"
CHECKPOINT_SENSITIVITY_TITLE = "Quantization noise by projection, per row (each checkpoint vs its source)"
CHECKPOINT_SENSITIVITY_NOTE = (
    "How far each method got and where its noise remains: each quantized layer of the row's checkpoint on the "
    "reference's input (the source with the checkpoint's own SmoothQuant factors or rotation applied, so the "
    "reference computes the source's function), output SNR in dB per projection kind, mean over layers (worst "
    "layer); `quantkit quality`, the study's quality stage, on held-out text. Higher is less noise. A method that "
    "raises a kind's SNR removed noise there; the kinds that stay lowest are where the remaining loss comes from."
)
BLOCK_SENSITIVITY_TITLE = "Quantization noise by block, per row (peers included)"
BLOCK_SENSITIVITY_NOTE = (
    "The same checkpoints measured where every method's folded transform cancels: each decoder layer's attention "
    "and MLP block, all its quantized layers together, fed the reference's input through the checkpoint's own "
    "norms, output SNR in dB per block kind, mean over layers (worst layer); `quantkit quality`. It compares "
    "quantkit's rows with the peers' (whose AWQ scales the checkpoint does not record, so their single projections "
    "cannot be measured). Higher is less noise; noise that a block's later layers compound shows here, not above."
)
SENSITIVITY_NOTE = (
    "Where a format's rounding noise sits before any method: each Linear of the source quantized alone on held-out "
    "text (`quantkit diagnose`), output SNR in dB per projection kind, mean over layers (worst layer). A kind far "
    "below the others is a candidate for higher precision; when all sit near the format's floor and the outlier "
    "figures are small, outlier methods (SQ, Rot) have little to remove and only a finer format lowers the loss."
)


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _degradation_cell(r: TableRow, key: str | None) -> tuple[str, bool | None]:
    """(text, significant) of a degradation-table cell: Delta ± noise, n.s. inside it; key None: Delta Avg."""
    d = cast(Degradation, r.degradation)  # a degraded (non-BF16) row
    delta, noise = (d.delta_avg, d.noise_avg) if key is None else (d.delta.get(key), d.noise.get(key))
    return _delta_ns(delta, noise, with_noise=True), significant(delta, noise)


def verdict_lines(results: Results | dict | str | Path) -> tuple[str, list[str]] | None:
    """(the rule, one sentence per verdict) of a study's `meta.verdicts` (quantkit.evals.verdicts: per model the
    numerics floor, the reference, each row's loss vs BF16 and each method vs its baseline), or None without."""
    verdicts = _meta(results).get("verdicts")
    if not isinstance(verdicts, dict) or not verdicts.get("sentences"):
        return None
    return str(verdicts.get("rule", "")), [str(s) for s in verdicts["sentences"]]


VERDICTS_TITLE = "Verdicts"


def to_markdown(
    table: Table,
    time_line: str | None = None,
    sensitivity: Sequence[SensitivitySection] = (),
    verdicts: tuple[str, list[str]] | None = None,
) -> str:
    """The verdicts in words (`verdict_lines`: rule, then one line each) when given, the summary paragraph, Table 2
    (scores, Avg, ΔAvg, noise), the diagnostics table, the per-benchmark degradation vs BF16; `time_line`
    (timing_line) under the notes; each of `sensitivity` (`sensitivity_sections`: the source's and the rows'
    per-projection SNR tables) a section with a table per model at the end."""
    lead, extra, diag = _lead_columns(table), _extra_columns(table), _diagnostic_columns(table)
    groups = [g for g, n in _group_spans(table.columns) for g in [g] + [""] * (n - 1)]
    width = len(lead) + len(table.columns) + len(extra)
    text = summary(table)
    said = [] if verdicts is None else [f"## {VERDICTS_TITLE}", "", f"Rule: {verdicts[0]}.", ""]
    said += [] if verdicts is None else [*(f"- {line}" for line in verdicts[1]), ""]
    lines = [
        "# Table 2" + (f": {_title(table.results)}" if _title(table.results) else ""),
        "",
        *said,
        *([text, ""] if text else []),
        notes(table),
        "",
        *([time_line, ""] if time_line else []),
        _md_row([h for h, _ in lead] + groups + [h for h, _ in extra]),
        _md_row(["---"] * len(lead) + ["---:"] * (len(table.columns) + len(extra))),
        _md_row([""] * len(lead) + [f"**{b.label}**" for b in table.columns] + [""] * len(extra)),
    ]
    section = None
    for r in table.rows:
        if table.has_sections and r.row.section != section:
            section = r.row.section
            lines.append(_md_row([f"*{section or ''}*"] + [""] * (width - 1)))
        lines.append(
            _md_row(
                [f(r) for _, f in lead]
                + [_score(r.row.scores.get(b.key)) for b in table.columns]
                + [f(r) for _, f in extra]
            )
        )
    if diag:
        lines += [
            "",
            "## Diagnostics",
            "",
            _md_row([h for h, _ in lead] + [h for h, _ in diag]),
            _md_row(["---"] * len(lead) + ["---:"] * len(diag)),
        ]
        lines += [_md_row([f(r) for _, f in lead] + [f(r) for _, f in diag]) for r in table.rows]
    degraded = [r for r in table.rows if r.degradation]
    if degraded:
        lines += [
            "",
            f"## Degradation vs BF16 (points, ± noise floor where known; {NS}: inside it)",
            "",
            _md_row([h for h, _ in lead] + [b.label for b in table.columns] + ["ΔAvg"]),
            _md_row(["---"] * len(lead) + ["---:"] * (len(table.columns) + 1)),
        ]
        for r in degraded:
            cells = [_degradation_cell(r, b.key)[0] for b in table.columns] + [_degradation_cell(r, None)[0]]
            lines.append(_md_row([f(r) for _, f in lead] + cells))
    for title, note, unit, per_model in sensitivity:
        tables = {model: sensitivity_table(t, unit) for model, t in per_model.items()}
        if any(tables.values()):
            lines += ["", f"## {title}", "", note]
            for model, text in tables.items():
                lines += ["", f"**{model}**", "", text] if text else []
    return "\n".join(lines) + "\n"


def _clean(value: Any) -> Any:
    """Floats rounded to 10 decimals (drops binary noise such as -1.7199999999999989), recursively."""
    if isinstance(value, float):
        return round(value, 10)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _row_record(table: Table, r: TableRow) -> dict[str, Any]:
    """One row of report.json (full precision; benchmark dicts keyed by canonical benchmark key)."""
    d = r.degradation
    return {
        "id": r.row.row_id,
        "section": r.row.section,
        "variant": r.row.variant,
        "label": r.row.label,
        "model": r.row.model,
        "recipe": r.row.recipe,
        "precision": r.row.precision,
        "scores": {b.key: r.row.scores[b.key] for b in table.columns if b.key in r.row.scores},
        "avg": r.avg,
        "delta": d.delta if d else None,
        "delta_avg": d.delta_avg if d else None,
        "noise": d.noise if d else None,
        "noise_avg": d.noise_avg if d else None,
        "significant": {k: significant(v, d.noise.get(k)) for k, v in d.delta.items()} if d else None,
        "delta_avg_significant": significant(d.delta_avg, d.noise_avg) if d else None,
        "recovery": d.recovery if d else None,
        "flips": r.row.flips or None,
        "flips_mean": r.flips_mean,
        "kl": r.row.kl,
        "outliers": r.row.outliers or None,
        "calibration": None if r.row.calibration is None else list(r.row.calibration),
        "size": r.row.size,
    }


def to_json(table: Table) -> str:
    """report.json (report_version 1): study identity, columns, one record per row (floats rounded to 10 decimals)."""
    res = table.results
    doc = {
        "report_version": 1,
        "study": res.study,
        "suite": res.suite,
        "suite_version": res.suite_version,
        "created": res.created,
        "source": res.source,
        "columns": [{"key": b.key, "label": b.label, "group": b.group} for b in table.columns],
        "rows": [_clean(_row_record(table, r)) for r in table.rows],
    }
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def to_csv(table: Table) -> str:
    """One line per results row: identity, scores by label, avg, delta_avg, the optional figures some row has,
    per-benchmark deltas (and noise, flips where present) by canonical key, outlier figures."""
    keys = [b.key for b in table.columns]
    columns: list[tuple[str, Callable[[TableRow], Any]]] = [
        ("id", lambda r: r.row.row_id),
        ("section", lambda r: r.row.section),
        ("variant", lambda r: r.row.variant),
        ("label", lambda r: r.row.label),
        ("model", lambda r: r.row.model),
        ("recipe", lambda r: r.row.recipe),
        ("precision", lambda r: r.row.precision),
    ]
    columns += [(b.label, _keyed(lambda r, k: r.row.scores.get(k), b.key)) for b in table.columns]
    columns += [("avg", lambda r: r.avg), ("delta_avg", lambda r: r.degradation and r.degradation.delta_avg)]
    if table.has_noise:
        columns.append(("noise_avg", lambda r: r.degradation and r.degradation.noise_avg))
    columns.append(("recovery", lambda r: r.degradation and r.degradation.recovery))
    if table.has_flips:
        columns.append(("flips_mean", lambda r: r.flips_mean))
    if table.has_kl:
        columns.append(("kl", lambda r: r.row.kl))
    if table.has_calibration:
        columns.append(
            (
                "calibration",
                lambda r: (r.row.calibration is not None and describe_calibration(r.row.calibration)) or None,
            )
        )
    if table.has_size:
        columns += [
            ("size_bytes", lambda r: r.row.size and r.row.size["bytes"]),
            ("size_bf16_ratio", lambda r: r.row.size and r.row.size["bf16_ratio"]),
        ]
    columns += [(f"delta_{k}", _keyed(lambda r, k: r.degradation and r.degradation.delta.get(k), k)) for k in keys]
    if table.has_noise:
        columns += [(f"noise_{k}", _keyed(lambda r, k: r.degradation and r.degradation.noise.get(k), k)) for k in keys]
    if table.has_flips:
        columns += [(f"flips_{k}", _keyed(lambda r, k: r.row.flips.get(k), k)) for k in keys]
    columns += [(f"outlier_{k}", _keyed(lambda r, k: r.row.outliers.get(k), k)) for k in table.outlier_keys]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([name for name, _ in columns])
    for r in table.rows:
        writer.writerow(["" if (v := get(r)) is None else _clean(v) for _, get in columns])
    return buf.getvalue()


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}
th,td{padding:3px 7px;text-align:right;border-bottom:1px solid #eee;white-space:nowrap}
th{border-bottom:1px solid #999}
td.l,th.l{text-align:left}
tr.section td{text-align:left;font-style:italic;background:#f4f4f4;border-top:1px solid #999}
thead tr:first-child th{border-top:2px solid #222}
tbody tr:last-child td{border-bottom:2px solid #222}
.neg{color:#b00020}.pos{color:#1b7a1b}
td.ns{color:#999}
.figs{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}
.notes{font-size:12px;color:#555;max-width:70em}
figure{margin:1em 0}figcaption{font-size:12px;color:#555}
"""


def _cell(text: str, cls: str = "", tag: str = "td", attrs: str = "") -> str:
    cls_attr = f' class="{cls}"' if cls else ""
    return f"<{tag}{cls_attr}{attrs}>{html.escape(text)}</{tag}>"


def _sign_class(x: float | None, sig: bool | None = None) -> str:
    """ "ns" (greyed) for a delta inside its noise floor, else "neg"/"pos" by sign."""
    if sig is False:
        return "ns"
    return "" if x is None or x == 0 else ("neg" if x < 0 else "pos")


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    return (
        f"<table><thead><tr>{''.join(head)}</tr></thead><tbody>"
        + "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
        + "</tbody></table>"
    )


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def to_html(
    table: Table,
    figures: dict[str, str] | None = None,
    time_line: str | None = None,
    sensitivity: Sequence[SensitivitySection] = (),
    verdicts: tuple[str, list[str]] | None = None,
) -> str:
    """Self-contained page: inline CSS; the verdicts (as `to_markdown`); the summary paragraph; Table 2 with grouped
    headers; the diagnostics table; the degradation table (n.s. cells greyed); inline SVG plots (Delta per
    benchmark, then Delta Avg and KL per variant side by side); the per-projection SNR tables of `sensitivity` (as
    `to_markdown`); then `figures` ({caption: inline <svg>}, e.g. each checkpoint's outlier diagnostics) when
    given; `time_line` (timing_line) under the notes."""
    lead, extra, diag = _lead_columns(table), _extra_columns(table), _diagnostic_columns(table)
    width = len(lead) + len(table.columns) + len(extra)
    head1 = [_cell(h, "l", "th", ' rowspan="2"') for h, _ in lead]
    head1 += [_cell(g, "", "th", f' colspan="{n}" style="text-align:center"') for g, n in _group_spans(table.columns)]
    head1 += [_cell(h, "", "th", ' rowspan="2"') for h, _ in extra]
    head2 = [_cell(b.label, "", "th") for b in table.columns]
    body, section = [], None
    for r in table.rows:
        if table.has_sections and r.row.section != section:
            section = r.row.section
            body.append(f'<tr class="section"><td colspan="{width}">{html.escape(section or "")}</td></tr>')
        cells = [_cell(f(r), "l") for _, f in lead] + [_cell(_score(r.row.scores.get(b.key))) for b in table.columns]
        for header, f in extra:
            d = r.degradation if header == "ΔAvg" else None
            cells.append(_cell(f(r), _sign_class(d.delta_avg, significant(d.delta_avg, d.noise_avg)) if d else ""))
        body.append("<tr>" + "".join(cells) + "</tr>")
    text = summary(table)
    parts = [
        f"<h1>Table 2{': ' + html.escape(_title(table.results)) if _title(table.results) else ''}</h1>",
        *(
            [
                f"<h2>{VERDICTS_TITLE}</h2>",
                f'<p class="notes">Rule: {html.escape(verdicts[0])}.</p>',
                "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in verdicts[1]) + "</ul>",
            ]
            if verdicts
            else []
        ),
        *([f"<p>{html.escape(text)}</p>"] if text else []),
        f'<p class="notes">{html.escape(notes(table))}</p>',
        *([f'<p class="notes">{html.escape(time_line)}</p>'] if time_line else []),
        "<table><thead><tr>"
        + "".join(head1)
        + "</tr><tr>"
        + "".join(head2)
        + "</tr></thead><tbody>"
        + "".join(body)
        + "</tbody></table>",
    ]
    if diag:
        parts += [
            "<h2>Diagnostics</h2>",
            _html_table(
                [_cell(h, "l", "th") for h, _ in lead] + [_cell(h, "", "th") for h, _ in diag],
                [[_cell(f(r), "l") for _, f in lead] + [_cell(f(r)) for _, f in diag] for r in table.rows],
            ),
        ]
    degraded = [r for r in table.rows if r.degradation]
    if degraded:
        rows_html = []
        for r in degraded:
            cells = [_cell(f(r), "l") for _, f in lead]
            deg = cast(Degradation, r.degradation)  # `degraded` rows have one
            per_key: list[tuple[str | None, float | None]] = [(b.key, deg.delta.get(b.key)) for b in table.columns]
            for key, delta in per_key + [(None, deg.delta_avg)]:
                text, sig = _degradation_cell(r, key)
                cells.append(_cell(text, _sign_class(delta, sig)))
            rows_html.append(cells)
        degradation_head = (
            [_cell(h, "l", "th") for h, _ in lead]
            + [_cell(b.label, "", "th") for b in table.columns]
            + [_cell("ΔAvg", "", "th")]
        )
        parts += [
            f"<h2>Degradation vs BF16 (points, ± noise floor where known; {NS}: inside it, greyed)</h2>",
            _html_table(degradation_head, rows_html),
            "<h2>Plots</h2>",
            _figure(
                cast(str, plot_benchmark_degradation(table)),  # a plot: there are degraded rows
                "Delta vs BF16 per benchmark and Avg (points)",
            ),
        ]
        side = [
            (plot_variant_degradation(table), "Delta Avg vs BF16 per variant and precision (points)"),
            (plot_variant_kl(table), "KL vs BF16 per variant and precision (nats/token, held-out text)"),
        ]
        parts.append('<div class="figs">' + "".join(_figure(svg, c) for svg, c in side if svg) + "</div>")
    for title, note, unit, per_model in sensitivity:
        sensitivity_parts = []
        for model, per_recipe in per_model.items():
            head, rows = sensitivity_cells(per_recipe, unit)
            if head:
                sensitivity_parts += [
                    f"<h3>{html.escape(model)}</h3>",
                    _html_table(
                        [_cell(head[0], "l", "th")] + [_cell(h, "", "th") for h in head[1:]],
                        [[_cell(row[0], "l")] + [_cell(c) for c in row[1:]] for row in rows],
                    ),
                ]
        if sensitivity_parts:
            parts += [f"<h2>{html.escape(title)}</h2>", f'<p class="notes">{html.escape(note)}</p>']
            parts += sensitivity_parts
    if figures:
        parts.append("<h2>Outlier diagnostics</h2>")
        parts += [_figure(svg, caption) for caption, svg in figures.items()]
    title = html.escape(f"quantkit report: {_title(table.results) or table.results.source}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def render_report(
    results: Results | dict | str | Path, out_dir: str | Path, figures: dict[str, str] | None = None
) -> dict[str, Path]:
    """Validate `results` (a Results, a parsed dict, or a JSON path) and write report.{md,csv,json,html} to out_dir;
    `figures` ({caption: inline <svg>}) are appended to the HTML page; the study's `meta.timings` give a "Time:" line,
    its `meta.pending` (rows not measured yet) a "Pending:" one, its `meta.sensitivity` and
    `meta.checkpoint_sensitivity` the per-projection SNR tables, its `meta.verdicts` the opening "Verdicts" section."""
    res = results if isinstance(results, Results) else load_results(results)
    table = build_table(res)
    lines = (pending_line(results), timing_line(_meta(results).get("timings")))
    time_line = " ".join(line for line in lines if line) or None
    sensitivity = sensitivity_sections(results)
    verdicts = verdict_lines(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, render in zip(
        REPORT_FILES,
        (
            lambda t: to_markdown(t, time_line, sensitivity, verdicts),
            to_csv,
            to_json,
            lambda t: to_html(t, figures, time_line, sensitivity, verdicts),
        ),
    ):
        paths[name] = out / name
        write_text_atomic(paths[name], render(table))
    return paths
