"""Run lm-evaluation-harness tasks against a local checkpoint, offline.

The `vllm` backend is the deployment path (the checkpoint served by vLLM with quantkit's plugin
loaded in the engine processes); `hf` runs the transformers model. Generation is greedy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.serve.engine import cpu_engine_kwargs, offline_environment


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
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    if backend == "vllm":
        model_args: dict[str, Any] = dict(
            pretrained=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
            **cpu_engine_kwargs(),
        )
    elif backend == "hf":
        model_args = dict(pretrained=str(model_dir), dtype=dtype, device="cpu")
    else:
        raise ValueError(f"unknown lm-eval backend {backend!r}; expected 'vllm' or 'hf'")
    task_manager = TaskManager(include_path=str(include_path) if include_path else None)
    lm = get_model(backend)(**model_args)
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=task_manager,
            limit=limit,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            log_samples=True,
        )
    finally:
        if backend == "vllm":  # stop the engine process now, not at interpreter exit
            lm.model.llm_engine.engine_core.shutdown()
