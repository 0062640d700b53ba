"""The ``host`` mover: a numba-parallel host->host copy (staging buffers, the host backend).

Synchronous: the copy is done when :meth:`copy` returns; ``stream`` is ignored (None allowed).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from typing import Any

import numpy as np

from flashboot.kernels._numba import parallel_call
from flashboot.memory import Span

from .base import Mover
from .batch import ChunkBatch
from .registry import register_mover

CHUNK_BYTES = 1 << 20
"""Bytes per parallel work item: large enough to amortise the loop, small enough to balance threads."""

_SERIAL_BELOW_BYTES = 1 << 20
"""Below this a plain memmove beats waking numba's thread pool."""


@functools.cache
def _parallel_copy():
    from flashboot.kernels.host_copy import copy_chunks  # imports numba: only when a copy needs it

    return copy_chunks


_LAYER_LOCK = threading.Lock()
_serialise: bool | None = None
"""Whether parallel copies must go one at a time: numba's ``workqueue`` threading layer (what it
falls back to without OpenMP or TBB: a slim image has no libgomp) is not thread-safe, and two
lanes of the executor copying at once ended the process ("Concurrent access has been
detected"). None until the first copy has shown which layer numba picked."""


_pool_pid: int | None = None
"""The process whose first parallel copy started numba's thread pool. A child forked from it
(multiprocessing's default on Linux) is ended by GNU OpenMP at its first parallel region ("fork()
called from a process already using GNU OpenMP, this is unsafe"): there the copy is a memmove."""


def _run_parallel(dst: np.ndarray, src: np.ndarray) -> None:
    global _serialise, _pool_pid
    if _pool_pid is not None and _pool_pid != os.getpid():
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, src.nbytes)
        return
    copy = _parallel_copy()
    if _serialise is False:
        parallel_call(copy, dst, src, CHUNK_BYTES)
        return
    with _LAYER_LOCK:
        if _pool_pid is None:  # set first: a child forked during this copy must not wait on the lock it holds
            _pool_pid = os.getpid()
        parallel_call(copy, dst, src, CHUNK_BYTES)
        if _serialise is None:
            import numba

            _serialise = numba.threading_layer() == "workqueue"


def warm_host_copy() -> float:
    """Compile (or load from numba's cache) the parallel loop now, off a caller's critical path;
    returns the ms it took (~0 once warm). A first copy of 1 MiB or more pays it otherwise."""
    t0 = time.perf_counter()
    one = np.zeros(1, np.uint8)
    _run_parallel(one, one.copy())
    return (time.perf_counter() - t0) * 1e3


def host_copy(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    """Copy ``nbytes`` between two host addresses with numba's parallel loop.

    Small or overlapping ranges go through memmove (the parallel chunks assume no overlap).
    """
    if nbytes < _SERIAL_BELOW_BYTES or (src_ptr < dst_ptr + nbytes and dst_ptr < src_ptr + nbytes):
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
        return
    dst = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(dst_ptr), dtype=np.uint8)
    src = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(src_ptr), dtype=np.uint8)
    _run_parallel(dst, src)


@register_mover
class HostMover(Mover):
    """numba-parallel host->host copy in 1 MiB chunks; synchronous, stream ignored."""

    name = "host"
    paths = frozenset({"host"})
    alignment = 1
    batched = "one synchronous host copy per run of contiguous chunks"

    def copy(self, dst: Any, src: Any, nbytes: int | None = None, *, stream: Any = None) -> None:
        """As :meth:`Mover.copy`; ``stream`` may be omitted (host copies are synchronous)."""
        super().copy(dst, src, nbytes, stream=stream)

    def copy_batch(self, dst: Any, src: Any, chunks: Any, *, stream: Any = None) -> None:
        """As :meth:`Mover.copy_batch`; synchronous, ``stream`` may be omitted."""
        super().copy_batch(dst, src, chunks, stream=stream)

    def _copy(self, dst: Span, src: Span, nbytes: int, path: str, stream: Any) -> None:
        host_copy(dst.ptr, src.ptr, nbytes)

    def _copy_batch(self, batch: ChunkBatch, stream: Any) -> None:
        for d, s, n in zip(*(a.tolist() for a in batch.runs())):
            host_copy(batch.dst.ptr + d, batch.src.ptr + s, n)


__all__ = ["HostMover", "host_copy", "warm_host_copy", "CHUNK_BYTES"]
