"""Sweep the tiles of quantkit's four Triton GEMMs per shape class: what their default tiles should be (issue 18).

The GEMMs launch with `quantkit.kernels.gemm_tiles.default_tiles(M, block_k, kernel)`: one GemmTiles per shape class
of M (decode M <= 16, small M <= 64, prefill; the grouped GEMMs pass the mean rows per expert, cdiv(S, E)). For each
kernel and class this times every candidate of `candidates(kernel, class)` (the class's default among them) on
the class's shapes:

  fp8_block, nvfp4            Llama-3-8B's layers (qkv, o, gate_up, down) at M = 1, 16 | 32, 64 | 2048, 8192
  fp8_block_grouped,          Qwen3-Next-like experts (gate_up with its row gather, down), 512 experts top-10 and
  nvfp4_grouped               128 top-8, at token counts whose cdiv(S, E) falls in the class

checks each output against the dequantized float32 reference (err/tol <= 1, the bound of tests/test_kernels_gemm.py:
tiles change speed, never results; a miss fails the run), and ranks the candidates by the geometric mean over the
class's shapes of (default's time / candidate's time). A candidate that does not compile or launch (shared memory,
registers) is listed with its error and left out of the ranking. Nothing is applied: the summary table says what
a kernel's tiles should become, and a person edits DEFAULT_TILES (all kernels) or KERNEL_TILES (one kernel's
override) in kernels/gemm_tiles.py. NVFP4's prefill class times the dequantize-first path (its bf16 GEMM's tiles).

CUDA: triton.testing.do_bench median. Without a GPU only `--quick` runs: tiny shapes and two candidates a class
through the Triton interpreter, to prove the sweep works, not speed. Results: benchmarks/results/tiles_<device>_<date>.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from bench_gemm import (
    LAYERS,
    activation_operands,
    bench_context,
    err_over_tol,
    first_line,
    record_head,
    time_ms,
    weight_operands,
    write_results,
)
from bench_grouped_gemm import CONFIGS, activations, expert_weights, reference_error

from quantkit import formats
from quantkit.kernels.fp8_gemm import fp8_block_gemm
from quantkit.kernels.gemm_tiles import GEMM_KERNELS, SHAPE_CLASSES, GemmTiles, default_tiles, shape_class
from quantkit.kernels.grouped_gemm import fp8_block_grouped_gemm, nvfp4_grouped_gemm
from quantkit.kernels.nvfp4_gemm import DEFAULT_BLOCK_K, nvfp4_gemm

KERNELS = GEMM_KERNELS
DENSE_M = {"decode": (1, 16), "small": (32, 64), "prefill": (2048, 8192)}
# shape class -> {config: token counts}, cdiv(tokens * top_k, E) inside the class (checked in `grouped_shapes`)
GROUPED_TOKENS = {
    "decode": {"qwen3-next-512e-top10": (16, 512), "moe-128e-top8": (16, 256)},
    "small": {"qwen3-next-512e-top10": (2048,), "moe-128e-top8": (512,)},
    "prefill": {"qwen3-next-512e-top10": (4096, 32768), "moe-128e-top8": (4096, 32768)},
}
QUICK_LAYERS = {"edge": (136, 200)}  # N, K off the 128 grid
QUICK_M = {"decode": (3,), "small": (40,), "prefill": (80,)}
QUICK_CONFIG = {"tiny-6e-top2": (6, 2, 256, 96)}  # (E, top_k, hidden, expert FFN): N = 192, K = 96 or 256
QUICK_TOKENS = {"decode": (4,), "small": (60,), "prefill": (240,)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes, two candidates a class (the only mode without a GPU)"
    )
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument(
        "--classes", nargs="+", choices=[name for name, _ in SHAPE_CLASSES], default=[name for name, _ in SHAPE_CLASSES]
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def candidates(kernel: str, klass: str, quick: bool) -> list[GemmTiles]:
    """The tiles tried for `kernel` in shape class `klass`, the class's default first (with the kernel's block_k).
    FP8 kernels step K by the scale block (128); NVFP4 ones also try 64 and 256."""
    block_k = DEFAULT_BLOCK_K if kernel.startswith("nvfp4") else formats.FP8_WEIGHT_BLOCK
    default = default_tiles(dict(SHAPE_CLASSES)[klass] or 1 << 20, block_k, kernel)  # the class's largest M
    block_ks = (64, 128, 256) if kernel.startswith("nvfp4") else (formats.FP8_WEIGHT_BLOCK,)
    if klass == "decode":
        grid = [
            GemmTiles(16, bn, bk, num_warps=4, num_stages=st)
            for bn in (32, 64, 128, 256)
            for st in (3, 5)
            for bk in block_ks
            if bk == block_k or (bn == 64 and st == 3)
        ]
    elif klass == "small":
        grid = [
            GemmTiles(bm, bn, bk, num_warps=4, num_stages=st)
            for bm in (32, 64)
            for bn in (64, 128, 256)
            for st in (3, 4)
            for bk in block_ks
            if bk == block_k or (bn == 128 and st == 3)
        ]
    else:
        grid = [
            GemmTiles(bm, bn, bk, num_warps=w, num_stages=st)
            for bm, bn, w in ((64, 128, 4), (64, 128, 8), (128, 128, 4), (128, 128, 8), (64, 256, 8), (128, 256, 8))
            for st in (3, 4)
            for bk in block_ks
            if bk == block_k or (bm == 128 and bn == 128 and w == 8 and st == 3)
        ]
    others = [t for t in grid if t != default]
    return [default, others[0]] if quick else [default, *others]


def dense_shapes(
    kernel: str, klass: str, quick: bool, device: torch.device, gen: torch.Generator
) -> Iterator[tuple[dict, dict]]:
    """(shape description, operands) for the dense GEMMs' shapes of class `klass`; operands as bench_gemm builds
    them plus "ref": the dequantized float32 inputs (x, w) of `kernel`'s reference."""
    layers = QUICK_LAYERS if quick else LAYERS["llama3-8b"]
    for layer, (n, k) in layers.items():
        w = weight_operands(n, k, device, gen)
        if kernel == "fp8_block":
            w_deq = formats.dequantize_fp8_block(w["wq_block"], w["ws_block"])
        else:
            w_deq = formats.dequantize_nvfp4(
                formats.NVFP4Tensor(w["w_packed"], w["w_block_scale"], w["w_global"].reshape(()), k)
            )
        for m in (QUICK_M if quick else DENSE_M)[klass]:
            assert shape_class(m) == klass, (m, klass)
            x = activation_operands(m, k, device, gen)
            if kernel == "fp8_block":
                x_deq = formats.dequantize_fp8_per_token(x["xq"], x["xs"])
            else:
                x_deq = formats.dequantize_nvfp4(
                    formats.NVFP4Tensor(x["a_packed"], x["a_block_scale"], x["a_global"], k)
                )
            yield (
                {"shape": f"{layer} M={m} N={n} K={k}", "flops": 2 * m * n * k},
                {"x": x, "w": w, "ref": (x_deq, w_deq)},
            )


