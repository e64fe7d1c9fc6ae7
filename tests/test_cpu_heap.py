"""quantkit.serve.cpu.heap: after install(), a block above glibc's largest mmap threshold (32 MiB) comes from the
heap and, freed, stays in it (the heap is not trimmed) for the next one until release() hands it back; without it (or
with
QUANTKIT_CPU_HEAP=off) glibc mmaps it. Each case runs in a fresh interpreter, so that this test process's own malloc
settings do not matter; glibc's mallinfo2() counts the bytes in mmapped blocks (hblkhd) and in the heap (arena):
exact counts, no timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from quantkit.serve.cpu import heap as cpu_heap

PROBE = """
import ctypes, json, sys
import torch
from quantkit.serve.cpu import heap as cpu_heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
installed = cpu_heap.install() if sys.argv[1] == "install" else False
again = cpu_heap.install() if installed else False
before = mallinfo2().hblkhd
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, twice glibc's largest mmap threshold
mmapped = mallinfo2().hblkhd - before
arena = mallinfo2().arena
del x
kept = mallinfo2().arena >= arena  # not trimmed: the freed block stays in the heap for the next tensor
print(json.dumps(dict(installed=installed, again=again, mmapped=mmapped, kept=kept)))
"""

RELEASE_PROBE = """
import json, os, sys
import torch
from quantkit.serve.cpu import heap as cpu_heap

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

installed = cpu_heap.install() if sys.argv[1] == "install" else False
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page written (resident)
del x
kept = rss()
released = cpu_heap.release()
print(json.dumps(dict(installed=installed, released=released, freed=kept - rss())))
"""

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_heap acts only on machines without CUDA")


def probe(mode: str, script: str = PROBE, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", script, mode], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_large_blocks_come_from_the_heap_and_are_reused():
    assert cpu_heap.wanted()  # this project's machines: Linux, glibc, no CUDA
    result = probe("install")
    assert result == dict(installed=True, again=True, mmapped=0, kept=True)


def test_without_install_or_switched_off_glibc_mmaps_large_blocks():
    assert probe("default")["mmapped"] >= 64 << 20
    off = probe("install", **{cpu_heap.SWITCH_ENV: "off"})
    assert not off["installed"] and off["mmapped"] >= 64 << 20


def test_not_wanted_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cpu_heap.wanted()


def test_release_hands_the_kept_heap_back():
    """After install(), a freed 64 MiB tensor stays resident in the heap; release() returns it to the kernel. The
    bound: resident memory falls by at least 60 MiB -- the block's 64 MiB less 4 MiB for anything the interpreter
    allocates between the two readings (a few small objects: kilobytes). Without install(), release() does nothing
    (glibc already unmapped the block at free)."""
    result = probe("install", RELEASE_PROBE)
    assert result["installed"] and result["released"] and result["freed"] >= 60 << 20, result
    assert probe("default", RELEASE_PROBE)["released"] is False
