"""Swap an arena's physical segments for those of another arena, at the same addresses.

An atomic refit copies the new weights into a staging arena (fresh segments mapped elsewhere),
verifies them, and then :func:`replace_backing` maps the staging segments under the live
arena's addresses: every view and every pointer a CUDA graph captured stays valid and now reads
the new bytes, with no copy. The shape is cuda_core's virtual memory resource: take a reference
to both sets of segments (``cuMemRetainAllocationHandle``; a ``dup`` of the memfd on the host
backend), release the old backing, map the new one in a transaction of its own, and commit it
only on success. A failure maps the old segments back, so the old weights stay whole.
"""

from __future__ import annotations

import os
import time

from .. import _cuda
from ..errors import ArenaError
from . import backing_host as host
from .undo import _Undo


class _CudaSegments:
    """Segment references and mappings through the driver (the arena's home device current)."""

    def __init__(self, arena):
        self.drv = _cuda.driver()
        self.index = arena.home_device.index
        access = self.drv.CUmemLocation()
        access.type = self.drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.devices = []  # who may read the live range now keeps that right over the new segments
        for i in range(_cuda.device_count()):
            access.id = i
            flags = _cuda.check(self.drv.cuMemGetAccess(access, arena._ptr), f"cuMemGetAccess(cuda:{i})")
            if int(flags) == int(self.drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
                self.devices.append(i)

    def retain(self, arena, i: int):
        addr = arena._ptr + i * arena._segment_bytes
        return _cuda.check(self.drv.cuMemRetainAllocationHandle(addr), f"cuMemRetainAllocationHandle(segment {i})")

    def release(self, handle) -> None:
        _cuda.check(self.drv.cuMemRelease(handle), "cuMemRelease")

    def attach(self, into: _Undo, arena, refs: list):
        """Map ``refs`` (owned from now on by the returned segments, released by ``into``) under
        ``arena``'s range, then one grant over all of it."""
        from .backing_cuda import _Backing, _set_access

        backing = _Backing(arena._ptr, arena._segment_bytes, arena._segment_sizes)
        into.push("release the segments", backing.release)
        for i, ref in enumerate(refs):
            backing.add(i, ref)
        for i in range(len(refs)):
            backing.map(i)
        _set_access(arena._ptr, arena._nbytes, self.devices)
        return backing

    def adopt(self, arena, backing) -> None:
        arena._segments = backing  # export() exports these from now on; sleep releases them


class _HostSegments:
    """Segment references (dups of the memfds) and ``MAP_FIXED`` mappings over the reservation."""

    def retain(self, arena, i: int) -> int:
        return os.dup(arena._descriptor.fds[i])

    def release(self, fd: int) -> None:
        os.close(fd)

    def attach(self, into: _Undo, arena, refs: list):
        backing = host._HostBacking(arena._ptr, arena._segment_bytes, arena._segment_sizes)
        into.push("release the segments", backing.release)
        for i, fd in enumerate(refs):
            backing.add(i, fd)
        for i in range(len(refs)):
            backing.map(i)
        return backing

    def adopt(self, arena, backing) -> None:
        arena._segments = backing
        arena._descriptor = arena._host_descriptor(list(backing.fds))


def staging_for(arena):
    """A new owner arena whose segments can replace ``arena``'s: the same capacity, segment size
    and device; on the host backend its memfds carry ``arena``'s id, which importers check.
    OutOfMemoryError (bytes needed and free) when there is no room for it."""
    from .range import Arena

    if arena.device.is_cuda:
        return Arena.create(arena.nbytes, arena.device, segment_bytes=arena.segment_bytes)
    return Arena._create_host(arena.nbytes, arena.segment_bytes, arena_id=arena.arena_id)


def check_replaceable(arena, role: str = "live") -> None:
    """ArenaError unless ``arena``'s segments can be replaced: open, awake, owned by this process
    and mapped by no other (:meth:`~flashboot.arena.Arena.share`)."""
    arena._check_open()
    if arena.imported:
        raise ArenaError(f"replace_backing: the {role} arena {arena.arena_id} is opened from another process's export; "
                         "only an owner's segments can move")
    arena._check_awake(f"moving its segments ({role})")
    if arena._shares:
        raise ArenaError(f"arena {arena.arena_id} cannot change its segments: {len(arena._shares)} other process(es) "
                         f"map it ({'; '.join(sorted(arena._shares))})")


def _check_pair(arena, staging) -> None:
    check_replaceable(arena)
    check_replaceable(staging, "staging")
    if (arena.nbytes, arena.segment_bytes, arena.home_device) != (staging.nbytes, staging.segment_bytes,
                                                                   staging.home_device):
        raise ArenaError(f"replace_backing: arena {arena.arena_id} ({arena.nbytes:,} bytes in segments of "
                         f"{arena.segment_bytes:,} on {arena.home_device}) and staging arena {staging.arena_id} "
                         f"({staging.nbytes:,} bytes in segments of {staging.segment_bytes:,} on "
                         f"{staging.home_device}) differ")
    if not arena.device.is_cuda and staging.arena_id != arena.arena_id:
        raise ArenaError(f"replace_backing: host staging arena {staging.arena_id} names its memfds after itself, and "
                         f"importers of arena {arena.arena_id} would refuse them; make it with staging_for()")


@_cuda.keeps_context
def replace_backing(arena, staging, timings: dict | None = None) -> float:
    """Map ``staging``'s segments under ``arena``'s addresses and release ``arena``'s old ones;
    returns the ms of the swap (from the device wait to the new segments mapped and granted).
    ``staging`` stays usable (its own mapping of the same memory) until the caller closes it.
    The device's work is waited for first: call it between kernels that read the weights (the
    range is unmapped for the moment of the swap).

    ``timings`` (optional dict) receives where the time went, in ms: ``prepare_ms`` (references
    to both sets of segments taken and the old exports revoked, before the device wait and not
    part of the swap's ms: the weights stay mapped meanwhile), ``sync_ms`` (the device wait),
    ``unmap_ms`` (the old segments, one ``cuMemUnmap`` over the range), ``map_ms`` (the new
    ones, one grant), and ``release_old_ms``: freeing the old segments' memory, done after the
    swap and not part of its ms (nothing maps them any more).

    On failure the old segments are mapped back (ArenaError or CudaError from the step that
    failed, the arena unchanged); ArenaError before anything moves for an importer, an asleep or
    shared arena, or arenas of different sizes, segment sizes or devices.
    """
    _check_pair(arena, staging)
    for a in (arena, staging):
        a._make_all()  # one made with segments_now: every segment moves
    stats = timings if timings is not None else {}
    cuda = arena.device.is_cuda
    if cuda:
        _cuda.use_device(arena.home_device.index)
    seg = _CudaSegments(arena) if cuda else _HostSegments()
    where = f"segments of arena {arena.arena_id} (from staging arena {staging.arena_id})"
    before = (lambda i=arena.home_device.index: _cuda.use_device(i)) if cuda else None
    with arena._map_lock:
        # again under the lock: a close() or sleep() may have run since _check_pair (an asleep
        # arena's segments had been asked for, a raw AttributeError on the host backend)
        check_replaceable(arena)
        # what the swap needs is gathered before the device wait: the range is unmapped only
        # from the unmap to the grant, and nothing here touches the weights' mapping
        t_prep = time.perf_counter()
        new, old = [], []
        try:
            new += [seg.retain(staging, i) for i in range(staging.segments)]
            old += [seg.retain(arena, i) for i in range(arena.segments)]
        except BaseException:
            for r in new + old:
                seg.release(r)
            raise
        arena._revoke_exports()  # descriptors handed out name the old segments
        t0 = time.perf_counter()
        if cuda:
            _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize(before replacing segments)")
        t_unmap = time.perf_counter()
        arena._backing.release()  # unmaps the old segments; their memory lives on through ``old``
        t_map = time.perf_counter()
        fresh = _Undo(where, before_release=before)
        try:
            made = seg.attach(fresh, arena, new)
        except BaseException as exc:
            fresh.release()  # unmaps what was mapped, drops the new references
            back = _Undo(f"old segments of arena {arena.arena_id}", before_release=before)
            try:
                restored = seg.attach(back, arena, old)
            except BaseException:
                back.release()
                arena._asleep = True  # nothing backs the range: reads fault, wake() maps new segments
                raise ArenaError(f"replacing {where} failed ({exc}) and the old segments could not be mapped back; "
                                 "the arena is asleep (wake() it and reload)") from exc
            back.commit_into(arena._backing)
            seg.adopt(arena, restored)
            raise
        fresh.commit_into(arena._backing)
        seg.adopt(arena, made)
        t_done = time.perf_counter()
        for r in old:
            seg.release(r)
    t_released = time.perf_counter()
    stats.update(prepare_ms=(t0 - t_prep) * 1e3, sync_ms=(t_unmap - t0) * 1e3, unmap_ms=(t_map - t_unmap) * 1e3,
                 map_ms=(t_done - t_map) * 1e3, release_old_ms=(t_released - t_done) * 1e3)
    return (t_done - t0) * 1e3


__all__ = ["check_replaceable", "replace_backing", "staging_for"]
