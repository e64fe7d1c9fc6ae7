"""Peak memory of a block of work, this process and the processes it starts, in GiB (2**30 bytes): the study
records it per stage beside the wall time (`timings.json`, the report's "Time:" line).

Two measurements; the larger is reported:
- this process's resident high-water mark (`VmHWM` in /proc/self/status), reset when the block starts by writing
  5 to /proc/self/clear_refs (Linux >= 4.0). Exact for work done in this process (quantize, KL, diagnose). Where
  the reset is refused, or inside another PeakMemory block of this process (the reset would spoil the outer
  block's mark), this measurement is left out: an unreset mark would report an earlier stage's peak;
- the proportional set size (PSS: each shared page split between the processes that map it, so the sum is not
  counted twice) summed over this process and its descendants (vLLM's engine core, the peers' calibration
  subprocesses), sampled every `interval_s` seconds on a thread. A peak shorter than the interval can be missed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

import psutil

GIB = 2**30
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
_open_blocks = 0  # PeakMemory blocks open in this process (a stage may run another: the study's quantize)
_open_blocks_lock = threading.Lock()


class PeakMemory:
    """`with PeakMemory() as peak: work()`, then `peak.gib`: the block's peak memory (see the module docstring).
    `samples` counts the samples of the process tree taken so far."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.gib = 0.0
        self.samples = 0
        self._sampled_bytes = 0
        self._hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="quantkit-peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        global _open_blocks
        with _open_blocks_lock:
            self._hwm_reset = _open_blocks == 0 and _reset_high_water_mark()
            _open_blocks += 1
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        global _open_blocks
        self._stop.set()
        self._thread.join()
        with _open_blocks_lock:
            _open_blocks -= 1
        self._sample()
        hwm = _high_water_mark_bytes() if self._hwm_reset else 0
        self.gib = max(hwm, self._sampled_bytes) / GIB

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        self._sampled_bytes = max(self._sampled_bytes, tree_pss_bytes())
        self.samples += 1


def tree_pss_bytes() -> int:
    """PSS summed over this process and its live descendants (bytes); a process that exits while it is read, or
    whose memory this user may not read, counts 0."""
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total


def _reset_high_water_mark() -> bool:
    """Set this process's VmHWM to its current RSS; False where the kernel or the sandbox refuses."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _high_water_mark_bytes() -> int:
    """This process's VmHWM (bytes; 0 where /proc/self/status does not give it)."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return 0
