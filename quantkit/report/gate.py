"""CI gate: does a recipe lose more against BF16 in `current` than it did in `baseline`?

For every non-BF16 row (variant, recipe) of the baseline file, with Delta = score(recipe) - score(BF16 of
the same variant) in points (negative = worse), computed in each file (quantkit.report.table.degradation):

    change  = Delta_current - Delta_baseline          (negative = more degradation now)
    allowed = max(threshold, noise)                   noise: the larger of the two files' noise floors
    regression when change < -allowed

per benchmark (threshold `max_drop`, or a per-benchmark override) and for Delta Avg over the benchmarks of
the baseline row (threshold `max_avg_drop`, noise sqrt(sum noise_b^2)/n). KL (nats/token vs BF16), where the
baseline has it: regression when kl_current > max_kl_ratio * kl_baseline and kl_current - kl_baseline >
min_kl_increase. Rows or benchmarks only in `current` are listed, not gated. Exit status of `run_gate`:
0 pass, 1 regression, 2 malformed input (ResultsError: missing rows/benchmarks/KL, a recipe row without its
BF16 row, non-finite scores, unknown schema version, bad thresholds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from quantkit.errors import print_error
from quantkit.metrics import noise_of_mean
from quantkit.report.benchmarks import resolve
from quantkit.report.results import Results, ResultsError, load_results
from quantkit.report.table import Degradation, degradation, mean
from quantkit.yamlfile import read_yaml


@dataclass(frozen=True)
class Thresholds:
    """Gate limits; the defaults are configs/gate.yaml's. Points are score points 0-100."""

    max_drop: float = 2.0  # extra degradation allowed per benchmark (points)
    max_avg_drop: float = 1.0  # extra degradation allowed for Delta Avg (points)
    max_kl_ratio: float = 1.25  # KL may grow by this factor ...
    min_kl_increase: float = 0.001  # ... or by this much (nats/token), whichever allows more
    benchmarks: dict[str, float] = field(default_factory=dict)  # per-benchmark max_drop (canonical keys)

    def for_benchmark(self, key: str) -> float:
        """The max_drop (points) of benchmark `key` (canonical): its override, else max_drop."""
        return self.benchmarks.get(key, self.max_drop)


