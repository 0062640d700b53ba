"""The Arena: one reserved address range, its segments (CUDA or host), export/open, views."""

from __future__ import annotations

import ctypes
import fcntl
import os
import secrets
import socket
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from .. import _cuda
from ..errors import ArenaError, CapabilityError, CudaError, FlashBootError, OutOfMemoryError
from ..fdshare import FdStream, take_fds
from ..gil_time import gil_free
from ..memory import Device, Span, cgroup_memory_room, map_refused
from . import backing_cuda as cuda_backing
from . import backing_host as host
from .backing_cuda import (_allocation_prop, _granularity, _Mappings, _reserve, _resolve_access, _set_access,
                           can_access_peer, fabric_preflight)
from .backing_host import _memfd_name
from .descriptor import ArenaDescriptor
from .segments import (HANDLE_FABRIC_POSIX_FD, HANDLE_MEMFD, HANDLE_POSIX_FD, HOST_GRANULARITY, _adjacent_runs,
                       _check_nbytes, _check_segment_bytes, _fd_target, _make_fd_room, _round_up, _segment_sizes,
                       parse_dtype)
from .sleep import SleepWake
from .undo import _Undo


class _DeviceRange:
    """``nbytes`` of device memory at ``ptr`` as a CUDA Array Interface (v2) exporter; holds ``owner``."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def _views_held(flat) -> bool:
    """Whether tensors besides ``flat`` share its storage: views handed out, still held."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # no way to tell: keep the memory for whatever may view it
        return True
    return use_count(flat.untyped_storage()._cdata) > 2  # flat itself and the storage object of this call


