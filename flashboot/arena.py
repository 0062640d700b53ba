"""The arena: one contiguous, shareable address range per device; every weight is a zero-copy view into it.

Two backends behind one API, both built from **segments**: physical allocations of
``segment_bytes`` (default :data:`SEGMENT_BYTES`, 256 MiB) mapped back to back into one reserved
virtual range, so the weights still sit at offsets of one byte range and move as one.

* **CUDA** (``device=int | "cuda:N"``): ``cuMemCreate`` per segment, one ``cuMemAddressReserve``,
  ``cuMemMap`` per segment, one ``cuMemSetAccess``. The capacity is rounded up to the allocation
  granularity (2 MiB on an H200). Each segment is exportable as a POSIX fd, plus a fabric handle
  where a one-time preflight says fabric is permitted (it is not on machines without an IMEX
  channel: ``CUDA_ERROR_NOT_PERMITTED``).
* **host** (``device="cpu"``, the default without CUDA): one ``memfd`` (anonymous shared memory)
  per segment, mapped with ``MAP_FIXED`` into one reserved range, exportable in the same way. Its
  granularity is fixed at 2 MiB, the CUDA granularity of our GPUs, so an arena asked for the same
  bytes has the same capacity and segments on both backends (a layout planned on a CPU machine
  fits the GPU arena). The pages are sparse until touched.

Why segments: granting a GPU access to a peer's allocation costs ~9.5 ms the first time when the
allocation is 512 MiB or larger, whatever its size, and ~1 ms below that (measured on H200;
:data:`SEGMENT_BYTES`). With 256 MiB segments an importer maps the first segment in ~1 ms and the
rest on first use, each just ahead of its copy, so mapping overlaps the transfer.

An exporter hands out :meth:`Arena.export` (a small picklable :class:`ArenaDescriptor`); another
process on the host calls :meth:`Arena.open`, which takes the segments' fds with ``pidfd_getfd``
(only pid and fd numbers cross the rendezvous) or uses fds received over a Unix socket, then
imports and maps them, possibly on a different GPU than the exporter's (a peer mapping over NVLink).

Setup is transactional: each step pushes its release onto an undo list; a failure halfway runs
the list in reverse, and :meth:`Arena.close` runs it too. Views do not keep the memory mapped
after ``close()``: using a view of a closed arena is a use-after-free, as with any device pointer.
Dropping the last reference to an arena (and its views) without ``close()`` releases it with a
ResourceWarning.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import mmap
import os
import re
import secrets
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import _cuda
from ._json import check_fields, int_at_least, is_str
from .errors import ArenaError, CapabilityError, CudaError, FlashBootError, OutOfMemoryError
from .fdshare import pidfd_getfd, take_fds
from .memory import Device, Span

SEGMENT_BYTES = 256 << 20
"""Default size of an arena's physical allocations (the last one may be shorter).

