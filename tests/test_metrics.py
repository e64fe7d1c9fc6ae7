"""quantkit.metrics: every error measure on constructed inputs with known answers."""

import math

import numpy as np
import pytest
import torch

from quantkit.metrics import (
    answer_flips,
    bootstrap_ci,
    energy,
    holm,
    is_regression,
    kl_divergence,
    noise_of_mean,
    paired_bootstrap,
    snr_db,
    stratified_bootstrap,
    total_flips,
)


def test_snr_db_of_energies():
    assert snr_db(100.0, 1.0) == pytest.approx(20.0)
    assert snr_db(2.0, 1.0) == pytest.approx(10 * math.log10(2))
    assert snr_db(1.0, 0.0) == math.inf and snr_db(0.0, 0.0) == math.inf  # exact product
    assert snr_db(0.0, 1.0) == -math.inf  # all-zero output with noise


def test_energy_is_the_float64_sum_of_squares():
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))  # float32
    exact = math.fsum(v * v for v in x.double().flatten().tolist())
    assert isinstance(energy(x), float) and energy(x) == pytest.approx(exact, rel=1e-12)


def test_kl_divergence_known_values():
    p = torch.tensor([0.5, 0.25, 0.25]).log()
    q = torch.tensor([0.25, 0.5, 0.25]).log()
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log p/q = 0.25 ln 2
    assert kl_divergence(p, q).item() == pytest.approx(expected)
    assert kl_divergence(p + 7.0, p).item() == pytest.approx(0.0, abs=1e-12)  # shift-invariant logits


