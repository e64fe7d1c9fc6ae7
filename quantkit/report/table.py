"""Table 2 figures: Avg, degradation vs BF16 and its noise floor, per row.

Conventions (points 0-100): Avg is the plain mean of the row's benchmark scores (paper 000, Table 2), over
the suite's `avg` benchmarks when the results name a suite that has one (table2: the paper's 11 columns;
other columns are shown but kept out of Avg and Delta Avg), else over all of them.
Delta = score(recipe) - score(BF16 of the same variant), negative = worse; Delta Avg is the mean of the
per-benchmark deltas over the Avg benchmarks both rows have (= Avg - Avg(BF16) when they have the same ones).
Noise of a delta: the row's `noise_floor` (half-width of the paired-bootstrap CI of the delta); else, with
`ci95` on both rows, sqrt(h_recipe^2 + h_bf16^2) of the two CI half-widths; else unknown. Noise of Delta
Avg: sqrt(sum noise_b^2) / n when every benchmark has one (independent benchmarks;
`quantkit.metrics.noise_of_mean`).
Significance: a delta is inside its noise floor ("n.s.") when |delta| <= noise (the 95% CI of the delta
contains 0); unknown without a noise. Two variants' Delta Avg under one precision differ significantly when
|difference| > sqrt(noise_a^2 + noise_b^2) (their paired bootstraps are over different models' items,
independent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

from quantkit.metrics import noise_of_mean
from quantkit.report.benchmarks import Benchmark, ordered, resolve
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
    # % : mean over the Avg's benchmarks (those BF16 scores above 0) of 100 x score / BF16 score, as the verdicts'
    # recovery (quantkit.metrics.stratified_bootstrap); None when no benchmark has a BF16 score above 0
    recovery: float | None = None


def degradation(row: Row, base: Row, avg_keys: frozenset[str] | None = None) -> Degradation:
    """Delta of `row` against its BF16 row `base` (see the module docstring); Delta Avg over `avg_keys` (None: all)."""
    common = [b for b in row.scores if b in base.scores]
    delta = {b: row.scores[b] - base.scores[b] for b in common}
    noise = {}
    for b in common:
        if b in row.noise_floor:
            noise[b] = row.noise_floor[b]
        elif b in row.ci95 and b in base.ci95:
            noise[b] = math.hypot(_half_width(row.ci95[b]), _half_width(base.ci95[b]))
    in_avg = [b for b in common if avg_keys is None or b in avg_keys]
    noise_avg = noise_of_mean([noise[b] for b in in_avg]) if in_avg and all(b in noise for b in in_avg) else None
    ratios = [row.scores[b] / base.scores[b] for b in in_avg if base.scores[b] > 0]
    return Degradation(
        delta=delta,
        delta_avg=mean([delta[b] for b in in_avg]) if in_avg else None,
        noise=noise,
        noise_avg=noise_avg,
        recovery=100 * mean(ratios) if ratios else None,
    )


def significant(delta: float | None, noise: float | None) -> bool | None:
    """Whether a delta lies outside its noise floor (|delta| > noise); None when either is unknown."""
    return None if delta is None or noise is None else abs(delta) > noise


def avg_keys_of(suite: str | None) -> frozenset[str] | None:
    """Canonical keys of a named suite's `avg` benchmarks; None (Avg over all columns) for a suite without
    one, or one that is not (or no longer) a known suite."""
    from quantkit.evals.suite import load_suite

    if suite is None:
        return None
    try:
        spec = load_suite(suite)
    except ValueError:
        return None
    return frozenset(resolve(b).key for b in spec.avg) if spec.avg else None


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
    """Columns (benchmarks present in any row, in Table 2 order), outlier figure names, rows in file order;
    `avg_keys`: the columns Avg is over (None: all)."""

    columns: tuple[Benchmark, ...]
    outlier_keys: tuple[str, ...]
    rows: tuple[TableRow, ...]
    results: Results
    avg_keys: frozenset[str] | None = None

    @property
    def not_in_avg(self) -> tuple[Benchmark, ...]:
        """Columns shown but kept out of Avg and Delta Avg."""
        return tuple(b for b in self.columns if self.avg_keys is not None and b.key not in self.avg_keys)

    @property
    def has_kl(self) -> bool:
        """Whether any row records a held-out KL (nats/token vs BF16)."""
        return any(r.row.kl is not None for r in self.rows)

    @property
    def has_flips(self) -> bool:
        """Whether any row has a mean flip rate."""
        return any(r.flips_mean is not None for r in self.rows)

    @property
    def has_noise(self) -> bool:
        """Whether any row's Delta Avg has a noise floor."""
        return any(r.degradation and r.degradation.noise_avg is not None for r in self.rows)

    @property
    def has_size(self) -> bool:
        """Whether any row records its checkpoint size."""
        return any(r.row.size is not None for r in self.rows)

    @property
    def has_calibration(self) -> bool:
        """Whether any row records its calibration sets (an empty tuple counts: recorded, none)."""
        return any(r.row.calibration is not None for r in self.rows)

    @property
    def has_sections(self) -> bool:
        """Whether any row names a section."""
        return any(r.row.section for r in self.rows)

    @property
    def has_ids(self) -> bool:
        """Whether any row has a row id."""
        return any(r.row.row_id for r in self.rows)


