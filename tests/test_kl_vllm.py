"""KL from the serving engine (`quantkit.evals.degradation`: `record_heldout_logprobs`, `engine_kl`, `topk_kl`)
against the float32 transformers reference (`heldout_kl`), on the tiny model and a weight-perturbed copy of it.

Tolerances (derived, not measured):
- ETA = 1e-4 nats: the engine's per-token logprob error against the float32 reference when vLLM runs the
  unquantized model in float32 -- float32 summation order only (unit roundoff 2**-24; a length-K dot product is
  off by ~lambda sqrt(K) u relative, 1.4e-5 at K = 512, lambda = 10; a handful of such ops per layer of this
  2-layer model; exp/log are 1-ulp functions): the derivation of tests/test_serve_quantized.py's EXACT. No
  quantizer runs here, so no rounding-midpoint flips (that file's docstring) can exceed it.
- KL agreement per position: `kl_agreement_bound` with ETA, i.e. (e^ETA - 1) E_p|log p/q| + 2 ETA (derivation
  in its docstring). The perturbed copy's KL is ~1 nat per token (a random tiny model; asserted: > 10x the
  bound), so the bound (~3e-4) separates a correct engine KL from logprobs of the wrong model or shifted by a
  position (errors of O(KL)). Measured 2026-11-23: max |served - reference| 6e-7 nats against bounds 3.2e-4.
- Top-k: 0 <= KL - KL_k <= P(R) (-min_i log q_i) (`topk_kl`), up to float64 rounding of sums of <= V terms
  (V * 2**-52 ~ 1e-13; ROUNDING = 1e-12) on float64 inputs; on the engine's float32 logprobs, which are
  normalized only to within their rounding (|log sum exp| <= ETA, first bullet), `kl_divergence`'s
  renormalization moves the full KL by <= 2 ETA against the top-k estimate's unrenormalized sums.
Cost: two vLLM engine starts (tiny model, float32; 4-10 s each on an idle 2-core machine, 70 s each at load 10),
three small transformers forwards; the top-k checks reuse the same engines.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.evals.degradation import (
    LOGPROBS_FILE,
    HeldoutLogprobsError,
    _load_float32,
    engine_kl,
    heldout_kl,
    kl_agreement_bound,
    load_heldout_logprobs,
    record_heldout_logprobs,
    topk_kl,
)
from quantkit.metrics import kl_divergence

ETA = 1e-4
ROUNDING = 1e-12
NUM_SEQUENCES, SEQ_LEN, TOP_K = 2, 48, 8


def test_topk_kl_is_a_lower_bound_within_the_stated_gap():
    """On random distributions: k = V is the exact KL; k < V stays below it by at most P(R) (-min log q)."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(300, 64, generator=gen, dtype=torch.float64) * 3
    test = ref + torch.randn(300, 64, generator=gen, dtype=torch.float64)
    log_p, log_q = ref.log_softmax(-1), test.log_softmax(-1)
    exact = kl_divergence(ref, test)
    full, rest = topk_kl(*log_p.topk(64, -1)[::-1], *log_q.topk(64, -1)[::-1])
    torch.testing.assert_close(full, exact, atol=ROUNDING, rtol=0)
    assert rest.max() < ROUNDING
    estimate, rest = topk_kl(*log_p.topk(8, -1)[::-1], *log_q.topk(8, -1)[::-1])
    gap = exact - estimate
    assert gap.min() >= -ROUNDING and (gap > 1e-3).any()  # a lower bound, not the KL itself
    assert (gap <= rest * -log_q.min(-1).values + ROUNDING).all()


def test_topk_gap_is_not_bounded_by_tail_mass_alone():
    """The bound needs the test model's smallest logprob: equal top-k, equal tail masses, and a tail token the
    test model gives e^-60 still leave a gap of ~P(R) * 60 nats."""
    tail = 0.1
    p = torch.tensor([0.5, 0.4] + [tail / 2] * 2, dtype=torch.float64)
    q = torch.tensor([0.5, 0.4, tail - math.exp(-60), math.exp(-60)], dtype=torch.float64)
    ids = torch.tensor([[0, 1]])
    estimate, rest = topk_kl(ids, p.log()[None, :2], ids, q.log()[None, :2])
    exact = kl_divergence(p.log(), q.log())
    assert estimate.item() == pytest.approx(0.0, abs=ROUNDING) and rest.item() == pytest.approx(tail)
    assert exact > 0.4 * tail * 60 and exact <= rest * -q.log().min() + ROUNDING


