"""pytest plugin: run the kernel tests' Triton launches natively on the GPU (`benchmarks/gpu_all.sh` loads it).

The kernel tests (tests/test_kernels_*.py) build CPU tensors and check the kernels against CPU references;
CI runs them through the Triton interpreter. Loaded with ``-p native_kernel_tests`` (benchmarks/ on
sys.path, TRITON_INTERPRET unset), every Triton kernel launch whose tensor arguments live on the CPU runs
compiled on the current CUDA device instead: each argument's whole storage is copied to the device (tensors
sharing a storage share the copy, so views, strides and offsets mean what they meant), the kernel runs, and
every storage is copied back, so what the kernel wrote lands in the test's tensors. The tests' assertions
and references are untouched: the same checks, now of the GPU's results (bit-exact quantizers, the GEMM
bounds). Kernels launched with CUDA tensors pass through unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from triton.runtime.jit import JITFunction


def launch_on(device: str, run: Callable) -> Callable:
    """`run` (a Triton kernel's launch method) made to run with the storages of its CPU tensor arguments on
    `device`, copied there before and back after."""

    def launch(self, *args, **kwargs):
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage address -> (CPU bytes, device bytes)

        def moved(value):
            if not (isinstance(value, torch.Tensor) and value.device.type == "cpu"):
                return value
            storage = value.untyped_storage()
            if storage.data_ptr() not in copies:
                host = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
                copies[storage.data_ptr()] = (host, host.to(device, copy=True))
            on_device = copies[storage.data_ptr()][1].untyped_storage()
            return torch.empty(0, dtype=value.dtype, device=device).set_(
                on_device, value.storage_offset(), value.shape, value.stride()
            )

        result = run(self, *map(moved, args), **{k: moved(v) for k, v in kwargs.items()})
        for host, on_device in copies.values():
            host.copy_(on_device)  # synchronizes: the kernel has finished
        return result

    return launch


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise pytest.UsageError("native_kernel_tests: unset TRITON_INTERPRET (the kernels must compile for the GPU)")
    if not torch.cuda.is_available():
        raise pytest.UsageError("native_kernel_tests: no CUDA device")
    JITFunction.run = launch_on("cuda", JITFunction.run)
    os.environ["QUANTKIT_NATIVE_KERNELS"] = "1"  # the FP8 tensor cores' accumulation term of the GEMM bound


def pytest_report_header(config: pytest.Config) -> str:
    return f"native_kernel_tests: Triton launches of CPU tensors run on {torch.cuda.get_device_name()}"
