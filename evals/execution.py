"""Run model-written programs for code benchmarks, only when the user opted in; pass@k.

Opt-in: `QUANTKIT_ALLOW_CODE_EXECUTION=1` in the environment (set by `quantkit eval --allow-code-execution`
and by `suite.evaluate(..., allow_code=True)`); without it `run_program` raises `CodeExecutionRefused`.
Our code tasks are also marked `unsafe_code: true`, so lm-eval refuses them without
`confirm_run_unsafe_code`.

Each step (compile, then run; `python -I` is a single run step) is a fresh subprocess in a new session, in a
fresh temporary working directory (also its HOME and TMPDIR), stdin/stdout/stderr on /dev/null, started
through `sandbox_exec.py`, which confines itself and execs the step (the caller is never forked: a fork of an
evaluation process with vLLM loaded cost ~0.28 s a step), with:

- always: a wall-clock timeout (the run step: `timeout`; a compile step: at least `COMPILE_TIMEOUT_S`), after
  which (and after every step) the whole process group gets SIGKILL;
  rlimits on address space, file size and CPU seconds (`ceil(timeout) + 1`, SIGKILL one second later),
  no core dumps; `COMPILE_LIMITS` and `RUN_LIMITS` give the values (compilers need more room);
- process count: a fresh `pids` cgroup per step with `pids.max` (threads count too) where our cgroup is
  writable (root), whose leftovers are then all killed, even those that left the process group;
  otherwise RLIMIT_NPROC, which Linux enforces for non-root users only;
- where the kernel allows it (Linux >= 5.12 with user namespaces): new user, mount and network namespaces,
  so no network at all (only an unconfigured loopback), every mount read-only except the working
  directory, and no capabilities once the program starts (its uid is unmapped), so it cannot undo that.

`sandbox_report()` says which of these work on this machine (probed once, logged on first use).
Not enforced: reading files the user may read, seeing and signalling the user's other processes (as root:
all root processes), CPU use by many threads in parallel (only their sum is limited), lingering processes
that left the process group when no pids cgroup is available. This is defence in depth, not a security
boundary: run untrusted models' code in a container or VM.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)

ALLOW_ENV = "QUANTKIT_ALLOW_CODE_EXECUTION"
DEFAULT_TIMEOUT_S = 10.0
# A compile step's wall limit: compilers are trusted programs that always finish, and a loaded 2-core machine
# stretches them (tsc took 10.2 s with two other jobs on the cores, 2026-11-28): the program's own run keeps `timeout`.
COMPILE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Limits:
    memory_bytes: int  # RLIMIT_AS
    file_bytes: int  # RLIMIT_FSIZE: largest file it may write
    processes: int  # pids.max of its cgroup, else RLIMIT_NPROC


COMPILE_LIMITS = Limits(memory_bytes=8 << 30, file_bytes=256 << 20, processes=256)
RUN_LIMITS = Limits(memory_bytes=4 << 30, file_bytes=16 << 20, processes=64)

# Debian's libjavatuples-java: MultiPL-E's Java programs all `import org.javatuples.*;`.
JAVATUPLES_JAR = "/usr/share/java/javatuples.jar"


@dataclass(frozen=True)
class Toolchain:
    """How MultiPL-E's evaluator runs one language (its `evaluation/src/eval_<lang>.py`), in our sandbox.

    `steps`: commands with `{src}` (the program file), `{exe}` (a path to build to) and `{dir}` (the working
    directory) substituted; the last runs the program, those before it compile it. `files`: files the steps
    need besides their commands. `env`: extra environment for every step. `failure_markers`: text on the run
    step's stderr that fails the program although it exited 0 (mono's failed `Debug.Assert` does).
    """

    suffix: str
    steps: tuple[tuple[str, ...], ...]
    files: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    failure_markers: tuple[str, ...] = ()


# MultiPL-E languages we can run (Makefile `setup-toolchains` installs the system packages of the last four).
TOOLCHAINS: dict[str, Toolchain] = {
    "py": Toolchain(".py", ((sys.executable, "-I", "{src}"),)),
    "js": Toolchain(".js", (("node", "{src}"),)),
    "sh": Toolchain(".sh", (("bash", "{src}"),)),
    "cpp": Toolchain(".cpp", (("g++", "-std=c++17", "-O0", "-o", "{exe}", "{src}"), ("{exe}",))),
    "rs": Toolchain(".rs", (("rustc", "-O", "-o", "{exe}", "{src}"), ("{exe}",))),
    # javac/java are JVMs: their heaps are capped so that they start under the address-space rlimit
    # (the default reserves a quarter of RAM); -ea turns the tests' `assert`s on.
    "java": Toolchain(
        ".java",
        (
            ("javac", "-J-Xmx1g", "-encoding", "UTF8", "-cp", JAVATUPLES_JAR, "-d", "{dir}", "{src}"),
            (
                "java",
                "-Xmx1g",
                "-Xss8m",
                "-XX:ReservedCodeCacheSize=64m",
                "-ea",
                "-cp",
                "{dir}:" + JAVATUPLES_JAR,
                "Problem",
            ),
        ),
        files=(JAVATUPLES_JAR,),
    ),
    "ts": Toolchain(".ts", (("tsc", "--target", "esnext", "{src}"), ("node", "{dir}/program.js"))),
    "php": Toolchain(".php", (("php", "{src}"),)),
    # mcs: mono's C# compiler (MultiPL-E uses csc, the same language with DEBUG defined for Debug.Assert).
    "cs": Toolchain(
        ".cs",
        (("mcs", "-d:DEBUG", "-r:System.Numerics.dll", "-out:{exe}", "{src}"), ("mono", "{exe}")),
        env=(("MONO_TRACE_LISTENER", "Console.Error"),),
        failure_markers=("System.Diagnostics.DefaultTraceListener.Fail", "Unhandled Exception"),
    ),
}


class CodeExecutionRefused(QuantkitError, RuntimeError):
    """Code execution was not enabled by the user."""


def code_execution_allowed() -> bool:
    """True when the user opted in to running model-written code: $QUANTKIT_ALLOW_CODE_EXECUTION is "1"."""
    return os.environ.get(ALLOW_ENV) == "1"


_LAUNCHER = Path(__file__).with_name("sandbox_exec.py")


class SandboxStartError(QuantkitError, RuntimeError):
    """A sandboxed step's program could not be started (the confinement failed, or its command is missing)."""


