"""Table 2 figures: Avg, degradation vs BF16 and its noise floor, per row.

Conventions (points 0-100): Avg is the plain mean of the row's benchmark scores (paper 000, Table 2).
Delta = score(recipe) - score(BF16 of the same variant), negative = worse; Delta Avg is the mean of the
per-benchmark deltas over the benchmarks both rows have (= Avg - Avg(BF16) when they have the same ones).
Noise of a delta: the row's `noise_floor` (half-width of the paired-bootstrap CI of the delta); else, with
`ci95` on both rows, sqrt(h_recipe^2 + h_bf16^2) of the two CI half-widths; else unknown. Noise of Delta
Avg: sqrt(sum noise_b^2) / n when every benchmark has one (independent benchmarks;
`quantkit.metrics.noise_of_mean`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.metrics import noise_of_mean
from quantkit.report.benchmarks import Benchmark, ordered
from quantkit.report.results import Results, Row


def mean(values: list[float]) -> float:
    """Plain mean, exactly rounded sum (math.fsum)."""
    return math.fsum(values) / len(values)


@dataclass(frozen=True)
class Degradation:
    """score(row) - score(baseline) in points per benchmark and for Avg, with noise floors where known."""

    delta: dict[str, float]
    delta_avg: float | None
    noise: dict[str, float]
    noise_avg: float | None


def degradation(row: Row, base: Row) -> Degradation:
    """Delta of `row` against its BF16 row `base` (see the module docstring)."""
    common = [b for b in row.scores if b in base.scores]
    delta = {b: row.scores[b] - base.scores[b] for b in common}
    noise = {}
    for b in common:
        if b in row.noise_floor:
            noise[b] = row.noise_floor[b]
        elif b in row.ci95 and b in base.ci95:
            noise[b] = math.hypot(_half_width(row.ci95[b]), _half_width(base.ci95[b]))
    noise_avg = noise_of_mean(list(noise.values())) if common and len(noise) == len(common) else None
    return Degradation(delta=delta, delta_avg=mean(list(delta.values())) if delta else None, noise=noise,
                       noise_avg=noise_avg)


def _half_width(ci: tuple[float, float]) -> float:
    return (ci[1] - ci[0]) / 2


@dataclass(frozen=True)
class TableRow:
    """A results row with its Avg, and for non-BF16 rows its degradation and mean flip rate (fraction)."""

    row: Row
    avg: float
    degradation: Degradation | None
    flips_mean: float | None


@dataclass(frozen=True)
class Table:
    """Columns (benchmarks present in any row, in Table 2 order), outlier figure names, rows in file order."""

    columns: tuple[Benchmark, ...]
    outlier_keys: tuple[str, ...]
    rows: tuple[TableRow, ...]
    results: Results

    @property
    def has_kl(self) -> bool:
        return any(r.row.kl is not None for r in self.rows)

    @property
    def has_flips(self) -> bool:
        return any(r.flips_mean is not None for r in self.rows)

    @property
    def has_noise(self) -> bool:
        return any(r.degradation and r.degradation.noise_avg is not None for r in self.rows)

    @property
    def has_sections(self) -> bool:
        return any(r.row.section for r in self.rows)

    @property
    def has_ids(self) -> bool:
        return any(r.row.row_id for r in self.rows)


def build_table(results: Results) -> Table:
    """Compute every row's Avg and degradation vs the BF16 row of its variant."""
    rows = []
    for row in results.rows:
        deg = None if row.is_baseline else degradation(row, results.baseline(row.variant))
        flips = mean(list(row.flips.values())) if row.flips and not row.is_baseline else None
        rows.append(TableRow(row=row, avg=mean(list(row.scores.values())), degradation=deg, flips_mean=flips))
    columns = ordered([b for r in results.rows for b in r.scores])
    outlier_keys = tuple(dict.fromkeys(k for r in results.rows for k in r.outliers))
    return Table(columns=tuple(columns), outlier_keys=outlier_keys, rows=tuple(rows), results=results)
