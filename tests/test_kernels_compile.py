"""The kernels compile for Hopper (sm90) without a GPU, and the PTX keeps what the interpreter cannot show.

Triton ships ptxas, so a CPU machine can compile for sm90 ahead of time (a subprocess: the test session
runs with TRITON_INTERPRET=1, under which kernels are not compiled). Checked in the PTX:
- quantizers: every float32 division is ``div.rn.f32`` (IEEE, no flush-to-zero) -- Triton's plain ``/``
  would be the approximate ``div.full.f32`` and break bit-exactness with torch on the GPU;
- GEMMs at prefill tiles (NVFP4's dequantize-first bf16 GEMM too): Hopper's ``wgmma`` MMA and ``cp.async``
  multi-stage loads, given the 16-aligned sizes and strides Triton specializes real layer shapes to.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantkit.kernels import fp8_gemm, gemm_tiles, hadamard, nvfp4_gemm, quantize_fp8, quantize_nvfp4

ALIGNED = {"M", "N", "K", "K_PAD", "K_BYTES"}

def ptx(kernel, types, constexprs, tiles=None):
    sig = {name: types.get(name, "constexpr" if name in constexprs else "i32") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name in ALIGNED or (name.startswith("stride") and name != "stride_agm")}
    options = {} if tiles is None else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if tiles is not None:
        constexprs = {**constexprs, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
                      "GROUP_M": tiles.group_m}
    source = ASTSource(kernel, sig, constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"]

def summary(text):
    return {"divisions": sorted(set(re.findall(r"\b(?:div|rcp)\.[a-z0-9.]+", text))),
            "wgmma": "wgmma.mma_async" in text, "cp_async": "cp.async" in text}

out = {}
NO_HADAMARD = {"HADAMARD": 0, "HADAMARD_SCALE": 1.0}
for static in (False, True):
    out[f"quantize_nvfp4 static={static}"] = summary(ptx(
        quantize_nvfp4._quantize_nvfp4_kernel, {"x_ptr": "*bf16", "packed_ptr": "*u8", "block_scale_ptr": "*u8",
        "global_ptr": "*fp32", "static_global_ptr": "*fp32"},
        {"STATIC": static, "BLOCK_M": 16, "BLOCK_K": 256, **NO_HADAMARD}))
out["quantize_fp8"] = summary(ptx(quantize_fp8._quantize_fp8_per_token_kernel,
    {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32"}, {"BLOCK_M": 16, "BLOCK_K": 512, **NO_HADAMARD}))
# the online Hadamard fused in (rotated down_proj inputs): a small block and Llama-3-8B's 2048 (tiles as the
# wrappers choose them, `quantize_fp8.quantizer_tile`)
for block in (128, 2048):
    block_m, block_k = quantize_fp8.quantizer_tile("compile", 4096, block, 16, 256, block)
    out[f"quantize_nvfp4 hadamard={block}"] = summary(ptx(
        quantize_nvfp4._quantize_nvfp4_kernel, {"x_ptr": "*bf16", "packed_ptr": "*u8", "block_scale_ptr": "*u8",
        "global_ptr": "*fp32", "static_global_ptr": "*fp32"},
        {"STATIC": False, "BLOCK_M": block_m, "BLOCK_K": block_k, "HADAMARD": block,
         "HADAMARD_SCALE": hadamard.hadamard_scale(block)}))
    block_m, block_k = quantize_fp8.quantizer_tile("compile", 4096, block, 16, 512, block)
    out[f"quantize_fp8 hadamard={block}"] = summary(ptx(quantize_fp8._quantize_fp8_per_token_kernel,
        {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32"},
        {"BLOCK_M": block_m, "BLOCK_K": block_k, "HADAMARD": block, "HADAMARD_SCALE": hadamard.hadamard_scale(block)}))
for m in (1, 4096):
    out[f"fp8_gemm M={m}"] = summary(ptx(fp8_gemm._fp8_block_gemm_kernel,
        {"x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
         "bias_ptr": "*bf16", "y_ptr": "*bf16"},
        {"HAS_BIAS": True, "ROUND_BF16": False, "SCALE_BLOCK": 128}, gemm_tiles.default_tiles(m, 128, "fp8_block")))
    out[f"nvfp4_gemm M={m}"] = summary(ptx(nvfp4_gemm._nvfp4_gemm_kernel,
        {"a_ptr": "*u8", "a_scale_ptr": "*fp8e4nv", "a_global_ptr": "*fp32", "w_ptr": "*u8", "w_scale_ptr": "*fp8e4nv",
         "w_global_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"},
        {"HAS_BIAS": True, "TILE": tl.bfloat16, "ROUND_BF16": False},
        gemm_tiles.default_tiles(m, nvfp4_gemm.DEFAULT_BLOCK_K, "nvfp4")))
out["nvfp4_dequantize"] = summary(ptx(nvfp4_gemm._dequantize_kernel,
    {"packed_ptr": "*u8", "scale_ptr": "*fp8e4nv", "out_ptr": "*bf16"}, {"BLOCK_R": 32, "BLOCK_B": 64}))
out["nvfp4_dequantized_gemm M=4096"] = summary(ptx(nvfp4_gemm._dequantized_gemm_kernel,
    {"a_ptr": "*bf16", "a_global_ptr": "*fp32", "w_ptr": "*bf16", "w_global_ptr": "*fp32", "bias_ptr": "*bf16",
     "y_ptr": "*bf16"}, {"HAS_BIAS": True, "ROUND_BF16": False}, nvfp4_gemm.DEQUANTIZED_TILES))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sm90_ptx():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (silences its warning)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_quantizers_divide_with_ieee_rounding_on_hopper(sm90_ptx):
    for name in [n for n in sm90_ptx if n.startswith("quantize_")]:
        assert sm90_ptx[name]["divisions"] == ["div.rn.f32"], (name, sm90_ptx[name])


def test_every_kernel_compiles_for_hopper(sm90_ptx):
    assert sorted(sm90_ptx) == sorted(
        ["quantize_fp8", "quantize_nvfp4 static=False", "quantize_nvfp4 static=True"]
        + [f"quantize_{q} hadamard={b}" for q in ("fp8", "nvfp4") for b in (128, 2048)]  # online Hadamard fused
        + [f"{gemm} M={m}" for gemm in ("fp8_gemm", "nvfp4_gemm") for m in (1, 4096)]  # decode and prefill tiles
        + ["nvfp4_dequantize", "nvfp4_dequantized_gemm M=4096"]  # NVFP4's dequantize-first path (M > 64)
    )


def test_gemms_use_wgmma_and_pipelined_loads_on_hopper(sm90_ptx):
    for name in ("fp8_gemm M=4096", "nvfp4_gemm M=4096", "nvfp4_dequantized_gemm M=4096"):
        assert sm90_ptx[name]["wgmma"] and sm90_ptx[name]["cp_async"], (name, sm90_ptx[name])