def _start(
    argv: list[str], workdir: str, env: dict[str, str], stderr, *, cgroup: Path | None, isolate: bool, rlimits=()
) -> subprocess.Popen:
    """Start `argv` in a new session through `sandbox_exec.py` (which joins `cgroup`, isolates, sets `rlimits`
    and execs it); SandboxStartError when the program never started."""
    spec = {
        "argv": argv,
        "workdir": workdir,
        "cgroup": str(cgroup) if cgroup else None,
        "isolate": isolate,
        "rlimits": [list(r) for r in rlimits],
    }
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as errors:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_LAUNCHER), json.dumps(spec), str(write_fd)],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
                pass_fds=(write_fd,),
            )
        finally:
            os.close(write_fd)  # ours; the launcher's copy closes at its exec (or exit)
        failure = errors.read().decode("utf-8", "replace")  # EOF at the exec, or the launcher's error
    if failure:
        proc.wait()
        raise SandboxStartError(f"sandboxed step {argv[0]!r} did not start: {failure}")
    return proc


def _pids_cgroup_parent() -> Path | None:
    """Our own cgroup in the `pids` hierarchy (v1) or in cgroup v2 when it delegates `pids`, else None."""
    with suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                return Path("/sys/fs/cgroup/pids", path.lstrip("/"))
            v2 = Path("/sys/fs/cgroup", path.lstrip("/"))
            if controllers == "" and "pids" in (v2 / "cgroup.subtree_control").read_text().split():
                return v2
    return None


def _new_pids_cgroup(parent: Path, max_processes: int) -> Path:
    cgroup = Path(tempfile.mkdtemp(prefix="quantkit-exec-", dir=parent))
    (cgroup / "pids.max").write_text(str(max_processes))
    return cgroup


def _kill_and_remove(cgroup: Path) -> None:
    """SIGKILL everything left in `cgroup` (processes forked meanwhile included), then remove it."""
    while pids := (cgroup / "cgroup.procs").read_text().split():
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.01)
    cgroup.rmdir()


def _isolation_works() -> bool:
    """True when a program can start in the namespaces of `sandbox_exec.isolate` and write into its directory."""
    with tempfile.TemporaryDirectory(prefix="quantkit-probe-") as tmp:
        argv = [sys.executable, "-I", "-c", "open('probe', 'w').close()"]
        try:
            proc = _start(argv, tmp, dict(os.environ), subprocess.DEVNULL, cgroup=None, isolate=True)
            return proc.wait(timeout=30) == 0
        except (SandboxStartError, subprocess.SubprocessError):
            return False


@functools.cache
def _pids_cgroup() -> Path | None:
    """The parent of our per-step pids cgroups, when we may create them."""
    parent = _pids_cgroup_parent()
    if parent is None:
        return None
    try:
        _new_pids_cgroup(parent, 1).rmdir()
    except OSError:
        return None
    return parent


@functools.cache
def _namespaces_work() -> bool:
    return _isolation_works()


def sandbox_report() -> dict[str, str]:
    """What `run_program` enforces on this machine, beyond the timeout and rlimits (probed once)."""
    cgroup, root = _pids_cgroup(), os.geteuid() == 0
    isolated = _namespaces_work()
    return {
        "user": "root" if root else f"uid {os.geteuid()}",
        "rlimits": "address space, CPU seconds, file size; no core dumps",
        "process_count": f"pids cgroup under {cgroup}"
        if cgroup
        else "not enforced (root bypasses RLIMIT_NPROC)"
        if root
        else "RLIMIT_NPROC",
        "leftover_processes": "killed (pids cgroup)" if cgroup else "process group killed; setsid() escapes",
        "network": "none (network namespace)" if isolated else "NOT isolated",
        "filesystem": "read-only outside the working directory (mount namespace)"
        if isolated
        else "NOT isolated (user's permissions)",
    }


