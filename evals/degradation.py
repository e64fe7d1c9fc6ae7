"""How much a quantized checkpoint departs from its BF16 source, beside accuracy, and whether a drop is noise.

The measures themselves (flips, paired bootstrap, KL) are `quantkit.metrics`; this module applies them to
evaluation runs and checkpoints:

- `compare_runs`: from the per-sample logs (samples/<task>.jsonl) of two `suite.evaluate` runs, per task
  (or per group of tasks, e.g. a benchmark) the answer flips and the paired bootstrap of the score
  difference on the same items. The study's degradation stage and the tests use this one comparison.
- KL divergence of next-token distributions on held-out text: KL(P_ref || P_test), in nats per token,
  averaged over every predicted position of `quantkit.data.heldout_windows` (windows of the zoo's held-out
  speeches). Two sources of the same measure:
  * `engine_kl` (the study's default with the vLLM backend): from the prompt logprobs that the eval's own vLLM
    engine recorded (`record_heldout_logprobs`, file LOGPROBS_FILE in the eval directory), so it measures the
    served model in the eval dtype at no extra forward pass, at any model size. Full vocabulary, or the top-k
    estimate `topk_kl` (a certified lower bound; its error bound is in that docstring).
  * `heldout_kl` (the reference): transformers forward passes in float32, KL in float64
    (`quantkit.metrics.kl_divergence`); a quantkit checkpoint runs through `load_fake_quant_model` (the
    numerical reference the vLLM path is parity-tested against), so this measures the recipe's numerics, not
    a serving kernel. `kl_agreement_bound` states how far the two may differ.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.atomic import write_bytes_atomic
from quantkit.errors import QuantkitError
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


def compare_samples(
    reference: Mapping[str, Mapping[int, dict]],
    test: Mapping[str, Mapping[int, dict]],
    groups: Mapping[str, Sequence[str]] | None = None,
    n_boot: int = 10000,
    seed: int = 0,
) -> dict[str, tuple[Flips, PairedDelta]]:
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
        delta = paired_bootstrap(
            [reference[t][i]["score"] for t, i in ids], [test[t][i]["score"] for t, i in ids], n_boot=n_boot, seed=seed
        )
        out[name] = (flips, delta)
    return out


def compare_runs(
    reference_dir: str | Path,
    test_dir: str | Path,
    groups: Mapping[str, Sequence[str]] | None = None,
    n_boot: int = 10000,
    seed: int = 0,
) -> dict[str, dict]:
    """`compare_samples` of two `suite.evaluate` output directories, as JSON-ready
    {group: {'flips': Flips fields, 'delta': PairedDelta fields}}."""
    compared = compare_samples(read_samples(reference_dir), read_samples(test_dir), groups, n_boot=n_boot, seed=seed)
    return {name: dict(flips=asdict(flips), delta=asdict(delta)) for name, (flips, delta) in compared.items()}


def _load_float32(model_dir: Path) -> torch.nn.Module:
    config = json.loads((model_dir / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "quantkit":
        from quantkit.quantize.fake_quant import load_fake_quant_model

        return load_fake_quant_model(model_dir)
    from quantkit.models.attention import load_reference_model  # registers the quantkit architectures

    return load_reference_model(model_dir, torch.float32)


def heldout_kl(
    reference_dir: str | Path, test_dir: str | Path, num_sequences: int = 16, seq_len: int = 256, batch_size: int = 4
) -> dict[str, float]:
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
    return _kl_summary(torch.cat(kls))


def _kl_summary(kl: torch.Tensor) -> dict[str, float]:
    return dict(
        mean=kl.mean().item(),
        median=kl.median().item(),
        p99=kl.quantile(0.99).item(),
        max=kl.max().item(),
        tokens=kl.numel(),
    )


# ------------------------------------------------------------------------ KL from the serving engine

LOGPROBS_FILE = "heldout_logprobs.safetensors"
CHUNK_VALUES = 1 << 24  # logprob values per generate() call: bounds vLLM's Python-side prompt-logprob lists


class HeldoutLogprobsError(QuantkitError, ValueError):
    """Recorded held-out logprobs are missing, malformed, or not comparable (different tokens, modes or vocab)."""


def record_heldout_logprobs(
    llm: Any, tokens: torch.Tensor, path: str | Path, top_k: int | None = None
) -> dict[str, Any]:
    """Score `tokens` ((N, L) int64, `heldout_windows`) with the vLLM engine `llm` (a `vllm.LLM`, e.g. lm-eval's
    `VLLM.model`) and write its next-token logprobs at every position to `path` (safetensors, atomically);
    returns the file's metadata.

    One `generate(max_tokens=1)` pass: prompt logprobs for positions 0..L-2, the generated token's logprobs for
    position L-1 (the same L positions `heldout_kl` scores), each the engine's log_softmax in float32 of the
    logits it computed in its own dtype. Stored tensors: `tokens` (N, L) int64; with `top_k=None` (the engine
    needs `max_logprobs=-1`) `logprobs` (N, L, V) float32, the full vocabulary; else `topk_ids` (N, L, k) int64
    and `topk_logprobs` (N, L, k) float32, the engine's k most likely tokens in rank order. Row t predicts
    token t+1. Sequences go in chunks of at most CHUNK_VALUES logprob values."""
    from safetensors.torch import save
    from vllm import SamplingParams

    n, length = tokens.shape
    vocab = llm.llm_engine.model_config.get_vocab_size()
    width = vocab if top_k is None else top_k
    asked = -1 if top_k is None else top_k
    params = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=asked, logprobs=asked, flat_logprobs=True, detokenize=False
    )
    chunk = max(1, CHUNK_VALUES // (length * width))
    full = torch.full((n, length, vocab), float("nan")) if top_k is None else None  # filled sequence by sequence
    ids, logprobs = [], []
    for start in range(0, n, chunk):
        rows = tokens[start : start + chunk]
        outputs = llm.generate([{"prompt_token_ids": row.tolist()} for row in rows], params, use_tqdm=False)
        for i, (row, output) in enumerate(zip(rows, outputs), start):
            prompt_ids, prompt_logprobs = _position_logprobs(output.prompt_logprobs, 1, length - 1, width)
            last_ids, last_logprobs = _position_logprobs(output.outputs[0].logprobs, 0, 1, width)
            if not torch.equal(prompt_ids[:, 0], row[1:]):  # column 0: the token that came next
                raise HeldoutLogprobsError("vLLM's prompt logprobs do not follow the prompt tokens")
            row_ids = torch.cat([prompt_ids, last_ids])[:, 1:]
            row_logprobs = torch.cat([prompt_logprobs, last_logprobs])[:, 1:]
            if full is not None:  # no (N, L, V) int64 ids beside the values: 3x less memory
                full[i].scatter_(-1, row_ids, row_logprobs)
            else:
                ids.append(row_ids)
                logprobs.append(row_logprobs)
    meta = dict(
        mode="full" if top_k is None else "topk", top_k=str(width), vocab_size=str(vocab), source="vllm prompt_logprobs"
    )
    if full is not None:
        if full.isnan().any():
            raise HeldoutLogprobsError("vLLM's full-vocabulary logprobs miss some tokens")
        tensors = dict(tokens=tokens.contiguous(), logprobs=full)
    else:
        tensors = dict(
            tokens=tokens.contiguous(),
            topk_ids=torch.stack(ids).contiguous(),
            topk_logprobs=torch.stack(logprobs).contiguous(),
        )
    write_bytes_atomic(path, save(tensors, metadata=meta))
    return dict(file=Path(path).name, mode=meta["mode"], top_k=top_k, vocab_size=vocab, num_sequences=n, seq_len=length)


def _position_logprobs(flat: Any, skip: int, positions: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, 1 + width) token ids and logprobs from vLLM's FlatLogprobs, after its first `skip` positions
    (a prompt's position 0 predicts nothing): per position the actual next token, then the top `width` in rank
    order."""
    starts, ends = np.asarray(flat.start_indices[skip:]), np.asarray(flat.end_indices[skip:])
    if len(starts) != positions or not (ends - starts == width + 1).all():
        raise HeldoutLogprobsError(f"expected {positions} positions of {width + 1} logprobs from vLLM")
    first = int(starts[0])
    ids = torch.tensor(flat.token_ids[first:], dtype=torch.int64).view(positions, width + 1)
    values = torch.tensor(flat.logprobs[first:], dtype=torch.float32).view(positions, width + 1)
    return ids, values


