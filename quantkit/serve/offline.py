"""Offline generation with vLLM's `LLM` (greedy by default), with the logprob of every token kept.

    generate(model_dir, prompts, max_tokens=16) -> list[Generation]

Prompts are strings (tokenized by the checkpoint's tokenizer, which prepends BOS) or lists of token ids.
`Generation.logprobs[j]` is vLLM's logprob (nats) of `token_ids[j + 1]`: the prompt's tokens after the
first, then the generated tokens. Used by `quantkit generate`, the parity tests and the throughput figure.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from quantkit.serve.checkpoint_check import check_servable
from quantkit.serve.engine import cpu_engine_kwargs, offline_environment


@dataclass
class Generation:
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    logprobs: list[float]  # len(token_ids) - 1
    text: str  # the generated continuation


@dataclass
class GenerationRun:
    generations: list[Generation]
    seconds: float  # wall time of llm.generate (engine start-up excluded)
    generated_tokens: int

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of llm.generate's wall time (engine start-up excluded)."""
        return self.generated_tokens / self.seconds


def omp_bind_per_rank(tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU ranks ("0|1"), or None when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        return None
    per_rank = len(cores) // tp
    return "|".join(",".join(map(str, cores[r * per_rank : (r + 1) * per_rank])) for r in range(tp))


def generate(
    model_dir: str | Path,
    prompts: list[str] | list[list[int]],
    max_tokens: int = 16,
    *,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    max_model_len: int = 1024,
    seed: int = 0,
    with_logprobs: bool = True,
    warmup: bool = False,
) -> GenerationRun:
    """Start vLLM on `model_dir`, decode `max_tokens` greedily for each prompt, shut the engine down.

    warmup: first generate 2 tokens for one unrelated prompt, untimed (for throughput figures)."""
    import torch
    from vllm import LLM, SamplingParams

    check_servable(model_dir)
    offline_environment()
    env = {}
    if tensor_parallel_size > 1 and not torch.cuda.is_available():
        bind = omp_bind_per_rank(tensor_parallel_size)
        if bind is None:
            raise RuntimeError(f"tensor parallelism {tensor_parallel_size} on CPU needs {tensor_parallel_size} cores")
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **cpu_engine_kwargs(),
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    try:
        inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=0 if with_logprobs else None,
            logprobs=0 if with_logprobs else None,
        )
        if warmup:
            llm.generate(["warm-up"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.llm_engine.engine_core.shutdown()
    generations = []
    for out in outputs:
        ids, gen = list(out.prompt_token_ids), out.outputs[0]
        logprobs = []
        if with_logprobs:
            logprobs = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
            logprobs += [gen.logprobs[j][t].logprob for j, t in enumerate(gen.token_ids)]
        generations.append(Generation(ids + list(gen.token_ids), len(ids), logprobs, gen.text))
    return GenerationRun(generations, seconds, sum(len(o.outputs[0].token_ids) for o in outputs))
