"""Where the bytes land, the steps every source shares: admission before any allocation, the
mover and the one bulk-copy loop (the views built while it runs), the copy path's warm-up, and
verification against the pre-pack's chunk checksums.

Nothing here knows where the bytes come from (:mod:`flashboot.flashload.sources`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .. import _cuda
from ..errors import ChecksumMismatchError, LayoutError, OutOfMemoryError
from ..memory import Device
from ..pinning import device_free_bytes
from .views import make_views

DEFAULT_CHUNK_BYTES = 1 << 30
"""H2D chunk: a few large copies keep the copy engine busy (hardware.md: 1 GB chunks, one stream)."""
ARENA_ROUNDING = 2 << 20
"""Arenas round up to the 2 MiB allocation granularity; admission counts the rounded size."""


# ================================================================================ admission
def admit(nbytes: int, device: Device, *, free_bytes: int | None = None) -> int:
    """Refuse a load that cannot fit, before anything is allocated.

    ``nbytes`` is rounded up to the arena granularity; ``free_bytes`` defaults to what the device
    reports (``cuMemGetInfo``; MemAvailable on the host backend). Returns the free bytes seen;
    raises OutOfMemoryError with bytes needed and free.
    """
    needed = -(-nbytes // ARENA_ROUNDING) * ARENA_ROUNDING
    free = device_free_bytes(device) if free_bytes is None else free_bytes
    if needed > free:
        raise OutOfMemoryError(f"loading a {nbytes:,}-byte image into {device}", needed, free)
    return free


# ================================================================================ the copy
def mover_for(device: Device):
    """The mover of the bulk copy (created, and its backend imported, before the copy is timed)."""
    from ..movers import create_mover

    return create_mover("copy_engine" if device.is_cuda else "host")


def bulk_copy(mover, arena, src_span, nbytes: int, chunk_bytes: int, *, meanwhile=None) -> tuple[int, Any]:
    """Copy ``nbytes`` from the staged span into the arena in ``chunk_bytes`` pieces, running
    ``meanwhile()`` while the copy is in flight; returns (#chunks, what ``meanwhile`` returned).

    CUDA: the chunks are enqueued on one stream, ``meanwhile`` runs on this thread, then the
    stream is synchronised. Host backend: the host mover's copy into the memfd arena (one call:
    the mover splits it over its threads, without the GIL) runs on this thread and ``meanwhile``
    in a helper thread. Either way the copy has ended when this returns or raises (also when
    ``meanwhile`` failed), so the caller may close the arena.
    """
    if not arena.device.is_cuda:
        side = Beside(meanwhile) if meanwhile is not None else None
        try:
            mover.copy(arena.span(0, nbytes), src_span.sub(0, nbytes), stream=None)
        finally:
            result = side.join() if side is not None else None  # the copy's error, if any, wins
        return 1, result
    from ..cuda_streams import give_back, lend_stream

    stream = lend_stream(arena.device.index)  # the driver's: an engine's first copy pays no CuPy import
    n = 0
    try:
        for off in range(0, nbytes, chunk_bytes):
            size = min(chunk_bytes, nbytes - off)
            mover.copy(arena.span(off, size), src_span.sub(off, size), stream=stream)
            n += 1
        result = meanwhile() if meanwhile is not None else None
    except BaseException:
        try:
            stream.synchronize()  # what was enqueued must end before the arena can be released
        except Exception:
            pass  # the first error is the one to report
        raise
    stream.synchronize()
    give_back(stream)
    return n, result


class Beside:
    """``fn()`` in a helper thread; :meth:`join` returns its result or raises its error."""

    def __init__(self, fn):
        self._fn, self._result, self._error = fn, None, None
        self._thread = threading.Thread(target=self._run, name="flashboot-load-views", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # handed to join()
            self._error = exc

    def join(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def one_time_costs(report, **more: float) -> dict[str, float]:
    """What a load without :func:`flashboot.prepare` paid itself that ``prepare`` pays at start-up
    (some of it while the copy ran: see ``overlapped``)."""
    paid = {"metadata": report.metadata_ms, "arena": report.alloc_ms, "views": report.bind_ms, **more}
    return {k: round(v, 3) for k, v in paid.items() if v}


def timed_views(arena, meta, report):
    """:func:`make_views`, its time recorded as ``bind_ms``."""
    t0 = time.perf_counter()
    views = make_views(arena, meta)
    report.bind_ms = (time.perf_counter() - t0) * 1e3
    return views


def warm_copy(device: Device, mover) -> None:
    """One small pinned H2D on a fresh stream of ``device``: the copy path's first-use costs (the
    stream, the copy engine's first launch) are paid here, not by the load's first chunk. On the
    host backend: one copy large enough to compile the host mover's parallel loop."""
    if not device.is_cuda:
        import numpy as np

        mover.copy(np.zeros(2 << 20, np.uint8), np.ones(2 << 20, np.uint8), stream=None)
        return
    _warm_driver_copy(device.index, mover)


