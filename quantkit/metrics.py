"""Error measurement: the one definition of every figure quantkit reports about a quantized model's error.

- `snr_db(signal, noise)`: quantization SNR in dB, 10 log10(sum y^2 / sum (y - y_q)^2), from energies summed
  in float64 (`energy`). +inf for an exact product, -inf for a zero signal with noise.
- `kl_divergence(ref_logits, test_logits)`: KL(softmax(ref) || softmax(test)) in nats per position over the
  full vocabulary. Precision convention: log_softmax and the sum over the vocabulary in float64, whatever
  the logits' dtype, so that rounding of the log-probabilities (about 1e-7 nats in float32) cannot bias small
  KLs; callers average the per-position values in float64 too.
- `sensitivity_by_kind(snr_db)`: per-layer output SNRs summarized per projection kind (the module path inside its
  decoder layer): mean over layers, min and its layer; `quantkit diagnose`'s table of the source, `quantkit quality`'s
  of a checkpoint.
- `answer_flips(ref, test)`: items whose score changed (right->wrong, wrong->right) and whose answer changed
  between two runs' per-item records, paired by item id.
- Noise floor: `bootstrap_ci` (percentile bootstrap CI of a mean score), `paired_bootstrap` (the same
  resampled items for both runs: CI of mean(test) - mean(reference) and one-sided p(delta >= 0)),
  `is_regression` (the whole CI below -tolerance), `noise_of_mean` (CI half-width of a mean of independent
  estimates from theirs). Bootstraps draw with numpy's default_rng(seed): reproducible for a given seed.
- Several benchmarks at once: `stratified_bootstrap` (items resampled within each benchmark, the same draws for
  both runs): the CI and two-sided p of Delta Avg (mean over benchmarks of the per-benchmark deltas) and of the
  recovery (mean over benchmarks of 100 x mean(test) / mean(reference)). `holm` (Holm 1979): step-down adjusted
  p-values of a family of k comparisons, family-wise error <= alpha.

torch is imported by the tensor measures only, so that the report and the gate run without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def energy(x: torch.Tensor) -> float:
    """sum x^2 over every element, accumulated in float64."""
    return x.double().pow(2).sum().item()


def snr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) in dB for energies (sums of squares); +inf when noise is 0 (exact), -inf for
    zero signal with noise."""
    if noise == 0:
        return float("inf")
    return 10 * math.log10(signal / noise) if signal > 0 else float("-inf")


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(test)) in nats over the last dimension: float64, one value per position."""
    import torch

    if ref_logits.shape != test_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(test_logits.shape)}")
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(test_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


@dataclass
class Flips:
    """Answer flips between a reference run and a test run over n paired items."""

    n: int
    right_to_wrong: int
    wrong_to_right: int
    answer_changed: int

    @property
    def flip_rate(self) -> float:
        """Fraction (0-1) of items whose score changed in either direction; 0 for no items."""
        return (self.right_to_wrong + self.wrong_to_right) / self.n if self.n else 0.0


_LAYER_MODULE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def sensitivity_by_kind(snr: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Quantization SNR (dB) per projection kind, from one recipe's `quant_snr_db` ({linear: dB}): the kind is the
    module path inside its decoder layer, routed experts folded together (`self_attn.q_proj`, `mlp.down_proj`,
    `linear_attn.out_proj`, `mlp.experts.down_proj`); per kind `layers` {layer index: the layer's lowest SNR
    among that kind's matrices}, `mean_db` over those layers, `min_db` and the `worst_layer`. Kinds in ascending
    mean SNR: the first ones are the modules to keep in higher precision. Linears outside the decoder layers
    (none quantized by default) and non-finite SNRs (exact products, all-zero outputs) are left out."""
    layers: dict[str, dict[int, float]] = {}
    for name, db in snr.items():
        match = _LAYER_MODULE.match(name)
        if match is None or not math.isfinite(db):
            continue
        kind = _EXPERT_INDEX.sub(".experts.", "." + match.group(2)).removeprefix(".")
        per_layer = layers.setdefault(kind, {})
        layer = int(match.group(1))
        per_layer[layer] = min(db, per_layer.get(layer, math.inf))
    mean = {kind: sum(per_layer.values()) / len(per_layer) for kind, per_layer in layers.items()}
    table: dict[str, dict[str, Any]] = {}
    for kind in sorted(layers, key=mean.__getitem__):
        per_layer = layers[kind]
        worst = min(per_layer, key=per_layer.__getitem__)
        table[kind] = {
            "mean_db": mean[kind],
            "min_db": per_layer[worst],
            "worst_layer": worst,
            "layers": dict(sorted(per_layer.items())),
        }
    return table


def answer_flips(reference: Mapping[int, Mapping], test: Mapping[int, Mapping]) -> Flips:
    """Flips between two runs' records {item id: {'score', 'answer'}}; ValueError when the item ids differ."""
    if reference.keys() != test.keys():
        raise ValueError(f"runs scored different items: {len(reference.keys() ^ test.keys())} doc_ids differ")
    r2w = w2r = changed = 0
    for doc_id, ref in reference.items():
        a, b = float(ref["score"]), float(test[doc_id]["score"])
        r2w += a > b
        w2r += a < b
        changed += ref["answer"] != test[doc_id]["answer"]
    return Flips(len(reference), r2w, w2r, changed)


def total_flips(flips: Sequence[Flips]) -> Flips:
    """The flips of several item sets (e.g. the tasks of one benchmark) pooled into one."""
    return Flips(
        sum(f.n for f in flips),
        sum(f.right_to_wrong for f in flips),
        sum(f.wrong_to_right for f in flips),
        sum(f.answer_changed for f in flips),
    )