def load_thresholds(path: str | Path | None = None, **overrides: float | None) -> Thresholds:
    """Defaults, then the YAML file's values, then the non-None keyword overrides (CLI flags)."""
    values: dict = {}
    if path is not None:
        try:
            data = read_yaml(path) or {}
        except OSError as err:
            raise ResultsError(f"{path}: cannot read gate thresholds ({err})") from None
        if not isinstance(data, dict):
            raise ResultsError(f"{path}: gate thresholds must be a mapping")
        known = {f.name for f in fields(Thresholds)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ResultsError(f"{path}: unknown threshold(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        values = dict(data)
    values.update({k: v for k, v in overrides.items() if v is not None})
    where = str(path) if path is not None else "gate thresholds"
    for key, value in values.items():
        if key == "benchmarks":
            if not isinstance(value, dict):
                raise ResultsError(f"{where}: 'benchmarks' must map benchmark -> points")
            values[key] = {resolve(b).key: _limit(v, f"{where}: benchmarks[{b!r}]") for b, v in value.items()}
        else:
            values[key] = _limit(value, f"{where}: {key}")
    return replace(Thresholds(), **values)


def _limit(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ResultsError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Check:
    """One gated figure of one row: Delta (points) of a benchmark or "Avg", or "KL" (nats/token).

    `allowed` is the most it may worsen: max(threshold, noise) for deltas, the KL rule's slack for KL.
    """

    variant: str
    recipe: str
    what: str
    baseline: float
    current: float
    threshold: float
    allowed: float

    @property
    def worsening(self) -> float:
        """How much worse current is than baseline (> 0 = worse): lower Delta, or higher KL."""
        return self.current - self.baseline if self.what == "KL" else self.baseline - self.current

    @property
    def failed(self) -> bool:
        """True when worsening > allowed: a regression."""
        return self.worsening > self.allowed

    @property
    def verdict(self) -> str:
        """'REGRESSION' when failed; 'ok (within noise)' when worse by more than the threshold only; else 'ok'."""
        if self.failed:
            return "REGRESSION"
        return "ok (within noise)" if self.worsening > self.threshold else "ok"


@dataclass(frozen=True)
class GateResult:
    checks: tuple[Check, ...]
    new_rows: tuple[str, ...]  # variant/recipe only in current
    new_benchmarks: tuple[str, ...]  # "variant/recipe: benchmark" only in current

    @property
    def failures(self) -> tuple[Check, ...]:
        """The failed checks (regressions), in check order."""
        return tuple(c for c in self.checks if c.failed)


def _avg_noise(deg: Degradation, keys: list[str]) -> float | None:
    if not all(k in deg.noise for k in keys):
        return None
    return noise_of_mean([deg.noise[k] for k in keys])


def _max_noise(*values: float | None) -> float:
    return max((v for v in values if v is not None), default=0.0)


def compare(baseline: Results, current: Results, thresholds: Thresholds) -> GateResult:
    """Every check of the module docstring; raises ResultsError when current lacks what baseline gates."""
    checks: list[Check] = []
    new_benchmarks: list[str] = []
    for row in baseline.rows:
        if row.is_baseline:
            continue
        cur = current.find(row.variant, row.recipe)
        if cur is None:
            raise ResultsError(
                f"{current.source}: missing row variant {row.variant!r}, recipe {row.recipe!r} "
                f"(present in {baseline.source})"
            )
        base_deg = degradation(row, baseline.baseline(row.variant))
        cur_deg = degradation(cur, current.baseline(cur.variant))
        keys = list(base_deg.delta)
        missing = [resolve(k).label for k in keys if k not in cur_deg.delta]
        if missing:
            raise ResultsError(
                f"{current.source}: {row.name} lacks benchmark(s) {', '.join(missing)} "
                f"(scored in {baseline.source}, for the recipe row and its bf16 row)"
            )
        new_benchmarks += [f"{row.name}: {resolve(k).label}" for k in cur_deg.delta if k not in base_deg.delta]
        for k in keys:
            limit = thresholds.for_benchmark(k)
            noise = _max_noise(base_deg.noise.get(k), cur_deg.noise.get(k))
            checks.append(
                Check(
                    row.variant,
                    row.recipe,
                    resolve(k).label,
                    base_deg.delta[k],
                    cur_deg.delta[k],
                    limit,
                    max(limit, noise),
                )
            )
        noise = _max_noise(_avg_noise(base_deg, keys), _avg_noise(cur_deg, keys))
        checks.append(
            Check(
                row.variant,
                row.recipe,
                "Avg",
                mean([base_deg.delta[k] for k in keys]),
                mean([cur_deg.delta[k] for k in keys]),
                thresholds.max_avg_drop,
                max(thresholds.max_avg_drop, noise),
            )
        )
        if row.kl is not None:
            if cur.kl is None:
                raise ResultsError(f"{current.source}: {row.name} has no 'kl' (present in {baseline.source})")
            slack = max(row.kl * (thresholds.max_kl_ratio - 1), thresholds.min_kl_increase)
            checks.append(Check(row.variant, row.recipe, "KL", row.kl, cur.kl, slack, slack))
    new_rows = tuple(r.name for r in current.rows if not r.is_baseline and baseline.find(r.variant, r.recipe) is None)
    return GateResult(checks=tuple(checks), new_rows=new_rows, new_benchmarks=tuple(new_benchmarks))


def _fmt(check: Check, value: float) -> str:
    return f"{value:.4f}" if check.what == "KL" else f"{value:+.2f}"


def format_checks(checks: tuple[Check, ...]) -> str:
    """An aligned text table: variant, recipe, benchmark, baseline vs current Delta (or KL), allowed, verdict."""
    header = ("variant", "recipe", "benchmark", "baseline", "current", "change", "allowed", "verdict")
    lines = [header] + [
        (
            c.variant,
            c.recipe,
            c.what,
            _fmt(c, c.baseline),
            _fmt(c, c.current),
            f"{c.current - c.baseline:+.4f}" if c.what == "KL" else f"{c.current - c.baseline:+.2f}",
            f"+{c.allowed:.4f}" if c.what == "KL" else f"-{c.allowed:.2f}",
            c.verdict,
        )
        for c in checks
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {3, 4, 5, 6}
    out = [
        "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(line, widths))).rstrip()
        for line in lines
    ]
    return "\n".join([out[0], "  ".join("-" * w for w in widths), *out[1:]])


def run_gate(baseline: str | Path, current: str | Path, thresholds: Thresholds, verbose: bool = False) -> int:
    """Print the verdict; return 0 pass, 1 regression, 2 malformed input (message on stderr)."""
    try:
        result = compare(load_results(baseline), load_results(current), thresholds)
    except ResultsError as err:
        return print_error("gate", err)
    rows = len({(c.variant, c.recipe) for c in result.checks})
    limits = (
        f"max drop {thresholds.max_drop:.2f} points per benchmark, {thresholds.max_avg_drop:.2f} for Avg, "
        f"KL x{thresholds.max_kl_ratio:g} or +{thresholds.min_kl_increase:g}; noise floor widens each"
    )
    notes = (
        [f"not gated (only in current): {', '.join(result.new_rows + result.new_benchmarks)}"]
        if result.new_rows or result.new_benchmarks
        else []
    )
    if result.failures:
        print(format_checks(result.checks if verbose else result.failures))
        print(
            f"gate: FAIL: {len(result.failures)} regression(s) in {len(result.checks)} checks of {rows} "
            f"quantized row(s) ({limits}); Delta = recipe - BF16 in points, negative = worse",
            *notes,
            sep="\n",
        )
        return 1
    if verbose:
        print(format_checks(result.checks))
    worst = max(result.checks, key=lambda c: c.worsening - c.allowed, default=None)
    summary = f"gate: PASS: {len(result.checks)} checks of {rows} quantized row(s) within limits ({limits})"
    if worst is not None:
        slack = f"{worst.allowed:.4f}" if worst.what == "KL" else f"{worst.allowed:.2f} points"
        summary += (
            f"; closest: {worst.variant}/{worst.recipe} {worst.what} {_fmt(worst, worst.baseline)} -> "
            f"{_fmt(worst, worst.current)} (may worsen by {slack})"
        )
    print(summary, *notes, sep="\n")
    return 0
