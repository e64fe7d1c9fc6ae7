"""Degradation of eval runs and checkpoints, and pass@k, on constructed inputs with known answers (the
measures themselves: tests/test_metrics.py)."""

import json
import math

import pytest
import torch

from quantkit.evals.degradation import compare_runs, compare_samples, heldout_kl
from quantkit.evals.execution import pass_at_k
from quantkit.metrics import paired_bootstrap


def test_pass_at_k_matches_closed_form():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_compare_runs_reads_sample_logs(tmp_path):
    for run, scores in (("ref", [1, 1, 0, 1]), ("test", [1, 0, 0, 1])):
        (tmp_path / run / "samples").mkdir(parents=True)
        (tmp_path / run / "samples" / "qk_mmlu.jsonl").write_text(
            "".join(json.dumps(dict(doc_id=i, score=s, answer=s)) + "\n" for i, s in enumerate(scores))
        )
    out = compare_runs(tmp_path / "ref", tmp_path / "test", n_boot=200)
    assert out["qk_mmlu"]["flips"]["right_to_wrong"] == 1
    assert out["qk_mmlu"]["delta"]["delta"] == pytest.approx(-0.25)


def _records(scores, answers):
    return {i: dict(score=s, answer=a) for i, (s, a) in enumerate(zip(scores, answers))}


def test_compare_samples_pools_the_tasks_of_a_group():
    """A benchmark of two tasks: flips add up, the bootstrap pairs (task, doc_id) items in task order."""
    ref = {"a": _records([1, 1, 0], "xyz"), "b": _records([0, 1], "xy"), "c": _records([1], "x")}
    test = {"a": _records([0, 1, 1], "zyx"), "b": _records([0, 0], "xz"), "d": _records([1], "x")}
    out = compare_samples(ref, test, {"bench": ["a", "b", "missing"], "only_ref": ["c"]}, n_boot=300, seed=3)
    assert list(out) == ["bench"]  # "c" is not in the test run: nothing to compare
    flips, delta = out["bench"]
    assert (flips.n, flips.right_to_wrong, flips.wrong_to_right, flips.answer_changed) == (5, 2, 1, 3)
    assert flips.flip_rate == pytest.approx(0.6)
    assert delta == paired_bootstrap([1, 1, 0, 0, 1], [0, 1, 1, 0, 0], n_boot=300, seed=3)
    with pytest.raises(ValueError, match="different items"):
        compare_samples(ref, {**test, "b": _records([0], "x")}, {"bench": ["a", "b"]})


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
