"""How much a quantized checkpoint departs from its BF16 source, beside accuracy, and whether a drop is noise.

- Answer flips per task (`answer_flips`): from the per-sample logs (samples/<task>.jsonl) of two
  `suite.evaluate` runs, items whose score changed (right->wrong, wrong->right) and whose answer changed.
- KL divergence of next-token distributions on held-out text (`heldout_kl`): KL(P_ref || P_test), in
  nats per token, full vocabulary, averaged over every predicted position of `quantkit.data.heldout_windows`
  (windows of the zoo's held-out speeches). Method: transformers forward passes in float32; a quantkit
  checkpoint runs through `load_fake_quant_model` (the numerical reference the vLLM path is
  parity-tested against), so this measures the recipe's numerics, not a serving kernel.
- Noise floor: percentile bootstrap CI of a mean score (`bootstrap_ci`) and a paired bootstrap of the
  accuracy difference on the same items (`paired_bootstrap`); `is_regression` calls a drop only when the
  whole CI lies below -tolerance.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Flips:
    """Answer flips of one task between a reference run and a test run (paired by doc_id)."""

    n: int
    right_to_wrong: int
    wrong_to_right: int
    answer_changed: int

    @property
    def flip_rate(self) -> float:
        return (self.right_to_wrong + self.wrong_to_right) / self.n if self.n else 0.0


@dataclass
class PairedDelta:
    """mean(test) - mean(ref) over paired items, with its bootstrap CI and one-sided p(delta >= 0)."""

    delta: float
    ci_low: float
    ci_high: float
    p_not_worse: float
    n: int


def read_samples(run_dir: str | Path) -> dict[str, dict[int, dict]]:
    """{task: {doc_id: record}} from a `suite.evaluate` output directory."""
    samples_dir = Path(run_dir) / "samples"
    if not samples_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} has no samples/ directory (not a quantkit eval run)")
    out = {}
    for path in sorted(samples_dir.glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        out[path.stem] = {r["doc_id"]: r for r in records}
    return out


def answer_flips(reference: dict[int, dict], test: dict[int, dict]) -> Flips:
    """Flips between two runs' records of one task (records carry `score` and `answer`)."""
    if reference.keys() != test.keys():
        raise ValueError(f"runs scored different items: {len(reference.keys() ^ test.keys())} doc_ids differ")
    r2w = w2r = changed = 0
    for doc_id, ref in reference.items():
        a, b = float(ref["score"]), float(test[doc_id]["score"])
        r2w += a > b
        w2r += a < b
        changed += ref["answer"] != test[doc_id]["answer"]
    return Flips(len(reference), r2w, w2r, changed)


def compare_runs(reference_dir: str | Path, test_dir: str | Path, n_boot: int = 10000, seed: int = 0) -> dict[str, dict]:
    """Per task present in both runs: flips and the paired bootstrap of the score difference."""
    ref, test = read_samples(reference_dir), read_samples(test_dir)
    out = {}
    for task in sorted(ref.keys() & test.keys()):
        ids = sorted(ref[task])
        delta = paired_bootstrap([ref[task][i]["score"] for i in ids], [test[task].get(i, {}).get("score") for i in ids],
                                 n_boot=n_boot, seed=seed)
        out[task] = dict(flips=asdict(answer_flips(ref[task], test[task])), delta=asdict(delta))
    return out


def bootstrap_ci(scores, n_boot: int = 10000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap (1 - alpha) CI of the mean of per-item scores."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("need a non-empty 1-D sequence of scores")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    return float(x.mean()), float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2))


def paired_bootstrap(reference, test, n_boot: int = 10000, alpha: float = 0.05, seed: int = 0) -> PairedDelta:
    """Bootstrap over items (same resampled items for both runs) of mean(test) - mean(reference)."""
    if any(s is None for s in test):
        raise ValueError("the test run lacks some of the reference run's items")
    a, b = np.asarray(reference, dtype=np.float64), np.asarray(test, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"need two equally long non-empty score vectors, got {a.shape} and {b.shape}")
    diff = b - a
    idx = np.random.default_rng(seed).integers(0, diff.size, size=(n_boot, diff.size))
    boot = diff[idx].mean(axis=1)
    return PairedDelta(float(diff.mean()), float(np.quantile(boot, alpha / 2)), float(np.quantile(boot, 1 - alpha / 2)),
                       float((boot >= 0).mean()), int(diff.size))


def is_regression(delta: PairedDelta, tolerance: float = 0.0) -> bool:
    """True when the whole CI of the difference lies below -tolerance (a drop beyond noise)."""
    return delta.ci_high < -tolerance


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(test)) in nats over the last dimension (one value per position)."""
    if ref_logits.shape != test_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(test_logits.shape)}")
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(test_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _load_float32(model_dir: Path) -> torch.nn.Module:
    config = json.loads((model_dir / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "quantkit":
        from quantkit.quantize.fake_quant import load_fake_quant_model

        return load_fake_quant_model(model_dir)
    from transformers import AutoModelForCausalLM

    import quantkit.models  # noqa: F401 - registers the quantkit architecture

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def heldout_kl(reference_dir: str | Path, test_dir: str | Path, num_sequences: int = 16, seq_len: int = 256,
               batch_size: int = 4) -> dict[str, float]:
    """Mean, median, p99 and max per-token KL(reference || test) on held-out windows (module docstring)."""
    from transformers import AutoTokenizer

    from quantkit.data import heldout_windows

    reference_dir, test_dir = Path(reference_dir), Path(test_dir)
    tokens = heldout_windows(AutoTokenizer.from_pretrained(reference_dir), num_sequences, seq_len)
    ref_model, test_model = _load_float32(reference_dir), _load_float32(test_dir)
    kls = []
    with torch.no_grad():
        for batch in tokens.split(batch_size):
            kls.append(kl_divergence(ref_model(batch).logits, test_model(batch).logits).flatten())
    kl = torch.cat(kls)
    return dict(mean=kl.mean().item(), median=kl.median().item(), p99=kl.quantile(0.99).item(),
                max=kl.max().item(), tokens=kl.numel())
