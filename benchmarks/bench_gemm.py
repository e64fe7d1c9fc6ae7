"""Benchmark quantkit's Triton GEMMs against torch baselines on real Llama-3-8B / Qwen3-8B layer shapes.

For each layer (N, K) and token count M, in one run on one device:

  torch_bf16           x @ w.T, bfloat16
  torch_fp8_rowwise    torch._scaled_mm, FP8 E4M3, per-token x scales, per-channel w scales
  torch_fp8_blockwise  torch._scaled_mm, FP8 E4M3, 1x128 x scales, 128x128 w scales (when supported)
  triton_fp8_block     quantkit.kernels.fp8_gemm.fp8_block_gemm (per-token x, 128x128 w)
  triton_nvfp4         quantkit.kernels.nvfp4_gemm.nvfp4_gemm (per-token NVFP4 x, NVFP4 w)

Each reports time, TFLOP/s (2MNK / time), GB/s (bytes of the operands, scales included, plus the bf16
output, / time) and its speed-up over each baseline (baseline time / its time). Operands are quantized
before timing: the figures are GEMM only. The Triton kernels' outputs are also checked against the
dequantized float32 product with the tolerance of tests/test_kernels_gemm.py ("err/tol" <= 1 passes).

CUDA: triton.testing.do_bench (median). Without a GPU only `--quick` runs: tiny shapes through the Triton
interpreter, to prove the script works -- those times measure the interpreter, not the kernels.
Results: benchmarks/results/gemm_<device>_<date>.{json,md}. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run through the CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import triton
import triton.testing

from quantkit import formats
from quantkit.kernels.fp8_gemm import fp8_block_gemm
from quantkit.kernels.nvfp4_gemm import nvfp4_gemm
from quantkit.kernels.quantize_fp8 import quantize_fp8_per_token
from quantkit.kernels.quantize_nvfp4 import quantize_nvfp4_per_token

# Linear layers as (N, K) = (out_features, in_features); qkv and gate_up fused as vLLM runs them.
LAYERS = {
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}
TOKENS = (1, 16, 128, 2048, 8192)  # M: decode, small batch, prefill (issue 18's shapes)
QUICK_LAYERS = {"tiny": {"edge": (136, 200), "square": (256, 256)}}  # N, K off and on the 128 grid
QUICK_M = (1, 16)
BASELINES = ("torch_bf16", "torch_fp8_rowwise", "torch_fp8_blockwise")
OURS = ("triton_fp8_block", "triton_nvfp4")
BLOCK = formats.FP8_WEIGHT_BLOCK


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes, M in (1, 16): a smoke run (the only mode without a GPU)"
    )
    p.add_argument("--models", nargs="+", choices=sorted(LAYERS), default=sorted(LAYERS))
    p.add_argument("--m", nargs="+", type=int, default=None, help=f"token counts (default {TOKENS})")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- operands -------------------------------------------------------------------------------------------


def weight_operands(n: int, k: int, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    wq_block, ws_block = formats.quantize_fp8_block(w)
    wq_row, ws_row = formats.quantize_fp8_per_token(w)  # one scale per output channel
    nv = formats.quantize_nvfp4_weight(w)
    return {
        "w": w,
        "wq_block": wq_block,
        "ws_block": ws_block,
        "wq_row": wq_row,
        "ws_row": ws_row,
        "w_packed": nv.packed,
        "w_block_scale": nv.block_scale,
        "w_global": nv.global_scale.reshape(1),
    }


def activation_operands(m: int, k: int, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    xq, xs = quantize_fp8_per_token(x)
    packed, block_scale, global_ = quantize_nvfp4_per_token(x)
    return {"x": x, "xq": xq, "xs": xs, "a_packed": packed, "a_block_scale": block_scale, "a_global": global_}


def blockwise_scales(xs: torch.Tensor, ws: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch._scaled_mm's (BlockWise1x128, BlockWise128x128) scales: a (M, K/128) outer-dim-major (our
    per-token scale repeated over K blocks: the same numbers), b (K/128, N/128) with K-block stride 1
    and the K-block count padded to a multiple of 4 in memory (pytorch test_scaled_matmul_cuda.py)."""
    kb = triton.cdiv(k, BLOCK)
    scale_a = xs.expand(-1, kb).t().contiguous().t()
    padded = torch.zeros(ws.shape[0], triton.cdiv(kb, 4) * 4, dtype=torch.float32, device=ws.device)
    padded[:, :kb] = ws
    return scale_a, padded[:, :kb].t()


