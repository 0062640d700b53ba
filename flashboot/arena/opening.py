"""Opening an arena another process exported: its segments' fds taken (or given), its address
range reserved here, the first segment mapped at once and the others on first use.

A mixin of :class:`flashboot.arena.Arena` (:meth:`~Opening.open` builds an importer through the
Arena's constructor; mapping on first use, its ``pending`` callable, is the Arena's own).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import Any, Sequence

from .. import _cuda
from ..errors import ArenaError, CapabilityError, CudaError, FlashBootError
from ..fdshare import FdStream, take_fds
from ..memory import Device
from . import backing_host as host
from .backing_cuda import _Mappings, _reserve, _resolve_access, _set_access, can_access_peer
from .backing_host import _memfd_name
from .descriptor import ArenaDescriptor
from .segments import _adjacent_runs, _fd_target, _make_fd_room, _segment_sizes
from .undo import _Undo


class Opening:
    """:meth:`open` and its parts (see the module docstring)."""

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
            raise ArenaError(f"{Opening._source(descriptor, fds, i)} is not segment {i} of arena {descriptor.arena_id}: "
                             f"it is {target!r}, expected {expected!r}")
        found = os.fstat(fd).st_size
        if found < size:
            raise ArenaError(f"segment {i} of arena {descriptor.arena_id} holds {found:,} bytes; the descriptor says "
                             f"{size:,}")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & host.HOST_SEALS_REQUIRED != host.HOST_SEALS_REQUIRED:
            raise ArenaError(f"{Opening._source(descriptor, fds, i)} (segment {i} of arena {descriptor.arena_id}, "
                             f"{found:,} bytes) is not sealed against shrinking: seals found: "
                             f"{host._seal_names(seals)}; required: {host._seal_names(host.HOST_SEALS_REQUIRED)} "
                             "(a shrinking memfd would kill this process with SIGBUS; make host arenas with "
                             "flashboot.Arena.create)")
