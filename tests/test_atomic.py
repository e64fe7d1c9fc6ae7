"""quantkit.atomic: atomic_dir cleans up on failure, overwrites on request, removes dead writers' leftovers and
keeps live writers' temps; exclusive_lock refuses (naming the holder) or waits, across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from quantkit.atomic import LockedError, atomic_dir, exclusive_lock, write_text_atomic


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_atomic_dir_renames_on_success_and_cleans_up_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ZeroDivisionError), atomic_dir(target) as tmp:
        (tmp / "half").write_text("x")
        raise ZeroDivisionError
    assert _siblings(target) == []
    with atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.") and not target.exists()
        (tmp / "a").write_text("1")
    assert _siblings(target) == ["out"] and (target / "a").read_text() == "1"
    assert target.stat().st_mode & 0o777 == 0o755


def test_atomic_dir_overwrite(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(FileExistsError, match="already exists"), atomic_dir(target):
        pytest.fail("the body must not run when the target exists")
    with pytest.raises(RuntimeError), atomic_dir(target, overwrite=True):  # a failed overwrite keeps the old one
        raise RuntimeError
    assert (target / "old").exists()
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new"] and _siblings(target) == ["out"]


def test_dead_writers_leftovers_removed_live_writers_kept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        leftovers = {
            name: tmp_path / f".out.{pid}.ab_c12.tmp" for name, pid in (("dead", dead.pid), ("live", live.pid))
        }
        other = tmp_path / f".out.x.{dead.pid}.abc.tmp"  # the temp of another target, "out.x"
        for path in (*leftovers.values(), other):
            path.mkdir()
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a").write_text("1")
        assert not leftovers["dead"].exists() and leftovers["live"].exists() and other.exists()
    finally:
        live.communicate()


def test_write_text_atomic(tmp_path):
    path = write_text_atomic(tmp_path / "sub" / "a.json", "{}\n")
    assert path.read_text() == "{}\n" and _siblings(path) == ["a.json"]


HOLDER = """
import sys
from quantkit.atomic import exclusive_lock
with exclusive_lock(sys.argv[1], "the thing"):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_lock_refuses_or_waits_across_processes(tmp_path):
    lock = tmp_path / "run" / ".lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with (
            pytest.raises(
                LockedError,
                match=rf"the thing is in use by another quantkit process \(pid {holder.pid}; lock file {lock}\)",
            ),
            exclusive_lock(lock, "the thing"),
        ):
            pass
        acquired = threading.Event()

        def waiter() -> None:
            with exclusive_lock(lock, "the thing", wait=True):
                acquired.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.5)
        assert not acquired.is_set(), "wait=True must block while another process holds the lock"
        holder.stdin.close()  # the holder exits and the kernel releases its lock
        assert acquired.wait(timeout=60)
        thread.join()
    finally:
        holder.kill()
        holder.wait()
    with exclusive_lock(lock, "the thing"):  # free again
        assert lock.read_text() == f"{os.getpid()}\n"
