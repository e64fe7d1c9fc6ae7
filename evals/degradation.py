"""How much a quantized checkpoint departs from its BF16 source, beside accuracy, and whether a drop is noise.

The measures themselves (flips, paired bootstrap, KL) are `quantkit.metrics`; this module applies them to
evaluation runs and checkpoints:

- `compare_runs`: from the per-sample logs (samples/<task>.jsonl) of two `suite.evaluate` runs, per task
  (or per group of tasks, e.g. a benchmark) the answer flips and the paired bootstrap of the score
  difference on the same items. The study's degradation stage and the tests use this one comparison.
- KL divergence of next-token distributions on held-out text (`heldout_kl`): KL(P_ref || P_test), in
  nats per token, full vocabulary, averaged over every predicted position of `quantkit.data.heldout_windows`
  (windows of the zoo's held-out speeches). Method: transformers forward passes in float32, KL in float64
  (`quantkit.metrics.kl_divergence`); a quantkit checkpoint runs through `load_fake_quant_model` (the
  numerical reference the vLLM path is parity-tested against), so this measures the recipe's numerics, not
  a serving kernel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from quantkit.metrics import Flips, PairedDelta, answer_flips, kl_divergence, paired_bootstrap, total_flips


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


def compare_samples(reference: Mapping[str, Mapping[int, dict]], test: Mapping[str, Mapping[int, dict]],
                    groups: Mapping[str, Sequence[str]] | None = None, n_boot: int = 10000,
                    seed: int = 0) -> dict[str, tuple[Flips, PairedDelta]]:
    """Per group of tasks (default: every task of `reference` alone), over the items of its tasks present in
    both runs (task by task, doc_ids sorted): pooled answer flips and the paired bootstrap of the score
    difference. A group without such items is left out; a task whose items differ between the runs raises
    ValueError."""
    groups = {task: [task] for task in sorted(reference)} if groups is None else groups
    out = {}
    for name, tasks in groups.items():
        tasks = [t for t in tasks if t in reference and t in test]
        ids = [(t, i) for t in tasks for i in sorted(reference[t])]
        if not ids:
            continue
        flips = total_flips([answer_flips(reference[t], test[t]) for t in tasks])
        delta = paired_bootstrap([reference[t][i]["score"] for t, i in ids], [test[t][i]["score"] for t, i in ids],
                                 n_boot=n_boot, seed=seed)
        out[name] = (flips, delta)
    return out


def compare_runs(reference_dir: str | Path, test_dir: str | Path, groups: Mapping[str, Sequence[str]] | None = None,
                 n_boot: int = 10000, seed: int = 0) -> dict[str, dict]:
    """`compare_samples` of two `suite.evaluate` output directories, as JSON-ready
    {group: {'flips': Flips fields, 'delta': PairedDelta fields}}."""
    compared = compare_samples(read_samples(reference_dir), read_samples(test_dir), groups, n_boot=n_boot, seed=seed)
    return {name: dict(flips=asdict(flips), delta=asdict(delta)) for name, (flips, delta) in compared.items()}


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
