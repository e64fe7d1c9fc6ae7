"""The results JSON (docs/report-format.md, schema_version 1): load and validate, with errors that name the problem.

Conventions: scores are points 0-100 as the paper prints them; `noise_floor` and CI bounds are points too;
`flips` are fractions 0-1 of items whose correctness changed vs BF16; `kl` is nats/token vs BF16;
`calibration` lists the calibration sets the row's checkpoint was made with (quantkit.quantize.provenance). The row
with recipe "bf16" is the baseline of its variant; every other row of that variant is compared with it.
Benchmark keys are canonicalized on load (quantkit.report.benchmarks.resolve).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.report.benchmarks import resolve

SCHEMA_VERSION = 1
BASELINE_RECIPE = "bf16"

_TOP_KEYS = {"schema_version", "study", "suite", "suite_version", "created", "rows", "meta"}
_ROW_KEYS = {
    "id",
    "section",
    "variant",
    "label",
    "model",
    "recipe",
    "precision",
    "scores",
    "ci95",
    "noise_floor",
    "flips",
    "kl",
    "outliers",
    "calibration",
    "size",
    "meta",
}
_CALIBRATION_KEYS = {"use", "source", "num_sequences", "seq_len"}


class ResultsError(QuantkitError, ValueError):
    """Malformed input (a results file or gate thresholds): the message names the file, the row and the field."""


@dataclass(frozen=True)
class Row:
    """One checkpoint x recipe. Dicts are keyed by canonical benchmark key; optional figures may be empty/None."""

    variant: str
    recipe: str
    precision: str
    label: str
    scores: dict[str, float]
    model: str | None = None
    section: str | None = None
    row_id: str | None = None
    ci95: dict[str, tuple[float, float]] = field(default_factory=dict)
    noise_floor: dict[str, float] = field(default_factory=dict)
    flips: dict[str, float] = field(default_factory=dict)
    kl: float | None = None
    outliers: dict[str, float] = field(default_factory=dict)
    calibration: tuple[dict[str, Any], ...] | None = None  # None: not recorded; (): the recipe calibrates nothing
    size: dict[str, float] | None = None  # {"bytes", "bf16_ratio"}: the checkpoint's weight files; None: not recorded

    @property
    def is_baseline(self) -> bool:
        """True for a variant's BF16 row (recipe "bf16")."""
        return self.recipe == BASELINE_RECIPE

    @property
    def name(self) -> str:
        """The row's display name, '<variant>/<recipe>'."""
        return f"{self.variant}/{self.recipe}"


@dataclass(frozen=True)
class Results:
    """A validated results file: rows in file order, each non-BF16 row with a BF16 row of its variant."""

    rows: tuple[Row, ...]
    study: str | None = None
    suite: str | None = None
    suite_version: str | None = None
    created: str | None = None
    source: str = "<results>"

    def baseline(self, variant: str) -> Row:
        """The BF16 row of a variant (validation guarantees there is one)."""
        return next(r for r in self.rows if r.variant == variant and r.is_baseline)

    def find(self, variant: str, recipe: str) -> Row | None:
        """The row of (variant, recipe), or None."""
        return next((r for r in self.rows if r.variant == variant and r.recipe == recipe), None)