def grouped_shapes(klass: str, quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[tuple[dict, dict]]:
    """(shape description, operands) for the grouped GEMMs' shapes of class `klass`: both projections of each MoE
    config (gate_up gathers its rows, down reads sorted rows), operands as bench_grouped_gemm builds them."""
    configs = QUICK_CONFIG if quick else CONFIGS
    for config, (e, top_k, hidden, ffn) in configs.items():
        token_counts = QUICK_TOKENS[klass] if quick else GROUPED_TOKENS[klass][config]
        for projection, (n, k, gather) in {"gate_up": (2 * ffn, hidden, True), "down": (hidden, ffn, False)}.items():
            w = expert_weights(e, n, k, device, gen)
            for tokens in token_counts:
                s = tokens * top_k
                assert shape_class(-(-s // e)) == klass, (config, tokens, klass)
                x = activations(tokens, top_k, e, k, gather, device, gen)
                yield (
                    {"shape": f"{config} {projection} tokens={tokens} S={s} N={n} K={k}", "flops": 2 * s * n * k},
                    {"x": x, "w": w, "k": k},
                )


def nvfp4_operands(x: dict, w: dict) -> tuple[torch.Tensor, ...]:
    """The NVFP4 GEMMs' leading operands: activation codes, block scales, global scale; then the weight's."""
    return x["a_packed"], x["a_block_scale"], x["a_global"], w["w_packed"], w["w_block_scale"], w["w_global"]


def launch(kernel: str, ops: dict, tiles: GemmTiles) -> Callable[[], torch.Tensor]:
    """A call running `kernel` on the shape's operands with `tiles`."""
    x, w = ops["x"], ops["w"]
    if kernel == "fp8_block":
        return lambda: fp8_block_gemm(x["xq"], x["xs"], w["wq_block"], w["ws_block"], tiles=tiles)
    if kernel == "nvfp4":
        return lambda: nvfp4_gemm(*nvfp4_operands(x, w), tiles=tiles)
    offsets = x["sort"].expert_offsets
    if kernel == "fp8_block_grouped":
        return lambda: fp8_block_grouped_gemm(
            x["xq"], x["xs"], w["wq_block"], w["ws_block"], offsets, row_index=x["row_index"], tiles=tiles
        )
    return lambda: nvfp4_grouped_gemm(*nvfp4_operands(x, w), offsets, row_index=x["row_index"], tiles=tiles)


def error(kernel: str, ops: dict, y: torch.Tensor) -> float:
    """err/tol of y against the dequantized float32 reference (grouped: the first rows of each expert)."""
    if kernel in ("fp8_block", "nvfp4"):
        return err_over_tol(y, *ops["ref"])
    return reference_error(f"triton_{kernel}", y, ops["x"], ops["w"], ops["k"])


def sweep(kernel: str, klass: str, quick: bool, device: torch.device, gen: torch.Generator) -> list[dict]:
    """One row per (shape, candidate): time, TFLOP/s, err/tol, or the candidate's error."""
    if kernel.endswith("grouped"):
        shapes = grouped_shapes(klass, quick, device, gen)
    else:
        shapes = dense_shapes(kernel, klass, quick, device, gen)
    tiles_tried = candidates(kernel, klass, quick)
    rows = []
    for shape, ops in shapes:
        for i, tiles in enumerate(tiles_tried):
            row = {"kernel": kernel, "class": klass, **shape, "tiles": asdict(tiles), "default": i == 0}
            fn = launch(kernel, ops, tiles)
            try:
                y = fn()
            except Exception as e:
                if i == 0:
                    raise  # the default tiles must run
                rows.append({**row, "status": first_line(e)})
                continue
            err = error(kernel, ops, y)
            if not err <= 1.0:
                raise AssertionError(f"{kernel} {shape['shape']} tiles {tiles}: err/tol {err:.3f} > 1")
            ms = time_ms(fn, device.type == "cuda")
            rows.append(
                {**row, "status": "ok", "time_us": ms * 1e3, "tflops": shape["flops"] / ms / 1e9, "err_over_tol": err}
            )
        del ops
    return rows


def ranking(rows: list[dict]) -> list[dict]:
    """Per (kernel, class): each candidate that ran on every shape of the class, with the geometric mean over the
    shapes of (default time / its time) and the worst shape's ratio, best first."""
    out = []
    for kernel, klass in dict.fromkeys((r["kernel"], r["class"]) for r in rows):
        group = [r for r in rows if r["kernel"] == kernel and r["class"] == klass]
        default = {r["shape"]: r["time_us"] for r in group if r["default"]}
        by_tiles: dict[str, list[dict]] = {}
        for r in group:
            by_tiles.setdefault(tiles_text(r["tiles"]), []).append(r)
        ranked = []
        for text, runs in by_tiles.items():
            if len(runs) != len(default) or any(r["status"] != "ok" for r in runs):
                continue
            ratios = [default[r["shape"]] / r["time_us"] for r in runs]
            ranked.append(
                {
                    "kernel": kernel,
                    "class": klass,
                    "tiles": text,
                    "default": runs[0]["default"],
                    "speedup_gmean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                    "speedup_worst": min(ratios),
                    "shapes": len(ratios),
                }
            )
        out += sorted(ranked, key=lambda r: -r["speedup_gmean"])
    return out


def tiles_text(t: dict) -> str:
    return f"{t['block_m']}x{t['block_n']}x{t['block_k']} g{t['group_m']} w{t['num_warps']} s{t['num_stages']}"


def markdown(meta: dict, rows: list[dict]) -> str:
    ranked = ranking(rows)
    lines = [
        *record_head("GEMM tile sweep", meta),
        f"- timing: {meta['timing']}; GEMM only (operands quantized, routing sorted before timing)",
        "- tiles: BLOCK_M x BLOCK_N x BLOCK_K, g GROUP_M, w num_warps, s num_stages; speed-up = default's time / this"
        " time; every candidate's output checked against the reference (err/tol <= 1)",
    ]
    if meta["interpreter"]:
        lines.append("- **CPU, Triton interpreter: these times measure the interpreter, not GPU speed.**")
    lines += [
        "",
        "## Best tiles per kernel and shape class",
        "",
        "| kernel | class | default | best | speed-up (geomean) | worst shape | shapes |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for kernel, klass in dict.fromkeys((r["kernel"], r["class"]) for r in ranked):
        group = [r for r in ranked if r["kernel"] == kernel and r["class"] == klass]
        best, default = group[0], next(r for r in group if r["default"])
        lines.append(
            f"| {kernel} | {klass} | {default['tiles']} | {best['tiles']} | {best['speedup_gmean']:.2f}x | "
            f"{best['speedup_worst']:.2f}x | {best['shapes']} |"
        )
    lines += [
        "",
        "## Every candidate",
        "",
        "| kernel | class | shape | tiles | time (us) | TFLOP/s | err/tol |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        tiles = tiles_text(r["tiles"]) + (" (default)" if r["default"] else "")
        head = f"| {r['kernel']} | {r['class']} | {r['shape']} | {tiles} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | |")
        else:
            lines.append(f"{head} {r['time_us']:.1f} | {r['tflops']:.3g} | {r['err_over_tol']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (context := bench_context("tune_tiles", args)) is None:
        return 2
    device, gen, meta = context
    rows: list[dict] = []
    with torch.inference_mode():
        for kernel in args.kernels:
            for klass in args.classes:
                print(
                    f"{kernel} {klass}: {len(candidates(kernel, klass, args.quick))} candidates",
                    file=sys.stderr,
                    flush=True,
                )
                rows += sweep(kernel, klass, args.quick, device, gen)
                write_results(args.out, "tiles", meta, rows, markdown(meta, rows), final=False)
    write_results(args.out, "tiles", meta, rows, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
