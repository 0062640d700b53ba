"""The arena: one contiguous, shareable allocation per device; every weight is a zero-copy view into it.

Two backends behind one API:

* **CUDA** (``device=int | "cuda:N"``): one physical allocation by ``cuMemCreate``, reserved and
  mapped as one contiguous virtual range (``cuMemAddressReserve``, ``cuMemMap``,
  ``cuMemSetAccess``). The capacity is rounded up to the allocation granularity (2 MiB on an
  H200). The handle is exportable as a POSIX fd, plus a fabric handle where a one-time preflight
  says fabric is permitted (it is not on machines without an IMEX channel:
  ``CUDA_ERROR_NOT_PERMITTED``).
* **host** (``device="cpu"``, the default without CUDA): a ``memfd`` (anonymous shared memory),
  ``mmap(MAP_SHARED)``, exportable in the same way. Its granularity is fixed at 2 MiB, the CUDA
  granularity of our GPUs, so an arena asked for the same bytes has the same capacity on both
  backends (a layout planned on a CPU machine fits the GPU arena). The pages are sparse until
  touched.

An exporter hands out :meth:`Arena.export` (a small picklable :class:`ArenaDescriptor`); another
process on the host calls :meth:`Arena.open`, which takes the fd with ``pidfd_getfd`` (only pid and
fd number cross the rendezvous) or uses an fd received over a Unix socket, then imports and maps
it, possibly on a different GPU than the exporter's (a peer mapping over NVLink).

Setup is transactional: each step pushes its release onto an undo list; a failure halfway runs
the list in reverse, and :meth:`Arena.close` runs it too. Views do not keep the memory mapped
after ``close()``: using a view of a closed arena is a use-after-free, as with any device pointer.
Dropping the last reference to an arena (and its views) without ``close()`` releases it with a
ResourceWarning.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import secrets
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import _cuda
from .errors import ArenaError, CapabilityError, CudaError, FlashBootError, OutOfMemoryError
from .fdshare import pidfd_getfd
from .memory import Device, Span

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

    ``pid`` and ``fd`` name the exporter's shareable fd (taken with ``pidfd_getfd``);
    ``fabric_handle`` (64 bytes) is set only for CUDA arenas created with a fabric handle.
    """

    backend: str  # "cuda" or "host"
    pid: int
    fd: int
    nbytes: int
    device_index: int  # the exporter's CUDA device; -1 for the host backend
    handle_type: str  # "posix_fd", "fabric+posix_fd" or "memfd"
    granularity: int
    arena_id: str
    fabric_handle: bytes | None = None
    hostname: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the fabric handle as hex)."""
        d = dataclasses.asdict(self)
        d["fabric_handle"] = self.fabric_handle.hex() if self.fabric_handle is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ArenaDescriptor":
        """Inverse of :meth:`to_dict`; ArenaError for missing or unknown fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"backend", "pid", "fd", "nbytes", "device_index", "handle_type", "granularity", "arena_id"} - set(d)
        unknown = set(d) - names
        if missing or unknown:
            raise ArenaError(f"bad arena descriptor: missing {sorted(missing)}, unknown {sorted(unknown)}")
        d = dict(d)
        if d.get("fabric_handle") is not None:
            d["fabric_handle"] = bytes.fromhex(d["fabric_handle"])
        return cls(**d)


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


# Host backend steps, module-level so tests can inject a failure into any one of them.

def _host_memfd(arena_id: str) -> int:
    return os.memfd_create(_MEMFD_PREFIX + arena_id, os.MFD_CLOEXEC)


def _host_truncate(fd: int, nbytes: int) -> None:
    os.ftruncate(fd, nbytes)


