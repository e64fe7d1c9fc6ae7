"""Crash and concurrency safety, with real processes: `quantkit run` SIGKILLed (with its vLLM children) during
quantize and again during eval resumes, reuses every finished artifact and never reads a half-written one; a
second concurrent `quantkit run` on the run directory refuses at once; two concurrent `quantkit zoo build` of
one checkpoint train it once, the other waits and reuses it.

The tiny study is the one of tests/test_pipeline.py (same spec); every wait polls for a condition.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_pipeline import BASELINE_RESULTS, _spec
from transformers import AutoModelForCausalLM

import quantkit.models  # noqa: F401  (registers the architecture with AutoModelForCausalLM)
from quantkit.atomic import LockedError, exclusive_lock

pytestmark = pytest.mark.slow

QUANTKIT = str(Path(sys.executable).parent / "quantkit")
STAGE_DIRS = ("diagnostics", "checkpoints", "evals", "degradation")


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """`quantkit ARGS` in a session of its own (so killpg reaches vLLM's children); stdout+stderr to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([QUANTKIT, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _poll(condition: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str, deadline: float = 900) -> None:
    """Wait until `condition()`; fail if `proc` exits first or after `deadline` seconds."""
    end = time.monotonic() + deadline
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"quantkit exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} after {deadline} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)


def _kill(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the process group, then wait until the run directory's lock is free (every member is dead)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 120
    while True:
        try:
            with exclusive_lock(run_dir / ".lock", "test"):
                return
        except LockedError:
            assert time.monotonic() < end, "the killed run's lock is still held after 120 s"
            time.sleep(0.1)


def _finished(run_dir: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file of every finished stage artifact (temp dirs, named .*, excluded)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for d in STAGE_DIRS
        for p in (run_dir / d).rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(run_dir).parts)
    }


def _run_and_kill(
    path: Path, run_dir: Path, log_name: str, condition: Callable[[], bool], what: str
) -> dict[str, tuple[int, int]]:
    """`quantkit run SPEC`, SIGKILLed (with its children) as soon as `condition()`; its finished artifacts."""
    log = path.parent / log_name
    proc = _start(["run", str(path)], log)
    _poll(condition, proc, log, what)
    _kill(proc, run_dir)
    return _finished(run_dir)


def _temps(run_dir: Path) -> list[Path]:
    return [p for d in STAGE_DIRS for p in (run_dir / d).glob(".*")]


def _assert_no_half_artifact(run_dir: Path) -> None:
    for ckpt in (run_dir / "checkpoints").glob("[!.]*"):
        assert (ckpt / "config.json").exists(), ckpt
        assert load_file(ckpt / "model.safetensors"), ckpt
    for ev in (run_dir / "evals").glob("[!.]*"):
        assert (ev / "results.json").exists() and json.loads((ev / "results.json").read_text())["benchmarks"], ev
    for diag in (run_dir / "diagnostics").glob("[!.]*"):
        assert (diag / "diagnostics.json").exists() and (diag / "summary.md").exists(), diag


def assert_resumed(run_dir: Path, killed: dict[str, tuple[int, int]]) -> dict[tuple[str, str], dict]:
    """A resumed study's checks: the artifacts finished before the kill (`killed`, as `_finished` gave them) are
    untouched, no temp dir or half artifact is left, the rows and the gate match the committed baseline (an
    uninterrupted run's results), every stage is timed; returns the timing entries by (stage, recipe)."""
    from quantkit.report.gate import load_thresholds, run_gate

    after = _finished(run_dir)
    assert {k: after[k] for k in killed} == killed, "finished artifacts were redone"
    assert _temps(run_dir) == [], "the killed runs' temp dirs are removed when their stage is redone"
    _assert_no_half_artifact(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    baseline = json.loads(BASELINE_RESULTS.read_text())
    assert [(r["variant"], r["recipe"], sorted(r["scores"])) for r in results["rows"]] == [
        (r["variant"], r["recipe"], sorted(r["scores"])) for r in baseline["rows"]
    ]
    assert run_gate(BASELINE_RESULTS, run_dir / "results.json", load_thresholds()) == 0
    timings = results["meta"]["timings"]
    assert list(timings["stages"]) == ["checkpoint", "diagnose", "quantize", "eval", "degradation", "quality"]
    assert "Time: checkpoint" in (run_dir / "report" / "report.md").read_text()
    return {(e["stage"], e["recipe"]): e for e in timings["entries"]}


@pytest.fixture(scope="module")
def spec(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny study's spec and its run directory."""
    tmp = tmp_path_factory.mktemp("crash")
    return _spec(tmp, tiny_checkpoint), tmp / "runs" / "tiny"


@pytest.fixture(scope="module")
def killed_in_quantize(spec):
    """The study killed as soon as a checkpoint (temp or finished) appears; its finished artifacts."""
    path, run_dir = spec
    return _run_and_kill(
        path, run_dir, "run1.log", lambda: any((run_dir / "checkpoints").glob("*")), "checkpoint being written"
    )


@pytest.fixture(scope="module")
def killed_in_eval(spec, killed_in_quantize):
    """The resumed study killed in the middle of an eval (some samples written into its temp dir)."""
    path, run_dir = spec

    def eval_half_done() -> bool:
        if not any((run_dir / "evals").glob(".tiny-*.tmp/samples/*.jsonl")):
            return False
        assert not any((run_dir / "evals").glob("[!.]*")), "an eval finished before the test saw one in flight"
        return True

    return _run_and_kill(path, run_dir, "run2.log", eval_half_done, "eval half done")


@pytest.fixture(scope="module")
def timings_before_resume(spec, killed_in_eval) -> dict:
    """timings.json as the killed runs left it: what the resumed run must carry over for stages it finds done."""
    from quantkit.pipelines.study import read_timings

    return read_timings(spec[1])


@pytest.fixture(scope="module")
def resumed(spec, killed_in_eval, timings_before_resume):
    """The study run to completion, with a second `quantkit run` started while it holds the lock."""
    path, run_dir = spec
    log = path.parent / "run3.log"
    proc = _start(["run", str(path)], log)
    _poll(lambda: (run_dir / ".lock").read_text() == f"{proc.pid}\n", proc, log, "lock taken")
    started = time.monotonic()
    second = subprocess.run([QUANTKIT, "run", str(path)], capture_output=True, text=True, timeout=300)
    refused = (second, time.monotonic() - started)
    assert proc.wait(timeout=1800) == 0, log.read_text()[-3000:]
    return refused


def test_sigkill_during_quantize_leaves_no_half_artifact(spec, killed_in_quantize):
    _, run_dir = spec
    _assert_no_half_artifact(run_dir)
    assert not any((run_dir / "evals").glob("[!.]*")), "killed before any eval"


def test_sigkill_during_eval_reuses_and_leaves_no_half_artifact(spec, killed_in_quantize, killed_in_eval):
    _, run_dir = spec
    _assert_no_half_artifact(run_dir)
    assert {k: killed_in_eval[k] for k in killed_in_quantize} == killed_in_quantize, "finished artifacts were redone"
    assert (run_dir / "checkpoints" / "tiny-bf16" / "config.json").exists()


def test_resumed_study_completes_and_reuses(spec, killed_in_eval, timings_before_resume, resumed):
    """A stage found done keeps the seconds (and peak memory) recorded by the run that made it; that is 0.0 (and no
    peak) when the run was killed between finishing the artifact and writing timings.json (the first kill can land
    there, so the cached bf16 quantize is compared with the killed runs' record, not required to be positive)."""
    _, run_dir = spec
    entries = assert_resumed(run_dir, killed_in_eval)
    before = timings_before_resume[("quantize", "tiny", "bf16")]
    assert entries[("quantize", "bf16")] == {
        "stage": "quantize",
        "model": "tiny",
        "recipe": "bf16",
        **before,
        "cached": True,
    }
    assert not entries[("eval", "w4a4_nvfp4")]["cached"] and entries[("eval", "w4a4_nvfp4")]["seconds"] > 0


def test_second_concurrent_run_refuses(spec, resumed):
    second, seconds = resumed
    _, run_dir = spec
    assert second.returncode != 0
    assert re.search(
        rf"run directory {re.escape(str(run_dir))} is in use by another quantkit process \(pid \d+", second.stderr
    ), second.stderr[-3000:]
    assert seconds < 120


def test_concurrent_zoo_builds_train_once(tmp_path):
    zoo_dir = tmp_path / "zoo"
    logs = [tmp_path / f"zoo{i}.log" for i in range(2)]
    with exclusive_lock(zoo_dir / ".ga-tiny.lock", "test"):  # both builds start while the checkpoint is busy
        procs = [_start(["zoo", "build", "ga", "--steps", "2", "--out", str(zoo_dir)], log) for log in logs]
        for proc, log in zip(procs, logs):
            _poll(lambda log=log: "waiting for zoo checkpoint" in log.read_text(), proc, log, "wait for the zoo lock")
    assert [proc.wait(timeout=1800) for proc in procs] == [0, 0], [log.read_text()[-3000:] for log in logs]
    trained = [bool(re.search(r"zoo ga-tiny: +\d+%", log.read_text())) for log in logs]
    assert sorted(trained) == [False, True], "exactly one build trains, the other reuses its checkpoint"
    out = zoo_dir / "ga-tiny"
    assert all(f"ga: {out}" in log.read_text() for log in logs)
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    AutoModelForCausalLM.from_pretrained(out)
    assert sorted(p.name for p in zoo_dir.iterdir()) == [
        ".ga-tiny.lock",
        ".tokenizer-2048.lock",
        "ga-tiny",
        "tokenizer-2048",
    ]
