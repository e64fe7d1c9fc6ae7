"""Prompt log-probabilities from a requested position on (`quantkit.serve.prompt_logprobs`) against vLLM's own, and
lm-eval's log-likelihoods through quantkit's continuation-scoring model (`evals.harness`) against stock lm-eval's.

Tolerance (derived): both sides compute the same float32 hidden states and the same LM head rows; only the GEMM's
shape differs (fewer rows; one row runs as a matrix-vector product), and with it the summation order of each
logit's length-K dot product. Two float32 orders of a dot product differ by at most 2 gamma_K sum_i |w_i x_i| <=
2 K u ||w_v|| ||x|| (u = 2^-24, Cauchy-Schwarz), and ||x|| <= max|g| sqrt(K) after the final RMSNorm of gain g (its
output has unit RMS before the gain). A log-probability, logit minus log-sum-exp, moves by at most twice the
largest logit change (the log-sum-exp moves by at most the largest), so

    TOL = 4 K u max_v ||w_v|| max|g| sqrt(K)

computed from the checkpoint's LM head and final norm (K = 256 here; ~1e-3 nats for the tiny model's weights). It
is a worst-case bound: a wrong row, position or token is off by O(1) nats. vLLM's own log-softmax and top-k gather
run on the same logits either way.
Cost: two vLLM engine starts of the tiny model (float32; ~10 s each on an idle 2-core machine).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from quantkit.serve.prompt_logprobs import FIRST_SCORED_POSITION, first_scored_position

pytestmark = pytest.mark.vllm_cpu

UNIT_ROUNDOFF = 2.0**-24


def tolerance(checkpoint) -> float:
    """TOL of the module docstring, from the checkpoint's LM head and final norm."""
    state = load_file(str(checkpoint / "model.safetensors"))
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"]).double()
    gain = state["model.norm.weight"].double()
    k = head.shape[1]
    return 4 * k * UNIT_ROUNDOFF * head.norm(dim=1).max().item() * gain.abs().max().item() * math.sqrt(k)


def test_first_scored_position_is_read_and_checked():
    from vllm import SamplingParams

    assert first_scored_position(SamplingParams(prompt_logprobs=1)) is None
    assert first_scored_position(SamplingParams(prompt_logprobs=1, extra_args={FIRST_SCORED_POSITION: 3})) == 3
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match=FIRST_SCORED_POSITION):
            first_scored_position(SamplingParams(prompt_logprobs=1, extra_args={FIRST_SCORED_POSITION: bad}))


def test_scored_rows_equal_vllms_and_the_rest_say_not_computed(tiny_checkpoint):
    """Prompts of 9-100 tokens, each asked twice in one batch: with a first scored position (1, inside, the last,
    past the end) and without one. Scored positions equal vLLM's own log-probabilities and top-1 tokens within TOL;
    earlier positions hold the prompt's token with a NaN log-probability. The engine prefills at most 32 tokens a
    step, so the 100-token prompt arrives in chunks and its first scored position (50) falls inside one."""
    from vllm import LLM, SamplingParams

    from quantkit.serve.engine import cpu_engine_kwargs

    tol = tolerance(tiny_checkpoint)
    assert tol < 0.05, tol  # the bound is informative: far below the O(1) error of a wrong row
    gen = torch.Generator().manual_seed(0)
    lengths_and_firsts = [(9, 1), (30, 12), (47, 46), (20, 25), (100, 50)]
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n, _ in lengths_and_firsts]
    chunked = dict(max_model_len=128, max_num_batched_tokens=32, seed=0)  # prefill steps of <= 32 tokens
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", **chunked, **cpu_engine_kwargs())
    try:
        plain = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        scored = [
            SamplingParams(
                temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False, extra_args={FIRST_SCORED_POSITION: p}
            )
            for _, p in lengths_and_firsts
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests + requests, [plain] * len(prompts) + scored, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for i, (prompt, (n, first)) in enumerate(zip(prompts, lengths_and_firsts, strict=True)):
        ours, theirs = outputs[len(prompts) + i], outputs[i]
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids  # sampling is untouched
        assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs) == n
        assert ours.prompt_logprobs[0] is None
        for position in range(1, n):
            entry, reference = ours.prompt_logprobs[position], theirs.prompt_logprobs[position]
            token = prompt[position]
            if position < first:
                assert set(entry) == {token} and math.isnan(entry[token].logprob)
                continue
            assert abs(entry[token].logprob - reference[token].logprob) <= tol, (i, position)
            top = [t for t, lp in entry.items() if lp.rank == 1]
            ref_top = [t for t, lp in reference.items() if lp.rank == 1]
            if top != ref_top:  # a different top-1 only where the two are tied within TOL
                assert abs(entry[top[0]].logprob - reference[ref_top[0]].logprob) <= tol, (i, position)


def test_lm_eval_loglikelihoods_equal_stock_lm_evals(tiny_checkpoint, monkeypatch):
    """lm-eval's log-likelihood requests through quantkit's model, with and without QUANTKIT_PROMPT_LOGPROBS=all:
    the continuation's summed log-probability equal within TOL per continuation token, and greedy flags equal
    unless a tie within TOL. The scored path really runs: the engine (in this process) saw the first scored
    position of every request, ctxlen as lm-eval computes it (a context longer than the model's length is cut
    from the left)."""
    from quantkit.evals.harness import SCORED_POSITIONS_ENV, open_lm
    from quantkit.serve import prompt_logprobs

    tol = tolerance(tiny_checkpoint)
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 500, (n,), generator=gen).tolist()  # noqa: E731
    requests = [(("", ""), ids(c), ids(k)) for c, k in ((1, 4), (12, 3), (40, 1), (60, 9), (150, 5))]
    seen: list[int] = []
    scored = prompt_logprobs._scored_prompt_logprobs

    def spy(runner, hidden_states, num_scheduled_tokens, wanted):
        seen.extend(first_scored_position(runner.requests[r].sampling_params) for r in wanted)
        return scored(runner, hidden_states, num_scheduled_tokens, wanted)

    monkeypatch.setattr(prompt_logprobs, "_scored_prompt_logprobs", spy)
    with open_lm(tiny_checkpoint, "vllm", dtype="float32", max_model_len=128) as lm:
        monkeypatch.setenv(SCORED_POSITIONS_ENV, "all")
        stock = lm._loglikelihood_tokens(requests)
        assert not seen
        monkeypatch.delenv(SCORED_POSITIONS_ENV)
        ours = lm._loglikelihood_tokens(requests)
    ctxlens = [c - max(0, c + k - 127) for c, k in ((1, 4), (12, 3), (40, 1), (60, 9), (150, 5))]
    assert sorted(set(seen)) == sorted(ctxlens)
    for (_, _, continuation), (ll, greedy), (ref_ll, ref_greedy) in zip(requests, ours, stock, strict=True):
        assert abs(ll - ref_ll) <= tol * len(continuation), (ll, ref_ll)
        # fixed inputs: a flag could differ only where a continuation token ties the top token within the two
        # orders' difference (~1e-6 nats measured); the random tiny model's logits are not that close here
        assert greedy == ref_greedy
