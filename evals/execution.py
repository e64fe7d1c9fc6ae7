"""Run model-written programs for code benchmarks, only when the user opted in; pass@k.

Opt-in: `QUANTKIT_ALLOW_CODE_EXECUTION=1` in the environment (set by `quantkit eval --allow-code-execution`
and by `suite.evaluate(..., allow_code=True)`); without it `run_program` raises `CodeExecutionRefused`.
Our code tasks are also marked `unsafe_code: true`, so lm-eval refuses them without
`confirm_run_unsafe_code`.

Each program runs in a fresh subprocess (`python -I`, or the language's toolchain for MultiPL-E), in a
temporary working directory, with a wall-clock timeout and a 4 GiB address-space limit. That is
isolation from the evaluating process, not a security sandbox: run untrusted models' code in a container.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ALLOW_ENV = "QUANTKIT_ALLOW_CODE_EXECUTION"
DEFAULT_TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 4 << 30

# MultiPL-E languages we can run: file suffix and the commands (`{src}`, `{exe}` substituted).
TOOLCHAINS: dict[str, tuple[str, list[list[str]]]] = {
    "py": (".py", [[sys.executable, "-I", "{src}"]]),
    "js": (".js", [["node", "{src}"]]),
    "sh": (".sh", [["bash", "{src}"]]),
    "cpp": (".cpp", [["g++", "-std=c++17", "-O0", "-o", "{exe}", "{src}"], ["{exe}"]]),
    "rs": (".rs", [["rustc", "-O", "-o", "{exe}", "{src}"], ["{exe}"]]),
}


class CodeExecutionRefused(RuntimeError):
    """Code execution was not enabled by the user."""


def code_execution_allowed() -> bool:
    return os.environ.get(ALLOW_ENV) == "1"


def _limit_memory() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def run_program(source: str, language: str = "py", timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when `source` compiles and exits with status 0 within `timeout` seconds (per step)."""
    if not code_execution_allowed():
        raise CodeExecutionRefused(
            f"code benchmarks execute model output: opt in with --allow-code-execution (or {ALLOW_ENV}=1)"
        )
    if language not in TOOLCHAINS:
        raise ValueError(f"no toolchain for language {language!r}; known: {sorted(TOOLCHAINS)}")
    suffix, steps = TOOLCHAINS[language]
    if shutil.which(steps[0][0]) is None:
        raise FileNotFoundError(f"{language} programs need {steps[0][0]!r} on PATH")
    with tempfile.TemporaryDirectory(prefix="quantkit-exec-") as tmp:
        src, exe = Path(tmp) / f"program{suffix}", Path(tmp) / "program"
        src.write_text(source, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               # rustup's rustc proxy finds its toolchains through these (default: under the real $HOME)
               "RUSTUP_HOME": os.environ.get("RUSTUP_HOME", str(Path.home() / ".rustup")),
               "CARGO_HOME": os.environ.get("CARGO_HOME", str(Path.home() / ".cargo"))}
        for step in steps:
            argv = [arg.format(src=src, exe=exe) for arg in step]
            try:
                done = subprocess.run(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                      timeout=timeout, preexec_fn=_limit_memory if language == "py" else None)
            except subprocess.TimeoutExpired:
                return False
            if done.returncode != 0:
                return False
    return True


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass (Chen et al. 2021, eq. 1): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