Measured on H200 x2 (benchmarks/RESULTS.md, "Peer mapping cost"): granting a GPU access to a
peer's allocation of 512 MiB or more costs ~9.5 ms the first time (whatever the size: 512 MiB and
8 GiB alike), ~1 ms below that, ~0.05 ms per further segment. Arenas of 256 MiB segments are mapped
by a clone segment by segment, just ahead of each segment's copy, so the mapping overlaps the copy
instead of standing before its first byte."""

HOST_GRANULARITY = 2 << 20
"""Capacity rounding of host arenas: 2 MiB, the CUDA VMM granularity on our GPUs (see module doc)."""

HANDLE_POSIX_FD = "posix_fd"
HANDLE_FABRIC_POSIX_FD = "fabric+posix_fd"
HANDLE_MEMFD = "memfd"

_MEMFD_PREFIX = "flashboot-arena-"


# --------------------------------------------------------------------------------------------
# The undo list
# --------------------------------------------------------------------------------------------


class _Undo:
    """Releases of everything an arena acquired, run newest first.

    Owned by an :class:`Arena` and referenced by its views (so the memory outlives the last view
    when the arena is dropped without ``close()``); never references the arena itself.
    """

    def __init__(self, what: str, before_release: Callable[[], None] | None = None):
        self.what = what
        self._steps: list[tuple[str, Callable[[], None]]] = []
        self._before_release = before_release
        self._lock = threading.Lock()

    def push(self, name: str, release: Callable[[], None]) -> None:
        self._steps.append((name, release))

    def __len__(self) -> int:
        return len(self._steps)

    @_cuda.keeps_context
    def release(self) -> None:
        """Run every release in reverse order; all run even if one fails, the first error is raised."""
        with self._lock:
            steps, self._steps = self._steps, []
        if not steps:
            return
        first: BaseException | None = None
        if self._before_release is not None:
            try:
                self._before_release()
            except BaseException as exc:  # still release what we can
                first = exc
        for name, release in reversed(steps):
            try:
                release()
            except BaseException as exc:
                if first is None:
                    first = exc
        if first is not None:
            if isinstance(first, FlashBootError):
                raise first
            raise ArenaError(f"releasing {self.what} failed: {type(first).__name__}: {first}") from first

    def __del__(self) -> None:
        if self._steps:
            warnings.warn(f"{self.what} was not closed; releasing it now", ResourceWarning, stacklevel=2)
            try:
                self.release()
            except FlashBootError:
                pass  # nobody to report to from a finalizer; the warning above names the arena


# --------------------------------------------------------------------------------------------
# Descriptor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArenaDescriptor:
    """What another process on this host needs to open an arena: small and picklable.

    ``pid`` and ``fds`` name the exporter's shareable fds, one per segment (taken with
    ``pidfd_getfd``); segment *i* covers bytes ``[i * segment_bytes, min((i + 1) *
    segment_bytes, nbytes))``. ``fabric_handles`` (64 bytes each, one per segment) are set only
    for CUDA arenas created with fabric handles.
    """

    backend: str  # "cuda" or "host"
    pid: int
    fds: tuple[int, ...]
    nbytes: int
    device_index: int  # the exporter's CUDA device; -1 for the host backend
    handle_type: str  # "posix_fd", "fabric+posix_fd" or "memfd"
    granularity: int
    segment_bytes: int
    arena_id: str
    fabric_handles: tuple[bytes, ...] | None = None
    hostname: str = ""

    def __post_init__(self) -> None:
        expected = _segment_count(self.nbytes, self.segment_bytes)
        if len(self.fds) != expected:
            raise ArenaError(f"arena descriptor {self.arena_id}: {self.nbytes:,} bytes in segments of "
                             f"{self.segment_bytes:,} need {expected} fds, it lists {len(self.fds)}")
        if self.fabric_handles is not None and len(self.fabric_handles) != expected:
            raise ArenaError(f"arena descriptor {self.arena_id}: {expected} segments but "
                             f"{len(self.fabric_handles)} fabric handles")

    @property
    def segments(self) -> int:
        """Number of physical allocations (one fd each)."""
        return len(self.fds)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (fabric handles as hex)."""
        d = dataclasses.asdict(self)
        d["fds"] = list(self.fds)
        d["fabric_handles"] = [h.hex() for h in self.fabric_handles] if self.fabric_handles is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ArenaDescriptor":
        """Inverse of :meth:`to_dict`; ArenaError naming the field for a missing, unknown or
        mistyped one (a descriptor arrives from another process: every field is checked)."""
        if not isinstance(d, dict):
            raise ArenaError(f"bad arena descriptor: must be an object, found {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"backend", "pid", "fds", "nbytes", "device_index", "handle_type", "granularity", "segment_bytes",
                   "arena_id"} - set(d)
        unknown = set(d) - names
        if missing or unknown:
            raise ArenaError(f"bad arena descriptor: missing {sorted(missing)}, unknown {sorted(unknown)}")
        d = dict(d)
        check_fields(d, _DESCRIPTOR_FIELDS, ArenaError, "bad arena descriptor: ")
        d["fds"] = tuple(d["fds"])
        if d.get("fabric_handles") is not None:
            d["fabric_handles"] = tuple(bytes.fromhex(h) for h in d["fabric_handles"])
        return cls(**d)


