"""Prompt log-probabilities only at the positions the caller reads (vLLM 0.32's V1 model runner).

lm-eval scores a log-likelihood request (context + continuation, one prompt) from vLLM's prompt log-probabilities
and reads the continuation's only (`prompt_logprobs[ctxlen:]`). vLLM computes them at every prompt position: the LM
head over the context as well, which on CPU is the largest single cost of a multiple-choice evaluation (42% of the
engine's time for SmolLM2-135M on AVX2: docs/results/trained-study-smollm.md, 2026-11-29 08:20).

A request whose `SamplingParams.extra_args` holds `FIRST_SCORED_POSITION` = p (1 <= p) gets prompt log-probabilities
at positions p, p + 1, ... only, computed exactly as vLLM computes them (the same hidden states, LM head, log-softmax
and top-k gather, for fewer rows). Positions 1 .. p - 1 hold only the prompt's own token, with a NaN log-probability:
"not computed", never a number that could be read as one. Requests without the key take vLLM's own code.

`install()` (called by the plugin in every vLLM process) wraps `GPUModelRunner._get_prompt_logprobs_dict`, which the
CPU runner inherits. Tested against vLLM's own prompt log-probabilities in tests/test_prompt_logprobs.py.
"""

from __future__ import annotations

from typing import Any

import torch

FIRST_SCORED_POSITION = (
    "quantkit_first_scored_position"  # SamplingParams.extra_args key: the first prompt position read
)


def first_scored_position(sampling_params: Any) -> int | None:
    """The first prompt position whose log-probability this request asks for (None: every position, vLLM's way)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    position = extra.get(FIRST_SCORED_POSITION)
    if position is None:
        return None
    if isinstance(position, bool) or not isinstance(position, int) or position < 1:
        raise ValueError(f"extra_args[{FIRST_SCORED_POSITION!r}] must be an int >= 1, got {position!r}")
    return position


def _scored_prompt_logprobs(
    runner: Any, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int], wanted: dict[str, int]
) -> tuple[dict[str, Any], list[str]]:
    """vLLM's per-request prompt log-probability loop for the requests in `wanted` (req_id -> top-k), computing rows
    from each one's first scored position on. Returns (finished requests' LogprobsTensors, their ids)."""
    from vllm.v1.outputs import LogprobsTensors

    finished: dict[str, Any] = {}
    done: list[str] = []
    for req_id, top_k in wanted.items():
        num_tokens = num_scheduled_tokens.get(req_id)
        request = runner.requests[req_id]
        if num_tokens is None or request.prompt_token_ids is None:  # preempted in prefill; prompt embeddings
            continue
        prompt = request.prompt_token_ids
        tensors = request.in_progress_prompt_logprobs_cpu
        if tensors is None:  # row r holds position r + 1; the rows never computed say so (NaN)
            tensors = LogprobsTensors.empty_cpu(len(prompt) - 1, top_k + 1)
            tensors.logprob_token_ids.copy_(torch.tensor(prompt[1:], dtype=torch.int32)[:, None])
            tensors.logprobs.fill_(float("nan"))
            tensors.selected_token_ranks.fill_(-1)
            request.in_progress_prompt_logprobs_cpu = tensors
        start = request.num_computed_tokens  # this step's first row
        remaining = len(prompt) - 1 - start
        if num_tokens <= remaining:  # a chunk; more rows come in later steps (vLLM defers the == case too)
            rows = num_tokens
        else:
            rows = remaining
            done.append(req_id)
            finished[req_id] = tensors
        first_row = (first_scored_position(request.sampling_params) or 1) - 1
        skip = min(max(first_row - start, 0), max(rows, 0))
        if rows - skip <= 0:
            continue
        offset = runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]].item() + skip
        logits = runner.model.compute_logits(hidden_states[offset : offset + rows - skip])
        first = start + skip
        targets = torch.tensor(prompt[first + 1 : first + 1 + rows - skip], device=logits.device)
        if runner.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits.to(torch.float32)
        else:
            scores = runner.sampler.compute_logprobs(logits)
        token_ids, logprobs, ranks, *_ = runner.sampler.gather_logprobs(scores, top_k, targets)
        written = slice(first, first + rows - skip)
        tensors.logprob_token_ids[written].copy_(token_ids)
        tensors.logprobs[written].copy_(logprobs)
        tensors.selected_token_ranks[written].copy_(ranks)
    return finished, done


def install() -> None:
    """Wrap the V1 model runner's prompt log-probabilities (idempotent): requests carrying `FIRST_SCORED_POSITION`
    go through `_scored_prompt_logprobs`, the rest through vLLM's own method."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllm_method = GPUModelRunner._get_prompt_logprobs_dict
    if getattr(vllm_method, "quantkit_scored", False):
        return

    def prompt_logprobs_dict(self: Any, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]) -> Any:
        pending = self.num_prompt_logprobs  # req_id -> top-k, for requests whose prompt rows are not all out yet
        ours = {
            req_id: top_k
            for req_id, top_k in pending.items()
            if req_id in self.requests and first_scored_position(self.requests[req_id].sampling_params) is not None
        }
        if not ours:
            return vllm_method(self, hidden_states, num_scheduled_tokens)
        for req_id in ours:  # vLLM's method sees the others only
            del pending[req_id]
        try:
            result = vllm_method(self, hidden_states, num_scheduled_tokens)
        finally:
            pending.update(ours)
        finished, done = _scored_prompt_logprobs(self, hidden_states, num_scheduled_tokens, ours)
        for req_id in done:
            del pending[req_id]
            self.requests[req_id].in_progress_prompt_logprobs_cpu = None
        return {**result, **finished}

    prompt_logprobs_dict.quantkit_scored = True  # type: ignore[attr-defined]  # the install mark
    prompt_logprobs_dict.wrapped = vllm_method  # type: ignore[attr-defined]
    GPUModelRunner._get_prompt_logprobs_dict = prompt_logprobs_dict  # type: ignore[method-assign]
