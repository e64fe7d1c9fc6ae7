"""`make bench` (benchmarks/bench_gemm.py) and benchmarks/bench_serve.py run on this machine and write JSON + markdown
(GEMM on CPU: --quick through the interpreter, kernels within tolerance; serving: a tiny checkpoint, two recipes)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_results(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gemm.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (json_file,), (md_file,) = tmp_path.glob("*.json"), tmp_path.glob("*.md")
    result = json.loads(json_file.read_text())
    text = json.dumps(result)
    for key in ("torch", "triton", "date", "command"):
        assert key in text
    rows = md_file.read_text()
    for impl in ("torch_bf16", "torch_fp8_rowwise", "triton_fp8_block", "triton_nvfp4"):
        assert f"| {impl} |" in rows
    errs = [float(line.rsplit("|", 2)[-2]) for line in rows.splitlines() if "| triton_" in line]
    assert errs and max(errs) <= 1.0


def test_serving_throughput_benchmark_runs(tiny_checkpoint, tmp_path):
    """benchmarks/bench_serve.py (the issue's throughput table) runs end to end: quantize, serve, time, report."""
    command = [sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--model", str(tiny_checkpoint),
               "--recipes", "bf16", "w4a4_nvfp4", "--prompts", "2", "--max-tokens", "4",
               "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (json_file,) = (tmp_path / "out").glob("serve_*.json")
    rows = {r["recipe"]: r for r in json.loads(json_file.read_text())["rows"]}
    assert rows["bf16"]["quant_method"] == "none" and rows["w4a4_nvfp4"]["quant_method"] == "quantkit"
    assert all(r["tokens"] == 2 * 4 and r["tokens_per_second"] > 0 for r in rows.values())
