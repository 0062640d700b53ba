"""The CUDA backend's driver steps: allocation properties, handle preflight, access grants,
reservation and mapping (cuMemCreate / cuMemAddressReserve / cuMemMap / cuMemSetAccess)."""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import _cuda
from ..errors import ArenaError, CapabilityError, CudaError
from ..gil_time import gil_free
from ..memory import Device
from .segments import _adjacent_runs
from .undo import _Undo


def _cu_device(index: int):
    return _cuda.check(_cuda.driver().cuDeviceGet(index), f"cuDeviceGet({index})")


def _device_attribute(index: int, name: str) -> int:
    drv = _cuda.driver()
    attr = getattr(drv.CUdevice_attribute, name)
    return int(_cuda.check(drv.cuDeviceGetAttribute(attr, _cu_device(index)), f"cuDeviceGetAttribute({name}, {index})"))


def can_access_peer(accessor: int, owner: int) -> bool:
    """True when CUDA device ``accessor`` can map memory that lives on device ``owner``."""
    if accessor == owner:
        return True
    drv = _cuda.driver()
    return bool(_cuda.check(drv.cuDeviceCanAccessPeer(_cu_device(accessor), _cu_device(owner)),
                            f"cuDeviceCanAccessPeer({accessor}, {owner})"))


_FABRIC_BIT = 0x8  # CU_MEM_HANDLE_TYPE_FABRIC
_POSIX_BIT = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _allocation_prop(index: int, fabric: bool):
    """A CUmemAllocationProp for pinned device memory on ``index``, POSIX fd (+ fabric) shareable."""
    drv = _cuda.driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if fabric:
        # requestedHandleTypes is a bitmask in C, but the Python enum refuses FABRIC|POSIX (9).
        # Write the field in the C struct (offset 4, after `type`); check the offset first by
        # reading back the POSIX value the setter just stored.
        field = ctypes.c_uint32.from_address(prop.getPtr() + 4)
        if field.value != _POSIX_BIT:
            raise CapabilityError("unexpected CUmemAllocationProp layout; cannot request fabric+posix_fd handles")
        field.value = _POSIX_BIT | _FABRIC_BIT
    return prop


def _granularity(prop) -> int:
    drv = _cuda.driver()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_cuda.check(drv.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))


@dataclass(frozen=True)
class HandleSupport:
    """Whether a shareable handle type works on a device, and why not."""

    supported: bool
    reason: str = ""


_preflight_cache: dict[tuple[int, str], HandleSupport] = {}


