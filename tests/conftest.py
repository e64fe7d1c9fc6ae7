"""Shared fixtures: a tiny quantkit checkpoint built locally (no hub), offline settings for vLLM/HF.

TRITON_INTERPRET=1 is set before anything imports triton, so kernels run on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def _cores_of_this_worker() -> None:
    """Under pytest-xdist (`make test`: TEST_WORKERS workers) on a machine with at least one core per worker, each
    worker's OpenMP threads get cores of their own: its vLLM engines bind to them (VLLM_CPU_OMP_THREADS_BIND, which
    `offline_environment` leaves as set) and its torch ops and the processes it starts use that many threads
    (OMP_NUM_THREADS, set before torch is imported). Two engines each bound to every core spin at each other's
    OpenMP barriers: two concurrent SmolLM2 engines on 2 cores took 158 s each to generate what they generate in
    50 s on a core each (2026-11-28, docs/results/ci-timings.md). The process affinity stays whole, so a
    tensor-parallel test still binds one rank per core. Values set by the user win."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker or count < 2 or len(cores) < count:
        return
    mine = cores[int(worker.removeprefix("gw")) % count :: count]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))


_cores_of_this_worker()

import pytest  # noqa: E402  (after the environment above)

from quantkit.data import STREAM_CACHE_ENV  # noqa: E402
from quantkit.serve.engine import offline_environment  # noqa: E402

# The CPU emulation's activation fake-quant stays eager in tests unless a test asks for the compiled one
# (`compiled_emulation`): on the tests' tiny models each inductor compile (~2.3 s, one per scheme and input shape)
# costs far more than the few small calls it would speed up (two vLLM parity tests: 13 compiles, 28 of their 97 s,
# measured 2026-11-28). The numbers are the same bit for bit (tests/test_emulated_activation.py).
COMPILE_ENV = "QUANTKIT_CPU_COMPILE"  # quantkit.serve.method_parts.COMPILE_ENV (not imported here: it imports vLLM)
os.environ.setdefault(COMPILE_ENV, "off")


@pytest.fixture(scope="session", autouse=True)
def _offline(tmp_path_factory):
    """Offline settings, with vLLM's and inductor's caches in one directory per pytest run: under pytest-xdist the
    workers share it (the parent of each worker's base temp), so vLLM inspects each model architecture in a
    subprocess (~20 s: it imports vLLM again) once per run rather than once per worker; so are the token streams
    (`quantkit.data.token_stream`: the training speeches take ~10 s to encode with a tiny tokenizer)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache_dir = root / "caches"
    cache_dir.mkdir(exist_ok=True)
    offline_environment(cache_dir=cache_dir)
    os.environ.setdefault(STREAM_CACHE_ENV, str(cache_dir / "token-streams"))  # not the user's ~/.cache


@pytest.fixture
def compiled_emulation(monkeypatch):
    """The emulation's activation fake-quant compiled (`quantkit.serve.method_parts`), as outside the tests."""
    monkeypatch.delenv(COMPILE_ENV, raising=False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer quantkit model (float32) with a BPE tokenizer trained on stdlib docstrings."""
    from quantkit.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def pytest_report_header(config: pytest.Config) -> str:
    """Which CPU kernels this run uses: the numerics of the `cpu_isa` tests depend on it (README, "Tests")."""
    import torch

    forced = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    return f"CPU kernels: ATen {torch.backends.cpu.get_cpu_capability()}" + (f" (forced: {forced})" if forced else "")


# The longest test files (measured: docs/results/ci-timings.md), started first so that under `make test`'s two
# xdist workers (--dist loadfile --no-loadscope-reorder hands out files in collection order) none of them is left
# running alone at the end.
LONGEST_FIRST = (
    "test_trained_gate.py",
    "test_trained_models.py",
    "test_serve_quantized.py",
    "test_ray_executor.py",
    "test_hybrid_serve_quantized.py",
    "test_evals_scorers.py",
    "test_benchmarks.py",
    "test_crash_safety.py",
    "test_streaming_quantize.py",
    "test_variants_vllm.py",
    "test_zoo.py",
    "test_hybrid_family.py",
    "test_pipeline.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in that order, the rest after in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum setup + call + teardown wall seconds per test file (module fixtures land on the file's first test)."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    log = os.environ.get("QUANTKIT_TEST_SECONDS_LOG")
    if log and "PYTEST_XDIST_WORKER" not in os.environ:  # one line a phase as it ends (the controller's copy)
        with open(log, "a") as f:
            f.write(f"{report.duration:9.2f} {report.when:8s} {report.outcome:7s} {report.nodeid}\n")


def pytest_terminal_summary(terminalreporter) -> None:
    """The 15 slowest test files, so a CI log shows where its time goes."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("slowest 15 test files (setup + call + teardown)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} s  all {len(_FILE_SECONDS)} files")