def load_heldout_logprobs(eval_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of an eval directory's LOGPROBS_FILE (`record_heldout_logprobs`)."""
    from safetensors import safe_open

    path = Path(eval_dir) / LOGPROBS_FILE
    if not path.exists():
        raise HeldoutLogprobsError(
            f"{path} does not exist: the eval ran without recording held-out logprobs "
            "(re-run its eval stage, or set kl.source: transformers)"
        )
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def topk_kl(
    ref_ids: torch.Tensor, ref_logprobs: torch.Tensor, test_ids: torch.Tensor, test_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (leading dims), from each model's top-k (ids, logprobs) (..., k): the coarse-grained KL
    and the reference mass P(R) it leaves unresolved, both float64 (...).

    A = the tokens in both top-k sets, R = the rest of the vocabulary; with P(R) = 1 - sum_A p and
    Q(R) = 1 - sum_A q (both known),
        KL_k = sum_{i in A} p_i log(p_i / q_i) + P(R) log(P(R) / Q(R)).
    Bound (exact): merging R into one outcome can only lose information (log-sum inequality), so
        KL - KL_k = P(R) * KL(P|R || Q|R) >= 0,
    a certified lower bound; and since P|R's probabilities are <= 1,
        KL(P|R || Q|R) <= max_{i in R} log(Q(R) / q_i) <= -min_i log q_i <= (z_max - z_min) + log V
    (z: the test model's logits, V: vocabulary). Hence 0 <= KL - KL_k <= P(R) * (-min_i log q_i). The top-k
    logprobs do not reveal min_i log q_i, so no upper bound follows from them alone (a test model that puts
    e^-100 on the one token carrying P(R) is off by about 100 P(R)); the caller reports P(R) so the bound can be
    evaluated for any known logit range. float32 logprobs make each term exact to ~k * 2**-24 relative."""
    sorted_ids, order = test_ids.sort(dim=-1)
    slot = torch.searchsorted(sorted_ids, ref_ids.contiguous()).clamp(max=test_ids.shape[-1] - 1)
    found = sorted_ids.gather(-1, slot) == ref_ids
    log_p, log_q = ref_logprobs.double(), test_logprobs.double().gather(-1, order.gather(-1, slot))
    p, q = log_p.exp() * found, log_q.exp() * found
    matched = (p * torch.where(found, log_p - log_q, 0.0)).sum(-1)
    p_rest, q_rest = (1 - p.sum(-1)).clamp(min=0.0), (1 - q.sum(-1)).clamp(min=torch.finfo(torch.float64).tiny)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=torch.finfo(torch.float64).tiny) / q_rest).log(), 0.0)
    return matched + rest, p_rest


def engine_kl(reference_eval_dir: str | Path, test_eval_dir: str | Path) -> dict[str, Any]:
    """Per-token KL(reference || test) from two eval directories' recorded engine logprobs: `heldout_kl`'s
    mean/median/p99/max/tokens, plus source, mode ('full' or 'topk') and, for top-k, k and the unresolved
    reference mass P(R) (mean, max) of `topk_kl`'s bound."""
    ref, ref_meta = load_heldout_logprobs(reference_eval_dir)
    test, test_meta = load_heldout_logprobs(test_eval_dir)
    if ref["tokens"].shape != test["tokens"].shape or not torch.equal(ref["tokens"], test["tokens"]):
        raise HeldoutLogprobsError(
            f"{reference_eval_dir} and {test_eval_dir} scored different held-out tokens "
            "(different tokenizers or kl settings)"
        )
    keys = ("mode", "top_k", "vocab_size")
    if [ref_meta.get(k) for k in keys] != [test_meta.get(k) for k in keys]:
        raise HeldoutLogprobsError(
            f"held-out logprobs not comparable: {[ref_meta.get(k) for k in keys]} vs "
            f"{[test_meta.get(k) for k in keys]} (mode, top_k, vocab_size)"
        )
    out: dict[str, Any] = dict(source="vllm", mode=ref_meta["mode"])
    if ref_meta["mode"] == "full":
        kl = kl_divergence(ref["logprobs"], test["logprobs"]).flatten()
    else:
        kl, rest = topk_kl(ref["topk_ids"], ref["topk_logprobs"], test["topk_ids"], test["topk_logprobs"])
        kl, rest = kl.flatten(), rest.flatten()
        out.update(
            top_k=int(ref_meta["top_k"]), unresolved_mass_mean=rest.mean().item(), unresolved_mass_max=rest.max().item()
        )
    return {**_kl_summary(kl), **out}


def kl_agreement_bound(ref_logits: torch.Tensor, test_logits: torch.Tensor, eta: float) -> torch.Tensor:
    """Per position, how far a KL computed from perturbed log-probabilities can be from KL(P || Q) of the exact
    `ref_logits`/`test_logits` (..., V), when every normalized log-probability of either model is off by at most
    `eta` nats (float64, (...)).

    Derivation: write a = log p, b = log q, a' = a + alpha, b' = b + beta with |alpha|, |beta| <= eta. Then
        KL' - KL = sum (p'_i - p_i)(a_i - b_i) + sum p'_i (alpha_i - beta_i),
    and |p'_i - p_i| = p_i |e^alpha_i - 1| <= p_i (e^eta - 1), so
        |KL' - KL| <= (e^eta - 1) E_p|log(p/q)| + 2 eta.
    eta itself: the serving engine's logprob error against the float32 reference. In float32 (eval dtype
    float32) it is float32 summation order only (tests/test_serve_quantized.py derives <= 1e-4 nats per token
    for the tiny models); in bfloat16 the logits alone are rounded to 8 significant bits, eta >= 2**-9 max|z|
    before any accumulated error, so the bf16 serving KL may differ from the float32 reference by far more than
    a tiny model's KL -- which is the point of measuring the served model."""
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(test_logits.double(), dim=-1)
    return math.expm1(eta) * (log_p.exp() * (log_p - log_q).abs()).sum(-1) + 2 * eta