@_cuda.keeps_context
def preflight_handle(index: int, handle: str) -> HandleSupport:
    """Try one tiny allocation with ``handle`` ("posix_fd" or "fabric") on CUDA device ``index``.

    The answer is cached per process. Fabric is tried as fabric+posix_fd, exactly what
    :meth:`Arena.create` would request; on machines without an IMEX channel ``cuMemCreate``
    answers CUDA_ERROR_NOT_PERMITTED and arenas fall back to POSIX fds only.
    """
    key = (index, handle)
    if key in _preflight_cache:
        return _preflight_cache[key]
    if handle not in ("posix_fd", "fabric"):
        raise ArenaError(f"unknown handle type {handle!r}; known: posix_fd, fabric")
    drv = _cuda.driver()
    _cuda.use_device(index)
    attr = ("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED" if handle == "fabric"
            else "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
    if not _device_attribute(index, attr):
        result = HandleSupport(False, f"cuda:{index} reports {attr} = 0")
    else:
        try:
            prop = _allocation_prop(index, fabric=handle == "fabric")
            size = _granularity(prop)
            h = _cuda.check(drv.cuMemCreate(size, prop, 0), f"cuMemCreate({handle} preflight)")
            try:
                kind = drv.CUmemAllocationHandleType
                if handle == "fabric":
                    _cuda.check(drv.cuMemExportToShareableHandle(h, kind.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                                "cuMemExportToShareableHandle(FABRIC)")
                else:
                    fd = _cuda.check(drv.cuMemExportToShareableHandle(h, kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                                     "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)")
                    os.close(int(fd))
            finally:
                _cuda.check(drv.cuMemRelease(h), "cuMemRelease")
            result = HandleSupport(True, "")
        except CudaError as exc:
            result = HandleSupport(False, f"{exc.call} returned {exc.name} ({exc.code})")
        except CapabilityError as exc:
            result = HandleSupport(False, str(exc))
    _preflight_cache[key] = result
    return result


def fabric_preflight(index: int) -> HandleSupport:
    """Whether arenas on CUDA device ``index`` can carry a fabric handle (cached; see :func:`preflight_handle`)."""
    if os.environ.get("FLASHBOOT_NO_FABRIC") == "1":
        return HandleSupport(False, "disabled by FLASHBOOT_NO_FABRIC=1")
    return preflight_handle(index, "fabric")


def _resolve_access(home: int, access: Any, first: int | None = None) -> list[int]:
    """CUDA device indices given read/write access to memory living on ``home``.

    Always ``first`` (default ``home``: the owner; an importer passes its own device), plus the
    ones in ``access``: an index, a list, or ``"all"`` (every device that can access ``home``).
    """
    devices = [home if first is None else first]
    if access is None:
        return devices
    if isinstance(access, str) and access == "all":
        return devices + [i for i in range(_cuda.device_count()) if i not in devices and can_access_peer(i, home)]
    if isinstance(access, (int, str, Device)):
        access = [access]
    for spec in access:
        dev = Device.parse(spec)
        if not dev.is_cuda:
            raise ArenaError(f"access lists CUDA devices; got {spec!r}")
        if dev.index not in devices:
            if not can_access_peer(dev.index, home):
                raise CapabilityError(f"cuda:{dev.index} cannot access memory on cuda:{home} (no peer access)")
            devices.append(dev.index)
    return devices


def _set_access(ptr, nbytes: int, devices: Sequence[int]) -> None:
    drv = _cuda.driver()
    descs = []
    for index in devices:
        d = drv.CUmemAccessDesc()
        d.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = index
        d.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(d)
    with gil_free():
        granted = drv.cuMemSetAccess(ptr, nbytes, descs, len(descs))
    _cuda.check(granted, f"cuMemSetAccess({list(devices)})")


def _reserve(undo: _Undo, nbytes: int, alignment: int) -> int:
    """Reserve ``nbytes`` of device virtual address space; pushes its release."""
    drv = _cuda.driver()
    ptr = _cuda.check(drv.cuMemAddressReserve(nbytes, alignment, 0, 0), f"cuMemAddressReserve({nbytes:,})")
    undo.push("cuMemAddressFree", lambda: _cuda.check(drv.cuMemAddressFree(ptr, nbytes), "cuMemAddressFree"))
    return int(ptr)


def _map_at(undo: _Undo, ptr: int, handle, nbytes: int) -> None:
    drv = _cuda.driver()
    _cuda.check(drv.cuMemMap(ptr, nbytes, 0, handle, 0), f"cuMemMap({nbytes:,} at {ptr:#x})")
    undo.push("cuMemUnmap", lambda: _cuda.check(drv.cuMemUnmap(ptr, nbytes), "cuMemUnmap"))


def _map_handle(undo: _Undo, handle, nbytes: int, granularity: int, devices: Sequence[int]) -> int:
    """Reserve a range, map ``handle`` into it and grant access; each step pushes its release."""
    ptr = _reserve(undo, nbytes, granularity)
    _map_at(undo, ptr, handle, nbytes)
    _set_access(ptr, nbytes, devices)
    return ptr


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(ptr, nbytes)`` spans merged into runs of adjacent ones, in address order."""
    runs: list[list[int]] = []
    for ptr, n in sorted(spans):
        if runs and runs[-1][0] + runs[-1][1] == ptr:
            runs[-1][1] += n
        else:
            runs.append([ptr, n])
    return [(p, n) for p, n in runs]


class _Mappings:
    """The segments mapped into one reserved range, unmapped together by :meth:`unmap`: one
    ``cuMemUnmap`` per run of adjacent mappings, since the driver unmaps a range spanning many
    mappings in one call (CUDA's vectorAddMMAP sample frees its striped allocation so), and a
    sleep should pay a call's fixed cost once, not once per segment (an arena of 60 segments
    unmapped and released one by one closed in 11.0 ms on an H200, benchmarks/RESULTS.md)."""

    def __init__(self):
        self._spans: list[tuple[int, int]] = []

    def map(self, ptr: int, handle, nbytes: int) -> None:
        drv = _cuda.driver()
        with gil_free():
            mapped = drv.cuMemMap(ptr, nbytes, 0, handle, 0)
        _cuda.check(mapped, f"cuMemMap({nbytes:,} at {ptr:#x})")
        self._spans.append((ptr, nbytes))

    def unmap_one(self, ptr: int) -> None:
        """Unmap the one mapping at ``ptr`` (a no-op where nothing is mapped there)."""
        for span in self._spans:
            if span[0] == ptr:
                self._spans.remove(span)
                _cuda.check(_cuda.driver().cuMemUnmap(*span), f"cuMemUnmap({span[1]:,} at {ptr:#x})")
                return

    def unmap(self) -> None:
        drv = _cuda.driver()
        runs, self._spans = _runs(self._spans), []
        for ptr, n in runs:
            _cuda.check(drv.cuMemUnmap(ptr, n), f"cuMemUnmap({n:,} at {ptr:#x})")


class _Backing:
    """An owner's physical segments in its reserved range: segment ``i``'s allocation handle and
    its mapping at ``ptr + i * segment_bytes``. Released all at once (:meth:`release`: sleep,
    close, a failed wake), one segment at a time (:meth:`release_segment`: a level-1 sleep frees
    each segment as soon as its bytes are copied out, so the driver's work on the freed memory
    overlaps the rest of the copy), or detached (:meth:`detach`: the handles go to another arena,
    a swap's handover). ``steps_ms``: the ms of the last release, per driver call."""

    def __init__(self, ptr: int, segment_bytes: int, sizes: Sequence[int]):
        self.ptr, self.segment_bytes, self.sizes = ptr, segment_bytes, list(sizes)
        self.handles: list = [None] * len(self.sizes)
        self._mappings = _Mappings()
        self.steps_ms: dict[str, float] = {}

    def add(self, i: int, handle) -> None:
        """Own ``handle`` as segment ``i``'s allocation (made here or handed over by another arena)."""
        self.handles[i] = handle

    def map(self, i: int) -> None:
        self._mappings.map(self.ptr + i * self.segment_bytes, self.handles[i], self.sizes[i])

    def release_segment(self, i: int) -> None:
        """Unmap segment ``i`` and release its handle: its memory goes back to the device now."""
        handle, self.handles[i] = self.handles[i], None
        try:
            self._mappings.unmap_one(self.ptr + i * self.segment_bytes)
        finally:
            if handle is not None:
                _cuda.check(_cuda.driver().cuMemRelease(handle), f"cuMemRelease(segment {i})")

    def release(self) -> None:
        """Release every handle, then unmap (one ``cuMemUnmap`` per run), which frees the memory.

        That order measured fastest on an H200 (13.96 GB in 52 segments: 6.5 ms, against 7-9 ms
        unmapping first, 6.5-10.4 ms segment by segment, and no gain from releasing on 2-4
        threads; benchmarks/RESULTS.md, "Issue 17 again"). All steps run; the first error is raised."""
        drv = _cuda.driver()
        handles, self.handles = self.handles, [None] * len(self.sizes)
        first: BaseException | None = None
        t0 = time.perf_counter()
        for i, handle in enumerate(handles):
            if handle is not None:
                try:
                    _cuda.check(drv.cuMemRelease(handle), f"cuMemRelease(segment {i})")
                except BaseException as exc:
                    first = first or exc
        t1 = time.perf_counter()
        try:
            self._mappings.unmap()
        except BaseException as exc:
            first = first or exc
        self.steps_ms = {"cuMemRelease": (t1 - t0) * 1e3, "cuMemUnmap": (time.perf_counter() - t1) * 1e3}
        if first is not None:
            raise first

    def detach(self) -> list[tuple[Any, int]]:
        """Unmap every segment and give up its handle, still allocated: ``(handle, nbytes)`` per
        segment that had one, in order. Nothing is freed; the caller owns the handles now."""
        t0 = time.perf_counter()
        self._mappings.unmap()
        handed = [(h, n) for h, n in zip(self.handles, self.sizes) if h is not None]
        self.handles = [None] * len(self.sizes)
        self.steps_ms = {"cuMemUnmap": (time.perf_counter() - t0) * 1e3}
        return handed


def attach_segments(undo: _Undo, ptr: int, prop, sizes: list[int], segment_bytes: int, devices: Sequence[int],
                    index: int, ready: Callable[[int], None] | None = None, timings: dict | None = None,
                    reuse: list[tuple[Any, int]] | None = None, upto: int | None = None) -> _Backing:
    """``cuMemCreate`` one allocation per segment and ``cuMemMap`` each at its place in the reserved
    range at ``ptr``; one step on ``undo`` releases them all (it unmaps and frees the segments,
    one ``cuMemUnmap`` per run, and leaves the range reserved). ``upto``: only the first ``upto``
    segments now, the others by :func:`make_segments` later (the step on ``undo`` releases those too).

    ``reuse``: ``(handle, nbytes)`` allocations handed over by another arena (a swap); a segment
    takes the first one of its size instead of a new allocation (they are taken off the list, the
    rest stay the caller's). Without ``ready``: one ``cuMemSetAccess`` over all of it at the end.
    With ``ready``: each segment is granted as soon as it is mapped and ``ready(i)`` is called, so
    a caller can issue the copy into segment ``i`` while the next ones are created (a copy needs
    its destination mapped and granted when it is enqueued). ``timings`` (optional dict) gains
    ``create_ms``, ``map_ms``, ``access_ms`` and ``ready_ms`` (time spent in ``ready``), summed,
    and ``reused`` (segments handed over). Returns the segments; CudaError from the call that failed."""
    backing = _Backing(ptr, segment_bytes, sizes)
    undo.push("release the segments", backing.release)
    make_segments(backing, range(len(sizes) if upto is None else min(upto, len(sizes))), prop, devices, index, ready, timings, reuse)
    return backing


def make_segments(backing: _Backing, indices: Sequence[int], prop, devices: Sequence[int], index: int,
                  ready: Callable[[int], None] | None = None, timings: dict | None = None,
                  reuse: list[tuple[Any, int]] | None = None) -> None:
    """Create, map and grant segments ``indices`` (ascending) of ``backing``, as :func:`attach_segments`
    describes; without ``ready``, one ``cuMemSetAccess`` per run of adjacent ones."""
    drv = _cuda.driver()
    stats = {"create_ms": 0.0, "map_ms": 0.0, "access_ms": 0.0, "ready_ms": 0.0, "reused": 0}
    ptr, segment_bytes, sizes = backing.ptr, backing.segment_bytes, backing.sizes
    try:
        for i in indices:
            size = sizes[i]
            addr = ptr + i * segment_bytes
            t0 = time.perf_counter()
            handed = next((k for k, (_h, n) in enumerate(reuse or ()) if n == size), None)
            if handed is not None:
                backing.add(i, reuse.pop(handed)[0])
                stats["reused"] += 1
            else:
                with gil_free():
                    made = drv.cuMemCreate(size, prop, 0)
                backing.add(i, _cuda.check(made, f"cuMemCreate({size:,} bytes on cuda:{index}, segment {i})"))
            t1 = time.perf_counter()
            backing.map(i)
            t2 = time.perf_counter()
            stats["create_ms"] += (t1 - t0) * 1e3
            stats["map_ms"] += (t2 - t1) * 1e3
            if ready is not None:
                _set_access(addr, size, devices)
                t3 = time.perf_counter()
                ready(i)
                _cuda.use_device(index)  # ready's copy may have made another device's context current
                stats["access_ms"] += (t3 - t2) * 1e3
                stats["ready_ms"] += (time.perf_counter() - t3) * 1e3
        if ready is None:
            t0 = time.perf_counter()
            for first, last in _adjacent_runs(list(indices)):  # one grant may span many mappings
                start = ptr + first * segment_bytes
                _set_access(start, ptr + (last - 1) * segment_bytes + sizes[last - 1] - start, devices)
            stats["access_ms"] += (time.perf_counter() - t0) * 1e3
    finally:
        if timings is not None:
            for key, value in stats.items():
                timings[key] = timings.get(key, 0) + value