def _rlimits(limits: Limits, cpu_seconds: int) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) for a step under `limits` and `cpu_seconds` of CPU."""
    return [
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        (resource.RLIMIT_NPROC, limits.processes, limits.processes),
        (resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),  # SIGXCPU, SIGKILL
        (resource.RLIMIT_CORE, 0, 0),
    ]


def _exited_unreaped(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` s for `pid` to exit, leaving it a zombie: its process group id stays reserved."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _run_step(
    argv: list[str],
    workdir: str,
    env: dict[str, str],
    limits: Limits,
    timeout: float,
    failure_markers: tuple[str, ...] = (),
) -> bool:
    """True when `argv` exits with status 0 within `timeout` and its stderr shows none of `failure_markers`;
    then its process group (and cgroup) is killed."""
    parent = _pids_cgroup()
    cgroup = _new_pids_cgroup(parent, limits.processes) if parent else None
    # an unlinked file of ours (the program cannot reach it by name); read only when markers are given
    with tempfile.TemporaryFile() if failure_markers else open(os.devnull, "wb") as stderr:
        try:
            proc = _start(
                argv,
                workdir,
                env,
                stderr,
                cgroup=cgroup,
                isolate=_namespaces_work(),
                rlimits=_rlimits(limits, math.ceil(timeout) + 1),
            )
            finished = _exited_unreaped(proc.pid, timeout)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            passed = proc.wait() == 0 and finished
        finally:
            if cgroup:
                _kill_and_remove(cgroup)
        if passed and failure_markers:
            stderr.seek(0)
            text = stderr.read(limits.file_bytes).decode("utf-8", errors="replace")
            passed = not any(marker in text for marker in failure_markers)
    return passed


def missing_tools(language: str) -> list[str]:
    """The commands (not on PATH) and files (absent) that `language`'s toolchain needs and this machine lacks."""
    toolchain = TOOLCHAINS[language]
    commands = dict.fromkeys(step[0] for step in toolchain.steps if "{" not in step[0])
    return [c for c in commands if shutil.which(c) is None] + [f for f in toolchain.files if not Path(f).is_file()]


_EXECUTION_SECONDS = [0.0]  # wall seconds this process has spent in run_program's sandboxed steps


def execution_seconds() -> float:
    """Wall seconds this process has spent running programs (`run_program`), for the eval's time breakdown."""
    return _EXECUTION_SECONDS[0]


def run_program(source: str, language: str = "py", timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when `source` compiles and runs successfully (exit status 0, no failure marker) within `timeout`
    seconds per step, by the language's `TOOLCHAINS` entry."""
    started = time.perf_counter()
    try:
        return _run_program(source, language, timeout)
    finally:
        _EXECUTION_SECONDS[0] += time.perf_counter() - started


def _run_program(source: str, language: str, timeout: float) -> bool:
    if not code_execution_allowed():
        raise CodeExecutionRefused(
            f"code benchmarks execute model output: opt in with --allow-code-execution (or {ALLOW_ENV}=1)"
        )
    if language not in TOOLCHAINS:
        raise ValueError(f"no toolchain for language {language!r}; known: {sorted(TOOLCHAINS)}")
    toolchain = TOOLCHAINS[language]
    if missing := missing_tools(language):
        raise FileNotFoundError(
            f"{language} programs need {', '.join(map(repr, missing))} (commands on PATH, "
            f"files): `make setup-toolchains` installs them on Debian"
        )
    _log_report_once()
    with tempfile.TemporaryDirectory(prefix="quantkit-exec-") as tmp:
        src, exe = Path(tmp) / f"program{toolchain.suffix}", Path(tmp) / "program"
        src.write_text(source, encoding="utf-8")
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": tmp,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            # rustup's rustc proxy finds its toolchains through these (default: under the real $HOME)
            "RUSTUP_HOME": os.environ.get("RUSTUP_HOME", str(Path.home() / ".rustup")),
            "CARGO_HOME": os.environ.get("CARGO_HOME", str(Path.home() / ".cargo")),
            **dict(toolchain.env),
        }
        for i, step in enumerate(toolchain.steps):
            last = i == len(toolchain.steps) - 1
            argv = [arg.format(src=src, exe=exe, dir=tmp) for arg in step]
            if not _run_step(
                argv,
                tmp,
                env,
                RUN_LIMITS if last else COMPILE_LIMITS,
                timeout if last else max(timeout, COMPILE_TIMEOUT_S),
                toolchain.failure_markers if last else (),
            ):
                return False
    return True


@functools.cache
def _log_report_once() -> None:
    log.info("code execution sandbox: %s", sandbox_report())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass (Chen et al. 2021, eq. 1): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
