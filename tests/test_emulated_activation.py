"""quantkit.serve.method_parts.emulated_activation: the CPU emulation's activation fake-quant, compiled by inductor for
calls of >= COMPILED_MIN_ROWS rows, equals the eager `Scheme.fake_quant_activation` bit for bit. Bit equality is the
right bound: every operation is elementwise IEEE arithmetic (division, multiplication, comparisons, rounding by
adding and subtracting a power of two, float8 conversion) or a max-reduction, all exact in any order and on any ISA
(the module is `cpu_isa`: it runs again with AVX2 kernels forced). The inputs carry the cases the rounding must get
right: signed zeros, values below E4M3's smallest scale, E2M1 midpoints (ties to even), outliers that saturate a
group, rows of zeros, a K that is not a multiple of 16, bf16 and float32 inputs, per-token, static and TP
(`row_amax`) scales."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from quantkit.formats.schemes import FP8_BLOCK, NVFP4
from quantkit.serve import method_parts
from quantkit.serve.method_parts import COMPILED_MIN_ROWS, emulated_activation

pytestmark = [pytest.mark.cpu_isa, pytest.mark.usefixtures("compiled_emulation")]  # conftest keeps it off


def activations(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(rows, k) activations with outlier channels and the edge cases of the module docstring."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(k, generator=g).pow(4).mul(200).add(0.01)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e4, -2.5, 0.25, 0.75])
    x[1] = 0.0  # a row of zeros: scale 1
    x[2, :16] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2) * torch.tensor([1.0, -1.0]).repeat(8)
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


CASES = [  # (scheme, rows, k, dtype, static global scale, TP row amax)
    (NVFP4, 300, 896, torch.bfloat16, False, False),
    (NVFP4, 64, 200, torch.float32, False, False),  # K padded to 208
    (NVFP4, 40, 576, torch.bfloat16, True, False),
    (NVFP4, 40, 576, torch.bfloat16, False, True),
    (FP8_BLOCK, 300, 896, torch.bfloat16, False, False),
    (FP8_BLOCK, 40, 200, torch.float32, False, True),
]


@pytest.mark.parametrize("scheme, rows, k, dtype, static, tp", CASES)
def test_compiled_equals_eager_bit_for_bit(scheme, rows, k, dtype, static, tp):
    x = activations(rows, k, dtype, seed=rows + k)
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = (amax.max() / 2688).reshape(1) if static else None
    row_amax = amax * 1.5 if tp else None  # a TP slice: the whole row's amax is larger than this slice's
    assert method_parts._compiled_fake_quant(scheme) is not None  # this machine has a C++ compiler
    for part in (x, x[: COMPILED_MIN_ROWS + 3], x.reshape(rows, 1, k)):  # several row counts, 3-D too
        part_amax = None if row_amax is None else row_amax[: part.shape[0]].reshape(*part.shape[:-1], 1)
        eager = scheme.fake_quant_activation(part, scale, part_amax)
        served = emulated_activation(scheme, part, scale, part_amax)
        assert served.dtype == torch.float32 and served.shape == part.shape
        assert torch.equal(bits(served), bits(eager))


def test_bad_input_is_refused_as_in_eager():
    x = activations(COMPILED_MIN_ROWS, 64, torch.bfloat16, seed=3)
    x[5, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        emulated_activation(NVFP4, x, None, None)


def test_switched_off_or_without_a_compiler_it_stays_eager(monkeypatch, caplog):
    monkeypatch.setattr(method_parts, "_compiled", {})
    monkeypatch.setenv(method_parts.COMPILE_ENV, "off")
    assert method_parts._compiled_fake_quant(NVFP4) is None
    monkeypatch.setattr(method_parts, "_compiled", {})
    monkeypatch.delenv(method_parts.COMPILE_ENV)
    with caplog.at_level(logging.WARNING), torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        assert method_parts._compiled_fake_quant(FP8_BLOCK) is None
    assert "no compiled activation fake-quant" in caplog.text
    x = activations(COMPILED_MIN_ROWS * 2, 128, torch.bfloat16, seed=4)
    assert torch.equal(bits(emulated_activation(FP8_BLOCK, x, None, None)), bits(FP8_BLOCK.fake_quant_activation(x)))


CACHE_PROBE = """
import sys, torch
from quantkit.formats.schemes import FP8_BLOCK, NVFP4
from quantkit.serve.method_parts import emulated_activation
g = torch.Generator().manual_seed(0)
x = (torch.randn(300, 896, generator=g) * torch.rand(896, generator=g).pow(4).mul(200)).to(torch.bfloat16)
with torch.inference_mode():
    for scheme in (FP8_BLOCK, NVFP4):
        served = emulated_activation(scheme, x, None, None)
        eager = scheme.fake_quant_activation(x)
        assert torch.equal(served.view(torch.int32), eager.view(torch.int32)), scheme.name
print("bit-equal under", torch.backends.cpu.get_cpu_capability())
"""


def test_an_inductor_cache_from_another_isa_is_not_reused(tmp_path):
    """Two fresh interpreters share one inductor cache directory: the first compiles on this machine's own ISA, the
    second with ATen's AVX2 kernels forced (as on an AVX2 machine sharing the cache). inductor's FX graph cache keys
    omit the ISA: reusing the first's C++ (written for AVX-512's vector widths) under AVX2 flags gave wrong numbers
    and a double free (torch 2.13), so the compiled fake-quant does not use that cache. Each run must still equal
    eager bit for bit (the bound of the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    for capability in (None, "avx2"):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run(
            [sys.executable, "-c", CACHE_PROBE], env=run_env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0 and "bit-equal under" in done.stdout, done.stderr[-3000:]


def test_the_tests_switch_is_the_emulations():
    """tests/conftest.py names the switch without importing vLLM: it must be the one the emulation reads."""
    from conftest import COMPILE_ENV

    assert COMPILE_ENV == method_parts.COMPILE_ENV
