"""Host pages for DMA: NUMA placement (mbind) and page-locking (cuMemHostRegister).

Pinning runs at about a third of the H2D rate on our machines (../shared/hardware.md: 4 GB in
220-290 ms), so callers do it off the critical path: early, in a background thread
(:func:`flashboot.stage`), or once per residency in the preloader daemon (served load).
``cuMemHostRegister`` pins the pages where they already are, unlike ``cudaHostAlloc``, so a
staging buffer bound to the GPU's NUMA node stays there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import _cuda
from .errors import CapabilityError, CudaError, FlashBootError
from .memory import Device, map_refused, thread_refused

CU_MEMHOSTREGISTER_PORTABLE = 0x01
"""Pinned for every CUDA context, not only the one current at registration (the daemon copies to
whichever GPU asks)."""

_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_PREFERRED = 1
_MPOL_BIND = 2
NUMA_POLICIES = {"preferred": _MPOL_PREFERRED, "bind": _MPOL_BIND}


# ------------------------------------------------------------------------------------------ NUMA
def numa_nodes(sys_root: str = "/sys") -> list[int]:
    """The online NUMA node ids (``[0]`` where the kernel exposes no node directory)."""
    base = os.path.join(sys_root, "devices/system/node")
    try:
        nodes = sorted(int(n[4:]) for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit())
    except FileNotFoundError:
        return [0]
    return nodes or [0]


def gpu_pci_bus_id(device: Device) -> str:
    """The device's PCI address as sysfs spells it (``0000:18:00.0``). Needs CUDA."""
    drv = _cuda.driver()
    dev = _cuda.check(drv.cuDeviceGet(device.index), f"cuDeviceGet({device.index})")
    raw = _cuda.check(drv.cuDeviceGetPCIBusId(32, dev), f"cuDeviceGetPCIBusId({device})")
    text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    return text.split("\x00", 1)[0].strip().lower()


def gpu_numa_node(device: Device, sys_root: str = "/sys") -> tuple[int | None, str]:
    """``(node, reason)``: the NUMA node nearest ``device``, or ``None`` and why binding is skipped.

    Binding is skipped on the host backend, on single-node machines and where the GPU reports no
    affinity (``numa_node`` = -1, as in most VMs).
    """
    if not device.is_cuda:
        return None, "host backend: no GPU to be near"
    nodes = numa_nodes(sys_root)
    if len(nodes) < 2:
        return None, f"single NUMA node ({nodes[0]}): nothing to choose"
    bus_id = gpu_pci_bus_id(device)
    path = os.path.join(sys_root, "bus/pci/devices", bus_id, "numa_node")
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"
    if node < 0:
        return None, f"{device} ({bus_id}) reports no NUMA affinity ({path} = {node})"
    return node, f"{device} ({bus_id}) is on NUMA node {node} of {len(nodes)}"