class Arena(SleepWake):
    """One contiguous shareable address range on a CUDA device or in host shared memory, backed by
    segments (physical allocations of ``segment_bytes``, see :data:`SEGMENT_BYTES`).

    Build one with :meth:`create` (the owner) or :meth:`open` (an importer of another process's
    arena). Attributes: ``nbytes`` (capacity, rounded up to ``granularity``), ``requested_nbytes``,
    ``device`` (where views live: the accessing device), ``home_device`` (where the memory
    physically is), ``ptr``, ``handle_type``, ``arena_id``, ``imported``, ``segment_bytes``,
    ``segments``.

    An opened arena maps its segments on first use: :meth:`span`, :meth:`view` and
    :meth:`bytes` map the segments they cover, :meth:`map_range` maps a range ahead of use and
    ``ptr`` maps all of it. Its fds are taken at :meth:`open`, so later mappings do not depend on
    the exporter still running.
    """

    def __init__(self, *, undo: _Undo, ptr: int, nbytes: int, requested_nbytes: int, device: Device,
                 home_device: Device, granularity: int, segment_bytes: int, handle_type: str, arena_id: str,
                 imported: bool, descriptor: ArenaDescriptor | None = None, segments: Any = None,
                 fabric: bool = False, pending: Callable[[list[int], dict], None] | None = None, backing: _Undo | None = None,
                 attach: Callable[..., list] | None = None):
        # Built by create()/open(); not meant to be called directly.
        self._undo = undo
        self._ptr = ptr
        self._nbytes = nbytes
        self._requested_nbytes = requested_nbytes
        self._device = device
        self._home_device = home_device
        self._granularity = granularity
        self._segment_bytes = segment_bytes
        self._segment_sizes = _segment_sizes(nbytes, segment_bytes)
        self._handle_type = handle_type
        self._arena_id = arena_id
        self._imported = imported
        self._descriptor = descriptor
        self._segments = segments  # an owner's physical segments (the backends' _Backing): export(), sleep()
        self._fabric = fabric
        self._map_segment = pending  # an importer's "map segments [i, ...]"; None once everything is mapped
        self._mapped = [pending is None] * len(self._segment_sizes)
        self._map_lock = threading.Lock()
        self._map_stats = {"segments": 0, "map_ms": 0.0}
        self._flat = None
        self._closed = False
        # An owner's physical segments apart from its address range (see sleep/wake): ``backing``
        # releases them, ``attach(into, ready=None, timings=None)`` makes new ones at the same
        # addresses (the backends' attach_segments; it returns the new segments).
        self._backing, self._attach = backing, attach
        self._exports = _Undo(f"exports of arena {arena_id}")  # the CUDA fds export() handed out
        self._exported: tuple[list[int], list[bytes]] | None = None  # CUDA fds (+ fabric) exported so far
        undo.push("close exported fds", self._exports.release)
        self._asleep = False
        self._waking_bytes = 0  # during wake(): the bytes from the start mapped so far (see backs())
        self._shares: set[str] = set()

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    @_cuda.keeps_context
    def create(cls, nbytes: int, device: Any = None, *, access: Any = None,
               segment_bytes: int | None = None, segments_now: int | None = None) -> "Arena":
        """Allocate an arena of at least ``nbytes`` bytes.

        ``device``: an int, ``"cuda:N"``, ``"cpu"`` (host backend) or None (``cuda:0`` where CUDA
        exists, else ``cpu``). ``access``: extra CUDA devices given read/write access (an index,
        a list, or ``"all"`` for every peer that can); the owning device always has it.
        ``segment_bytes``: size of each physical allocation (default :data:`SEGMENT_BYTES`; a
        multiple of the granularity). ``segments_now``: make only the first this many segments
        now (at least one) and each other one when it is first needed: exported, viewed, spanned,
        or all of them for :meth:`bytes`, ``ptr``, a sleep or a hand-over. A served load hands
        the daemon the first batch at once and makes the rest while the daemon copies it (the
        request now goes out 3-4 ms after the call, and the later batches, 5-11 ms of making and
        exporting for 12-14 GB on an H200, overlap the copy; benchmarks/RESULTS.md).

        Raises ArenaError for a bad size, OutOfMemoryError (bytes needed and free) before
        allocating, CapabilityError for a device that does not exist, CudaError for a driver failure.
        """
        nbytes = _check_nbytes(nbytes)
        dev = Device.parse(device)
        if segments_now is not None and (isinstance(segments_now, bool) or not isinstance(segments_now, int)
                                         or segments_now < 1):
            raise ArenaError(f"segments_now must be a positive int, got {segments_now!r}")
        if dev.is_cuda:
            return cls._create_cuda(nbytes, dev, access, segment_bytes, segments_now)
        if access is not None:
            raise ArenaError(f"access={access!r} applies to CUDA arenas; this one is on the host backend")
        return cls._create_host(nbytes, segment_bytes, segments_now=segments_now)

    @classmethod
    def _create_host(cls, nbytes: int, segment_bytes: Any, arena_id: str | None = None,
                     segments_now: int | None = None) -> "Arena":
        capacity = _round_up(nbytes, HOST_GRANULARITY)
        segment_bytes = _check_segment_bytes(segment_bytes, HOST_GRANULARITY)
        available = host._host_mem_available()
        if capacity > available:
            raise OutOfMemoryError("host arena (MemAvailable + SwapFree)", capacity, available)
        room = cgroup_memory_room()  # memfds are shared memory, charged to this process's memory cgroup
        if room is not None and capacity > room[0]:
            raise OutOfMemoryError(f"host arena (its memfds are charged to this process's memory cgroup: {room[1]})",
                                   capacity, room[0])
        arena_id = arena_id or secrets.token_hex(8)  # a staging arena's memfds carry its live arena's id (remap.py)
        sizes = _segment_sizes(capacity, segment_bytes)
        _make_fd_room(len(sizes), f"a host arena of {capacity:,} bytes")
        undo = _Undo(f"host arena {arena_id} ({capacity:,} bytes)")
        backing = _Undo(f"segments of host arena {arena_id}")
        try:
            ptr = host._host_reserve(capacity)
            undo.push("munmap", lambda: host._host_munmap(ptr, capacity))  # also unmaps every segment in it
            undo.push("release the segments", backing.release)

            def attach(into: _Undo, ready=None, timings=None, reuse=None, upto=None) -> host._HostBacking:
                return host.attach_segments(into, ptr, arena_id, sizes, segment_bytes, ready, timings, upto)

            made = attach(backing, upto=segments_now)
        except BaseException as exc:
            undo.release()
            if isinstance(exc, OSError):
                refused = map_refused(f"a {capacity:,}-byte host arena", capacity, exc)
                if isinstance(refused, OutOfMemoryError):  # under `ulimit -v`: the limit and what is left
                    raise refused from exc
                raise ArenaError(f"creating a {capacity:,}-byte host arena failed: {exc}") from exc
            raise
        arena = cls(undo=undo, ptr=ptr, nbytes=capacity, requested_nbytes=nbytes, device=Device("cpu"),
                    home_device=Device("cpu"), granularity=HOST_GRANULARITY, segment_bytes=segment_bytes,
                    handle_type=HANDLE_MEMFD, arena_id=arena_id, imported=False, segments=made, backing=backing,
                    attach=attach)
        def make_later(todo: list[int], out: dict) -> None:
            try:
                host.make_segments(made, todo, arena_id, timings=out)
            except OSError as exc:  # as create's own: named, not a bare errno
                raise ArenaError(f"making segment(s) {todo} of host arena {arena_id} failed: {exc}") from exc

        arena._make_later(make_later)
        if arena._map_segment is None:
            arena._descriptor = arena._host_descriptor(made.fds)
        return arena

    def _host_descriptor(self, fds: list[int]) -> ArenaDescriptor:
        """A host arena's descriptor: its memfds are what it exports."""
        return ArenaDescriptor("host", os.getpid(), tuple(fds), self._nbytes, -1, HANDLE_MEMFD, HOST_GRANULARITY,
                               self._segment_bytes, self._arena_id, None, socket.gethostname())

    @classmethod
    def _create_cuda(cls, nbytes: int, dev: Device, access: Any, segment_bytes: Any,
                     segments_now: int | None = None) -> "Arena":
        drv = _cuda.driver()
        index = dev.index
        _cuda.use_device(index)
        devices = _resolve_access(index, access)
        fabric = fabric_preflight(index).supported
        prop = _allocation_prop(index, fabric)
        granularity = _granularity(prop)
        capacity = _round_up(nbytes, granularity)
        segment_bytes = _check_segment_bytes(segment_bytes, granularity)
        free, _total = _cuda.check(drv.cuMemGetInfo(), "cuMemGetInfo")
        if capacity > free:
            raise OutOfMemoryError(f"arena on cuda:{index}", capacity, int(free))
        arena_id = secrets.token_hex(8)
        sizes = _segment_sizes(capacity, segment_bytes)
        undo = _Undo(f"CUDA arena {arena_id} ({capacity:,} bytes on cuda:{index})",
                     before_release=lambda: _cuda.use_device(index))
        backing = _Undo(f"segments of CUDA arena {arena_id}", before_release=lambda: _cuda.use_device(index))
        try:
            ptr = _reserve(undo, capacity, granularity)
            undo.push("release the segments", backing.release)

            def attach(into: _Undo, ready=None, timings=None, reuse=None, upto=None) -> cuda_backing._Backing:
                return cuda_backing.attach_segments(into, ptr, prop, sizes, segment_bytes, devices, index, ready,
                                                    timings, reuse, upto)

            made = attach(backing, upto=segments_now)
        except BaseException:
            undo.release()
            raise
        handle_type = HANDLE_FABRIC_POSIX_FD if fabric else HANDLE_POSIX_FD
        arena = cls(undo=undo, ptr=ptr, nbytes=capacity, requested_nbytes=nbytes, device=dev, home_device=dev,
                    granularity=granularity, segment_bytes=segment_bytes, handle_type=handle_type,
                    arena_id=arena_id, imported=False, segments=made, fabric=fabric, backing=backing, attach=attach)
        arena._make_later(lambda todo, out: cuda_backing.make_segments(made, todo, prop, devices, index, timings=out))
        return arena

    @classmethod
    @_cuda.keeps_context
    def open(cls, descriptor: ArenaDescriptor, device: Any = None, *, fds: Sequence[int] | None = None,
             access: Any = None, via: str = "auto", timings: dict | None = None) -> "Arena":
        """Map another process's arena into this one.

        ``device``: the CUDA device that accesses it (default: the exporter's index; a different
        one maps the memory as a peer), or ``"cpu"``/None for a host arena. ``fds``: the
        segments' fds already received (e.g. :func:`flashboot.fdshare.recv_fds`); the caller
        keeps owning them. Otherwise they are taken from the exporter with ``pidfd_getfd``.
        ``via``: ``"auto"``, ``"pidfd"`` or ``"fabric"`` (CUDA arenas with fabric handles; auto
        uses them when the descriptor comes from another host).

        The fds are taken and the address range reserved now, and the first segment mapped (so a
        wrong descriptor fails here); the other segments are mapped on first use (class doc).
        The opened arena is an importer: ``close()`` unmaps it and drops its handles; the
        exporter's memory stays. Raises ArenaError naming the pid for an exporter that has
        exited, and for an fd that is not the arena. ``timings`` (optional dict) receives where the
        time went, in ms: ``pidfd_getfd_ms`` (all segments), ``reserve_ms``, and for the first
        segment ``import_ms`` (CUDA), ``map_ms``, ``set_access_ms`` (CUDA).
        """
        if not isinstance(descriptor, ArenaDescriptor):
            raise ArenaError(f"Arena.open needs an ArenaDescriptor, got {type(descriptor).__name__}")
        if via not in ("auto", "pidfd", "fabric"):
            raise ArenaError(f"via must be 'auto', 'pidfd' or 'fabric', got {via!r}")
        if fds is not None and len(fds) != descriptor.segments:
            raise ArenaError(f"arena {descriptor.arena_id} has {descriptor.segments} segments; {len(fds)} fds were given")
        if descriptor.backend == "host":
            if device is not None and Device.parse(device).is_cuda:
                raise ArenaError(f"arena {descriptor.arena_id} is a host arena; open it with device='cpu', not {device!r}")
            if access is not None or via == "fabric":
                raise ArenaError("access= and via='fabric' apply to CUDA arenas; this one is a host arena")
            return cls._open(descriptor, Device("cpu"), fds, [], False, timings)
        if descriptor.backend != "cuda":
            raise ArenaError(f"unknown arena backend {descriptor.backend!r} in descriptor {descriptor.arena_id}")
        dev = Device.parse(descriptor.device_index if device is None else device)
        if not dev.is_cuda:
            raise ArenaError(f"arena {descriptor.arena_id} lives on cuda:{descriptor.device_index}; open it on a CUDA device, not {device!r}")
        home = descriptor.device_index
        _cuda.use_device(dev.index)
        if not can_access_peer(dev.index, home):
            raise CapabilityError(f"cuda:{dev.index} cannot map arena {descriptor.arena_id}: no peer access to cuda:{home}")
        devices = _resolve_access(home, access, first=dev.index)
        use_fabric = via == "fabric" or (
            via == "auto" and fds is None and descriptor.fabric_handles is not None
            and descriptor.hostname not in ("", socket.gethostname())
        )
        if use_fabric and descriptor.fabric_handles is None:
            raise ArenaError(f"arena {descriptor.arena_id} has no fabric handles (handle type {descriptor.handle_type})")
        return cls._open(descriptor, dev, fds, devices, use_fabric, timings)

    @staticmethod
    def _source(descriptor: ArenaDescriptor, fds: Sequence[int] | None, i: int) -> str:
        return f"fd {fds[i]}" if fds is not None else f"fd {descriptor.fds[i]} of pid {descriptor.pid}"

    @classmethod
    def _take_fds(cls, undo: _Undo, descriptor: ArenaDescriptor, fds: Sequence[int] | None) -> list[int]:
        """Own fds for every segment (dups of ``fds`` or taken from the exporter); one undo step
        closes those still open (a segment's fd is closed once it is mapped)."""
        _make_fd_room(descriptor.segments, f"opening arena {descriptor.arena_id}")
        own: list[int] = []
        undo.push("close segment fds", lambda: [os.close(fd) for fd in own if fd >= 0])
        if isinstance(fds, FdStream):  # still arriving: each is taken when its segment is mapped
            own.extend([-1] * descriptor.segments)
            return own
        if fds is None:
            try:
                own.extend(take_fds(descriptor.pid, descriptor.fds))
            except FlashBootError as exc:
                raise ArenaError(f"cannot open arena {descriptor.arena_id} exported by pid {descriptor.pid}: {exc}") from None
            return own
        for i, fd in enumerate(fds):
            try:
                own.append(os.dup(fd))
            except OSError as exc:
                raise ArenaError(f"fd {fd} given for segment {i} of arena {descriptor.arena_id} is not open: "
                                 f"{exc.strerror}") from None
        return own

    @classmethod
    def _open(cls, descriptor: ArenaDescriptor, dev: Device, fds: Sequence[int] | None, devices: list[int],
              use_fabric: bool, timings: dict | None) -> "Arena":
        drv = _cuda.driver() if dev.is_cuda else None
        home = descriptor.device_index
        where = f"home cuda:{home}, mapped on {dev}" if dev.is_cuda else "host"
        undo = _Undo(f"opened arena {descriptor.arena_id} ({where})",
                     before_release=(lambda: _cuda.use_device(dev.index)) if dev.is_cuda else None)
        sizes = _segment_sizes(descriptor.nbytes, descriptor.segment_bytes)
        stats = timings if timings is not None else {}
        try:
            t0 = time.perf_counter()
            own = [] if use_fabric else cls._take_fds(undo, descriptor, fds)
            t1 = time.perf_counter()
            mappings = _Mappings()
            if dev.is_cuda:
                base = _reserve(undo, descriptor.nbytes, descriptor.granularity)
                undo.push("cuMemUnmap", mappings.unmap)  # after the handles' releases: the mappings hold the memory
            else:
                for i, fd in enumerate(own):
                    if fd >= 0:  # one still to arrive is checked when it is taken
                        cls._check_memfd(descriptor, fds, i, fd, sizes[i])
                base = host._host_reserve(descriptor.nbytes)
                undo.push("munmap", lambda: host._host_munmap(base, descriptor.nbytes))
            stats["pidfd_getfd_ms"], stats["reserve_ms"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        except BaseException as exc:
            undo.release()
            if isinstance(exc, OSError):
                raise ArenaError(f"opening arena {descriptor.arena_id} failed: {exc}") from exc
            raise

        def import_segment(i: int, out: dict) -> None:
            """Import and map segment ``i`` (CUDA: not granted yet); its releases join the undo list."""
            ptr, size = base + i * descriptor.segment_bytes, sizes[i]
            t = time.perf_counter()
            if not use_fabric and own[i] < 0:  # an FdStream's: waits for it to arrive
                try:
                    own[i] = os.dup(fds[i])
                except OSError as exc:
                    raise ArenaError(f"fd {fds[i]} received for segment {i} of arena {descriptor.arena_id} is not "
                                     f"open: {exc.strerror}") from None
                if not dev.is_cuda:
                    cls._check_memfd(descriptor, fds, i, own[i], size)
                out["fd_wait_ms"] = out.get("fd_wait_ms", 0.0) + (time.perf_counter() - t) * 1e3
            if not dev.is_cuda:
                try:
                    host._host_map_segment(ptr, own[i], size)
                except OSError as exc:
                    raise ArenaError(f"mapping segment {i} of host arena {descriptor.arena_id} failed: {exc}") from exc
                os.close(own[i])  # the mapping keeps the memory
                own[i] = -1
                out["map_ms"] = out.get("map_ms", 0.0) + (time.perf_counter() - t) * 1e3
                return
            kind = drv.CUmemAllocationHandleType
            if use_fabric:
                fabric = drv.CUmemFabricHandle()
                fabric.data = descriptor.fabric_handles[i]
                handle = _cuda.check(drv.cuMemImportFromShareableHandle(fabric, kind.CU_MEM_HANDLE_TYPE_FABRIC),
                                     f"cuMemImportFromShareableHandle(FABRIC, segment {i})")
            else:
                try:
                    handle = _cuda.check(drv.cuMemImportFromShareableHandle(own[i], kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                                         f"cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR, segment {i})")
                except CudaError as exc:
                    raise ArenaError(f"{cls._source(descriptor, fds, i)} ({_fd_target(own[i])}) is not the CUDA memory "
                                     f"handle of segment {i} of arena {descriptor.arena_id}: {exc}") from exc
                os.close(own[i])  # the imported handle holds the allocation now
                own[i] = -1
            undo.push("cuMemRelease", lambda: _cuda.check(drv.cuMemRelease(handle), "cuMemRelease"))
            t1 = time.perf_counter()
            mappings.map(ptr, handle, size)
            for key, ms in (("import_ms", t1 - t), ("map_ms", time.perf_counter() - t1)):
                out[key] = out.get(key, 0.0) + ms * 1e3

        def map_segments(indices: list[int], out: dict) -> None:
            """Import and map segments ``indices`` (ascending), then grant access. Where only the
            home device is granted, one ``cuMemSetAccess`` per run of adjacent ones: a grant may
            span many mappings (as an owner's in :func:`~flashboot.arena.backing_cuda.attach_segments`), and
            each call pays its own page-table update, so mapping a held arena of 54 segments
            grants once, not 54 times. A grant to a peer goes segment by segment, as measured
            (benchmarks/RESULTS.md, "Peer mapping cost": a peer's grant is dear from 512 MiB on;
            whether one spanning many smaller allocations counts as large is not measured)."""
            for i in indices:
                import_segment(i, out)
            if dev.is_cuda:
                t = time.perf_counter()
                runs = _adjacent_runs(indices) if set(devices) == {home} else [(i, i + 1) for i in indices]
                for first, last in runs:
                    start = base + first * descriptor.segment_bytes
                    _set_access(start, base + (last - 1) * descriptor.segment_bytes + sizes[last - 1] - start, devices)
                out["set_access_ms"] = out.get("set_access_ms", 0.0) + (time.perf_counter() - t) * 1e3

        arena = cls(undo=undo, ptr=base, nbytes=descriptor.nbytes, requested_nbytes=descriptor.nbytes, device=dev,
                    home_device=Device("cuda", home) if dev.is_cuda else dev, granularity=descriptor.granularity,
                    segment_bytes=descriptor.segment_bytes, handle_type=descriptor.handle_type,
                    arena_id=descriptor.arena_id, imported=True, descriptor=descriptor, pending=map_segments)
        try:
            first: dict = {}
            arena._map_segments(0, 1, first)
            stats.update(first)
            arena._map_stats.update(segments=0, map_ms=0.0)  # map_stats counts what comes after open
        except BaseException:
            arena._closed = True
            undo.release()
            raise
        return arena

    @staticmethod
    def _check_memfd(descriptor: ArenaDescriptor, fds: Sequence[int] | None, i: int, fd: int, size: int) -> None:
        target = _fd_target(fd)
        expected = f"/memfd:{_memfd_name(descriptor.arena_id, i)}"
        if not (target == expected or target.startswith(expected + " ")):
            raise ArenaError(f"{Arena._source(descriptor, fds, i)} is not segment {i} of arena {descriptor.arena_id}: "
                             f"it is {target!r}, expected {expected!r}")
        found = os.fstat(fd).st_size
        if found < size:
            raise ArenaError(f"segment {i} of arena {descriptor.arena_id} holds {found:,} bytes; the descriptor says "
                             f"{size:,}")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & host.HOST_SEALS_REQUIRED != host.HOST_SEALS_REQUIRED:
            raise ArenaError(f"{Arena._source(descriptor, fds, i)} (segment {i} of arena {descriptor.arena_id}, "
                             f"{found:,} bytes) is not sealed against shrinking: seals found: "
                             f"{host._seal_names(seals)}; required: {host._seal_names(host.HOST_SEALS_REQUIRED)} "
                             "(a shrinking memfd would kill this process with SIGBUS; make host arenas with "
                             "flashboot.Arena.create)")

    # ---- mapping on first use ------------------------------------------------------------------

    def _map_segments(self, first: int, last: int, out: dict | None = None) -> None:
        """Map segments ``first`` .. ``last - 1`` that are not mapped yet (importers only)."""
        if self._map_segment is not None:
            self._map_pending(first, last, out)

    def _make_later(self, make: Callable[[list[int], dict], None]) -> None:
        """An owner made with ``segments_now``: the segments not made yet are made by ``make``
        when first needed, through the importers' map-on-first-use (:meth:`_map_segments`). A
        call that fails releases what it made, so a later one starts from a clean slate (no
        segment mapped but never granted, no handle left behind)."""
        segments = self._segments
        held = segments.handles if self._device.is_cuda else segments.fds
        made = [h is not None for h in held]
        if all(made):
            return

        def make_all_or_none(todo: list[int], out: dict) -> None:
            try:
                make(todo, out)
            except BaseException:
                for i in todo:
                    if held[i] is not None:
                        segments.release_segment(i)
                raise

        self._mapped, self._map_segment = made, make_all_or_none

    def _make_all(self) -> None:
        """Every segment made (and, on an importer, mapped): before anything that hands over,
        releases or exports all of them."""
        self._map_segments(0, len(self._mapped))
        if self._descriptor is None and not self._imported and not self._home_device.is_cuda and not self._asleep:
            self._descriptor = self._host_descriptor(self._segments.fds)

    @_cuda.keeps_context
    def _map_pending(self, first: int, last: int, out: dict | None) -> None:
        with self._map_lock:
            if self._map_segment is None:
                return
            t0 = time.perf_counter()
            todo = [i for i in range(first, last) if not self._mapped[i]]
            if todo:
                if self._device.is_cuda:
                    _cuda.use_device(self._device.index)
                self._map_segment(todo, out if out is not None else {})
                for i in todo:
                    self._mapped[i] = True
                self._map_stats["segments"] += len(todo)
                self._map_stats["map_ms"] += (time.perf_counter() - t0) * 1e3
            if all(self._mapped):
                self._map_segment = None

    def map_range(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Map the segments covering ``[offset, offset + nbytes)`` now (an opened arena maps
        them on first use otherwise); a no-op on an owner or where mapped already."""
        self._check_open()
        end = self._nbytes if nbytes is None else offset + nbytes
        if offset < 0 or end > self._nbytes or end < offset:
            raise ArenaError(f"range {offset:,}..{end:,} is outside arena {self._arena_id}'s {self._nbytes:,} bytes")
        if end > offset:
            self._map_segments(offset // self._segment_bytes, -(-end // self._segment_bytes))

    @property
    def mapped_nbytes(self) -> int:
        """Bytes of the capacity mapped in this process (all of it for an owner, but for segments that
        ``segments_now`` left to make)."""
        return sum(n for n, m in zip(self._segment_sizes, self._mapped) if m)

    def mapped_segments(self) -> tuple[bool, ...]:
        """Whether each segment is mapped in this process now (see :attr:`mapped_nbytes`)."""
        return tuple(self._mapped)

    @property
    def map_stats(self) -> dict[str, float]:
        """Segments mapped after :meth:`open` returned, and the ms it took (``segments``, ``map_ms``)."""
        return dict(self._map_stats)

    # ---- lifetime ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaError(f"arena {self._arena_id} is closed")

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def close(self, *, keep_viewed: bool = False) -> None:
        """Release everything in reverse order: exported fds, mappings, reservation, handles.

        An importer drops only its own mappings and handles. Closing twice raises ArenaError.
        Views must not be used after this, unless ``keep_viewed``: then views still held keep the
        memory, released with the last of them as a torch tensor's own memory is (a model's
        parameter read after its image's close had been a segfault, and on CUDA an illegal address
        that ends the process's context), and a ResourceWarning says so. Not the default: a view
        held only by an error's traceback would then keep the memory for as long as the error.
        """
        # under the map lock: a sleep, wake or remap that checked ``closed`` before this began
        # finishes first, and one that begins after it finds the arena closed (a wake that maps
        # new segments into a range given back would write over whatever the process put there)
        with self._map_lock:
            if self._closed:
                raise ArenaError(f"arena {self._arena_id} is already closed")
            self._closed = True
            flat, self._flat = self._flat, None
            self._map_segment = None
            if keep_viewed and flat is not None and _views_held(flat):
                warnings.warn(f"arena {self._arena_id} closed while views of it are still held: its "
                              f"{self._nbytes:,} bytes stay mapped until they are dropped", ResourceWarning, stacklevel=2)
                # the flat tensor's buffer holds the undo list: the last view dropped runs it
                self._undo.release_when_dropped()
                self._undo = _Undo(f"{self._undo.what}, released with its last view")
            else:
                self._undo.release()

    def __enter__(self) -> "Arena":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self.close()

    # ---- attributes --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Capacity in bytes (the request rounded up to ``granularity``)."""
        return self._nbytes

    @property
    def requested_nbytes(self) -> int:
        """The size :meth:`create` was asked for (the capacity for an opened arena)."""
        return self._requested_nbytes

    @property
    def device(self) -> Device:
        """The device views live on: the owner's device, or the importing device for a peer mapping."""
        return self._device

    @property
    def home_device(self) -> Device:
        """The device whose memory backs the arena (differs from ``device`` for a peer mapping)."""
        return self._home_device

    @property
    def ptr(self) -> int:
        """Base address (a device pointer for CUDA, a host address for the host backend); on an
        opened arena this maps every segment first (use :meth:`span` to map only a range)."""
        self._check_open()
        self._make_all()
        return self._ptr

    @property
    def granularity(self) -> int:
        """Capacity rounding and mapping alignment in bytes (CUDA recommended granularity; 2 MiB on host)."""
        return self._granularity

    @property
    def segment_bytes(self) -> int:
        """Size of each physical allocation (the last one may be shorter)."""
        return self._segment_bytes

    @property
    def segments(self) -> int:
        """Number of physical allocations behind the one address range."""
        return len(self._segment_sizes)

    @property
    def handle_type(self) -> str:
        """``"posix_fd"``, ``"fabric+posix_fd"`` (CUDA) or ``"memfd"`` (host)."""
        return self._handle_type

    @property
    def arena_id(self) -> str:
        """Random id shared by an arena and everything opened from its descriptor."""
        return self._arena_id

    @property
    def imported(self) -> bool:
        """True for an arena made by :meth:`open` (it does not own the memory)."""
        return self._imported

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ptr={self._ptr:#x}" + (", asleep" if self._asleep else "")
        where = str(self._device) if self._device == self._home_device else f"{self._device} (home {self._home_device})"
        role = "imported" if self._imported else "owner"
        return (f"Arena({self._arena_id}, {self._nbytes:,} bytes in {self.segments} segment(s) on {where}, "
                f"{self._handle_type}, {role}, {state})")

    # ---- sharing -----------------------------------------------------------------------------

    @_cuda.keeps_context
    def export(self) -> ArenaDescriptor:
        """A descriptor another process on this host passes to :meth:`open`.

        The CUDA fds are exported on first call and kept open until :meth:`close`. On an opened
        arena this returns the descriptor it was opened from (it still names the exporter).
        """
        self._check_open()
        self._check_awake("exporting it")
        self._make_all()
        if self._descriptor is None:
            self._export_cuda(len(self._segment_sizes))
        return self._descriptor

    @_cuda.keeps_context
    def export_segments(self, first: int, last: int) -> list[int]:
        """The shareable fds of segments ``first .. last - 1`` (kept open until :meth:`close`),
        exported now where they are not yet; :meth:`export` completes the rest.

        Why in parts: one ``cuMemExportToShareableHandle`` costs ~0.6 ms per 256 MiB segment on
        the H200 (30 ms for 13.8 GB, probe of 2026-12-01), so a served load hands the daemon its
        fds batch by batch and the copy of the first bytes starts while the rest are exported.
        A host arena's fds are its memfds, there from the start."""
        self._check_open()
        self._check_awake("exporting it")
        if not 0 <= first <= last <= len(self._segment_sizes):
            raise ArenaError(f"segments {first}..{last} are outside arena {self._arena_id}'s "
                             f"{len(self._segment_sizes)}")
        self._map_segments(0, last)  # an owner made with segments_now makes them now (exports go in order)
        if self._descriptor is None and not self._home_device.is_cuda:  # a host owner's fds are its memfds
            return list(self._segments.fds[first:last])
        if self._descriptor is None:
            self._export_cuda(last)
        fds = self._descriptor.fds if self._descriptor is not None else self._exported[0]
        return list(fds[first:last])

    def socket_descriptor(self) -> ArenaDescriptor:
        """The descriptor of a hand-over whose fds travel over a Unix socket (SCM_RIGHTS) in
        segment order, possibly before all are exported (:meth:`export_segments`): the receiver
        takes each segment's fd from the socket, so the fd numbers are not listed (zeros) and no
        fabric handle is."""
        self._check_open()
        index = self._home_device.index if self._home_device.is_cuda else -1
        return ArenaDescriptor("cuda" if self._home_device.is_cuda else "host", os.getpid(),
                               (0,) * len(self._segment_sizes), self._nbytes, index, self._handle_type,
                               self._granularity, self._segment_bytes, self._arena_id, None, socket.gethostname())

    def _export_cuda(self, upto: int) -> None:
        """Export one POSIX fd (and, where permitted, a fabric handle) for each segment below
        ``upto`` not exported yet; with the last one the descriptor is made."""
        drv = _cuda.driver()
        kind = drv.CUmemAllocationHandleType
        index = self._home_device.index
        _cuda.use_device(index)
        handles = self._segments.handles
        if self._exported is None:
            _make_fd_room(len(handles), f"exporting arena {self._arena_id}")
            fds: list[int] = []
            self._exports.push("close exported fds", lambda: [os.close(fd) for fd in fds])
            self._exported = (fds, [])
        fds, fabric = self._exported
        for i in range(len(fds), upto):
            handle = handles[i]
            with gil_free():
                exported = drv.cuMemExportToShareableHandle(handle, kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            fds.append(int(_cuda.check(exported, f"cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR, segment {i})")))
            if self._fabric:
                fh = _cuda.check(drv.cuMemExportToShareableHandle(handle, kind.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                                 f"cuMemExportToShareableHandle(FABRIC, segment {i})")
                fabric.append(bytes(fh.data))
        if len(fds) == len(handles):
            self._descriptor = ArenaDescriptor("cuda", os.getpid(), tuple(fds), self._nbytes, index, self._handle_type,
                                               self._granularity, self._segment_bytes, self._arena_id,
                                               tuple(fabric) if self._fabric else None, socket.gethostname())

    def _revoke_exports(self) -> None:
        """Close every fd handed out by :meth:`export` (a sleep or remap: they name old segments)."""
        self._exports.release()
        self._descriptor, self._exported = None, None

    # ---- views -------------------------------------------------------------------------------

    def span(self, offset: int = 0, nbytes: int | None = None) -> Span:
        """The byte range ``[offset, offset + nbytes)`` as a :class:`flashboot.memory.Span` (owner:
        this arena); its segments are mapped first."""
        self._check_open()
        self._check_awake("copying into or out of it")
        sub = Span(self._ptr, self._nbytes, self._device, False, self).sub(offset, nbytes)
        if sub.nbytes:
            self._map_segments(offset // self._segment_bytes, -(-(offset + sub.nbytes) // self._segment_bytes))
        return sub

    def bytes(self):
        """The whole capacity as a flat ``torch.uint8`` tensor (zero copy; maps every segment)."""
        self._check_open()
        self._check_awake("viewing it")
        self._make_all()
        return self._flat_tensor()

    def _flat_tensor(self):
        if self._flat is None:
            self._flat = self._make_flat()
        return self._flat

    def _make_flat(self):
        import torch

        if self._device.is_cuda:
            # torch wraps the range through the CUDA Array Interface and keeps the wrapper (and so the
            # undo log, the mapping's owner) alive as long as any view; torch finds the device from the
            # pointer. Not CuPy + DLPack: importing CuPy is 100-170 ms of a fresh process's first views.
            return torch.as_tensor(_DeviceRange(self._ptr, self._nbytes, self._undo), device=str(self._device))
        buf = (ctypes.c_uint8 * self._nbytes).from_address(self._ptr)
        buf._flashboot_undo = self._undo  # views keep the mapping alive when the arena is dropped unclosed
        return torch.frombuffer(buf, dtype=torch.uint8)

    def view(self, offset: int, shape: Any, dtype: Any, stride: Sequence[int] | None = None):
        """A zero-copy tensor of ``shape`` and ``dtype`` at byte ``offset``.

        ``stride`` is in elements (torch convention, non-negative), default contiguous.
        Raises ArenaError naming offset, extent and capacity when the view would not fit, or
        when ``offset`` is not a multiple of the dtype's item size.
        """
        import torch

        self._check_open()
        self._check_awake("viewing it")
        dt = parse_dtype(dtype)
        itemsize = torch.empty((), dtype=dt).element_size()
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape_t):
            raise ArenaError(f"view shape must be non-negative ints, got {shape!r}")
        if stride is None:
            stride_t, step = [], 1
            for s in reversed(shape_t):
                stride_t.append(step)
                step *= max(s, 1)
            stride_t = tuple(reversed(stride_t))
        else:
            stride_t = (stride,) if isinstance(stride, int) else tuple(stride)
            if len(stride_t) != len(shape_t):
                raise ArenaError(f"view stride {stride_t} has {len(stride_t)} dims, shape {shape_t} has {len(shape_t)}")
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stride_t):
                raise ArenaError(f"view strides must be non-negative ints (elements), got {stride_t}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ArenaError(f"view offset must be a non-negative int, got {offset!r}")
        if offset % itemsize:
            raise ArenaError(f"view offset {offset:,} is not aligned for {dt} (item size {itemsize} bytes)")
        numel = 1
        for s in shape_t:
            numel *= s
        extent = 0 if numel == 0 else (sum((n - 1) * st for n, st in zip(shape_t, stride_t)) + 1) * itemsize
        if offset + extent > self._nbytes:
            raise ArenaError(
                f"view of {extent:,} bytes at offset {offset:,} ends at {offset + extent:,}, past the arena's "
                f"{self._nbytes:,} bytes"
            )
        if extent:
            self._map_segments(offset // self._segment_bytes, -(-(offset + extent) // self._segment_bytes))
        typed = self._flat_tensor()[offset:offset + extent].view(dt)
        return typed.as_strided(shape_t, stride_t)