def candidates(m: int, n: int, k: int, x: dict, w: dict) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    """name -> (a call computing y (M, N) bf16, bytes it moves: operands incl. scales + output)."""
    kp = triton.cdiv(k, formats.NVFP4_GROUP) * formats.NVFP4_GROUP
    nb, kb = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    out = 2 * m * n
    scale_a_blk, scale_b_blk = blockwise_scales(x["xs"], w["ws_block"], k)
    ws_row_t = w["ws_row"].t().contiguous()
    bf16 = torch.bfloat16
    return {
        "torch_bf16": (lambda: x["x"] @ w["w"].t(), 2 * m * k + 2 * n * k + out),
        "torch_fp8_rowwise": (
            lambda: torch._scaled_mm(x["xq"], w["wq_row"].t(), scale_a=x["xs"], scale_b=ws_row_t, out_dtype=bf16),
            m * k + n * k + 4 * m + 4 * n + out,
        ),
        "torch_fp8_blockwise": (
            lambda: torch._scaled_mm(
                x["xq"], w["wq_block"].t(), scale_a=scale_a_blk, scale_b=scale_b_blk, out_dtype=bf16
            ),
            m * k + n * k + 4 * m * kb + 4 * nb * kb + out,
        ),
        "triton_fp8_block": (
            lambda: fp8_block_gemm(x["xq"], x["xs"], w["wq_block"], w["ws_block"]),
            m * k + n * k + 4 * m + 4 * nb * kb + out,
        ),
        "triton_nvfp4": (
            lambda: nvfp4_gemm(
                x["a_packed"], x["a_block_scale"], x["a_global"], w["w_packed"], w["w_block_scale"], w["w_global"]
            ),
            (m + n) * (kp // 2 + kp // 16) + 4 * m + 4 + out,
        ),
    }


def err_over_tol(y: torch.Tensor, x_deq: torch.Tensor, w_deq: torch.Tensor) -> float:
    """max |y - ref| / (2**-8 |ref| + K 2**-21 |x||w|^T): the bound of tests/test_kernels_gemm.py."""
    ref = x_deq @ w_deq.T
    tol = 2.0**-8 * ref.abs() + x_deq.shape[1] * 2.0**-21 * (x_deq.abs() @ w_deq.abs().T)
    return float(((y.float() - ref).abs() / tol.clamp_min(torch.finfo(torch.float32).tiny)).max())


# --- timing ---------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], torch.Tensor], cuda: bool) -> float:
    if cuda:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def first_line(e: Exception) -> str:
    """The exception's type and first line, fit for a markdown table cell."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".replace("|", "/")[:200]


def bench_shape(
    model: str, layer: str, n: int, k: int, ms: tuple[int, ...], device: torch.device, gen: torch.Generator
) -> list[dict]:
    cuda = device.type == "cuda"
    w = weight_operands(n, k, device, gen)
    w_deq = {
        "triton_fp8_block": formats.dequantize_fp8_block(w["wq_block"], w["ws_block"]),
        "triton_nvfp4": formats.dequantize_nvfp4(
            formats.NVFP4Tensor(w["w_packed"], w["w_block_scale"], w["w_global"].reshape(()), k)
        ),
    }
    rows = []
    for m in ms:
        x = activation_operands(m, k, device, gen)
        x_deq = {
            "triton_fp8_block": formats.dequantize_fp8_per_token(x["xq"], x["xs"]),
            "triton_nvfp4": formats.dequantize_nvfp4(
                formats.NVFP4Tensor(x["a_packed"], x["a_block_scale"], x["a_global"], k)
            ),
        }
        results = {}
        for name, (fn, nbytes) in candidates(m, n, k, x, w).items():
            row = {"model": model, "layer": layer, "M": m, "N": n, "K": k, "impl": name}
            try:
                y = fn()
            except (RuntimeError, ValueError, NotImplementedError) as e:  # e.g. no blockwise _scaled_mm here
                if name in OURS:
                    raise
                rows.append({**row, "status": f"unsupported ({first_line(e)})"})
                continue
            ms_ = time_ms(fn, cuda)
            results[name] = ms_
            flops = 2 * m * n * k
            row.update(status="ok", time_us=ms_ * 1e3, tflops=flops / ms_ / 1e9, gbps=nbytes / ms_ / 1e6, bytes=nbytes)
            if name in OURS:
                row["err_over_tol"] = err_over_tol(y, x_deq[name], w_deq[name])
            rows.append(row)
        for row in rows[-len(BASELINES) - len(OURS) :]:
            if row["status"] == "ok":
                row["speedup"] = {b: results[b] / results[row["impl"]] for b in BASELINES if b in results}
        del x, x_deq
    return rows


# --- output ---------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({os.cpu_count()} cores), Triton interpreter"


def record_head(title: str, meta: dict) -> list[str]:
    """The first lines of a kernel benchmark's record: the title on the device, date, versions, command."""
    return [
        f"# {title}: {meta['device']}",
        "",
        f"- date: {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}",
        f"- command: `{meta['command']}`",
    ]


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        *record_head("GEMM benchmark", meta),
        f"- timing: {meta['timing']}",
        "- speed-up = baseline time / this time (> 1: faster than the baseline); GB/s counts operands, scales and the"
        " bf16 output once; err/tol <= 1: within the tolerance of tests/test_kernels_gemm.py",
    ]
    if meta["interpreter"]:
        lines.append(
            "- **CPU, Triton interpreter: these times measure the interpreter and torch's CPU kernels, not GPU speed.**"
        )
    lines += [
        "",
        "| model | layer | M | N | K | impl | time (us) | TFLOP/s | GB/s "
        "| vs bf16 | vs fp8 rowwise | vs fp8 blockwise | err/tol |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['layer']} | {r['M']} | {r['N']} | {r['K']} | {r['impl']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | | | | | |")
            continue
        speed = [f"{r['speedup'][b]:.2f}x" if b in r.get("speedup", {}) else "-" for b in BASELINES]
        err = f"{r['err_over_tol']:.3f}" if "err_over_tol" in r else ""
        lines.append(f"{head} {r['time_us']:.1f} | {r['tflops']:.3g} | {r['gbps']:.3g} | {' | '.join(speed)} | {err} |")
    return "\n".join(lines) + "\n"


