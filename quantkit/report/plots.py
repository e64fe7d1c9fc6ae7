"""Degradation plots as inline SVG text (matplotlib, no pyplot state): per benchmark and per variant, and
the KL per variant beside them.

Bars are Delta = score(recipe) - score(BF16) in points (negative = worse); error bars are the noise floor
where the results carry one (quantkit.report.table). KL bars: the row's `kl`, nats/token vs BF16.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from quantkit.report.table import Table, TableRow

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

_RC: dict[RcKeyType, Any] = {"svg.hashsalt": "quantkit", "svg.fonttype": "none", "font.size": 9}


def inline_svg(fig: Figure) -> str:
    """The figure as an <svg> element for inline HTML (no XML prolog, no timestamp: reproducible)."""
    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog/doctype: the SVG goes inline into HTML


def _bars(ax, groups: list[str], series: list[tuple[str, list[float | None], list[float | None]]]) -> None:
    """Grouped bars: one group per x label, one bar per series (name, values, noise); None = no bar."""
    x = np.arange(len(groups))
    width = 0.8 / max(len(series), 1)
    for i, (name, values, noise) in enumerate(series):
        pos = x - 0.4 + width * (i + 0.5)
        vals = np.array([np.nan if v is None else v for v in values])
        err = np.array([0.0 if n is None else n for n in noise])
        ax.bar(pos, vals, width, label=name, yerr=err if err.any() else None, capsize=2, error_kw={"lw": 0.8})
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(x, groups, rotation=30 if len(groups) > 8 else 0, ha="right" if len(groups) > 8 else "center")
    ax.set_ylabel("Delta vs BF16 (points)")
    ax.grid(axis="y", lw=0.3)
    ax.legend(fontsize=7, ncols=1 + len(series) // 8, loc="best")


def _name(r: TableRow) -> str:
    return " ".join(p for p in (r.row.row_id, r.row.precision, r.row.label) if p)


def plot_benchmark_degradation(table: Table) -> str | None:
    """Delta per benchmark (and Avg), one bar per non-BF16 row; None when there is no such row."""
    rows = [r for r in table.rows if r.degradation]
    if not rows:
        return None
    labels = [b.label for b in table.columns] + ["Avg"]
    series = [
        (
            _name(r),
            [d.delta.get(b.key) for b in table.columns] + [d.delta_avg],
            [d.noise.get(b.key) for b in table.columns] + [d.noise_avg],
        )
        for r in rows
        if (d := r.degradation)  # every row of `rows` has one
    ]
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(max(6.0, 0.6 * len(labels) + 0.12 * len(labels) * len(rows)), 3.6))
        ax = fig.add_subplot()
        _bars(ax, labels, series)
        ax.set_title("Degradation per benchmark")
    return inline_svg(fig)


def _variant_series(rows: list[TableRow], value, noise) -> tuple[list[str], list[tuple[str, list, list]]]:
    """(variant names, one series per precision) of `value(row)` / `noise(row)` for the given rows."""
    variants = list(dict.fromkeys(r.row.variant for r in rows))
    names = {r.row.variant: r.row.label for r in rows}
    if len(set(names.values())) < len(names):  # labels repeat across sizes/sections: the ids are unique
        names = {v: v for v in variants}
    precisions = list(dict.fromkeys(r.row.precision for r in rows))
    by_key = {(r.row.variant, r.row.precision): r for r in rows}
    series = []
    for p in precisions:
        cells = [by_key.get((v, p)) for v in variants]
        series.append((p, [value(r) if r else None for r in cells], [noise(r) if r else None for r in cells]))
    return [names[v] for v in variants], series


def _variant_figure(groups: list[str], series: list, title: str, ylabel: str) -> str:
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(max(5.0, 1.2 * len(groups) + 0.3 * len(groups) * len(series)), 3.6))
        ax = fig.add_subplot()
        _bars(ax, groups, series)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    return inline_svg(fig)


def plot_variant_degradation(table: Table) -> str | None:
    """Delta Avg per variant, one bar per precision; None when there is no non-BF16 row."""
    rows = [r for r in table.rows if r.degradation]
    if not rows:
        return None
    groups, series = _variant_series(rows, lambda r: r.degradation.delta_avg, lambda r: r.degradation.noise_avg)
    return _variant_figure(groups, series, "Degradation of Avg per variant", "Delta vs BF16 (points)")


def plot_variant_kl(table: Table) -> str | None:
    """KL(P_bf16 || P_recipe) per variant, one bar per precision (nats/token, no error bars: the study
    reports the mean only); None when no non-BF16 row has a KL."""
    rows = [r for r in table.rows if r.degradation and r.row.kl is not None]
    if not rows:
        return None
    groups, series = _variant_series(rows, lambda r: r.row.kl, lambda r: None)
    return _variant_figure(groups, series, "KL vs BF16 per variant", "KL vs BF16 (nats/token)")
