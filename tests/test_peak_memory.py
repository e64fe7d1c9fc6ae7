"""quantkit.peak_memory: a block's peak memory, this process and its children (GiB)."""

import mmap
import subprocess
import sys
import time

import psutil
import pytest

from quantkit import peak_memory
from quantkit.peak_memory import GIB, PeakMemory

SIZE = 256 * 2**20  # bytes: far above what the interpreter allocates or frees on its own in these blocks
SLACK = 16 * 2**20  # bytes: pages the allocator may return to the kernel inside the block (trimmed free lists)
PAGE = 4096  # bytes: a write per page makes it resident
WAIT_S = 120.0  # the sampler thread is due every interval; a loaded CI machine may delay it, not by minutes


@pytest.fixture(autouse=True, params=["hwm-reset", "hwm-refused"])
def kernel(request, monkeypatch, tmp_path):
    """Each test twice: with the kernel's high-water mark reset, and where the reset is refused (a sandbox; here a
    clear_refs path that cannot be written), so the sampled PSS alone must carry the figure."""
    if request.param == "hwm-refused":
        monkeypatch.setattr(peak_memory, "CLEAR_REFS", tmp_path / "absent" / "clear_refs")
    return request.param


def test_a_block_reports_what_it_allocated_in_this_process():
    """The resident high-water mark (or, where the kernel refuses its reset, the sampled PSS) sees a buffer that
    was filled and freed inside the block: at least the PSS before it (<= RSS: shared pages are split) plus its
    size, less SLACK."""
    with PeakMemory(interval_s=0.05) as peak:
        before = psutil.Process().memory_full_info().pss
        buffer = _resident_buffer()
        _wait_for_samples(peak, 2)
        buffer.close()
    assert peak.gib * GIB >= before + SIZE - SLACK, (peak.gib, before / GIB)


def test_an_earlier_peak_of_this_process_is_not_reported():
    """A buffer freed before the block is outside it: the high-water mark is reset on entry (and left out where it
    cannot be), so the peak is the process's RSS now, far below RSS + SIZE."""
    buffer = _resident_buffer()
    buffer.close()
    with PeakMemory(interval_s=0.05) as peak:
        rss = psutil.Process().memory_info().rss
    assert peak.gib * GIB < rss + SIZE / 2, (peak.gib, rss / GIB)


def test_a_nested_block_leaves_the_outer_peak_alone(kernel):
    """A stage that runs another (the study's quantize inside eval) must not reset the outer block's mark: a buffer
    filled and freed before the inner block, between the outer block's samples (its interval is an hour: only the
    entry and exit samples are taken), is still in the outer peak. Only the kernel's mark can carry it, so where its
    reset is refused the outer peak is the sampled PSS, below that buffer."""
    with PeakMemory(interval_s=3600.0) as outer:
        before = psutil.Process().memory_full_info().pss
        buffer = _resident_buffer()
        buffer.close()
        with PeakMemory(interval_s=0.05) as inner:
            pass
    assert inner.gib * GIB < before + SIZE / 2, (inner.gib, before / GIB)
    if kernel == "hwm-reset":
        assert outer.gib * GIB >= before + SIZE - SLACK, (outer.gib, before / GIB)
    else:
        assert outer.gib * GIB < before + SIZE / 2, (outer.gib, before / GIB)


def test_a_child_processes_memory_is_counted():
    """A child that holds SIZE of its own written pages (PSS counts private pages in full) while the sampler
    takes two samples: the peak is at least SIZE above nothing, and the child is gone afterwards."""
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; b = b'x' * {SIZE}; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with PeakMemory(interval_s=0.05) as peak:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            _wait_for_samples(peak, 2)
    finally:
        child.communicate("")
    assert peak.gib * GIB >= SIZE, peak.gib
    assert child.returncode == 0


def _resident_buffer() -> mmap.mmap:
    """SIZE bytes of fresh anonymous memory, every page written, given back to the kernel by close(). Not from
    malloc: in a process that served on CPU, malloc keeps freed blocks (quantkit/serve/cpu/heap.py), so a bytes
    object of that size could reuse resident pages and raise no measure of memory at all."""
    buffer = mmap.mmap(-1, SIZE)
    for offset in range(0, SIZE, PAGE):
        buffer[offset] = 1
    return buffer


def _wait_for_samples(peak: PeakMemory, count: int) -> None:
    """Until the sampler has taken `count` more samples (it runs on its own thread)."""
    target = peak.samples + count
    deadline = time.monotonic() + WAIT_S
    while peak.samples < target:
        assert time.monotonic() < deadline, f"the sampler took {peak.samples} samples in {WAIT_S} s"
        time.sleep(0.01)
