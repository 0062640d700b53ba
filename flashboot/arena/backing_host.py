"""The host backend's physical steps: a reserved range (an inaccessible anonymous mapping, like
cuMemAddressReserve) and one memfd per segment mapped over its part with MAP_FIXED."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import time
from typing import Callable


_MEMFD_PREFIX = "flashboot-arena-"


def _host_mem_available() -> int:
    """Bytes the kernel says a new shared mapping can take (MemAvailable + SwapFree)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return fields.get("MemAvailable", fields.get("MemFree", 0)) + fields.get("SwapFree", 0)


# Host backend steps, module-level so tests can inject a failure into any one of them. The host
# backend reserves address space like cuMemAddressReserve (an inaccessible anonymous mapping) and
# maps each segment's memfd over its part with MAP_FIXED, so both backends share one segment model.

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _mmap_call(addr: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
    out = _libc().mmap(addr, nbytes, prot, flags, fd, 0)
    if out is None or out == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes:,} bytes: {os.strerror(err)}")
    return int(out)


def _host_munmap(addr: int, nbytes: int) -> None:
    if _libc().munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap of {nbytes:,} bytes at {addr:#x}: {os.strerror(err)}")


def _host_memfd(name: str) -> int:
    return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def _host_truncate(fd: int, nbytes: int) -> None:
    os.ftruncate(fd, nbytes)


HOST_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""A host segment's size is fixed once it is set: a memfd that shrinks under a process that maps it
kills that process with SIGBUS at its next touch (a served-load daemon, a holder, a clone), so every
importer refuses a segment without ``F_SEAL_SHRINK`` (:data:`HOST_SEALS_REQUIRED`)."""
HOST_SEALS_REQUIRED = fcntl.F_SEAL_SHRINK


def _host_seal(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, HOST_SEALS)


def _seal_names(seals: int) -> str:
    names = [n for n in ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE", "F_SEAL_FUTURE_WRITE")
             if hasattr(fcntl, n) and seals & getattr(fcntl, n)]
    return "+".join(names) or "none"


def _host_reserve(nbytes: int) -> int:
    return _mmap_call(None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)


def _host_map_segment(addr: int, fd: int, nbytes: int) -> None:
    _mmap_call(addr, nbytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd)


def _memfd_name(arena_id: str, segment: int) -> str:
    return f"{_MEMFD_PREFIX}{arena_id}.{segment}"


def _host_unmap_segment(addr: int, nbytes: int) -> None:
    """Put the reservation back over one segment (its pages go with the memfd's last reference)."""
    _mmap_call(addr, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1)


class _HostBacking:
    """A host arena's segments: segment ``i``'s memfd and its ``MAP_FIXED`` mapping over its part
    of the reserved range, released all at once (:meth:`release`) or one at a time
    (:meth:`release_segment`), as the CUDA backend's ``_Backing``. ``steps_ms``: the ms of the
    last release, per system call."""

    def __init__(self, ptr: int, segment_bytes: int, sizes: list[int]):
        self.ptr, self.segment_bytes, self.sizes = ptr, segment_bytes, list(sizes)
        self.fds: list[int | None] = [None] * len(self.sizes)
        self.mapped = [False] * len(self.sizes)
        self.steps_ms: dict[str, float] = {}

    def add(self, i: int, fd: int) -> None:
        self.fds[i] = fd

    def map(self, i: int) -> None:
        _host_map_segment(self.ptr + i * self.segment_bytes, self.fds[i], self.sizes[i])
        self.mapped[i] = True

    def _release(self, i: int, steps: dict[str, float]) -> None:
        t0 = time.perf_counter()
        try:
            if self.mapped[i]:
                self.mapped[i] = False
                _host_unmap_segment(self.ptr + i * self.segment_bytes, self.sizes[i])
        finally:
            t1 = time.perf_counter()
            fd, self.fds[i] = self.fds[i], None
            if fd is not None:
                os.close(fd)
            steps["unmap segment, keep the reservation"] = steps.get("unmap segment, keep the reservation", 0.0) + \
                (t1 - t0) * 1e3
            steps["close memfd"] = steps.get("close memfd", 0.0) + (time.perf_counter() - t1) * 1e3

    def release_segment(self, i: int) -> None:
        """Put the reservation back over segment ``i`` and close its memfd (its pages go with it)."""
        self._release(i, {})

    def release(self) -> None:
        """Release every segment still held; all run, the first error is raised."""
        steps: dict[str, float] = {}
        first: BaseException | None = None
        for i in range(len(self.sizes)):
            try:
                self._release(i, steps)
            except BaseException as exc:
                first = first or exc
        self.steps_ms = steps
        if first is not None:
            raise first


def attach_segments(undo, ptr: int, arena_id: str, sizes: list[int], segment_bytes: int,
                    ready: Callable[[int], None] | None = None, timings: dict | None = None,
                    upto: int | None = None) -> _HostBacking:
    """Create one memfd per segment and map it over its part of the reserved range at ``ptr``;
    one step on ``undo`` releases them (it detaches the segments and leaves the range reserved).
    ``upto``: only the first ``upto`` segments now, the others by :func:`make_segments` later.
    ``ready(i)``, when given, is called as soon as segment ``i`` is mapped (as the CUDA backend
    does). ``timings`` (optional dict) gains ``create_ms``, ``map_ms`` and ``ready_ms``, summed.
    Returns the segments (``fds``: the memfds); OSError from the step that failed."""
    backing = _HostBacking(ptr, segment_bytes, sizes)
    undo.push("release the segments", backing.release)
    make_segments(backing, range(len(sizes) if upto is None else min(upto, len(sizes))), arena_id, ready, timings)
    return backing


def make_segments(backing: _HostBacking, indices, arena_id: str, ready: Callable[[int], None] | None = None,
                  timings: dict | None = None) -> None:
    """Create and map segments ``indices`` of ``backing``, as :func:`attach_segments` describes."""
    stats = {"create_ms": 0.0, "map_ms": 0.0, "ready_ms": 0.0}
    try:
        for i in indices:
            t0 = time.perf_counter()
            fd = _host_memfd(_memfd_name(arena_id, i))
            backing.add(i, fd)
            _host_truncate(fd, backing.sizes[i])
            _host_seal(fd)
            t1 = time.perf_counter()
            backing.map(i)
            t2 = time.perf_counter()
            stats["create_ms"] += (t1 - t0) * 1e3
            stats["map_ms"] += (t2 - t1) * 1e3
            if ready is not None:
                ready(i)
                stats["ready_ms"] += (time.perf_counter() - t2) * 1e3
    finally:
        if timings is not None:
            for key, value in stats.items():
                timings[key] = timings.get(key, 0) + value