def build_table(results: Results) -> Table:
    """Compute every row's Avg and degradation vs the BF16 row of its variant."""
    rows = []
    avg_keys = avg_keys_of(results.suite)
    for row in results.rows:
        deg = None if row.is_baseline else degradation(row, results.baseline(row.variant), avg_keys)
        avg_flips = [v for k, v in row.flips.items() if avg_keys is None or k in avg_keys]
        flips = mean(avg_flips) if avg_flips and not row.is_baseline else None
        in_avg = [v for k, v in row.scores.items() if avg_keys is None or k in avg_keys]
        rows.append(TableRow(row=row, avg=mean(in_avg) if in_avg else math.nan, degradation=deg, flips_mean=flips))
    columns = ordered([b for r in results.rows for b in r.scores])
    outlier_keys = tuple(dict.fromkeys(k for r in results.rows for k in r.outliers))
    return Table(
        columns=tuple(columns), outlier_keys=outlier_keys, rows=tuple(rows), results=results, avg_keys=avg_keys
    )


@dataclass(frozen=True)
class Ranked:
    """One precision's quantized rows ordered by Delta Avg, least loss first, and for each adjacent pair
    whether the step down is significant (None: a noise unknown)."""

    precision: str
    rows: tuple[TableRow, ...]
    steps: tuple[bool | None, ...]


def _ranked(r: TableRow) -> tuple[float, float | None]:
    """(Delta Avg, its noise floor) of a row rank_variants keeps: it has a degradation with a Delta Avg."""
    d = cast(Degradation, r.degradation)
    return cast(float, d.delta_avg), d.noise_avg


def rank_variants(table: Table) -> list[Ranked]:
    """Per precision (first-appearance order), the non-BF16 rows with a Delta Avg, ordered best first."""
    by_precision: dict[str, list[TableRow]] = {}
    for r in table.rows:
        if r.degradation and r.degradation.delta_avg is not None:
            by_precision.setdefault(r.row.precision, []).append(r)
    out = []
    for precision, rows in by_precision.items():
        rows = sorted(rows, key=lambda r: -_ranked(r)[0])
        steps = []
        for a, b in zip(rows, rows[1:]):
            (da, na), (db, nb) = _ranked(a), _ranked(b)
            noise = None if na is None or nb is None else math.hypot(na, nb)
            steps.append(significant(da - db, noise))
        out.append(Ranked(precision=precision, rows=tuple(rows), steps=tuple(steps)))
    return out