@_cuda.keeps_context  # the caller's current context is restored
def _warm_driver_copy(index: int, mover) -> None:
    """:func:`warm_copy` on CUDA, through the driver (no CuPy): 64 KiB of page-locked host memory
    copied into 64 KiB of the device by ``mover`` on a private stream."""
    from ..cuda_streams import give_back, lend_stream
    from ..memory import CPU, Span, cuda_device

    drv = _cuda.driver()
    _cuda.use_device(index)
    nbytes = 1 << 16
    host = _cuda.check(drv.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc(64 KiB, copy warm-up)")
    try:
        dev = int(_cuda.check(drv.cuMemAlloc(nbytes), "cuMemAlloc(64 KiB, copy warm-up)"))
        try:
            stream = lend_stream(index)
            mover.copy(Span(dev, nbytes, cuda_device(index)), Span(int(host), nbytes, CPU, pinned=True), stream=stream)
            stream.synchronize()
            give_back(stream)
        finally:
            _cuda.check(drv.cuMemFree(dev), "cuMemFree(copy warm-up)")
    finally:
        _cuda.check(drv.cuMemFreeHost(host), "cuMemFreeHost(copy warm-up)")


# ================================================================================ verify
def verify_loaded(arena, metadata, where: str, report=None) -> int:
    """Recompute the image's chunk checksums on the arena's bytes (GPU kernel on CUDA, numba on the
    host); raises ChecksumMismatchError naming the first bad chunk. Returns the chunk count; sets
    ``report.verify_ms`` when a report is given."""
    t0 = time.perf_counter()  # the checksum module's import and first call are part of what verify costs
    from flashboot.kernels.checksum import chunk_checksums

    found = chunk_checksums(arena.span(0, metadata.image_nbytes), metadata.checksums.chunk_bytes)
    count = compare_digests(found, metadata, where)
    if report is not None:
        report.verify_ms = (time.perf_counter() - t0) * 1e3
        report.details["verified"] = f"{count} chunks match the pre-pack's checksums"
    return count


def compare_digests(found, metadata, where: str) -> int:
    """``found`` (chunk digests of the loaded bytes) against the metadata's: ChecksumMismatchError
    naming the first bad chunk, LayoutError for another chunk count. Returns the count."""
    import numpy as np

    cs, nbytes = metadata.checksums, metadata.image_nbytes
    if len(found) != len(cs.digests):
        raise LayoutError(f"{where}: {len(found)} chunks computed, the metadata records {len(cs.digests)}")
    # one vectorised comparison, no Python per chunk (a prepare thread's GIL time is the engine's)
    bad = np.flatnonzero(np.asarray(cs.digests, dtype=np.uint64) != np.asarray(found, dtype=np.uint64))
    if len(bad):
        k = int(bad[0])
        start, n = cs.chunk_range(k, nbytes)
        raise ChecksumMismatchError(where, k, start, n, int(cs.digests[k]), int(found[k]))
    return len(found)


__all__ = ["ARENA_ROUNDING", "DEFAULT_CHUNK_BYTES", "Beside", "admit", "bulk_copy", "compare_digests", "make_views",
           "mover_for", "one_time_costs", "timed_views", "verify_loaded", "warm_copy"]