@dataclass
class PairedDelta:
    """mean(test) - mean(ref) over n paired items, with its bootstrap CI and one-sided p(delta >= 0)."""

    delta: float
    ci_low: float
    ci_high: float
    p_not_worse: float
    n: int


def bootstrap_ci(
    scores: Sequence[float], n_boot: int = 10000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap (1 - alpha) CI of the mean of per-item scores."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("need a non-empty 1-D sequence of scores")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    return float(x.mean()), float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2))


def paired_bootstrap(
    reference: Sequence[float], test: Sequence[float | None], n_boot: int = 10000, alpha: float = 0.05, seed: int = 0
) -> PairedDelta:
    """Bootstrap over items (same resampled items for both runs) of mean(test) - mean(reference); item i of
    `test` pairs with item i of `reference` (None: the test run lacks it, a ValueError)."""
    if any(s is None for s in test):
        raise ValueError("the test run lacks some of the reference run's items")
    a, b = np.asarray(reference, dtype=np.float64), np.asarray(test, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"need two equally long non-empty score vectors, got {a.shape} and {b.shape}")
    diff = b - a
    idx = np.random.default_rng(seed).integers(0, diff.size, size=(n_boot, diff.size))
    boot = diff[idx].mean(axis=1)
    return PairedDelta(
        float(diff.mean()),
        float(np.quantile(boot, alpha / 2)),
        float(np.quantile(boot, 1 - alpha / 2)),
        float((boot >= 0).mean()),
        int(diff.size),
    )


def is_regression(delta: PairedDelta, tolerance: float = 0.0) -> bool:
    """True when the whole CI of the difference lies below -tolerance (a drop beyond noise)."""
    return delta.ci_high < -tolerance


def noise_of_mean(half_widths: Sequence[float]) -> float:
    """CI half-width of the mean of n independent estimates with these half-widths: sqrt(sum h^2) / n."""
    return math.sqrt(math.fsum(h * h for h in half_widths)) / len(half_widths)


@dataclass
class AvgDelta:
    """Delta Avg (points: mean over benchmarks of mean(test) - mean(reference), x100) and recovery (% : mean over
    benchmarks of 100 x mean(test) / mean(reference), the benchmarks whose reference mean is > 0), each with its
    percentile bootstrap CI; `p_two_sided`: bootstrap p of Delta Avg = 0; `n`: items over all benchmarks."""

    delta: float
    ci_low: float
    ci_high: float
    p_two_sided: float
    recovery: float | None
    recovery_low: float | None
    recovery_high: float | None
    n: int

    @property
    def floor(self) -> float:
        """The largest |Delta Avg| the CI admits (points): how far a delta this pair of runs shows could go."""
        return max(abs(self.ci_low), abs(self.ci_high))


def stratified_bootstrap(
    strata: Sequence[tuple[Sequence[float], Sequence[float]]], n_boot: int = 10000, alpha: float = 0.05, seed: int = 0
) -> AvgDelta:
    """Paired bootstrap of Delta Avg and recovery over benchmarks `strata` = [(reference scores, test scores), ...]
    (per-item scores 0-1, item i of test pairs with item i of reference): each replicate resamples the items of
    every benchmark independently (with replacement, same draws for both runs). CIs: percentiles alpha/2 and
    1 - alpha/2. p: the centred bootstrap's two-sided p, (1 + #{|d* - d| >= |d|}) / (1 + n_boot) (so never 0;
    resolution 1 / n_boot). One stratum gives `paired_bootstrap`'s delta and CI x100."""
    if not strata:
        raise ValueError("need at least one benchmark")
    rng = np.random.default_rng(seed)
    deltas, ratios, full_delta, full_ratio = [], [], [], []
    for ref, test in strata:
        a, b = np.asarray(ref, dtype=np.float64), np.asarray(test, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            raise ValueError(f"need two equally long non-empty score vectors per benchmark, got {a.shape}, {b.shape}")
        idx = rng.integers(0, a.size, size=(n_boot, a.size))
        ref_means, test_means = a[idx].mean(axis=1), b[idx].mean(axis=1)
        deltas.append(test_means - ref_means)
        full_delta.append(b.mean() - a.mean())
        if a.mean() > 0:  # recovery is undefined where the reference solves nothing
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios.append(np.where(ref_means > 0, test_means / ref_means, np.nan))
            full_ratio.append(b.mean() / a.mean())
    boot = 100 * np.mean(deltas, axis=0)
    delta = 100 * float(np.mean(full_delta))
    p = (1 + int((np.abs(boot - delta) >= abs(delta) - 1e-12).sum())) / (1 + n_boot)
    recovery = low = high = None
    if ratios:
        boot_recovery = 100 * np.mean(ratios, axis=0)
        recovery = 100 * float(np.mean(full_ratio))
        low, high = (float(np.nanquantile(boot_recovery, q)) for q in (alpha / 2, 1 - alpha / 2))
    return AvgDelta(
        delta=delta,
        ci_low=float(np.quantile(boot, alpha / 2)),
        ci_high=float(np.quantile(boot, 1 - alpha / 2)),
        p_two_sided=min(1.0, p),
        recovery=recovery,
        recovery_low=low,
        recovery_high=high,
        n=sum(len(ref) for ref, _ in strata),
    )


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[tuple[float, bool]]:
    """Holm's step-down procedure over a family of k p-values, in input order: (adjusted p, rejected at alpha).
    Adjusted p of the i-th smallest = max over j <= i of min(1, (k - j + 1) p_(j)); rejected iff adjusted <= alpha.
    Controls the family-wise error rate at alpha under any dependence between the comparisons."""
    k = len(p_values)
    order = sorted(range(k), key=lambda i: p_values[i])
    adjusted = [0.0] * k
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (k - rank) * p_values[i]))
        adjusted[i] = running
    return [(p, p <= alpha) for p in adjusted]
