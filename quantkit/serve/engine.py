"""Settings for running vLLM (and the HF stack around it) offline on this kind of machine.

On CPU: an explicit KV-cache size (without one the engine fails at start-up on memory), OpenMP bound to all
cores with none reserved, eager mode (no cold compile), and the engine core in the caller's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: no spawned process re-importing torch, transformers and vLLM). Why, with the
measured figures: benchmarks/README.md, "Measurements behind design choices". Tensor-parallel workers are
still processes of their own.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

# public: the numerics floor's order, and the CPU kernels recorded beside each evaluation
from quantkit.serve.cpu.linear import (  # noqa: F401
    GEMM_ENV,
    SUMMATION_ENV,
    SWITCH_ENV,
    cpu_kernels,
    summation_order,
)
from quantkit.serve.prompt_logprobs import FIRST_SCORED_POSITION  # noqa: F401  (public: the position lm-eval passes)

KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV cache: ample for tiny models and short prompts


def offline_environment(cache_dir: str | Path | None = None) -> None:
    """Forbid hub downloads; on CPU, bind vLLM's OpenMP threads to every core this process may use and run
    the offline engine core in this process (the OpenAI server always runs its own engine-core process).

    Values the user already set win. With `cache_dir`, vLLM's and inductor's caches go under it
    (keep them inside the run directory).
    """
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not _has_cuda():
        cores = sorted(os.sched_getaffinity(0))
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        defaults["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        defaults["VLLM_CACHE_ROOT"] = str(cache_dir / "vllm")
        defaults["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def cpu_engine_kwargs() -> dict[str, Any]:
    """Extra `vllm.LLM(...)` arguments for CPU machines (empty on CUDA, where vLLM sizes the cache)."""
    if _has_cuda():
        return {}
    return dict(enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES)


def release_engine_memory() -> None:
    """After an engine has closed and its last reference is dropped: collect it now (its model sits in reference
    cycles, which only the cyclic collector frees) and, on CPU, hand the freed heap back to the machine
    (`quantkit.serve.cpu.heap.release`) before the next stage runs in this process."""
    from quantkit.serve.cpu import heap as cpu_heap

    gc.collect()
    cpu_heap.release()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
