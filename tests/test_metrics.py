"""quantkit.metrics: every error measure on constructed inputs with known answers."""

import math

import numpy as np
import pytest
import torch

from quantkit.metrics import (
    answer_flips,
    bootstrap_ci,
    energy,
    is_regression,
    kl_divergence,
    noise_of_mean,
    paired_bootstrap,
    snr_db,
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
    worse = ref & (rng.random(400) < 0.7)           # ~30% of right answers lost: a real drop
    noisy = ref ^ (rng.random(400) < 0.04)          # symmetric 4% flips: noise
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
