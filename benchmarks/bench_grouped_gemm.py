"""Benchmark quantkit's grouped (MoE) Triton GEMMs against torch baselines on Qwen3-Next-like expert shapes.

Routed experts with hidden 2048 and expert FFN 512 (gate_up: N = 1024, K = 2048, its input gathered per token;
down: N = 2048, K = 512, on rows sorted by expert), 512 experts top-10 and 128 experts top-8, at 16, 512, 4096
and 32768 tokens; routing from random router logits (uneven counts, some experts without tokens at 16).
In one run on one device:

  torch_bf16_grouped_mm        torch._grouped_mm, bf16 (where this torch has it; else torch_bf16_mm_loop)
  torch_bf16_mm_loop           one x_e @ w_e.T per expert with rows, bf16 (only where _grouped_mm did not run)
  torch_fp8_rowwise_grouped    torch._scaled_grouped_mm, FP8 E4M3, per-row x and per-channel w scales
  torch_fp8_rowwise_loop       one torch._scaled_mm per expert with rows, the same scales
  triton_fp8_block_grouped     quantkit.kernels.grouped_gemm.fp8_block_grouped_gemm (per-token x, 128x128 w)
  triton_nvfp4_grouped         quantkit.kernels.grouped_gemm.nvfp4_grouped_gemm (NVFP4 x per token, NVFP4 w)

Ours gather the gate_up input rows themselves (row_index: the per-token quantized input, one row per token);
the baselines get it already gathered (S = tokens * top_k rows, copied before timing). Operands are quantized
and the routing sorted before timing: GEMM only (ours include their tile map, `expert_tiles`, a few small
torch ops per call). Time, TFLOP/s (2 S N K / time), GB/s (activation rows, the weights of experts with rows,
scales and the bf16 output, each once, / time), speed-up over each baseline, and err/tol of ours against the
per-expert dequantized float32 product (first 32 rows of each expert; tolerance of tests/test_kernels_gemm.py).
A last row per shape times `expert_tiles` alone (included in ours): its small torch launches are what a
fused tile-map kernel or CUDA graphs would save.

CUDA: triton.testing.do_bench median. Without a GPU only `--quick` runs (tiny shapes through the Triton
interpreter: it proves the script works, not speed). Results: benchmarks/results/grouped_gemm_<device>_<date>.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# bench_gemm sets TRITON_INTERPRET (no GPU) before triton is imported
from bench_gemm import bench_context, err_over_tol, first_line, record_head, time_ms, write_results

from quantkit import formats
from quantkit.kernels.expert_sort import sort_by_expert
from quantkit.kernels.gemm_tiles import default_tiles
from quantkit.kernels.grouped_gemm import expert_tiles, fp8_block_grouped_gemm, nvfp4_grouped_gemm
from quantkit.kernels.quantize_fp8 import quantize_fp8_per_token
from quantkit.kernels.quantize_nvfp4 import quantize_nvfp4_per_token

# name -> (experts, top_k, hidden, expert FFN)
CONFIGS = {"qwen3-next-512e-top10": (512, 10, 2048, 512), "moe-128e-top8": (128, 8, 2048, 512)}
TOKENS = (16, 512, 4096, 32768)
QUICK_CONFIGS = {"tiny-6e-top2": (6, 2, 256, 96)}  # N = 192 and K = 96 off the 128 grid
QUICK_TOKENS = (1, 9)
BASELINES = ("torch_bf16_grouped_mm", "torch_bf16_mm_loop", "torch_fp8_rowwise_grouped", "torch_fp8_rowwise_loop")
OURS = ("triton_fp8_block_grouped", "triton_nvfp4_grouped")
ERR_ROWS = 32  # rows of each expert checked against the reference
TILE_MAP = "expert_tiles (inside ours)"  # the tile map's torch ops alone: the part of our time that is not the kernel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (the only mode without a GPU)")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    p.add_argument("--tokens", nargs="+", type=int, default=None, help=f"token counts (default {TOKENS})")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def expert_weights(e: int, n: int, k: int, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random bf16 expert weights (E, N, K) and their quantized forms, stacked over experts."""
    w = (torch.randn(e, n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    fp8 = [formats.quantize_fp8_block(w[i]) for i in range(e)]
    wq_row, ws_row = formats.quantize_fp8_per_token(w.reshape(e * n, k))  # one scale per output channel
    nv = [formats.quantize_nvfp4_weight(w[i]) for i in range(e)]
    return {
        "w": w,
        "wq_block": torch.stack([q for q, _ in fp8]),
        "ws_block": torch.stack([s for _, s in fp8]),
        "wq_row": wq_row.reshape(e, n, k),
        "ws_row": ws_row.reshape(e, n),
        "w_packed": torch.stack([t.packed for t in nv]),
        "w_block_scale": torch.stack([t.block_scale for t in nv]),
        "w_global": torch.stack([t.global_scale for t in nv]),
    }


def activations(
    tokens: int, top_k: int, e: int, k: int, gather: bool, device: torch.device, gen: torch.Generator
) -> dict:
    """Routing sorted by expert and the activation operands: ours from one row per token (gather) or the
    sorted rows, the baselines' always sorted (gathered before timing)."""
    logits = torch.randn(tokens, e, generator=gen, device=device)
    sort = sort_by_expert(logits.topk(top_k, dim=1).indices, e)
    s = tokens * top_k
    x = torch.randn(tokens if gather else s, k, generator=gen, device=device).to(torch.bfloat16)
    row_index = sort.token_index if gather else None
    xq, xs = quantize_fp8_per_token(x)
    packed, block_scale, global_ = quantize_nvfp4_per_token(x)
    pick = (lambda t: t[row_index]) if gather else (lambda t: t)
    return {
        "sort": sort,
        "row_index": row_index,
        "counts": (sort.expert_offsets[1:] - sort.expert_offsets[:-1]).tolist(),
        "x_sorted": pick(x),
        "xq": xq,
        "xs": xs,
        "xq_sorted": pick(xq),
        "xs_sorted": pick(xs).reshape(-1).contiguous(),
        "a_packed": packed,
        "a_block_scale": block_scale,
        "a_global": global_,
    }


def _loop(
    counts: list[int],
    n: int,
    out_dtype: torch.dtype,
    device: torch.device,
    one: Callable[[int, int, int], torch.Tensor],
) -> Callable[[], torch.Tensor]:
    """A call running `one(expert, first row, last row)` for each expert with rows, into one (S, N) output."""
    bounds = [(i, sum(counts[:i]), sum(counts[: i + 1])) for i, c in enumerate(counts) if c]

    def run() -> torch.Tensor:
        y = torch.empty(sum(counts), n, dtype=out_dtype, device=device)
        for i, lo, hi in bounds:
            y[lo:hi] = one(i, lo, hi)
        return y

    return run


def candidates(
    n: int, k: int, x: dict, w: dict, device: torch.device
) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    """name -> (a call computing y (S, N) bf16, bytes it moves: activations, active experts' weights, scales,
    output)."""
    offsets, counts = x["sort"].expert_offsets, x["counts"]
    ends = offsets[1:].contiguous()
    s, active = sum(counts), sum(1 for c in counts if c)
    kp = -(-k // formats.NVFP4_GROUP) * formats.NVFP4_GROUP
    rows_in = x["xq"].shape[0]  # activation rows ours read: one per token (gate_up) or per sorted row (down)
    kb, nb = -(-k // formats.FP8_WEIGHT_BLOCK), -(-n // formats.FP8_WEIGHT_BLOCK)
    out, bf16 = 2 * s * n, torch.bfloat16
    w_t, wq_row_t = w["w"].transpose(1, 2), w["wq_row"].transpose(1, 2)
    return {
        "torch_bf16_grouped_mm": (
            lambda: torch._grouped_mm(x["x_sorted"], w_t, offs=ends),
            2 * s * k + 2 * active * n * k + out,
        ),
        "torch_fp8_rowwise_grouped": (
            lambda: torch._scaled_grouped_mm(
                x["xq_sorted"], wq_row_t, x["xs_sorted"], w["ws_row"], offs=ends, out_dtype=bf16
            ),
            s * k + active * n * k + 4 * s + 4 * active * n + out,
        ),
        "torch_fp8_rowwise_loop": (
            _loop(
                counts,
                n,
                bf16,
                device,
                lambda i, lo, hi: torch._scaled_mm(
                    x["xq_sorted"][lo:hi],
                    wq_row_t[i],
                    scale_a=x["xs_sorted"][lo:hi, None],
                    scale_b=w["ws_row"][i][None, :],
                    out_dtype=bf16,
                ),
            ),
            s * k + active * n * k + 4 * s + 4 * active * n + out,
        ),
        "triton_fp8_block_grouped": (
            lambda: fp8_block_grouped_gemm(
                x["xq"], x["xs"], w["wq_block"], w["ws_block"], offsets, row_index=x["row_index"]
            ),
            rows_in * k + 4 * rows_in + active * (n * k + 4 * nb * kb) + out,
        ),
        "triton_nvfp4_grouped": (
            lambda: nvfp4_grouped_gemm(
                x["a_packed"],
                x["a_block_scale"],
                x["a_global"],
                w["w_packed"],
                w["w_block_scale"],
                w["w_global"],
                offsets,
                row_index=x["row_index"],
            ),
            rows_in * (kp // 2 + kp // 16 + 4) + active * n * (kp // 2 + kp // 16) + 4 * active + out,
        ),
    }


def bf16_loop(n: int, x: dict, w: dict, device: torch.device) -> tuple[Callable[[], torch.Tensor], int]:
    """The bf16 baseline where torch._grouped_mm does not run: one mm per expert with rows."""
    counts, k = x["counts"], x["x_sorted"].shape[1]
    s, active = sum(counts), sum(1 for c in counts if c)
    fn = _loop(counts, n, torch.bfloat16, device, lambda i, lo, hi: x["x_sorted"][lo:hi] @ w["w"][i].T)
    return fn, 2 * s * k + 2 * active * n * k + 2 * s * n


def reference_error(name: str, y: torch.Tensor, x: dict, w: dict, k: int) -> float:
    """max err/tol of ours over the first ERR_ROWS rows of each expert with rows."""
    worst = 0.0
    offsets = x["sort"].expert_offsets.tolist()
    for i in range(len(offsets) - 1):
        lo, hi = offsets[i], min(offsets[i + 1], offsets[i] + ERR_ROWS)
        if hi == lo:
            continue
        src = slice(lo, hi) if x["row_index"] is None else x["row_index"][lo:hi].long()
        if name == "triton_fp8_block_grouped":
            x_deq = formats.dequantize_fp8_per_token(x["xq"][src], x["xs"][src])
            w_deq = formats.dequantize_fp8_block(w["wq_block"][i], w["ws_block"][i])
        else:
            x_deq = formats.dequantize_nvfp4(
                formats.NVFP4Tensor(x["a_packed"][src], x["a_block_scale"][src], x["a_global"][src], k)
            )
            w_deq = formats.dequantize_nvfp4(
                formats.NVFP4Tensor(w["w_packed"][i], w["w_block_scale"][i], w["w_global"][i], k)
            )
        worst = max(worst, err_over_tol(y[lo:hi], x_deq, w_deq))
    return worst


def bench_projection(
    config: str,
    projection: str,
    e: int,
    top_k: int,
    n: int,
    k: int,
    gather: bool,
    token_counts: tuple[int, ...],
    device: torch.device,
    gen: torch.Generator,
) -> list[dict]:
    cuda = device.type == "cuda"
    w = expert_weights(e, n, k, device, gen)
    rows = []
    for tokens in token_counts:
        x = activations(tokens, top_k, e, k, gather, device, gen)
        s = tokens * top_k
        head = {
            "config": config,
            "projection": projection,
            "tokens": tokens,
            "S": s,
            "E": e,
            "active_experts": sum(1 for c in x["counts"] if c),
            "N": n,
            "K": k,
        }
        calls = candidates(n, k, x, w, device)
        results, shape_rows = {}, []
        for name in (*BASELINES, *OURS):
            if name == "torch_bf16_mm_loop":
                if "torch_bf16_grouped_mm" in results:
                    continue
                calls[name] = bf16_loop(n, x, w, device)
            fn, nbytes = calls[name]
            row = {**head, "impl": name}
            try:
                y = fn()
            except (RuntimeError, ValueError, NotImplementedError, AttributeError) as err:  # e.g. no _scaled_grouped_mm
                if name in OURS:
                    raise
                shape_rows.append({**row, "status": f"unsupported ({first_line(err)})"})
                continue
            ms = time_ms(fn, cuda)
            results[name] = ms
            row.update(
                status="ok", time_us=ms * 1e3, tflops=2 * s * n * k / ms / 1e9, gbps=nbytes / ms / 1e6, bytes=nbytes
            )
            if name in OURS:
                row["err_over_tol"] = reference_error(name, y, x, w, k)
            shape_rows.append(row)
        for row in shape_rows:
            if row["status"] == "ok":
                row["speedup"] = {b: results[b] / results[row["impl"]] for b in BASELINES if b in results}
        block_m = default_tiles(
            -(-s // e), formats.FP8_WEIGHT_BLOCK, "fp8_block_grouped"
        ).block_m  # the default tiles' BLOCK_M
        offsets = x["sort"].expert_offsets
        ms = time_ms(lambda offsets=offsets, s=s, block_m=block_m: expert_tiles(offsets, s, block_m), cuda)
        shape_rows.append({**head, "impl": TILE_MAP, "status": "ok", "time_us": ms * 1e3})
        rows += shape_rows
        del x
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        *record_head("Grouped (MoE) GEMM benchmark", meta),
        f"- timing: {meta['timing']}; GEMM only (operands quantized, routing sorted before timing)",
        "- S = tokens * top_k sorted rows; speed-up = baseline time / this time (> 1: faster); GB/s counts activation"
        " rows, the weights of experts with rows, scales and the bf16 output once; err/tol <= 1: within the tolerance"
        " of tests/test_kernels_gemm.py",
    ]
    if meta["interpreter"]:
        lines.append(
            "- **CPU, Triton interpreter: these times measure the interpreter and torch's CPU kernels, not GPU speed.**"
        )
    names = {
        "torch_bf16_grouped_mm": "bf16 grouped_mm",
        "torch_bf16_mm_loop": "bf16 mm loop",
        "torch_fp8_rowwise_grouped": "fp8 rowwise grouped",
        "torch_fp8_rowwise_loop": "fp8 rowwise loop",
    }
    lines += [
        "",
        "| config | projection | tokens | S | active experts | N | K | impl | time (us) | TFLOP/s | GB/s | "
        + " | ".join(f"vs {names[b]}" for b in BASELINES)
        + " | err/tol |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|" + "---:|" * len(BASELINES) + "---:|",
    ]
    for r in rows:
        head = (
            f"| {r['config']} | {r['projection']} | {r['tokens']} | {r['S']} | {r['active_experts']} | {r['N']} | "
            f"{r['K']} | {r['impl']} |"
        )
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} |" + " |" * (len(BASELINES) + 3))
            continue
        speed = [f"{r['speedup'][b]:.2f}x" if b in r.get("speedup", {}) else "-" for b in BASELINES]
        err = f"{r['err_over_tol']:.3f}" if "err_over_tol" in r else ""
        rates = " | ".join(f"{r[key]:.3g}" if key in r else "-" for key in ("tflops", "gbps"))
        lines.append(f"{head} {r['time_us']:.1f} | {rates} | {' | '.join(speed)} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (context := bench_context("bench_grouped_gemm", args)) is None:
        return 2
    device, gen, meta = context
    configs = QUICK_CONFIGS if args.quick else {name: CONFIGS[name] for name in args.configs}
    token_counts = tuple(args.tokens) if args.tokens else (QUICK_TOKENS if args.quick else TOKENS)
    rows = []
    with torch.inference_mode():
        for config, (e, top_k, hidden, ffn) in configs.items():
            for projection, (n, k, gather) in {
                "gate_up": (2 * ffn, hidden, True),
                "down": (hidden, ffn, False),
            }.items():
                print(
                    f"{config} {projection} E={e} top_k={top_k} N={n} K={k} tokens={list(token_counts)}",
                    file=sys.stderr,
                    flush=True,
                )
                rows += bench_projection(config, projection, e, top_k, n, k, gather, token_counts, device, gen)
                write_results(args.out, "grouped_gemm", meta, rows, markdown(meta, rows), final=False)
    write_results(args.out, "grouped_gemm", meta, rows, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