def load_results(source: str | Path | dict[str, Any]) -> Results:
    """Read and validate a results JSON file (or an already parsed dict); raises ResultsError."""
    if isinstance(source, dict):
        return parse_results(source, "<results>")
    path = Path(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ResultsError(f"{path}: not valid JSON ({err})") from None
    return parse_results(data, str(path))


def parse_results(data: Any, where: str) -> Results:
    """Validate a parsed results document (see the module docstring); `where` prefixes every error."""
    if not isinstance(data, dict):
        raise ResultsError(f"{where}: the top level must be an object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(f"{where}: unknown schema_version {version!r} (this quantkit reads {SCHEMA_VERSION})")
    _no_unknown(data, _TOP_KEYS, where)
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ResultsError(f"{where}: 'rows' must be a non-empty list")
    parsed = [_row(r, f"{where}: rows[{i}]") for i, r in enumerate(rows)]
    seen: set[tuple[str, str]] = set()
    for i, row in enumerate(parsed):
        if (row.variant, row.recipe) in seen:
            raise ResultsError(f"{where}: rows[{i}]: duplicate row for variant {row.variant!r}, recipe {row.recipe!r}")
        seen.add((row.variant, row.recipe))
    baselines = {r.variant for r in parsed if r.is_baseline}
    for i, row in enumerate(parsed):
        if row.variant not in baselines:
            raise ResultsError(
                f"{where}: rows[{i}] ({row.name}): variant {row.variant!r} has no "
                f"{BASELINE_RECIPE!r} row to compare with"
            )
    meta = {k: _opt_str(data, k, where) for k in ("study", "suite", "suite_version", "created")}
    return Results(rows=tuple(parsed), source=where, **meta)


def _row(data: Any, where: str) -> Row:
    if not isinstance(data, dict):
        raise ResultsError(f"{where}: a row must be an object")
    _no_unknown(data, _ROW_KEYS, where)
    variant, recipe = _req_str(data, "variant", where), _req_str(data, "recipe", where)
    where = f"{where} ({variant}/{recipe})"
    scores = _bench_dict(data, "scores", where, lambda v, w: _number(v, w, 0.0, 100.0))
    if not scores:
        raise ResultsError(f"{where}: 'scores' must be a non-empty object of benchmark -> points (0-100)")
    ci95 = _bench_dict(data, "ci95", where, _interval)
    noise = _bench_dict(data, "noise_floor", where, lambda v, w: _number(v, w, 0.0, math.inf))
    flips = _bench_dict(data, "flips", where, lambda v, w: _number(v, w, 0.0, 1.0))
    for name, extra in (("ci95", ci95), ("noise_floor", noise), ("flips", flips)):
        missing = sorted(set(extra) - set(scores))
        if missing:
            raise ResultsError(f"{where}: '{name}' has benchmarks without a score: {', '.join(missing)}")
    outliers = data.get("outliers") or {}
    if not isinstance(outliers, dict):
        raise ResultsError(f"{where}: 'outliers' must be an object of name -> number")
    kl = data.get("kl")
    return Row(
        variant=variant,
        recipe=recipe,
        precision=_opt_str(data, "precision", where) or ("BF16" if recipe == BASELINE_RECIPE else recipe),
        label=_opt_str(data, "label", where) or variant,
        scores=scores,
        model=_opt_str(data, "model", where),
        section=_opt_str(data, "section", where),
        row_id=_opt_str(data, "id", where),
        ci95=ci95,
        noise_floor=noise,
        flips=flips,
        kl=None if kl is None else _number(kl, f"{where}: 'kl'", 0.0, math.inf),
        outliers={k: _number(v, f"{where}: outliers[{k!r}]", -math.inf, math.inf) for k, v in outliers.items()},
        calibration=_calibration(data.get("calibration"), f"{where}: 'calibration'"),
        size=_size(data.get("size"), f"{where}: 'size'"),
    )


def _size(value: Any, where: str) -> dict[str, float] | None:
    """A row's checkpoint size: {"bytes": > 0, "bf16_ratio": > 0} (None: not recorded)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"bytes", "bf16_ratio"}:
        raise ResultsError(f'{where}: expected {{"bytes": ..., "bf16_ratio": ...}}, got {value!r}')
    return {k: _number(value[k], f"{where}[{k!r}]", 0.0, math.inf) for k in ("bytes", "bf16_ratio")}


def _calibration(value: Any, where: str) -> tuple[dict[str, Any], ...] | None:
    """A row's calibration sets: a list of {use, source, num_sequences, seq_len} (None: not recorded)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ResultsError(f"{where}: expected a list of calibration sets, got {value!r}")
    for i, s in enumerate(value):
        if not isinstance(s, dict) or set(s) != _CALIBRATION_KEYS:
            raise ResultsError(
                f"{where}[{i}]: a calibration set is an object with exactly "
                f"{', '.join(sorted(_CALIBRATION_KEYS))}, got {s!r}"
            )
        for key in ("use", "source"):
            _req_str(s, key, f"{where}[{i}]")
        for key in ("num_sequences", "seq_len"):
            if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < 1:
                raise ResultsError(f"{where}[{i}]: '{key}' must be a positive integer, got {s[key]!r}")
    return tuple(dict(s) for s in value)


def _no_unknown(data: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ResultsError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(sorted(allowed))})"
        )


def _req_str(data: dict, key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ResultsError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _opt_str(data: dict, key: str, where: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ResultsError(f"{where}: '{key}' must be a string, got {value!r}")
    return value


def _number(value: Any, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ResultsError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ResultsError(f"{where}: {value} is not a finite number")
    if not lo <= value <= hi:
        raise ResultsError(f"{where}: {value} is outside [{lo}, {hi}]")
    return float(value)


def _interval(value: Any, where: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ResultsError(f"{where}: expected [low, high], got {value!r}")
    low, high = (_number(v, where, 0.0, 100.0) for v in value)
    if low > high:
        raise ResultsError(f"{where}: low {low} > high {high}")
    return low, high


def _bench_dict(data: dict, key: str, where: str, check: Callable[[Any, str], Any]) -> dict:
    raw = data.get(key) or {}
    if not isinstance(raw, dict):
        raise ResultsError(f"{where}: '{key}' must be an object keyed by benchmark")
    out: dict = {}
    for name, value in raw.items():
        canonical = resolve(name).key
        if canonical in out:
            raise ResultsError(f"{where}: '{key}' names benchmark {canonical!r} twice (as {name!r} and another alias)")
        out[canonical] = check(value, f"{where}: {key}[{name!r}]")
    return out
