"""Atomic artifacts and exclusive locks: a reader never sees half an artifact, two writers never share one.

- `write_text_atomic(path, text)`: a temporary file beside the target, then os.replace.
- `atomic_dir(path)`: a context manager yielding a fresh temporary directory beside `path`; on success it is
  renamed to `path`, on any failure (exception, Ctrl-C) it is removed. A SIGKILL leaves the temporary
  directory behind; its name carries the writer's pid (`.NAME.PID.XXXX.tmp`), and the next `atomic_dir` for
  the same target removes leftovers whose writer is dead.
- `check_output_dir(path, inputs=...)`: the checks a command runs on its output directory before any work.
- `exclusive_lock(path, what)`: an advisory `flock` on a lock file, released when the process dies (also by
  SIGKILL); `wait=False` refuses at once with `LockedError` naming the holder, `wait=True` blocks until free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from quantkit.errors import QuantkitError

logger = logging.getLogger(__name__)


class LockedError(QuantkitError, RuntimeError):
    """Another process holds the lock (the message names it and the lock file)."""


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically, creating parent directories; returns the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically (a temp file beside it, renamed into place), creating parent
    directories; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM
    return True


def _remove_dead_temps(path: Path) -> None:
    """Remove `.NAME.PID.XXXX.tmp` siblings of `path` left by writers that no longer run (e.g. SIGKILLed)."""
    own = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.\w+\.tmp")  # mkdtemp's XXXX: letters, digits, _
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        if (m := own.fullmatch(tmp.name)) and not _pid_alive(int(m.group(1))):
            shutil.rmtree(tmp, ignore_errors=True)


class OutputPathError(QuantkitError, ValueError):
    """An output directory that cannot be written where asked: a file is there, a parent is a file or not writable,
    or it is (or holds, or lies inside) an input of the same command."""


def check_output_dir(path: str | Path, *, overwrite: bool = False, inputs: tuple[str | Path, ...] = ()) -> Path:
    """`path` checked as the target of `atomic_dir`, before any work: not an existing file, not existing unless
    `overwrite`, not one of `inputs` nor inside one nor holding one, and creatable (its nearest existing ancestor is
    a writable directory). Returns `path`; OutputPathError (FileExistsError when it exists) names the problem."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"output {path} is a file, not a directory: choose another path")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    target = path.resolve()
    for source in inputs:
        source = Path(source).resolve()
        if target == source or source in target.parents or target in source.parents:
            relation = "is" if target == source else "lies inside" if source in target.parents else "holds"
            raise OutputPathError(f"output {path} {relation} the input {source}: write the result somewhere else")
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"cannot create {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot create {path}: {ancestor} is not writable")
    return path


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it becomes `path` (replacing it if `overwrite`).

    Raises FileExistsError (before any work) when `path` exists and `overwrite` is false."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (pass overwrite to replace it)")
    check_output_dir(path, overwrite=True)  # not a file; its parent creatable
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if path.exists():
            if not overwrite:
                raise FileExistsError(f"{path} appeared while it was being written (another writer?)")
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive_lock(path: str | Path, what: str, *, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file `path` (created if missing) for the duration of the block.

    `what` names the protected thing in the error ("run directory runs/default"). The lock file records the
    holder's pid; the lock itself is the kernel's (flock), so a killed holder never leaves a stale lock.
    With `wait`, a busy lock logs one warning naming the holder, then blocks until it is free."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            if not wait:
                raise LockedError(
                    f"{what} is in use by another quantkit process (pid {holder}; lock file {path}): "
                    "wait for it to finish, or use another directory"
                ) from None
            logger.warning(
                "waiting for %s: in use by another quantkit process (pid %s; lock file %s)", what, holder, path
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
