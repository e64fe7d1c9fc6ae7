"""Hostile programs against `run_program`'s limits: each limit the sandbox claims on this machine is proven here.

Checks that depend on what the machine allows (pids cgroup, namespaces) skip, naming why, only when
`sandbox_report()` says that mechanism is unavailable.
"""

import resource
import shutil
import socket
import sys
import textwrap
import time
import uuid
from contextlib import suppress
from pathlib import Path

import pytest

from quantkit.evals import execution
from quantkit.evals.execution import ALLOW_ENV, RUN_LIMITS, run_program, sandbox_report

TIMEOUT = 2.0
MARGIN = 2.0  # seconds of slack over the timeout on a busy 2-core machine


@pytest.fixture(autouse=True)
def allow_code(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")


def program(source: str) -> str:
    return textwrap.dedent(source).strip() + "\n"


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        with suppress(OSError):
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def wait_gone(marker: str, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def timed_run(source: str, **kwargs) -> tuple[bool, float]:
    start = time.monotonic()
    passed = run_program(source, **kwargs)
    return passed, time.monotonic() - start


def test_report_names_every_mechanism():
    report = sandbox_report()
    assert set(report) == {"user", "rlimits", "process_count", "leftover_processes", "network", "filesystem"}
    print(report)  # shown with -s: what this machine enforces


def test_well_behaved_program_passes(tmp_path):
    source = program("""
        import os, subprocess, sys
        data = bytearray(256 << 20)  # 256 MiB
        with open("out.bin", "wb") as f:
            f.write(bytes(1 << 20))
        assert os.path.getsize("out.bin") == 1 << 20
        assert all(subprocess.run([sys.executable, "-c", "pass"]).returncode == 0 for _ in range(4))
        assert sum(range(10**6)) > 0
    """)
    assert run_program(source, timeout=10)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_compiled_program_passes_under_compile_limits():
    assert run_program("#include <vector>\nint main() { std::vector<int> v(1 << 20); return v[7]; }", "cpp", timeout=30)


@pytest.mark.parametrize("escape", [False, True], ids=["fork-bomb", "fork-bomb-setsid"])
def test_fork_bomb_is_contained_and_leaves_nothing(escape):
    if escape and "cgroup" not in sandbox_report()["process_count"]:
        pytest.skip(
            "no writable pids cgroup here: processes that call setsid() outlive the run "
            "(until RLIMIT_CPU), see test_rlimit_cpu_kills_an_escaped_spinner"
        )
    marker = f"bomb-{uuid.uuid4().hex}"
    bomb = program(f"""
        import os
        while True:
            try:
                if os.fork() == 0 and {escape}:
                    os.setsid()  # a new session: out of reach of the process-group kill
            except OSError:
                pass
    """)
    source = program(f"""
        import os, sys
        os.execv(sys.executable, [sys.executable, "-c", {bomb!r}, {marker!r}])
    """)
    passed, elapsed = timed_run(source, timeout=TIMEOUT)
    assert not passed and elapsed < TIMEOUT + MARGIN
    assert wait_gone(marker, within=2.0) == []


def test_process_count_is_limited():
    if sandbox_report()["process_count"].startswith("not enforced"):
        pytest.skip(f"process count not enforceable here: {sandbox_report()['process_count']}")
    spawn = """
        import subprocess
        children = [subprocess.Popen(["sleep", "5"]) for _ in range({n})]
        for child in children:
            child.kill()
    """
    assert run_program(program(spawn.format(n=8)), timeout=10)
    assert not run_program(program(spawn.format(n=RUN_LIMITS.processes + 8)), timeout=10)


def test_memory_hog_fails_fast_and_leaves_the_caller_alone():
    before = resource.getrlimit(resource.RLIMIT_AS)
    passed, elapsed = timed_run("hog = bytearray(8 << 30)\n", timeout=TIMEOUT)
    assert not passed and elapsed < TIMEOUT
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(8 << 20)) == 8 << 20


@pytest.mark.parametrize(
    "source",
    [
        "while True:\n    pass\n",
        program("""
        import signal
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            pass
    """),
    ],
    ids=["loop", "loop-ignoring-signals"],
)
def test_infinite_loop_is_stopped_at_the_timeout(source):
    passed, elapsed = timed_run(source, timeout=TIMEOUT)
    assert not passed and TIMEOUT <= elapsed < TIMEOUT + MARGIN


def test_rlimit_cpu_kills_an_escaped_spinner(monkeypatch):
    """Without the pids cgroup a setsid() child escapes the group kill; RLIMIT_CPU still ends it.

    The program returns only once the spinner has written a byte from its own Python code, so the spinner is past
    its exec and startup when the run ends. Before, a CI run (2026-11-29, loaded) found no spinner 0.38 s into the
    test; the likely cause, not shown: Popen returns once the exec has begun (its close-on-exec pipe closes early in
    execve), and /proc/PID/cmdline is empty until the new program's arguments are set up. The spinner needs
    `hard_limit` CPU seconds to be killed; `3 * hard_limit` wall seconds leave it a third of a core, what it gets
    beside five other busy processes on CI's 2 cores."""
    monkeypatch.setattr(execution, "_pids_cgroup", lambda: None)
    marker = f"spin-{uuid.uuid4().hex}"
    spinner = (
        "import signal, sys\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nsys.stdout.write('x')\n"
        "sys.stdout.flush()\nwhile True:\n    pass\n"
    )
    source = program(f"""
        import subprocess, sys
        spinner = subprocess.Popen(
            [sys.executable, "-c", {spinner!r}, {marker!r}], start_new_session=True, stdout=subprocess.PIPE
        )
        assert spinner.stdout.read(1) == b"x"
    """)
    assert run_program(source, timeout=2.0)
    assert processes_with(marker), "the spinner should have outlived the run"
    hard_limit = 4  # CPU seconds for timeout=2: SIGXCPU (ignored) at ceil(2) + 1 = 3, SIGKILL at 4
    assert wait_gone(marker, within=3 * hard_limit) == []


def test_no_writes_outside_the_working_directory(tmp_path):
    if sandbox_report()["filesystem"].startswith("NOT"):
        pytest.skip(f"no mount namespace here: {sandbox_report()['filesystem']}")
    targets = [tmp_path / "outside.txt", Path("/tmp") / f"quantkit-escape-{uuid.uuid4().hex}"]
    source = program(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, "w").write("escaped")
            except OSError:
                pass
        open("inside.txt", "w").write("fine")
    """)
    assert run_program(source, timeout=TIMEOUT)  # it ran, and could write in its own directory
    assert not any(t.exists() for t in targets)


def test_file_size_is_limited():
    write = """
        chunk = bytes(1 << 20)
        with open("big.bin", "wb") as f:
            for _ in range({mib}):
                f.write(chunk)
    """
    assert run_program(program(write.format(mib=4)), timeout=10)
    passed, elapsed = timed_run(program(write.format(mib=1024)), timeout=10)  # 1 GiB
    assert not passed and elapsed < 5


def test_no_network():
    if sandbox_report()["network"].startswith("NOT"):
        pytest.skip(f"no network namespace here: {sandbox_report()['network']}")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        source = program(f"""
            import socket, sys
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
            except OSError:
                sys.exit(0)
            sys.exit(1)
        """)
        assert run_program(source, timeout=TIMEOUT)  # the connection failed
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()


# One program per MultiPL-E language whose assertion style needs the toolchain's flags: `{check}` is a true or
# a false comparison, so the program compiles either way and only the run step can tell them apart (Java's
# `assert` needs -ea; mono exits 0 after a failed Debug.Assert, so its stderr marker decides).
RUNTIME_ASSERTIONS = {
    "java": "class Problem {{\n    public static void main(String[] args) {{\n    assert({check});\n    }}\n}}\n",
    "cs": "using System.Diagnostics;\nclass Problem {{\n    public static void Main(string[] args) {{\n"
    "    Debug.Assert({check});\n    }}\n}}\n",
    "php": '<?php\nif (!({check})) {{ throw new Exception("Test failed!"); }}\n',
    "ts": "declare var require: any;\nconst assert = require('node:assert');\nconst n: number = "
    "1;\nassert.ok({check});\n",
}


@pytest.mark.parametrize("language", sorted(RUNTIME_ASSERTIONS))
def test_failed_runtime_assertion_fails_the_program(language):
    if missing := execution.missing_tools(language):
        pytest.skip(f"{language} needs {missing}, system tools (`make setup-toolchains`) absent here")
    source = RUNTIME_ASSERTIONS[language]
    assert run_program(source.format(check="1 + 1 == 2"), language, timeout=30)
    assert not run_program(source.format(check="1 + 1 == 3"), language, timeout=30)


def test_a_step_that_cannot_start_is_an_error_not_a_failed_program(tmp_path):
    """`sandbox_exec.py` reports a failure before the exec (a missing command, a confinement it cannot apply)
    through its error pipe: the caller raises SandboxStartError naming it, so a broken sandbox cannot score
    every program as failed."""
    env = {"PATH": "/usr/bin:/bin"}
    with pytest.raises(execution.SandboxStartError, match=r"no-such-command-quantkit.*FileNotFoundError"):
        execution._run_step(["no-such-command-quantkit"], str(tmp_path), env, RUN_LIMITS, TIMEOUT)
    with pytest.raises(execution.SandboxStartError, match=r"cgroup\.procs"):
        execution._start(["true"], str(tmp_path), env, None, cgroup=tmp_path / "no-such-cgroup", isolate=False).wait()


def test_a_step_exits_with_the_programs_own_status(tmp_path):
    """The launcher execs the program in its own process (same pid, new session): its exit status and its
    process group are the program's."""
    env = {"PATH": "/usr/bin:/bin"}
    script = "import os, sys; sys.exit(0 if os.getsid(0) == os.getpid() else 3)"
    proc = execution._start([sys.executable, "-I", "-c", script], str(tmp_path), env, None, cgroup=None, isolate=False)
    assert proc.wait(timeout=30) == 0
    proc = execution._start(["sh", "-c", "exit 127"], str(tmp_path), env, None, cgroup=None, isolate=False)
    assert proc.wait(timeout=30) == 127  # the launcher's own start-failure status, but the program's: no error