def test_kl_divergence_is_float64_and_exact_for_tiny_differences():
    """float64 whatever the logits' dtype: a KL of ~5e-9 nats (far below float32's rounding of log-probabilities,
    ~1e-7) still matches its second-order value (sum_i p_i d_i^2 - (sum_i p_i d_i)^2) / 2."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 4096, generator=gen, dtype=torch.float64)
    d = 1e-4 * torch.randn(3, 4096, generator=gen, dtype=torch.float64)
    kl = kl_divergence(ref, ref + d)
    p = torch.softmax(ref, -1)
    second_order = ((p * d * d).sum(-1) - (p * d).sum(-1) ** 2) / 2
    assert kl.dtype == torch.float64 and kl.shape == (3,)
    assert torch.allclose(kl, second_order, rtol=1e-3, atol=0)
    assert kl_divergence(ref.float(), ref.float()).dtype == torch.float64
    with pytest.raises(ValueError, match="logit shapes differ"):
        kl_divergence(ref, ref[:, :-1])


def _records(scores, answers):
    return {i: dict(score=s, answer=a) for i, (s, a) in enumerate(zip(scores, answers))}


def test_answer_flips_counts_each_direction():
    ref = _records([1, 1, 0, 0, 1], ["A", "B", "C", "D", "x"])
    test = _records([0, 1, 1, 0, 1], ["C", "B", "A", "A", "x"])
    flips = answer_flips(ref, test)
    assert (flips.right_to_wrong, flips.wrong_to_right, flips.answer_changed, flips.n) == (1, 1, 3, 5)
    assert flips.flip_rate == pytest.approx(0.4)
    with pytest.raises(ValueError, match="different items"):
        answer_flips(ref, _records([1], ["A"]))


def test_bootstrap_ci_covers_mean_with_binomial_width():
    scores = np.r_[np.ones(300), np.zeros(700)]
    mean, low, high = bootstrap_ci(scores, n_boot=4000)
    assert mean == pytest.approx(0.3)
    half_width = 1.96 * math.sqrt(0.3 * 0.7 / 1000)
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.1)


def test_paired_bootstrap_separates_noise_from_regression():
    same = paired_bootstrap([1, 0, 1, 1, 0] * 40, [1, 0, 1, 1, 0] * 40)
    assert (same.delta, same.ci_low, same.ci_high) == (0.0, 0.0, 0.0) and not is_regression(same)
    rng = np.random.default_rng(1)
    ref = rng.random(400) < 0.6
    worse = ref & (rng.random(400) < 0.7)  # ~30% of right answers lost: a real drop
    noisy = ref ^ (rng.random(400) < 0.04)  # symmetric 4% flips: noise
    drop = paired_bootstrap(ref, worse)
    assert drop.delta < -0.1 and is_regression(drop) and drop.p_not_worse == 0.0
    assert not is_regression(paired_bootstrap(ref, noisy))


def test_total_flips_pools_item_sets():
    a = answer_flips(_records([1, 0], ["A", "B"]), _records([0, 0], ["B", "B"]))
    b = answer_flips(_records([0, 1, 1], ["A", "B", "C"]), _records([1, 1, 1], ["B", "B", "C"]))
    total = total_flips([a, b])
    assert (total.n, total.right_to_wrong, total.wrong_to_right, total.answer_changed) == (5, 1, 1, 2)
    assert total.flip_rate == pytest.approx(0.4) and total_flips([]).flip_rate == 0.0


def test_noise_of_mean_of_independent_estimates():
    assert noise_of_mean([3.0, 4.0]) == pytest.approx(2.5)  # sqrt(9 + 16) / 2
    assert noise_of_mean([1.0] * 4) == pytest.approx(0.5)  # n equal half-widths: h / sqrt(n)


def test_stratified_bootstrap_of_one_benchmark_is_the_paired_bootstrap_in_points():
    """Same seed, same draws: one stratum reproduces `paired_bootstrap` exactly (x100), bit for bit."""
    rng = np.random.default_rng(3)
    ref, test = rng.integers(0, 2, 200).astype(float), rng.integers(0, 2, 200).astype(float)
    single, avg = paired_bootstrap(ref, test, seed=7), stratified_bootstrap([(ref, test)], seed=7)
    assert (avg.delta, avg.ci_low, avg.ci_high) == pytest.approx(
        (100 * single.delta, 100 * single.ci_low, 100 * single.ci_high), rel=1e-12, abs=1e-12
    )
    assert avg.n == 200


def test_stratified_bootstrap_delta_avg_recovery_and_p():
    """Known answers: Delta Avg is the mean of the per-benchmark deltas, recovery the mean of the ratios; identical
    runs give p = 1 and a zero-width CI; 60 of 200 items lost gives a CI far below 0 (sd of the mean delta
    ~ sqrt(0.3 x 0.7 / 200) = 3.2 points, so -30 is ~9 sd out) and the smallest p the 10000 draws resolve."""
    a = [1.0] * 100 + [0.0] * 100
    b = [1.0] * 50 + [0.0] * 150
    same = stratified_bootstrap([(a, a), (b, b)])
    assert same.delta == 0 and same.p_two_sided == 1.0 and same.ci_low == same.ci_high == 0
    assert same.recovery == pytest.approx(100.0) and same.floor == 0
    worse = stratified_bootstrap([(a, b), ([1.0] * 200, [1.0] * 140 + [0.0] * 60)])
    assert worse.delta == pytest.approx((-25 + -30) / 2)
    assert worse.recovery == pytest.approx((50 + 70) / 2)  # 100 x (0.25 / 0.5 + 0.7 / 1) / 2
    assert worse.ci_high < -20 and worse.p_two_sided == pytest.approx(1 / 10001)
    assert worse.recovery_low < worse.recovery < worse.recovery_high
    zero = stratified_bootstrap([([0.0] * 10, [1.0] * 10)])  # BF16 solves nothing: recovery undefined
    assert zero.recovery is None and zero.delta == 100


def test_holm_matches_the_textbook_step_down():
    """p = (0.01, 0.04, 0.03, 0.005), k = 4: sorted 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 -> 0.06
    (monotone); at alpha 0.05 the first two are rejected, and the step-down stops at 0.03."""
    out = holm([0.01, 0.04, 0.03, 0.005])
    assert [p for p, _ in out] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert [r for _, r in out] == [True, False, False, True]
    assert holm([0.04]) == [(0.04, True)] and holm([]) == []
