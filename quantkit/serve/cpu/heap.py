"""Large CPU tensors from malloc's heap instead of fresh mmaps, in the processes that serve on a CPU (glibc Linux).

glibc's malloc serves every block above its mmap threshold (32 MiB at most) with a new anonymous mmap and unmaps
it on free, so each such tensor page-faults in freshly zeroed pages every time it is made. Serving on CPU makes
many per forward pass: a 4096-token prefill chunk's MLP activations (Qwen2.5-0.5B: 4096 x 9728 float32 = 160 MB),
prompt log-likelihoods' logits, and above all the emulated quantized layers' float32 inputs, their fake-quant
temporaries and outputs. Measured on this project's 2-core machine (benchmarks/README.md, "Measurements behind
design choices"): Qwen2.5-Coder-0.5B's W4A4 row on 32 HumanEval problems 121.7 -> 101.3 s, peak RSS 6.69 -> 6.87 GB,
the same completions; its BF16 row and SmolLM2-135M's (smaller tensors) unchanged.

`install()` (the plugin runs it in every vLLM process on a machine without CUDA) sets M_MMAP_MAX to 0, so every
block comes from the heap and is reused once freed, and M_TRIM_THRESHOLD to `TRIM_THRESHOLD_BYTES`, so freed heap
memory stays with the process for the next forward pass instead of going back to the kernel (up to 2 GiB free at
the heap's top). Same numbers (where a tensor lives changes no arithmetic); the cost is memory: the process keeps
the heap of its largest step (docs/scaling.md). Blocks already mmapped are unmapped on free as before. `release()`
hands the heap's free memory back (malloc_trim) once an engine is gone, so a study's process holds 1-3 GiB between
its rows instead of the last engine's heap; the next engine's peak is the same either way (it reuses a kept heap).
`QUANTKIT_CPU_HEAP=off` keeps glibc's defaults; other C libraries (musl) and other systems are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch

SWITCH_ENV = "QUANTKIT_CPU_HEAP"  # "off": glibc's default mmap and trim thresholds
M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's <malloc.h>
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt's largest (an int): a free top of the heap beyond 2 GiB goes back

_installed = False


def wanted() -> bool:
    """True in a process serving on CPU with glibc (no CUDA device) unless `QUANTKIT_CPU_HEAP=off`."""
    if os.environ.get(SWITCH_ENV, "").lower() in ("off", "0", "false"):
        return False
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and not torch.cuda.is_available()


def install() -> bool:
    """Set this process's malloc to serve large blocks from its heap and keep freed memory (see the module
    docstring) where `wanted()`; True if set (idempotent). Raises OSError if glibc refuses a setting."""
    global _installed
    if _installed:
        return True
    if not wanted():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    for name, param, value in (
        ("M_MMAP_MAX", M_MMAP_MAX, 0),
        ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    ):
        if mallopt(param, value) != 1:
            raise OSError(f"glibc mallopt({name}, {value}) failed")
    _installed = True
    return True


def release() -> bool:
    """Return every free page of this process's heap to the kernel (glibc's malloc_trim(0)) where `install()` set
    this process; True if trimmed. Call it once an engine and its model are freed; live tensors are untouched."""
    if not _installed:
        return False
    malloc_trim = ctypes.CDLL(None).malloc_trim
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    malloc_trim(0)
    return True
