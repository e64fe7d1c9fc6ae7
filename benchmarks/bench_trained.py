"""Time and peak memory of each quantkit command on the trained models (registry-shipped, DESIGN.md "Trained models").

    python benchmarks/bench_trained.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]
                                       [--sq-sequences 32] [--seq-len 512] [--quality-sequences N]
                                       [--diagnose-sequences N] [--out DIR]

Per model, each command runs as its own `quantkit` process (what a user types) and is measured from outside: wall
time, and peak resident memory of that process (ru_maxrss of os.wait4: imports included, file-backed pages
included), next to the bf16 checkpoint's size and their ratio (issue 28's bound: peak <= 1.5x the bf16
checkpoint for the 0.5B). Commands: `models fetch` (skipped when cached: the cache is $QUANTKIT_MODELS_DIR),
`quantize --streaming` with w8a8_fp8_block, w4a4_nvfp4 and w4a4_nvfp4_sq (SmoothQuant with --sq-sequences
windows of --seq-len tokens: a recipe file written beside the outputs), `quality` on the three checkpoints, and
`diagnose` (at their command-line defaults unless --quality-sequences / --diagnose-sequences are given); each
row says its settings. A table goes to stdout; JSON + markdown to benchmarks/results/
(machine, date, command). Work files go to a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
RECIPES = ["w8a8_fp8_block", "w4a4_nvfp4"]
SQ_RECIPE = "w4a4_nvfp4_sq"
QUALITY_SEQUENCES = 16  # `quantkit quality`'s default (x 256 tokens)


def quantkit_command() -> list[str]:
    """The `quantkit` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("quantkit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "quantkit.cli"]


def measure(args: list[str], log: Path) -> dict:
    """Run one command; {'seconds', 'peak_rss_mib', 'returncode'} (its output goes to `log`)."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "returncode": proc.returncode,
    }


def checkpoint_mib(model_dir: Path) -> float:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20


def sq_recipe_file(work: Path, num_sequences: int, seq_len: int) -> Path:
    """w4a4_nvfp4_sq with the calibration count lowered (the shipped recipe keeps the paper's 4096 x 512)."""
    import yaml

    from quantkit.quantize.recipe import RECIPES_DIR

    spec = yaml.safe_load((RECIPES_DIR / f"{SQ_RECIPE}.yaml").read_text())
    name = f"{SQ_RECIPE}_{num_sequences}x{seq_len}"
    spec.update(name=name)
    spec["smoothquant"].update(num_sequences=num_sequences, seq_len=seq_len)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def bench_model(name: str, work: Path, args: argparse.Namespace) -> list[dict]:
    from quantkit.models.trained import cached

    qk = quantkit_command()
    rows = []

    def run(command: str, argv: list[str], settings: str = "") -> dict:
        log = work / f"{name}.{command.replace(' ', '_')}.log"
        print(f"[{name}] {command} {settings}...", flush=True)
        row = {"model": name, "command": command, "settings": settings, **measure(qk + argv, log)}
        if row["returncode"] != 0:
            raise SystemExit(
                f"{command} failed (exit {row['returncode']}); its output: {log}\n{log.read_text()[-2000:]}"
            )
        rows.append(row)
        return row

    if cached(name) is None:
        run("models fetch", ["models", "fetch", name])
    model_dir = cached(name)
    bf16_mib = checkpoint_mib(model_dir)
    outs = []
    for recipe in [*RECIPES, str(sq_recipe_file(work, args.sq_sequences, args.seq_len))]:
        label = Path(recipe).stem
        out = work / f"{name}-{label}"
        settings = (
            f"--streaming, SmoothQuant {args.sq_sequences} x {args.seq_len}"
            if recipe.endswith(".yaml")
            else "--streaming"
        )
        row = run(f"quantize {label}", ["quantize", "--streaming", str(model_dir), recipe, str(out)], settings)
        row["output_mib"] = round(checkpoint_mib(out), 1)
        outs.append(str(out))
    from quantkit.diagnose.defaults import DEFAULT_NUM_SEQUENCES, DEFAULT_RECIPES, DEFAULT_SEQ_LEN

    n = args.quality_sequences or QUALITY_SEQUENCES
    run("quality", ["quality", "--num-sequences", str(n), str(model_dir), *outs], f"{len(outs)} checkpoints, {n} x 256")
    n = args.diagnose_sequences or DEFAULT_NUM_SEQUENCES
    run(
        "diagnose",
        ["diagnose", "--num-sequences", str(n), "--out", str(work / f"{name}-diagnostics"), str(model_dir)],
        f"{n} x {DEFAULT_SEQ_LEN}, {len(DEFAULT_RECIPES)} recipes",
    )
    for row in rows:
        row["bf16_checkpoint_mib"] = round(bf16_mib, 1)
        row["peak_over_bf16"] = round(row["peak_rss_mib"] / bf16_mib, 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--sq-sequences", type=int, default=32, help="SmoothQuant calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per SmoothQuant calibration window")
    parser.add_argument("--quality-sequences", type=int, help="held-out windows for quality (default: its own)")
    parser.add_argument("--diagnose-sequences", type=int, help="held-out windows for diagnose (default: its own)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-trained-"))
    try:
        rows = [row for name in args.models for row in bench_model(name, work, args)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stamp = datetime.now(UTC)
    machine = f"{platform.machine()}-{len(os.sched_getaffinity(0))}-cores"
    lines = [
        "| model | command | settings | seconds | peak RSS (MiB) | bf16 checkpoint (MiB) | peak / bf16 | "
        "output (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['command']} | {r['settings']} | {r['seconds']} | {r['peak_rss_mib']} | "
        f"{r['bf16_checkpoint_mib']} | {r['peak_over_bf16']}x | {r.get('output_mib', '')} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", *sys.argv])
    base = args.out / f"trained_{machine}_{stamp:%Y-%m-%d_%H%M}"
    meta = {
        "machine": machine,
        "cpu": platform.processor() or platform.machine(),
        "date": stamp.isoformat(timespec="seconds"),
        "command": command,
    }
    base.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    base.with_suffix(".md").write_text(
        f"# Trained models: time and peak memory per command\n\n{meta['machine']}, "
        f"{meta['date']}, `{command}`\n\n{table}\n"
    )
    print(f"written {base}.json / .md")


if __name__ == "__main__":
    main()
