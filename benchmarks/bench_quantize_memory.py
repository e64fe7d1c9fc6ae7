"""Peak host memory and time of `quantkit quantize`: streaming (one decoder layer at a time) vs the whole-model path.

    python benchmarks/bench_quantize_memory.py [--sizes-gb 0.25 0.5 1 2] [--recipe w8a8_fp8_block] [--quick] [--out DIR]

For each size, a random Qwen3-architecture checkpoint (bf16, one shard per decoder layer + index; hidden 1024,
intermediate 2816, 8 heads of 128, 4 KV heads, vocab 512: ~12M parameters = 23.6 MB bf16 per layer) is built with
as many layers as make the size; each path quantizes it in a fresh subprocess, which reports its own peak RSS
(VmHWM of /proc/self/status, reset after the imports: the high-water mark of resident memory during the
quantization, file-backed pages included) and the wall time of `quantize_checkpoint`; its RSS after the imports,
before any work, is reported as the floor. A table goes to stdout, JSON + markdown to benchmarks/results/ (machine,
date, command). --quick: two tiny sizes (a few layers), for the test.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from quantkit.models.tiny import TINY_SHAPE

RESULTS = Path(__file__).resolve().parent / "results"
# the zoo's tiny shape (the layer count is --layers), and the measured one: Qwen3-0.6B-like widths
QUICK_SHAPE = {k: v for k, v in TINY_SHAPE.items() if k != "num_hidden_layers"} | {"vocab_size": 512}
SHAPE = dict(
    QUICK_SHAPE, hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=4, head_dim=128
)


def build_random_checkpoint(out_dir: Path, num_layers: int, tokenizer_dir: Path, seed: int = 0, **shape) -> Path:
    """A random bf16 Qwen3ForCausalLM checkpoint, one safetensors shard per decoder layer (+ one for the rest) and
    model.safetensors.index.json, built one layer at a time (memory: one layer). Matrices N(0, 0.02), norm weights
    1 + N(0, 0.1); `tokenizer_dir`'s tokenizer files are copied (its vocabulary must fit vocab_size)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    out_dir.mkdir(parents=True)
    config = Qwen3Config(num_hidden_layers=num_layers, **{**SHAPE, **shape})
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)

    def draw(key: str) -> torch.Tensor:
        if key.endswith("norm.weight"):
            return (1 + 0.1 * torch.randn(shapes[key], generator=gen)).to(torch.bfloat16)
        return (0.02 * torch.randn(shapes[key], generator=gen)).to(torch.bfloat16)

    groups = [[k for k in shapes if not k.startswith("model.layers.")]]
    groups += [[k for k in shapes if k.startswith(f"model.layers.{i}.")] for i in range(num_layers)]
    weight_map, total = {}, 0
    for n, keys in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: draw(k) for k in keys}
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        total += sum(t.numel() * 2 for t in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def layer_bytes(shape: dict) -> int:
    """bf16 bytes of one decoder layer of `shape`."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return 2 * (h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d)


def child(model: str, recipe: str, out: str, streaming: bool) -> None:
    """Run one quantization in this process; print JSON {import_peak_rss_mb, floor_rss_mb, peak_rss_mb, seconds}.

    After the imports the kernel's peak-RSS mark is reset to the current RSS (/proc/self/clear_refs, Linux >= 4.0),
    so peak_rss_mb is the high-water mark of resident memory during the quantization (file-backed pages
    included), not the imports' transient peak."""
    import quantkit.quantize.streaming  # noqa: F401  (both paths' modules imported before the reset)
    from quantkit.quantize.checkpoint import quantize_checkpoint

    import_peak = _status_mb("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")
    floor = _status_mb("VmRSS")
    start = time.perf_counter()
    quantize_checkpoint(model, recipe, out, streaming=streaming)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "import_peak_rss_mb": import_peak,
                "floor_rss_mb": floor,
                "peak_rss_mb": _status_mb("VmHWM"),
                "seconds": seconds,
            }
        )
    )