def bind_to_node(addr: int, nbytes: int, node: int, policy: str = "preferred") -> None:
    """Set the NUMA policy of the mapping ``[addr, addr + nbytes)`` to ``node`` (mbind(2)).

    Call it before the pages are touched: the policy decides where they are allocated. For a
    shared tmpfs mapping the policy is the file's, so pages the preloader writes through
    ``pwrite`` land there too. ``preferred`` (default) falls back to other nodes when ``node`` is
    full, so a crowded node slows the H2D instead of failing the boot; ``bind`` is strict.
    """
    if policy not in NUMA_POLICIES:
        raise FlashBootError(f"unknown NUMA policy {policy!r}; known: {', '.join(NUMA_POLICIES)}")
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise CapabilityError(f"mbind: no syscall number known for {platform.machine()}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes),
                      ctypes.c_int(NUMA_POLICIES[policy]), mask, ctypes.c_ulong(len(mask) * bits + 1),
                      ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        raise FlashBootError(
            f"mbind({addr:#x}, {nbytes:,} bytes, {policy} node {node}) failed: {errno.errorcode.get(err, err)} "
            f"({os.strerror(err)})"
        )


# ------------------------------------------------------------------------------------- pinning


def fs_type(path: str, mounts_file: str = "/proc/self/mounts") -> str:
    """The filesystem type (``tmpfs``, ``ext4``, ...) holding ``path``: the longest mount point
    that contains it, or ``"unknown"``."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open(mounts_file) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def pin_refused_message(path: str, offset: int, nbytes: int, fs_type: str, error: Any) -> str:
    """What to say when the driver refuses to page-lock an image's host mapping for DMA."""
    msg = (f"cannot pin {nbytes:,} bytes at offset {offset:,} of {path} (a {fs_type} file) for DMA: {error}. "
           "Pinning (cuMemHostRegister) needs anonymous or tmpfs-backed memory; ")
    if fs_type in ("tmpfs", "ramfs", "hugetlbfs"):
        return msg + ("this file is on tmpfs already, so the driver refused for another reason (locked-memory "
                      "limit `ulimit -l`, or too little free memory)")
    return msg + ("this driver refuses a shared mapping of a file on disk. Stage the image into /dev/shm first "
                  "(`flashboot preload IMAGE_DIR`, then load the directory again; for a raw file, copy it to "
                  "/dev/shm) and pass that")


@dataclass
class PinnedRegion:
    """A host range page-locked with ``cuMemHostRegister``; :meth:`unregister` (or ``with``) unpins it."""

    ptr: int
    nbytes: int
    pin_ms: float
    device_index: int
    _lock: threading.Lock
    _registered: bool = True

    @property
    def registered(self) -> bool:
        return self._registered

    @_cuda.keeps_context
    def unregister(self) -> float:
        """Unpin (idempotent); returns the milliseconds it took (about 170 ms per 8 GB)."""
        with self._lock:
            if not self._registered:
                return 0.0
            _cuda.use_device(self.device_index)  # the driver call needs a context in this thread too
            t0 = time.perf_counter()
            _cuda.check(_cuda.driver().cuMemHostUnregister(self.ptr), f"cuMemHostUnregister({self.ptr:#x})")
            self._registered = False
            return (time.perf_counter() - t0) * 1e3

    def __enter__(self) -> "PinnedRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()


POPULATE_THREADS = min(8, os.cpu_count() or 1)
"""Threads that fault a large buffer's pages in before it is pinned (:func:`populate`)."""
POPULATE_SHARE_BYTES = 64 << 20
"""The least each of those threads is given (a thread start costs more than faulting in less)."""
POPULATE_TIMEOUT_S = 120.0
"""How long :func:`populate` waits for a thread (~30 GB/s on 8 threads of the H200 machine)."""


def populate(buf, *, threads: int | None = None) -> None:
    """Fault in every page of the writable mapping ``buf`` before it is pinned: one byte written
    per 4 KiB page (the kernel zeroes each page, or each 2 MiB huge page, as it maps it), shared
    out over up to ``threads`` threads (default :data:`POPULATE_THREADS`; numpy writes with the
    GIL released).

    ``cuMemHostRegister`` of memory never touched faults every page in itself, on one thread. A
    12.81 GiB level-1 backup on the H200 machine (2026-12-04, two rounds): 4,313-5,058 ms as small
    pages; 2,380-3,549 ms with huge pages asked for (:func:`~flashboot.fileio.io_buffer`); with
    huge pages and populated by 8 threads first, 849-877 ms (populate 437-570, register 308-412)."""
    import numpy as np

    pages = np.frombuffer(buf, np.uint8)[::4096]
    if threads is None:
        threads = POPULATE_THREADS
    threads = max(1, min(threads, len(pages) * 4096 // POPULATE_SHARE_BYTES))
    share = -(-len(pages) // threads)
    parts = [pages[i:i + share] for i in range(0, len(pages), share)]
    errors: list[BaseException] = []

    def fill(i: int) -> None:  # an index, not a view: a thread never started would keep buf exported
        try:
            parts[i].fill(0)
        except BaseException as exc:  # raised by the caller below
            errors.append(exc.with_traceback(None))  # its frames hold a view of buf

    workers = [threading.Thread(target=fill, args=(i,), name=f"flashboot-populate-{i}", daemon=True)
               for i in range(1, len(parts))]
    refused = None
    for k, worker in enumerate(workers):
        try:
            worker.start()
        except RuntimeError as exc:  # the started ones still write into buf: joined before the error is raised
            refused = thread_refused(f"faulting in {len(buf):,} bytes with {len(workers) + 1} threads", exc)
            del workers[k:]
            break
    if refused is None:
        fill(0)
    for worker in workers:
        worker.join(POPULATE_TIMEOUT_S)
        if worker.is_alive():
            raise FlashBootError(f"{worker.name} did not fault in its share of {len(buf):,} bytes in "
                                 f"{POPULATE_TIMEOUT_S:g} s")
    # the views of buf go before an error is raised: the traceback keeps this frame, and the caller's
    # close of buf then failed with BufferError ("exported pointers exist") over the error itself
    del pages, parts
    if refused is not None:
        raise refused
    if errors:
        raise errors[0]


@_cuda.keeps_context
def register_host(ptr: int, nbytes: int, device: Device, *, path: str | None = None, offset: int = 0) -> PinnedRegion:
    """Page-lock ``[ptr, ptr + nbytes)`` for DMA (portable across contexts). Needs CUDA.

    Makes ``device``'s primary context current in the calling thread first (the driver call needs
    a context). Raises CapabilityError on the host backend; when the driver refuses, CudaError,
    or, for a mapping of file ``path`` (at ``offset``), CapabilityError saying what to do.
    """
    if not device.is_cuda:
        raise CapabilityError("pinning host memory needs a CUDA device; the host backend copies from pageable memory")
    if nbytes <= 0:
        raise FlashBootError(f"cannot pin {nbytes} bytes")
    _cuda.use_device(device.index)
    t0 = time.perf_counter()
    try:
        _cuda.check(_cuda.driver().cuMemHostRegister(ptr, nbytes, CU_MEMHOSTREGISTER_PORTABLE),
                    f"cuMemHostRegister({ptr:#x}, {nbytes:,} bytes)")
    except CudaError as exc:
        if path is None:
            raise
        raise CapabilityError(pin_refused_message(path, offset, nbytes, fs_type(path), exc)) from exc
    return PinnedRegion(ptr, nbytes, (time.perf_counter() - t0) * 1e3, device.index, threading.Lock())


@_cuda.keeps_context
def device_free_bytes(device: Device) -> int:
    """Bytes free for a new allocation on ``device``: ``cuMemGetInfo`` on CUDA, MemAvailable on the host."""
    if device.is_cuda:
        _cuda.use_device(device.index)
        free, _total = _cuda.check(_cuda.driver().cuMemGetInfo(), f"cuMemGetInfo({device})")
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise CapabilityError("/proc/meminfo has no MemAvailable line")


__all__ = [
    "PinnedRegion", "register_host", "populate", "bind_to_node", "gpu_numa_node", "gpu_pci_bus_id", "numa_nodes",
    "device_free_bytes", "NUMA_POLICIES",
]


# ------------------------------------------------------------------------------ mapped files
class MappedFile:
    """A file mapped ``MAP_SHARED`` read-write at a fixed host address (``ptr``), e.g. a staged
    image in /dev/shm: the same physical pages as the file, no copy. :meth:`close` unmaps."""

    def __init__(self, path: str, nbytes: int, *, fd: int | None = None):
        import mmap as _mmap

        if nbytes <= 0:
            raise FlashBootError(f"cannot map {nbytes} bytes of {path}")
        own = fd is None
        if own:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise FlashBootError(f"cannot open {path} to map it: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise FlashBootError(f"{path} holds {size:,} bytes; {nbytes:,} were to be mapped")
            try:
                self._mm = _mmap.mmap(fd, nbytes, flags=_mmap.MAP_SHARED, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
            except OSError as exc:  # ENOMEM under `ulimit -v`: the bare error named no file, no bytes, no limit
                raise map_refused(f"mapping {path}", nbytes, exc) from None
        finally:
            if own:
                os.close(fd)
        # The ctypes object exports the buffer only for this line, so close() is never blocked.
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.path, self.nbytes = path, nbytes

    @property
    def closed(self) -> bool:
        return self._mm is None

    def array(self):
        """The mapping as a flat numpy uint8 array (zero copy; do not use it after :meth:`close`)."""
        import numpy as np

        if self._mm is None:
            raise FlashBootError(f"mapping of {self.path} is closed")
        return np.frombuffer((ctypes.c_uint8 * self.nbytes).from_address(self.ptr), dtype=np.uint8)

    def close(self) -> None:
        """Unmap (idempotent)."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> "MappedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__.append("MappedFile")
