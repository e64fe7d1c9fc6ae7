"""Degradation metrics and pass@k on constructed inputs with known answers."""

import json
import math

import numpy as np
import pytest
import torch

from quantkit.evals.degradation import (
    answer_flips,
    bootstrap_ci,
    compare_runs,
    heldout_kl,
    is_regression,
    kl_divergence,
    paired_bootstrap,
)
from quantkit.evals.execution import pass_at_k


def test_pass_at_k_matches_closed_form():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_kl_divergence_known_values():
    p = torch.tensor([0.5, 0.25, 0.25]).log()
    q = torch.tensor([0.25, 0.5, 0.25]).log()
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log p/q = 0.25 ln 2
    assert kl_divergence(p, q).item() == pytest.approx(expected)
    assert kl_divergence(p + 7.0, p).item() == pytest.approx(0.0, abs=1e-12)  # shift-invariant logits


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


def test_compare_runs_reads_sample_logs(tmp_path):
    for run, scores in (("ref", [1, 1, 0, 1]), ("test", [1, 0, 0, 1])):
        (tmp_path / run / "samples").mkdir(parents=True)
        (tmp_path / run / "samples" / "qk_mmlu.jsonl").write_text(
            "".join(json.dumps(dict(doc_id=i, score=s, answer=s)) + "\n" for i, s in enumerate(scores)))
    out = compare_runs(tmp_path / "ref", tmp_path / "test", n_boot=200)
    assert out["qk_mmlu"]["flips"]["right_to_wrong"] == 1
    assert out["qk_mmlu"]["delta"]["delta"] == pytest.approx(-0.25)


def test_heldout_kl_is_zero_against_itself_and_positive_against_a_perturbed_copy(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    same = heldout_kl(tiny_checkpoint, tiny_checkpoint, num_sequences=2, seq_len=32)
    assert same["mean"] == pytest.approx(0.0, abs=1e-9) and same["tokens"] == 64
    noisy = tmp_path / "noisy"
    shutil.copytree(tiny_checkpoint, noisy)
    state = load_file(str(noisy / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in state.items()}
    save_file(state, str(noisy / "model.safetensors"), metadata={"format": "pt"})
    assert heldout_kl(tiny_checkpoint, noisy, num_sequences=2, seq_len=32)["mean"] > 1e-4