@pytest.fixture(scope="module")
def recorded(tiny_checkpoint, tmp_path_factory):
    """Eval-like directories holding the engine's full and top-k logprobs of the tiny model and of a copy with
    noise added to every matrix; and the held-out tokens."""
    from transformers import AutoTokenizer

    from quantkit.data import heldout_windows
    from quantkit.evals.harness import open_lm

    tmp = tmp_path_factory.mktemp("kl_vllm")
    noisy = tmp / "noisy"
    shutil.copytree(tiny_checkpoint, noisy)
    state = load_file(str(noisy / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    save_file(
        {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in state.items()},
        str(noisy / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokens = heldout_windows(AutoTokenizer.from_pretrained(tiny_checkpoint), NUM_SEQUENCES, SEQ_LEN)
    dirs = {}
    for name, model in (("ref", tiny_checkpoint), ("noisy", noisy)):
        with open_lm(model, "vllm", dtype="float32", max_model_len=128, max_logprobs=-1) as lm:
            for mode, top_k in (("full", None), ("topk", TOP_K)):
                dirs[name, mode] = tmp / f"{name}-{mode}"
                info = record_heldout_logprobs(lm.model, tokens, dirs[name, mode] / LOGPROBS_FILE, top_k)
                assert info["mode"] == mode and info["vocab_size"] == lm.model.llm_engine.model_config.get_vocab_size()
    return dict(dirs=dirs, tokens=tokens, models=dict(ref=tiny_checkpoint, noisy=noisy))


def _reference_logits(model_dir, tokens):
    with torch.no_grad():
        return _load_float32(model_dir)(tokens).logits.double()


def test_engine_logprobs_are_the_served_models(recorded):
    """Each stored full-vocabulary row is the log_softmax of that model's float32 logits at those tokens, to ETA."""
    for name in ("ref", "noisy"):
        tensors, meta = load_heldout_logprobs(recorded["dirs"][name, "full"])
        assert torch.equal(tensors["tokens"], recorded["tokens"]) and meta["source"] == "vllm prompt_logprobs"
        reference = _reference_logits(recorded["models"][name], recorded["tokens"]).log_softmax(-1)
        assert (tensors["logprobs"].double() - reference).abs().max() <= ETA, name


def test_engine_kl_agrees_with_the_transformers_reference(recorded):
    dirs, tokens = recorded["dirs"], recorded["tokens"]
    assert engine_kl(dirs["ref", "full"], dirs["ref", "full"])["mean"] == 0.0  # the same logprobs: exactly 0
    ref_logits = _reference_logits(recorded["models"]["ref"], tokens)
    test_logits = _reference_logits(recorded["models"]["noisy"], tokens)
    reference = kl_divergence(ref_logits, test_logits)
    ref, _ = load_heldout_logprobs(dirs["ref", "full"])
    test, _ = load_heldout_logprobs(dirs["noisy", "full"])
    served = kl_divergence(ref["logprobs"], test["logprobs"])
    bound = kl_agreement_bound(ref_logits, test_logits, ETA)
    print(
        f"KL per token: served mean {served.mean():.6g}, reference mean {reference.mean():.6g}; "
        f"max |served - reference| {(served - reference).abs().max():.3g} against bounds "
        f"{bound.min():.3g}..{bound.max():.3g}"
    )
    assert ((served - reference).abs() <= bound).all()
    assert bound.mean() < reference.mean() / 10  # the bound is tight enough to catch an O(KL) error
    summary = engine_kl(dirs["ref", "full"], dirs["noisy", "full"])
    assert summary["source"] == "vllm" and summary["mode"] == "full" and summary["tokens"] == reference.numel()
    assert summary["mean"] == pytest.approx(served.mean().item(), abs=ROUNDING)
    transformers = heldout_kl(recorded["models"]["ref"], recorded["models"]["noisy"], NUM_SEQUENCES, SEQ_LEN)
    assert abs(summary["mean"] - transformers["mean"]) <= bound.mean().item()


def test_engine_topk_kl_is_below_the_full_kl_within_its_bound(recorded):
    dirs = recorded["dirs"]
    ref, _ = load_heldout_logprobs(dirs["ref", "topk"])
    test, _ = load_heldout_logprobs(dirs["noisy", "topk"])
    full_ref, _ = load_heldout_logprobs(dirs["ref", "full"])
    full_test, _ = load_heldout_logprobs(dirs["noisy", "full"])
    assert torch.equal(ref["topk_ids"], full_ref["logprobs"].topk(TOP_K, -1).indices)  # the engine's own top-k
    estimate, rest = topk_kl(ref["topk_ids"], ref["topk_logprobs"], test["topk_ids"], test["topk_logprobs"])
    exact = kl_divergence(full_ref["logprobs"], full_test["logprobs"])
    min_log_q = full_test["logprobs"].double().log_softmax(-1).min(-1).values
    gap = exact - estimate
    assert gap.min() >= -2 * ETA and (gap <= rest * -min_log_q + 2 * ETA).all()
    assert (gap > 10 * ETA).any()  # k = 8 of 512 leaves real mass unresolved: the check is not vacuous
    summary = engine_kl(dirs["ref", "topk"], dirs["noisy", "topk"])
    assert summary["mode"] == "topk" and summary["top_k"] == TOP_K
    assert summary["unresolved_mass_max"] == pytest.approx(rest.max().item())


def test_engine_kl_refuses_files_it_cannot_compare(recorded, tmp_path):
    dirs = recorded["dirs"]
    with pytest.raises(HeldoutLogprobsError, match="not comparable"):
        engine_kl(dirs["ref", "full"], dirs["noisy", "topk"])
    with pytest.raises(HeldoutLogprobsError, match="does not exist"):
        engine_kl(dirs["ref", "full"], tmp_path)
    other = tmp_path / "other"
    tensors, meta = load_heldout_logprobs(dirs["noisy", "full"])
    other.mkdir()
    save_file({**tensors, "tokens": tensors["tokens"].flip(-1).contiguous()}, str(other / LOGPROBS_FILE), metadata=meta)
    with pytest.raises(HeldoutLogprobsError, match="different held-out tokens"):
        engine_kl(dirs["ref", "full"], other)


def test_study_spec_kl_keys(tmp_path):
    from quantkit.pipelines.study import load_spec

    def spec(extra: str):
        path = tmp_path / "spec.yaml"
        path.write_text(f"name: s\nmodels: {{m: zoo:ga}}\nrecipes: [bf16]\n{extra}")
        return load_spec(path)

    assert spec("").kl == dict(num_sequences=16, seq_len=128, source="vllm", top_k=None)
    assert spec("eval: {backend: hf}\n").kl["source"] == "transformers"
    assert spec("kl: {top_k: 64}\n").kl["top_k"] == 64
    for bad, message in (
        ("kl: {source: hf}", "kl.source must be one of"),
        ("kl: {top_k: 0}", "kl.top_k must be"),
        ("kl: {nope: 1}", r"unknown kl key\(s\) \['nope'\]"),
        ("eval: {backend: hf}\nkl: {source: vllm}", "needs eval.backend vllm"),
        ("parallel: {data_parallel_size: 2}", "data_parallel_size 1"),
        ("eval: {numerics: yes please}", "eval.numerics must be true, false or a list"),
        ("eval: {numerics: [bf16, w8a8]}", r"eval.numerics names \['w8a8'\], not among the spec's recipes"),
        ("eval: {reference: 1}", "eval.reference must be true or false"),
        ("eval: {backend: hf, numerics: true}\nkl: {source: transformers}", "numerics .* needs eval.backend vllm"),
        ("eval: {limits: {m: 0}}", "eval.limits.m must be a positive integer"),
        ("eval: {limits: {x: 5}}", "eval.limits must map model labels"),
    ):
        with pytest.raises(ValueError, match=message):
            spec(bad + "\n")
    assert spec("eval: {limits: {m: 7}, numerics: true}\n").eval["limits"] == {"m": 7}


def test_study_spec_suite_per_model(tmp_path):
    """eval.suites gives a model its own suite (pipelines/real.yaml: SmolLM2 on commonsense, the coder on code);
    labels and suites are checked on load; --model keeps a spec model's own suite, else the default one."""
    from quantkit.pipelines.study import Study, load_spec

    path = tmp_path / "spec.yaml"

    def spec(suites: str, model: str | None = None):
        path.write_text(
            f"name: s\nmodels: {{a: zoo:ga, b: zoo:gatednorm}}\nrecipes: [bf16]\n"
            f"eval: {{suite: code, suites: {suites}}}\n"
        )
        return load_spec(path, model)

    study = Study(spec("{b: commonsense}"))
    assert (study.suite("a"), study.suite("b")) == ("code", "commonsense")
    assert Study(spec("null")).suite("b") == "code"
    assert Study(spec("{b: commonsense}", model="zoo:gatednorm")).suite("gatednorm") == "commonsense"
    assert Study(spec("{b: commonsense}", model="zoo:dyt")).suite("dyt") == "code"
    for bad, message in (
        ("{c: commonsense}", r"names model\(s\) \['c'\]"),
        ("{b: nope}", "unknown suite 'nope'"),
        ("[commonsense]", "must map model labels to suites"),
    ):
        with pytest.raises(ValueError, match=message):
            spec(bad)