def metadata(device: torch.device, quick: bool) -> dict:
    """What every result file records: device, date (UTC), versions, the command, the timing method."""
    return {
        "device": device_name(device),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms)"
        if device.type == "cuda"
        else "time.perf_counter median of 3 after 1 warm-up call",
        "quick": quick,
    }


def write_results(out: Path, prefix: str, meta: dict, rows: list[dict], text: str, final: bool = True) -> None:
    """<out>/<prefix>_<device slug>_<date>[_quick].json (meta + rows) and .md (`text`), rewritten as rows come
    (final=False: a run cut short keeps what it measured); the final write also prints the table."""
    slug = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
    date = dt.datetime.fromisoformat(meta["date"])
    stem = f"{prefix}_{slug}_{date:%Y-%m-%d_%H%M%S}{'_quick' if meta['quick'] else ''}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({**meta, "complete": final, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(
        text if final else text + "\n(incomplete: the run is still going or was cut short)\n"
    )
    if final:
        print(text)
        print(f"wrote {out / stem}.json and .md", file=sys.stderr)


def bench_device(script: str, quick: bool) -> torch.device | None:
    """The CUDA device, or the CPU for a --quick run; None, having said why on stderr, for a full run without a GPU
    (the caller exits 2)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if quick:
        return torch.device("cpu")
    print(
        f"{script}: no CUDA device; without a GPU only --quick runs (tiny shapes through the Triton interpreter)",
        file=sys.stderr,
    )
    return None


def bench_context(script: str, args: argparse.Namespace) -> tuple[torch.device, torch.Generator, dict] | None:
    """A GEMM benchmark's setting: `bench_device`, a generator on it seeded by args.seed and the run's `metadata`;
    None (said why on stderr) where `bench_device` is None."""
    device = bench_device(script, args.quick)
    if device is None:
        return None
    return device, torch.Generator(device=device).manual_seed(args.seed), metadata(device, args.quick)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (context := bench_context("bench_gemm", args)) is None:
        return 2
    device, gen, meta = context
    layers = QUICK_LAYERS if args.quick else {name: LAYERS[name] for name in args.models}
    ms = tuple(args.m) if args.m else (QUICK_M if args.quick else TOKENS)
    rows = []
    with torch.inference_mode():
        for model, shapes in layers.items():
            for layer, (n, k) in shapes.items():
                print(f"{model} {layer} N={n} K={k} M={list(ms)}", file=sys.stderr, flush=True)
                rows += bench_shape(model, layer, n, k, ms, device, gen)
                write_results(args.out, "gemm", meta, rows, markdown(meta, rows), final=False)
    write_results(args.out, "gemm", meta, rows, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