_HANDLE_TYPES = (HANDLE_POSIX_FD, HANDLE_FABRIC_POSIX_FD, HANDLE_MEMFD)


def _is_handle(h: Any) -> bool:
    return type(h) is str and len(h) == 128 and all(c in "0123456789abcdef" for c in h)


_DESCRIPTOR_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "backend": ("'cuda' or 'host'", lambda v: v in ("cuda", "host")),
    "pid": ("an int >= 1", int_at_least(1)),
    "fds": ("a list of ints >= 0", lambda v: type(v) is list and all(map(int_at_least(0), v))),
    "nbytes": ("an int >= 1", int_at_least(1)),
    "device_index": ("an int >= -1", int_at_least(-1)),
    "handle_type": (f"one of {_HANDLE_TYPES}", lambda v: v in _HANDLE_TYPES),
    "granularity": ("an int >= 1", int_at_least(1)),
    "segment_bytes": ("an int >= 1", int_at_least(1)),
    "arena_id": ("1-64 hex digits", lambda v: is_str(v) and re.fullmatch(r"[0-9a-f]{1,64}", v) is not None),
    "fabric_handles": ("null or a list of 64-byte hex handles",
                       lambda v: v is None or (type(v) is list and all(map(_is_handle, v)))),
    "hostname": ("a string", is_str),
}
"""What each descriptor field must be (in words) and its test; :meth:`ArenaDescriptor.from_dict` checks them."""


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _check_nbytes(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise ArenaError(f"arena size must be an int number of bytes, got {nbytes!r}")
    if nbytes <= 0:
        raise ArenaError(f"arena size must be positive, got {nbytes:,} bytes")
    return nbytes


def _round_up(n: int, granularity: int) -> int:
    return (n + granularity - 1) // granularity * granularity


def parse_dtype(dtype: Any):
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float16"``)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip()
        name = name[len("torch."):] if name.startswith("torch.") else name
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    raise ArenaError(f"unknown dtype {dtype!r}: use a torch.dtype or its name, e.g. 'bfloat16'")


def _host_mem_available() -> int:
    """Bytes the kernel says a new shared mapping can take (MemAvailable + SwapFree)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return fields.get("MemAvailable", fields.get("MemFree", 0)) + fields.get("SwapFree", 0)


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


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
    return os.memfd_create(name, os.MFD_CLOEXEC)


def _host_truncate(fd: int, nbytes: int) -> None:
    os.ftruncate(fd, nbytes)


def _host_reserve(nbytes: int) -> int:
    return _mmap_call(None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)


def _host_map_segment(addr: int, fd: int, nbytes: int) -> None:
    _mmap_call(addr, nbytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd)


def _memfd_name(arena_id: str, segment: int) -> str:
    return f"{_MEMFD_PREFIX}{arena_id}.{segment}"


def _segment_count(nbytes: int, segment_bytes: int) -> int:
    if segment_bytes <= 0:
        raise ArenaError(f"segment size must be positive, got {segment_bytes:,} bytes")
    return -(-nbytes // segment_bytes)


def _segment_sizes(nbytes: int, segment_bytes: int) -> list[int]:
    """Sizes of the segments of an ``nbytes`` arena: all ``segment_bytes`` but a shorter last one."""
    count = _segment_count(nbytes, segment_bytes)
    return [segment_bytes] * (count - 1) + [nbytes - segment_bytes * (count - 1)]


def _check_segment_bytes(segment_bytes: Any, granularity: int) -> int:
    if segment_bytes is None:
        return _round_up(SEGMENT_BYTES, granularity)
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes <= 0:
        raise ArenaError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
    if segment_bytes % granularity:
        raise ArenaError(f"segment_bytes {segment_bytes:,} is not a multiple of the allocation granularity "
                         f"{granularity:,}")
    return segment_bytes


def _make_fd_room(count: int, what: str) -> None:
    """Raise the soft open-file limit (up to the hard one) so ``count`` more fds fit; ArenaError if not."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    need = in_use + count + 64  # headroom for sockets and files the caller opens next
    if soft != resource.RLIM_INFINITY and need > soft:
        if hard != resource.RLIM_INFINITY and need > hard:
            raise ArenaError(f"{what} needs {count:,} fds (one per segment) and {in_use:,} are open; the hard limit "
                             f"on open files is {hard:,}: raise it (ulimit -Hn) or use larger segments")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --------------------------------------------------------------------------------------------
# CUDA helpers
# --------------------------------------------------------------------------------------------



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
    _cuda.check(drv.cuMemSetAccess(ptr, nbytes, descs, len(descs)), f"cuMemSetAccess({list(devices)})")


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


# --------------------------------------------------------------------------------------------
# The arena
# --------------------------------------------------------------------------------------------


class _DeviceRange:
    """``nbytes`` of device memory at ``ptr`` as a CUDA Array Interface (v2) exporter; holds ``owner``."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class Arena:
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
                 imported: bool, descriptor: ArenaDescriptor | None = None, handles: list | None = None,
                 fabric: bool = False, pending: Callable[[int], None] | None = None):
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
        self._handles = handles  # the owner's CUmemGenericAllocationHandles, for export()
        self._fabric = fabric
        self._map_segment = pending  # an importer's "map segment i"; None once everything is mapped
        self._mapped = [pending is None] * len(self._segment_sizes)
        self._map_lock = threading.Lock()
        self._map_stats = {"segments": 0, "map_ms": 0.0}
        self._flat = None
        self._closed = False

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    @_cuda.keeps_context
    def create(cls, nbytes: int, device: Any = None, *, access: Any = None,
               segment_bytes: int | None = None) -> "Arena":
        """Allocate an arena of at least ``nbytes`` bytes.

        ``device``: an int, ``"cuda:N"``, ``"cpu"`` (host backend) or None (``cuda:0`` where CUDA
        exists, else ``cpu``). ``access``: extra CUDA devices given read/write access (an index,
        a list, or ``"all"`` for every peer that can); the owning device always has it.
        ``segment_bytes``: size of each physical allocation (default :data:`SEGMENT_BYTES`; a
        multiple of the granularity).

        Raises ArenaError for a bad size, OutOfMemoryError (bytes needed and free) before
        allocating, CapabilityError for a device that does not exist, CudaError for a driver failure.
        """
        nbytes = _check_nbytes(nbytes)
        dev = Device.parse(device)
        if dev.is_cuda:
            return cls._create_cuda(nbytes, dev, access, segment_bytes)
        if access is not None:
            raise ArenaError(f"access={access!r} applies to CUDA arenas; this one is on the host backend")
        return cls._create_host(nbytes, segment_bytes)

    @classmethod
    def _create_host(cls, nbytes: int, segment_bytes: Any) -> "Arena":
        capacity = _round_up(nbytes, HOST_GRANULARITY)
        segment_bytes = _check_segment_bytes(segment_bytes, HOST_GRANULARITY)
        available = _host_mem_available()
        if capacity > available:
            raise OutOfMemoryError("host arena (MemAvailable + SwapFree)", capacity, available)
        arena_id = secrets.token_hex(8)
        sizes = _segment_sizes(capacity, segment_bytes)
        _make_fd_room(len(sizes), f"a host arena of {capacity:,} bytes")
        undo = _Undo(f"host arena {arena_id} ({capacity:,} bytes)")
        fds: list[int] = []
        try:
            ptr = _host_reserve(capacity)
            undo.push("munmap", lambda: _host_munmap(ptr, capacity))  # also unmaps every segment in it
            for i, size in enumerate(sizes):
                fd = _host_memfd(_memfd_name(arena_id, i))
                undo.push("close memfd", lambda fd=fd: os.close(fd))
                fds.append(fd)
                _host_truncate(fd, size)
                _host_map_segment(ptr + i * segment_bytes, fd, size)
        except BaseException as exc:
            undo.release()
            if isinstance(exc, OSError):
                raise ArenaError(f"creating a {capacity:,}-byte host arena failed: {exc}") from exc
            raise
        descriptor = ArenaDescriptor("host", os.getpid(), tuple(fds), capacity, -1, HANDLE_MEMFD, HOST_GRANULARITY,
                                     segment_bytes, arena_id, None, socket.gethostname())
        return cls(undo=undo, ptr=ptr, nbytes=capacity, requested_nbytes=nbytes, device=Device("cpu"),
                   home_device=Device("cpu"), granularity=HOST_GRANULARITY, segment_bytes=segment_bytes,
                   handle_type=HANDLE_MEMFD, arena_id=arena_id, imported=False, descriptor=descriptor)

    @classmethod
    def _create_cuda(cls, nbytes: int, dev: Device, access: Any, segment_bytes: Any) -> "Arena":
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
        undo = _Undo(f"CUDA arena {arena_id} ({capacity:,} bytes on cuda:{index})",
                     before_release=lambda: _cuda.use_device(index))
        handles = []
        try:
            ptr = _reserve(undo, capacity, granularity)
            for i, size in enumerate(_segment_sizes(capacity, segment_bytes)):
                handle = _cuda.check(drv.cuMemCreate(size, prop, 0),
                                     f"cuMemCreate({size:,} bytes on cuda:{index}, segment {i})")
                undo.push("cuMemRelease", lambda h=handle: _cuda.check(drv.cuMemRelease(h), "cuMemRelease"))
                handles.append(handle)
                _map_at(undo, ptr + i * segment_bytes, handle, size)
            _set_access(ptr, capacity, devices)  # one grant may span many mappings
        except BaseException:
            undo.release()
            raise
        handle_type = HANDLE_FABRIC_POSIX_FD if fabric else HANDLE_POSIX_FD
        return cls(undo=undo, ptr=ptr, nbytes=capacity, requested_nbytes=nbytes, device=dev, home_device=dev,
                   granularity=granularity, segment_bytes=segment_bytes, handle_type=handle_type,
                   arena_id=arena_id, imported=False, handles=handles, fabric=fabric)

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
            if dev.is_cuda:
                base = _reserve(undo, descriptor.nbytes, descriptor.granularity)
            else:
                for i, fd in enumerate(own):
                    cls._check_memfd(descriptor, fds, i, fd, sizes[i])
                base = _host_reserve(descriptor.nbytes)
                undo.push("munmap", lambda: _host_munmap(base, descriptor.nbytes))
            stats["pidfd_getfd_ms"], stats["reserve_ms"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        except BaseException as exc:
            undo.release()
            if isinstance(exc, OSError):
                raise ArenaError(f"opening arena {descriptor.arena_id} failed: {exc}") from exc
            raise

        def map_segment(i: int, out: dict) -> None:
            """Import, map and grant segment ``i``; its releases join the arena's undo list."""
            ptr, size = base + i * descriptor.segment_bytes, sizes[i]
            t = time.perf_counter()
            if not dev.is_cuda:
                try:
                    _host_map_segment(ptr, own[i], size)
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
            _map_at(undo, ptr, handle, size)
            t2 = time.perf_counter()
            _set_access(ptr, size, devices)
            t3 = time.perf_counter()
            for key, ms in (("import_ms", t1 - t), ("map_ms", t2 - t1), ("set_access_ms", t3 - t2)):
                out[key] = out.get(key, 0.0) + ms * 1e3

        arena = cls(undo=undo, ptr=base, nbytes=descriptor.nbytes, requested_nbytes=descriptor.nbytes, device=dev,
                    home_device=Device("cuda", home) if dev.is_cuda else dev, granularity=descriptor.granularity,
                    segment_bytes=descriptor.segment_bytes, handle_type=descriptor.handle_type,
                    arena_id=descriptor.arena_id, imported=True, descriptor=descriptor, pending=map_segment)
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

    # ---- mapping on first use ------------------------------------------------------------------

    def _map_segments(self, first: int, last: int, out: dict | None = None) -> None:
        """Map segments ``first`` .. ``last - 1`` that are not mapped yet (importers only)."""
        if self._map_segment is not None:
            self._map_pending(first, last, out)

    @_cuda.keeps_context
    def _map_pending(self, first: int, last: int, out: dict | None) -> None:
        with self._map_lock:
            if self._map_segment is None:
                return
            t0 = time.perf_counter()
            done = 0
            for i in range(first, last):
                if not self._mapped[i]:
                    if self._device.is_cuda:
                        _cuda.use_device(self._device.index)
                    self._map_segment(i, out if out is not None else {})
                    self._mapped[i] = True
                    done += 1
            if done:
                self._map_stats["segments"] += done
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
        """Bytes of the capacity mapped in this process (all of it for an owner)."""
        return sum(n for n, m in zip(self._segment_sizes, self._mapped) if m)

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

    def close(self) -> None:
        """Release everything in reverse order: exported fds, mappings, reservation, handles.

        An importer drops only its own mappings and handles. Closing twice raises ArenaError.
        Views must not be used after this.
        """
        if self._closed:
            raise ArenaError(f"arena {self._arena_id} is already closed")
        self._closed = True
        self._flat = None
        with self._map_lock:
            self._map_segment = None
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
        self._map_segments(0, len(self._mapped))
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
        state = "closed" if self._closed else f"ptr={self._ptr:#x}"
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
        if self._descriptor is None:
            self._descriptor = self._export_cuda()
        return self._descriptor

    def _export_cuda(self) -> ArenaDescriptor:
        """Export one POSIX fd per segment (kept open until close) and, where permitted, fabric handles."""
        drv = _cuda.driver()
        kind = drv.CUmemAllocationHandleType
        index = self._home_device.index
        _cuda.use_device(index)
        _make_fd_room(len(self._handles), f"exporting arena {self._arena_id}")
        fds: list[int] = []
        self._undo.push("close exported fds", lambda: [os.close(fd) for fd in fds])
        fabric: list[bytes] = []
        for i, handle in enumerate(self._handles):
            fds.append(int(_cuda.check(drv.cuMemExportToShareableHandle(handle, kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                                       f"cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR, segment {i})")))
            if self._fabric:
                fh = _cuda.check(drv.cuMemExportToShareableHandle(handle, kind.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                                 f"cuMemExportToShareableHandle(FABRIC, segment {i})")
                fabric.append(bytes(fh.data))
        return ArenaDescriptor("cuda", os.getpid(), tuple(fds), self._nbytes, index, self._handle_type,
                               self._granularity, self._segment_bytes, self._arena_id,
                               tuple(fabric) if self._fabric else None, socket.gethostname())

    # ---- views -------------------------------------------------------------------------------

    def span(self, offset: int = 0, nbytes: int | None = None) -> Span:
        """The byte range ``[offset, offset + nbytes)`` as a :class:`flashboot.memory.Span` (owner:
        this arena); its segments are mapped first."""
        self._check_open()
        sub = Span(self._ptr, self._nbytes, self._device, False, self).sub(offset, nbytes)
        if sub.nbytes:
            self._map_segments(offset // self._segment_bytes, -(-(offset + sub.nbytes) // self._segment_bytes))
        return sub

    def bytes(self):
        """The whole capacity as a flat ``torch.uint8`` tensor (zero copy; maps every segment)."""
        self._check_open()
        self._map_segments(0, len(self._mapped))
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




# --------------------------------------------------------------------------------------------
# Warm-up
# --------------------------------------------------------------------------------------------


_warm_mappings: dict[tuple[int, int], _Undo] = {}
"""(accessing device, home device) -> the warm-up granule kept mapped (see :func:`warm_import`)."""
_warm_lock = threading.Lock()


@_cuda.keeps_context
def warm_import(device: Any, peers: Any = "all", *, keep: bool = True) -> dict[str, Any]:
    """Pay the driver's costs of importing and mapping another device's memory now, so a later
    :meth:`Arena.open` on the critical path does not.

    Measured on H200 x2: the first peer grant in a process costs ~2 ms, and ~1 ms again whenever
    no peer mapping from that device is left; while one small mapping stays, granting a 256 MiB
    segment costs ~0.1 ms. So on CUDA device ``device`` this makes the primary context current,
    then for each device in ``peers`` (``"all"``: ``device`` and every device it can access as a
    peer; or an index/name/list) creates one granule there, exports it as a POSIX fd, takes the
    fd back with ``pidfd_getfd``, imports, reserves, maps and grants ``device`` access (the steps
    of :meth:`Arena.open`) and copies within it once. With ``keep`` (default) the granule stays
    mapped until :func:`release_warm_imports` or process exit: one granule (2 MiB on an H200) of
    each peer's memory per process; a pair already kept is not warmed again.

    Best effort by design (it only moves cost earlier): a step that fails is named in
    ``errors`` and the other devices are still warmed; the real open raises its own errors.
    Host backend: nothing to warm. Returns ``{"warm_ms", "context_ms", "peers": [warmed indices],
    "errors": [...]}``.
    """
    dev = Device.parse(device)
    out: dict[str, Any] = {"warm_ms": 0.0, "context_ms": 0.0, "peers": [], "errors": []}
    if not dev.is_cuda:
        return out
    t0 = time.perf_counter()
    drv = _cuda.driver()
    index = dev.index
    _cuda.use_device(index)
    out["context_ms"] = (time.perf_counter() - t0) * 1e3
    if isinstance(peers, str) and peers == "all":
        targets = [index] + [i for i in range(_cuda.device_count()) if i != index and can_access_peer(index, i)]
    else:
        targets = [Device.parse(p).index for p in ([peers] if isinstance(peers, (int, str, Device)) else peers)]
    posix = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    for home in targets:
        with _warm_lock:
            if (index, home) in _warm_mappings:
                out["peers"].append(home)
                continue
        undo = _Undo(f"warm-up import of a cuda:{home} granule on cuda:{index}",
                     before_release=lambda: _cuda.use_device(index))
        try:
            prop = _allocation_prop(home, fabric=False)
            granularity = _granularity(prop)
            handle = _cuda.check(drv.cuMemCreate(granularity, prop, 0), f"cuMemCreate(warm-up, cuda:{home})")
            undo.push("cuMemRelease", lambda h=handle: _cuda.check(drv.cuMemRelease(h), "cuMemRelease"))
            fd = int(_cuda.check(drv.cuMemExportToShareableHandle(handle, posix, 0),
                                 "cuMemExportToShareableHandle(warm-up)"))
            undo.push("close exported fd", lambda f=fd: os.close(f))
            own_fd = pidfd_getfd(os.getpid(), fd)
            try:
                imported = _cuda.check(drv.cuMemImportFromShareableHandle(own_fd, posix),
                                       "cuMemImportFromShareableHandle(warm-up)")
            finally:
                os.close(own_fd)
            undo.push("cuMemRelease(imported)", lambda h=imported: _cuda.check(drv.cuMemRelease(h), "cuMemRelease"))
            ptr = _map_handle(undo, imported, granularity, granularity, [index])
            half = granularity // 2
            _cuda.check(drv.cuMemcpyDtoD(ptr, ptr + half, half), "cuMemcpyDtoD(warm-up)")
            _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize(warm-up)")  # done before it may be unmapped
            out["peers"].append(home)
            if keep:
                with _warm_lock:
                    _warm_mappings[(index, home)], undo = undo, None
        except Exception as exc:  # noqa: BLE001 - best effort by design: named in the result, never hidden
            out["errors"].append(f"cuda:{home}: {type(exc).__name__}: {exc}")
        finally:
            try:
                if undo is not None:
                    undo.release()
            except Exception as exc:  # noqa: BLE001 - as above
                out["errors"].append(f"cuda:{home} release: {type(exc).__name__}: {exc}")
    out["warm_ms"] = (time.perf_counter() - t0) * 1e3
    return out


@_cuda.keeps_context
def release_warm_imports() -> int:
    """Unmap and free every granule :func:`warm_import` kept; returns how many there were."""
    with _warm_lock:
        kept = list(_warm_mappings.values())
        _warm_mappings.clear()
    for undo in kept:
        undo.release()
    return len(kept)



__all__ = ["Arena", "ArenaDescriptor", "HandleSupport", "fabric_preflight", "preflight_handle", "can_access_peer",
           "parse_dtype", "HOST_GRANULARITY", "SEGMENT_BYTES", "release_warm_imports", "warm_import"]
