"""A thread's CPU time inside calls that release the GIL, so the GIL a background thread held can
be bounded by its CPU time less those calls, not by all of it.

Issue 19 budgets the GIL an early call's thread holds beside the engine (20 ms + 1 us a tensor).
Its CPU time bounds that from above, but a served load's hand-over spends most of it in the
driver (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``, ``cuMemExportToShareableHandle``:
~0.25 ms of CPU per 256 MiB segment on the H200) and in ``sendmsg``, none of which holds the
GIL: cuda-bindings releases it around every driver call since 12.9.1 / 13.0.0 (its release
notes), CPython's socket module around every send. Each such call is wrapped in
:func:`gil_free`, which adds the thread's CPU time between its entry and exit to a per-thread
total (:func:`gil_free_cpu_s`). The wrapper's own entry and the bindings' argument conversion
are counted too: a few microseconds a call, against the ~250 us of the driver's own work.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

_totals = threading.local()


class _Counted:
    __slots__ = ("_c0",)

    def __enter__(self):
        self._c0 = time.thread_time()
        return self

    def __exit__(self, *exc):
        _totals.s = getattr(_totals, "s", 0.0) + time.thread_time() - self._c0
        return False


_NOT_COUNTED = contextlib.nullcontext()


@functools.cache
def driver_releases_gil() -> bool:
    """Whether the installed cuda-bindings release the GIL around driver calls (12.9.1 and later
    in the 12 series, every 13.x)."""
    try:
        from cuda.bindings import __version__ as version
    except ImportError:
        return False
    try:
        parts = tuple(int(p) for p in version.split(".")[:3])
    except ValueError:
        return False
    return parts >= (12, 9, 1)


def gil_free(driver: bool = True):
    """A context manager around one call that releases the GIL: its CPU time on this thread is
    added to :func:`gil_free_cpu_s`. ``driver``: a cuda-bindings call, counted only where the
    installed bindings release the GIL (:func:`driver_releases_gil`); False: a system call that
    CPython always releases it around (a socket send)."""
    return _Counted() if not driver or driver_releases_gil() else _NOT_COUNTED


def gil_free_cpu_s() -> float:
    """This thread's CPU seconds so far inside :func:`gil_free` calls."""
    return getattr(_totals, "s", 0.0)


__all__ = ["gil_free", "gil_free_cpu_s", "driver_releases_gil"]
