"""`make bench` (benchmarks/bench_gemm.py) runs on this machine (CPU: --quick through the interpreter) and
writes JSON + markdown with the device, versions and every implementation's row, kernels within tolerance."""

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
