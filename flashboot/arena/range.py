"""The Arena: one reserved address range, its segments (CUDA or host), export, views (open: :mod:`.opening`)."""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from .. import _cuda
from ..errors import ArenaError, OutOfMemoryError
from ..gil_time import gil_free
from ..memory import Device, Span, cgroup_memory_room, map_refused
from . import backing_cuda as cuda_backing
from . import backing_host as host
from .backing_cuda import _allocation_prop, _granularity, _reserve, _resolve_access, fabric_preflight
from .descriptor import ArenaDescriptor
from .opening import Opening
from .segments import (HANDLE_FABRIC_POSIX_FD, HANDLE_MEMFD, HANDLE_POSIX_FD, HOST_GRANULARITY, _check_nbytes,
                       _check_segment_bytes, _make_fd_room, _round_up, _segment_sizes, parse_dtype)
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


class Arena(SleepWake, Opening):
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