def _host_mmap(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _host_address(mm: mmap.mmap) -> int:
    # The ctypes object exports the mmap's buffer only for this line; the address stays valid
    # until mm.close(), and no lingering export blocks that close.
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


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


def _map_handle(undo: _Undo, handle, nbytes: int, granularity: int, devices: Sequence[int],
                timings: dict | None = None) -> int:
    """Reserve a range, map ``handle`` into it and grant access; each step pushes its release.
    ``timings`` (optional) receives ``reserve_map_ms`` and ``set_access_ms``."""
    drv = _cuda.driver()
    t0 = time.perf_counter()
    ptr = _cuda.check(drv.cuMemAddressReserve(nbytes, granularity, 0, 0), f"cuMemAddressReserve({nbytes:,})")
    undo.push("cuMemAddressFree", lambda: _cuda.check(drv.cuMemAddressFree(ptr, nbytes), "cuMemAddressFree"))
    _cuda.check(drv.cuMemMap(ptr, nbytes, 0, handle, 0), f"cuMemMap({nbytes:,})")
    undo.push("cuMemUnmap", lambda: _cuda.check(drv.cuMemUnmap(ptr, nbytes), "cuMemUnmap"))
    t1 = time.perf_counter()
    _set_access(ptr, nbytes, devices)
    if timings is not None:
        timings["reserve_map_ms"] = (t1 - t0) * 1e3
        timings["set_access_ms"] = (time.perf_counter() - t1) * 1e3
    return int(ptr)


# --------------------------------------------------------------------------------------------
# The arena
# --------------------------------------------------------------------------------------------


class Arena:
    """One contiguous shareable allocation on a CUDA device or in host shared memory.

    Build one with :meth:`create` (the owner) or :meth:`open` (an importer of another process's
    arena). Attributes: ``nbytes`` (capacity, rounded up to ``granularity``), ``requested_nbytes``,
    ``device`` (where views live: the accessing device), ``home_device`` (where the memory
    physically is), ``ptr``, ``handle_type``, ``arena_id``, ``imported``.
    """

    def __init__(self, *, undo: _Undo, ptr: int, nbytes: int, requested_nbytes: int, device: Device,
                 home_device: Device, granularity: int, handle_type: str, arena_id: str,
                 imported: bool, descriptor: ArenaDescriptor | None = None, cuda_handle: Any = None,
                 fabric: bool = False):
        # Built by create()/open(); not meant to be called directly.
        self._undo = undo
        self._ptr = ptr
        self._nbytes = nbytes
        self._requested_nbytes = requested_nbytes
        self._device = device
        self._home_device = home_device
        self._granularity = granularity
        self._handle_type = handle_type
        self._arena_id = arena_id
        self._imported = imported
        self._descriptor = descriptor
        self._cuda_handle = cuda_handle  # the owner's CUmemGenericAllocationHandle, for export()
        self._fabric = fabric
        self._flat = None
        self._closed = False

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def create(cls, nbytes: int, device: Any = None, *, access: Any = None) -> "Arena":
        """Allocate an arena of at least ``nbytes`` bytes.

        ``device``: an int, ``"cuda:N"``, ``"cpu"`` (host backend) or None (``cuda:0`` where CUDA
        exists, else ``cpu``). ``access``: extra CUDA devices given read/write access (an index,
        a list, or ``"all"`` for every peer that can); the owning device always has it.

        Raises ArenaError for a bad size, OutOfMemoryError (bytes needed and free) before
        allocating, CapabilityError for a device that does not exist, CudaError for a driver failure.
        """
        nbytes = _check_nbytes(nbytes)
        dev = Device.parse(device)
        if dev.is_cuda:
            return cls._create_cuda(nbytes, dev, access)
        if access is not None:
            raise ArenaError(f"access={access!r} applies to CUDA arenas; this one is on the host backend")
        return cls._create_host(nbytes)

    @classmethod
    def _create_host(cls, nbytes: int) -> "Arena":
        capacity = _round_up(nbytes, HOST_GRANULARITY)
        available = _host_mem_available()
        if capacity > available:
            raise OutOfMemoryError("host arena (MemAvailable + SwapFree)", capacity, available)
        arena_id = secrets.token_hex(8)
        undo = _Undo(f"host arena {arena_id} ({capacity:,} bytes)")
        try:
            fd = _host_memfd(arena_id)
            undo.push("close memfd", lambda: os.close(fd))
            _host_truncate(fd, capacity)
            mm = _host_mmap(fd, capacity)
            undo.push("munmap", mm.close)
            ptr = _host_address(mm)
        except BaseException as exc:
            undo.release()
            if isinstance(exc, OSError):
                raise ArenaError(f"creating a {capacity:,}-byte host arena failed: {exc}") from exc
            raise
        descriptor = ArenaDescriptor("host", os.getpid(), fd, capacity, -1, HANDLE_MEMFD, HOST_GRANULARITY,
                                     arena_id, None, socket.gethostname())
        return cls(undo=undo, ptr=ptr, nbytes=capacity, requested_nbytes=nbytes, device=Device("cpu"),
                   home_device=Device("cpu"), granularity=HOST_GRANULARITY, handle_type=HANDLE_MEMFD,
                   arena_id=arena_id, imported=False, descriptor=descriptor)

    @classmethod
    def _create_cuda(cls, nbytes: int, dev: Device, access: Any) -> "Arena":
        drv = _cuda.driver()
        index = dev.index
        _cuda.use_device(index)
        devices = _resolve_access(index, access)
        fabric = fabric_preflight(index).supported
        prop = _allocation_prop(index, fabric)
        granularity = _granularity(prop)
        capacity = _round_up(nbytes, granularity)
        free, _total = _cuda.check(drv.cuMemGetInfo(), "cuMemGetInfo")
        if capacity > free:
            raise OutOfMemoryError(f"arena on cuda:{index}", capacity, int(free))
        arena_id = secrets.token_hex(8)
        undo = _Undo(f"CUDA arena {arena_id} ({capacity:,} bytes on cuda:{index})",
                     before_release=lambda: _cuda.use_device(index))
        try:
            handle = _cuda.check(drv.cuMemCreate(capacity, prop, 0), f"cuMemCreate({capacity:,} bytes on cuda:{index})")
            undo.push("cuMemRelease", lambda: _cuda.check(drv.cuMemRelease(handle), "cuMemRelease"))
            ptr = _map_handle(undo, handle, capacity, granularity, devices)
        except BaseException:
            undo.release()
            raise
        handle_type = HANDLE_FABRIC_POSIX_FD if fabric else HANDLE_POSIX_FD
        return cls(undo=undo, ptr=ptr, nbytes=capacity, requested_nbytes=nbytes, device=dev, home_device=dev,
                   granularity=granularity, handle_type=handle_type, arena_id=arena_id, imported=False,
                   cuda_handle=handle, fabric=fabric)

    @classmethod
    def open(cls, descriptor: ArenaDescriptor, device: Any = None, *, fd: int | None = None,
             access: Any = None, via: str = "auto", timings: dict | None = None) -> "Arena":
        """Map another process's arena into this one.

        ``device``: the CUDA device that accesses it (default: the exporter's index; a different
        one maps the memory as a peer), or ``"cpu"``/None for a host arena. ``fd``: an fd already
        received for it (e.g. :func:`flashboot.fdshare.recv_fd`); the caller keeps owning it.
        Otherwise the fd is taken from the exporter with ``pidfd_getfd``. ``via``: ``"auto"``,
        ``"pidfd"`` or ``"fabric"`` (CUDA arenas with a fabric handle; auto uses it when the
        descriptor comes from another host).

        The opened arena is an importer: ``close()`` unmaps it and drops its handle; the
        exporter's memory stays. Raises ArenaError naming the pid for an exporter that has
        exited, and for an fd that is not the arena. ``timings`` (optional dict) receives where the
        time went, in ms: ``pidfd_getfd_ms``, ``import_ms`` (CUDA), ``reserve_map_ms``,
        ``set_access_ms`` (CUDA) or ``map_ms`` (host).
        """
        if not isinstance(descriptor, ArenaDescriptor):
            raise ArenaError(f"Arena.open needs an ArenaDescriptor, got {type(descriptor).__name__}")
        if via not in ("auto", "pidfd", "fabric"):
            raise ArenaError(f"via must be 'auto', 'pidfd' or 'fabric', got {via!r}")
        if descriptor.backend == "host":
            if device is not None and Device.parse(device).is_cuda:
                raise ArenaError(f"arena {descriptor.arena_id} is a host arena; open it with device='cpu', not {device!r}")
            if access is not None or via == "fabric":
                raise ArenaError("access= and via='fabric' apply to CUDA arenas; this one is a host arena")
            return cls._open_host(descriptor, fd, timings)
        if descriptor.backend != "cuda":
            raise ArenaError(f"unknown arena backend {descriptor.backend!r} in descriptor {descriptor.arena_id}")
        dev = Device.parse(descriptor.device_index if device is None else device)
        if not dev.is_cuda:
            raise ArenaError(f"arena {descriptor.arena_id} lives on cuda:{descriptor.device_index}; open it on a CUDA device, not {device!r}")
        return cls._open_cuda(descriptor, dev, fd, access, via, timings)

    @staticmethod
    def _take_fd(descriptor: ArenaDescriptor, fd: int | None) -> int:
        """An fd for the arena owned by the caller: a dup of ``fd`` or one taken from the exporter."""
        if fd is not None:
            try:
                return os.dup(fd)
            except OSError as exc:
                raise ArenaError(f"fd {fd} given for arena {descriptor.arena_id} is not open: {exc.strerror}") from None
        try:
            return pidfd_getfd(descriptor.pid, descriptor.fd)
        except FlashBootError as exc:
            raise ArenaError(f"cannot open arena {descriptor.arena_id} exported by pid {descriptor.pid}: {exc}") from None

    @classmethod
    def _open_host(cls, descriptor: ArenaDescriptor, fd: int | None, timings: dict | None = None) -> "Arena":
        t0 = time.perf_counter()
        own_fd = cls._take_fd(descriptor, fd)
        t1 = time.perf_counter()
        undo = _Undo(f"opened host arena {descriptor.arena_id}")
        try:
            try:
                target = _fd_target(own_fd)
                expected = f"/memfd:{_MEMFD_PREFIX}{descriptor.arena_id}"
                if not target.startswith(expected):
                    source = f"fd {fd}" if fd is not None else f"fd {descriptor.fd} of pid {descriptor.pid}"
                    raise ArenaError(f"{source} is not arena {descriptor.arena_id}: it is {target!r}, expected {expected!r}")
                size = os.fstat(own_fd).st_size
                if size < descriptor.nbytes:
                    raise ArenaError(f"arena {descriptor.arena_id} holds {size:,} bytes; the descriptor says {descriptor.nbytes:,}")
                mm = _host_mmap(own_fd, descriptor.nbytes)
                undo.push("munmap", mm.close)
                ptr = _host_address(mm)
                if timings is not None:
                    timings["pidfd_getfd_ms"] = (t1 - t0) * 1e3
                    timings["map_ms"] = (time.perf_counter() - t1) * 1e3
            finally:
                os.close(own_fd)  # the mapping keeps the memory; the fd is not needed any more
        except BaseException as exc:
            undo.release()
            if isinstance(exc, OSError):
                raise ArenaError(f"mapping host arena {descriptor.arena_id} failed: {exc}") from exc
            raise
        return cls(undo=undo, ptr=ptr, nbytes=descriptor.nbytes, requested_nbytes=descriptor.nbytes,
                   device=Device("cpu"), home_device=Device("cpu"), granularity=descriptor.granularity,
                   handle_type=descriptor.handle_type, arena_id=descriptor.arena_id, imported=True,
                   descriptor=descriptor)

    @classmethod
    def _open_cuda(cls, descriptor: ArenaDescriptor, dev: Device, fd: int | None, access: Any, via: str,
                   timings: dict | None = None) -> "Arena":
        drv = _cuda.driver()
        kind = drv.CUmemAllocationHandleType
        index = dev.index
        _cuda.use_device(index)
        home = descriptor.device_index
        if not can_access_peer(index, home):
            raise CapabilityError(f"cuda:{index} cannot map arena {descriptor.arena_id}: no peer access to cuda:{home}")
        devices = _resolve_access(home, access, first=index)
        use_fabric = via == "fabric" or (
            via == "auto" and fd is None and descriptor.fabric_handle is not None
            and descriptor.hostname not in ("", socket.gethostname())
        )
        if use_fabric and descriptor.fabric_handle is None:
            raise ArenaError(f"arena {descriptor.arena_id} has no fabric handle (handle type {descriptor.handle_type})")
        undo = _Undo(f"opened CUDA arena {descriptor.arena_id} (home cuda:{home}, mapped on cuda:{index})",
                     before_release=lambda: _cuda.use_device(index))
        try:
            if use_fabric:
                fabric = drv.CUmemFabricHandle()
                fabric.data = descriptor.fabric_handle
                handle = _cuda.check(drv.cuMemImportFromShareableHandle(fabric, kind.CU_MEM_HANDLE_TYPE_FABRIC),
                                     "cuMemImportFromShareableHandle(FABRIC)")
            else:
                t0 = time.perf_counter()
                own_fd = cls._take_fd(descriptor, fd)
                t1 = time.perf_counter()
                if timings is not None:
                    timings["pidfd_getfd_ms"] = (t1 - t0) * 1e3
                try:
                    handle = _cuda.check(drv.cuMemImportFromShareableHandle(own_fd, kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                                         "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)")
                except CudaError as exc:
                    source = f"fd {fd}" if fd is not None else f"fd {descriptor.fd} of pid {descriptor.pid}"
                    raise ArenaError(f"{source} ({_fd_target(own_fd)}) is not the CUDA memory handle of arena "
                                     f"{descriptor.arena_id}: {exc}") from exc
                finally:
                    os.close(own_fd)  # the imported handle holds the allocation now
                if timings is not None:
                    timings["import_ms"] = (time.perf_counter() - t1) * 1e3
            undo.push("cuMemRelease", lambda: _cuda.check(drv.cuMemRelease(handle), "cuMemRelease"))
            ptr = _map_handle(undo, handle, descriptor.nbytes, descriptor.granularity, devices, timings)
        except BaseException:
            undo.release()
            raise
        return cls(undo=undo, ptr=ptr, nbytes=descriptor.nbytes, requested_nbytes=descriptor.nbytes, device=dev,
                   home_device=Device("cuda", home), granularity=descriptor.granularity,
                   handle_type=descriptor.handle_type, arena_id=descriptor.arena_id, imported=True,
                   descriptor=descriptor)

    # ---- lifetime ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaError(f"arena {self._arena_id} is closed")

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def close(self) -> None:
        """Release everything in reverse order: exported fd, mapping, reservation, handle.

        An importer drops only its own mapping and handle. Closing twice raises ArenaError.
        Views must not be used after this.
        """
        if self._closed:
            raise ArenaError(f"arena {self._arena_id} is already closed")
        self._closed = True
        self._flat = None
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
        """Base address (a device pointer for CUDA, a host address for the host backend)."""
        self._check_open()
        return self._ptr

    @property
    def granularity(self) -> int:
        """Capacity rounding and mapping alignment in bytes (CUDA recommended granularity; 2 MiB on host)."""
        return self._granularity

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
        return f"Arena({self._arena_id}, {self._nbytes:,} bytes on {where}, {self._handle_type}, {role}, {state})"

    # ---- sharing -----------------------------------------------------------------------------

    def export(self) -> ArenaDescriptor:
        """A descriptor another process on this host passes to :meth:`open`.

        The CUDA fd is exported on first call and kept open until :meth:`close`. On an opened
        arena this returns the descriptor it was opened from (it still names the exporter).
        """
        self._check_open()
        if self._descriptor is None:
            self._descriptor = self._export_cuda()
        return self._descriptor

    def _export_cuda(self) -> ArenaDescriptor:
        """Export the POSIX fd (kept open until close) and, where permitted, the fabric handle."""
        drv = _cuda.driver()
        kind = drv.CUmemAllocationHandleType
        index = self._home_device.index
        _cuda.use_device(index)
        fd = int(_cuda.check(drv.cuMemExportToShareableHandle(self._cuda_handle, kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                             "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)"))
        self._undo.push("close exported fd", lambda: os.close(fd))
        fabric_bytes = None
        if self._fabric:
            fh = _cuda.check(drv.cuMemExportToShareableHandle(self._cuda_handle, kind.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                             "cuMemExportToShareableHandle(FABRIC)")
            fabric_bytes = bytes(fh.data)
        return ArenaDescriptor("cuda", os.getpid(), fd, self._nbytes, index, self._handle_type, self._granularity,
                               self._arena_id, fabric_bytes, socket.gethostname())

    # ---- views -------------------------------------------------------------------------------

    def span(self, offset: int = 0, nbytes: int | None = None) -> Span:
        """The byte range ``[offset, offset + nbytes)`` as a :class:`flashboot.memory.Span` (owner: this arena)."""
        self._check_open()
        whole = Span(self._ptr, self._nbytes, self._device, False, self)
        return whole.sub(offset, nbytes)

    def bytes(self):
        """The whole capacity as a flat ``torch.uint8`` tensor (zero copy)."""
        self._check_open()
        if self._flat is None:
            self._flat = self._make_flat()
        return self._flat

    def _make_flat(self):
        import torch

        if self._device.is_cuda:
            import cupy

            with cupy.cuda.Device(self._device.index):
                mem = cupy.cuda.UnownedMemory(self._ptr, self._nbytes, self._undo, device_id=self._device.index)
                array = cupy.ndarray((self._nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
                return torch.from_dlpack(array)
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
        typed = self.bytes()[offset:offset + extent].view(dt)
        return typed.as_strided(shape_t, stride_t)




# --------------------------------------------------------------------------------------------
# Warm-up
# --------------------------------------------------------------------------------------------


def warm_import(device: Any, peers: Any = "all") -> dict[str, Any]:
    """Pay the one-time driver cost of importing and mapping another device's memory now, so a
    later :meth:`Arena.open` on the critical path does not (measured on H200 x2: the first peer
    mapping in a fresh process ~10 ms, the same mapping on the owner's device ~0.5 ms).

    On CUDA device ``device``: makes its primary context current (creating it if needed), then
    for each device in ``peers`` (``"all"``: ``device`` and every device it can access as a peer;
    or an index/name/list) creates one granule there, exports it as a POSIX fd, takes the fd back
    with ``pidfd_getfd``, imports it, reserves, maps and grants ``device`` access (the steps of
    :meth:`Arena.open`), copies within it once, and releases all of it. Nothing is kept.

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
            _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize(warm-up)")  # done before it is unmapped
            out["peers"].append(home)
        except Exception as exc:  # noqa: BLE001 - best effort by design: named in the result, never hidden
            out["errors"].append(f"cuda:{home}: {type(exc).__name__}: {exc}")
        finally:
            try:
                undo.release()
            except Exception as exc:  # noqa: BLE001 - as above
                out["errors"].append(f"cuda:{home} release: {type(exc).__name__}: {exc}")
    out["warm_ms"] = (time.perf_counter() - t0) * 1e3
    return out


__all__ = ["Arena", "ArenaDescriptor", "HandleSupport", "fabric_preflight", "preflight_handle", "can_access_peer",
           "parse_dtype", "HOST_GRANULARITY", "warm_import"]
