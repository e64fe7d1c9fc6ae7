"""The first process of a sandboxed step (`execution._run_step`): confine itself, then exec the step's command.

Run as a script, `python -I -S sandbox_exec.py SPEC ERROR_FD`, never imported by quantkit: it uses only the
standard library, so it starts in ~20 ms whatever the caller has loaded. SPEC is JSON:
{"argv": [...], "workdir": str, "cgroup": str | null, "isolate": bool, "rlimits": [[resource, soft, hard], ...]}.
In order: join `cgroup` (its pids.max limits the step), `isolate` (new user, mount and network namespaces, every
mount read-only but `workdir`), set `rlimits`, exec `argv` (PATH from this process's environment, which the
caller set). ERROR_FD is the write end of a pipe, closed by the exec: a failure before the program starts is
written there as one line ("<exception>: <message>") and the process exits 127, so the caller can tell a
sandbox that could not start from a program that failed.

Why a process of its own: the caller's confinement used to run in the child of a fork of the caller
(`subprocess.Popen(preexec_fn=...)`), and forking the evaluation process with a vLLM engine loaded cost
~0.28 s a step (the fork and Python's at-fork handlers; 2-core EPYC, 2026-11-29), 6-15x the program itself.
Without a `preexec_fn` the caller starts this script by vfork/posix_spawn (~4 ms).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

# Linux constants (<sched.h>, <sys/mount.h>, <linux/mount.h>); mount_setattr is syscall 442 on every
# architecture but alpha.
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
START_FAILED = 127  # this script's exit status when the step's program never started


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def isolate(workdir: str) -> None:
    """New user, mount and network namespaces; all mounts read-only but `workdir`; the cwd is `workdir`."""
    libc = ctypes.CDLL(None, use_errno=True)
    path = os.fsencode(workdir)
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET))
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None))  # nothing propagates to the host
    _check(libc.mount(path, path, None, _MS_BIND, None))  # its own mount, to keep writable
    read_only, writable = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY), _MountAttr(attr_clr=_MOUNT_ATTR_RDONLY)
    size = ctypes.sizeof(_MountAttr)
    _check(libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, ctypes.byref(read_only), size))
    _check(libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path, 0, ctypes.byref(writable), size))
    os.chdir(workdir)  # the cwd set before the bind mount is the read-only directory beneath it


def confine_and_exec(spec: dict) -> None:
    """Everything SPEC asks, then exec its argv (does not return unless something failed)."""
    if spec["cgroup"]:
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    if spec["isolate"]:
        isolate(spec["workdir"])
    # after unshare, which creates the user namespace under the caller's own limits
    for rlimit, soft, hard in spec["rlimits"]:
        resource.setrlimit(rlimit, (soft, hard))
    os.execvp(spec["argv"][0], spec["argv"])


def main() -> None:
    spec, error_fd = json.loads(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(error_fd, False)  # closed by the exec: the caller then reads EOF, nothing written
    try:
        confine_and_exec(spec)
    except BaseException as exc:
        os.write(error_fd, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:4000])
        os._exit(START_FAILED)


if __name__ == "__main__":
    main()
