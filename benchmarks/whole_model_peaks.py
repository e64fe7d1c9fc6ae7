"""The whole-model quantize path's peak resident memory on real checkpoints, against the estimate `quantize` uses
to choose it (`quantkit.quantize.checkpoint.whole_model_bytes`).

    python benchmarks/whole_model_peaks.py --model DIR [--model DIR ...] [--recipes w4a4_nvfp4 w4a4_nvfp4_sq ...]

Each (model, recipe) is quantized on the whole-model path in a fresh subprocess (`bench_quantize_memory.child`:
VmHWM after the imports, so the peak of the quantization itself, the import floor included). Prints a markdown
table (peak, estimate, peak / estimate: the estimate must stay above 1.0x) with machine, date and command.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize_memory import measure

from quantkit.quantize.checkpoint import float32_bytes, whole_model_bytes
from quantkit.quantize.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True, help="checkpoint directory (repeatable)")
    parser.add_argument("--recipes", nargs="+", default=["w4a4_nvfp4", "w4a4_nvfp4_sq", "w4a4_nvfp4_sq_gptq"])
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {platform.processor() or platform.node()}; date: "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; command: {' '.join(sys.argv)}\n"
    )
    print("| model | recipe | float32 GB | peak RSS GB | estimate GB | peak / estimate | seconds |")
    print("|---|---|---|---|---|---|---|")
    for model in map(Path, args.model):
        f32 = float32_bytes(model) / 1e9
        for recipe in args.recipes:
            estimate = whole_model_bytes(model, load_recipe(recipe)) / 1e9
            with tempfile.TemporaryDirectory() as tmp:
                r = measure(model, recipe, Path(tmp) / "out", streaming=False)
            peak = r["peak_rss_mb"] * 2**20 / 1e9
            print(
                f"| {model.name} | {recipe} | {f32:.2f} | {peak:.2f} | {estimate:.2f} | {peak / estimate:.2f}x | "
                f"{r['seconds']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