def _status_mb(key: str) -> float:
    """A kB field of /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def measure(model: Path, recipe: str, out: Path, streaming: bool) -> dict:
    run = subprocess.run(
        [sys.executable, __file__, "--child", str(model), recipe, str(out), "1" if streaming else "0"],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise RuntimeError(f"quantize ({'streaming' if streaming else 'whole-model'}) failed:\n{run.stderr[-3000:]}")
    shutil.rmtree(out)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-gb", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="checkpoint sizes, GB of bf16"
    )
    parser.add_argument("--recipe", default="w8a8_fp8_block")
    parser.add_argument("--quick", action="store_true", help="two tiny sizes (a test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "RECIPE", "OUT", "STREAMING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, recipe, out, streaming = args.child
        child(model, recipe, out, streaming == "1")
        return

    from quantkit.data import stdlib_docstrings
    from quantkit.models.tokenizer import save_tokenizer, train_bpe_tokenizer

    shape = QUICK_SHAPE if args.quick else SHAPE
    per_layer = layer_bytes(shape)
    depths = [2, 4] if args.quick else [max(1, round(gb * 1e9 / per_layer)) for gb in args.sizes_gb]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-quantize-memory-") as tmp:
        work = Path(tmp)
        tok = work / "tokenizer"
        save_tokenizer(train_bpe_tokenizer(stdlib_docstrings(), SHAPE["vocab_size"]), tok)
        for depth in depths:
            model = build_random_checkpoint(work / f"m{depth}", depth, tok, **shape)
            size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            row = {"layers": depth, "bf16_gb": size / 1e9, "float32_gb": 2 * size / 1e9}
            for path, streaming in (("streaming", True), ("whole", False)):
                m = measure(model, args.recipe, work / f"q{depth}-{path}", streaming)
                row.update(
                    {
                        f"{path}_peak_rss_gb": m["peak_rss_mb"] / 1024,
                        f"{path}_floor_rss_gb": m["floor_rss_mb"] / 1024,
                        f"{path}_import_peak_rss_gb": m["import_peak_rss_mb"] / 1024,
                        f"{path}_seconds": m["seconds"],
                    }
                )
            rows.append(row)
            print(format_row(row), flush=True)
            shutil.rmtree(model)
    peaks = [r["streaming_peak_rss_gb"] for r in rows]
    summary = {
        "streaming_peak_spread": max(peaks) / min(peaks) - 1,
        "whole_over_streaming_at_largest": rows[-1]["whole_peak_rss_gb"] / rows[-1]["streaming_peak_rss_gb"],
    }
    machine = f"{platform.machine()}-{torch.get_num_threads()}-threads-{math.ceil(_mem_total_gb())}GB"
    stamp = datetime.now(UTC)
    result = {
        "machine": machine,
        "cpu": platform.processor() or platform.machine(),
        "date": stamp.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "recipe": args.recipe,
        "torch": torch.__version__,
        "shape": shape,
        "rows": rows,
        "summary": summary,
    }
    table = markdown(result)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"quantize_memory_{machine}_{stamp:%Y-%m-%d_%H%M%S}{'_quick' if args.quick else ''}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{name}.md").write_text(table)


def _mem_total_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def format_row(r: dict) -> str:
    return (
        f"| {r['layers']} | {r['bf16_gb']:.3f} | {r['float32_gb']:.3f} | {r['streaming_peak_rss_gb']:.3f} | "
        f"{r['whole_peak_rss_gb']:.3f} | {r['whole_peak_rss_gb'] / r['streaming_peak_rss_gb']:.2f} | "
        f"{r['streaming_seconds']:.1f} | {r['whole_seconds']:.1f} |"
    )


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"# quantize memory: streaming vs whole-model ({result['recipe']})",
        "",
        f"machine {result['machine']} ({result['cpu']}), torch {result['torch']}, {result['date']}",
        "",
        f"command: `{result['command']}`",
        "",
        "| layers | bf16 GB | float32 GB | streaming peak RSS GB | whole-model peak RSS GB | whole / streaming "
        "| streaming s | whole-model s |",
        "|---|---|---|---|---|---|---|---|",
        *(format_row(r) for r in result["rows"]),
        "",
        f"streaming peak RSS spread across sizes: {100 * s['streaming_peak_spread']:.1f}% (max / min - 1); "
        f"whole-model / streaming at the largest size: {s['whole_over_streaming_at_largest']:.2f}x; "
        f"RSS after imports (floor, both paths): {result['rows'][0]['streaming_floor_rss_gb']:.3f} GB; the "
        f"imports' own "
        f"transient peak: {result['rows'][0]['streaming_import_peak_rss_gb']:.3f} GB",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
