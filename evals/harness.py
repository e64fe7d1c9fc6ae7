"""Run lm-evaluation-harness tasks against a local checkpoint, offline.

The `vllm` backend is the deployment path (the checkpoint served by vLLM with quantkit's plugin
loaded in the engine processes); `hf` runs the transformers model. Determinism: the tasks' own
generation settings apply (ours are greedy, temperature 0); Python, NumPy, torch, few-shot and vLLM
seeds are all `seed`. vLLM batches requests, so logits can differ in the last bits between runs with
different batch compositions (`limit`, task order); hf runs one request at a time (batch size 1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from quantkit.serve.engine import cpu_engine_kwargs, offline_environment


class EvalBackend(StrEnum):
    """Who runs the checkpoint for lm-eval (`--backend`, the study's `eval.backend`; equal to its string)."""

    VLLM = "vllm"  # vLLM, quantkit's plugin loaded (the served numerics)
    HF = "hf"  # transformers: unquantized checkpoints only (it does not reproduce quantized checkpoints' numerics)


BACKENDS = tuple(str(b) for b in EvalBackend)

# "all": ask vLLM for every prompt position's log-probability, as stock lm-eval does (benchmarks, A/B checks)
SCORED_POSITIONS_ENV = "QUANTKIT_PROMPT_LOGPROBS"


def continuation_scoring_vllm() -> type:
    """lm-eval's `vllm` model asking vLLM for the continuation's prompt log-probabilities only.

    lm-eval reads a log-likelihood request's `prompt_logprobs[ctxlen:]`; this subclass passes ctxlen to the engine
    (`quantkit.serve.prompt_logprobs.FIRST_SCORED_POSITION`), so the LM head and log-softmax run over the
    continuation's positions instead of the whole prompt. Everything else is lm-eval's: the same batches, the same
    sampling parameters otherwise, the same parsing. `QUANTKIT_PROMPT_LOGPROBS=all` turns it off."""
    import os

    from lm_eval.models.vllm_causallms import VLLM
    from vllm import SamplingParams

    from quantkit.serve.engine import FIRST_SCORED_POSITION

    class ContinuationScoringVLLM(VLLM):
        _first_scored: dict[tuple[int, ...], int] = {}

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False) -> list:
            if os.environ.get(SCORED_POSITIONS_ENV, "").strip().lower() == "all":
                return super()._loglikelihood_tokens(requests, disable_tqdm)
            longest = self.max_length - 1  # lm-eval's truncation, so that the prompts match those it sends
            first: dict[tuple[int, ...], int] = {}
            for _, context, continuation in requests:
                prompt = tuple((context + continuation)[-longest:])
                ctxlen = len(context) - max(0, len(context) + len(continuation) - longest)
                first[prompt] = min(ctxlen, first.get(prompt, ctxlen))  # one prompt, two splits: the earlier
            self._first_scored = first
            try:
                return super()._loglikelihood_tokens(requests, disable_tqdm)
            finally:
                self._first_scored = {}

        def _model_generate(self, requests: list, generate: bool = False, sampling_params: Any = None) -> Any:
            if generate or not self._first_scored:
                return super()._model_generate(requests, generate, sampling_params)
            params = [  # lm-eval's log-likelihood parameters, plus the first position it reads
                SamplingParams(
                    temperature=0,
                    prompt_logprobs=1,
                    max_tokens=1,
                    detokenize=False,
                    extra_args={FIRST_SCORED_POSITION: max(1, self._first_scored[tuple(r)])},
                )
                for r in requests
            ]
            return super()._model_generate(requests, generate=True, sampling_params=params)

    return ContinuationScoringVLLM


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval logs a usage hint for every task with a `custom_dataset` (all our offline tasks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


@contextmanager
def open_lm(
    model_dir: str | Path,
    backend: str = "vllm",
    seed: int = 1234,
    max_model_len: int = 1024,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    max_logprobs: int | None = None,
) -> Iterator[Any]:
    """An lm-eval LM on `model_dir` (vLLM engine or transformers model), shut down on exit.

    vLLM only: tensor_parallel_size shards the model over that many GPUs (or CPU ranks); data_parallel_size
    > 1 makes lm-eval run that many engine replicas (through ray, which lm-eval requires for it);
    max_logprobs (None: vLLM's default, 20; -1: the whole vocabulary) caps the logprobs a request may ask for,
    and changes nothing else the engine computes."""
    offline_environment()
    from lm_eval.api.registry import get_model

    logging.getLogger("lm_eval.api.task").addFilter(_DropCustomDatasetNotice())
    if backend == EvalBackend.VLLM:
        model_args: dict[str, Any] = dict(
            pretrained=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            **cpu_engine_kwargs(),
        )
        if max_logprobs is not None:
            model_args["max_logprobs"] = max_logprobs
    elif backend == EvalBackend.HF:
        from transformers import AutoConfig

        from quantkit.models.attention import reference_attention  # registers the quantkit architectures

        model_args = dict(pretrained=str(model_dir), dtype=dtype, device="cpu", max_length=max_model_len, batch_size=1)
        attention = reference_attention(AutoConfig.from_pretrained(model_dir))
        if attention is not None:  # passed on to from_pretrained
            model_args["attn_implementation"] = attention
    else:
        raise ValueError(f"unknown lm-eval backend {backend!r}; expected one of {BACKENDS}")
    lm = (continuation_scoring_vllm() if backend == EvalBackend.VLLM else get_model(backend))(**model_args)
    try:
        yield lm
    finally:
        if backend == EvalBackend.VLLM and data_parallel_size == 1:  # stop the engine now, not at interpreter exit
            lm.model.llm_engine.engine_core.shutdown()


def evaluate_tasks(
    lm: Any,
    tasks: list[str],
    task_manager: Any,
    limit: int | None = None,
    seed: int = 1234,
    gen_kwargs: dict[str, Any] | None = None,
    allow_unsafe_code: bool = False,
    chat_template: bool = False,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate on an open LM with per-sample logs and every seed set to `seed`; `chat_template`
    renders each prompt through the tokenizer's chat template (a task's `gen_prefix` opens the answer)."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=task_manager,
        limit=limit,
        gen_kwargs=gen_kwargs or None,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        log_samples=True,
        bootstrap_iters=1000,
        confirm_run_unsafe_code=allow_unsafe_code,
        apply_chat_template=chat_template,
    )


def run_lm_eval(
    model_dir: str | Path,
    tasks: list[str],
    include_path: str | Path | None = None,
    backend: str = "vllm",
    limit: int | None = None,
    seed: int = 1234,
    max_model_len: int = 1024,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Evaluate `tasks` (names, or YAML tasks under `include_path`); return lm-eval's results dict."""
    offline_environment()
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(include_path) if include_path else None)
    with open_lm(model_dir, backend, seed=seed, max_model_len=max_model_len, dtype=dtype) as lm:
        return evaluate_tasks(lm, tasks, task_manager, limit=limit, seed=seed)
