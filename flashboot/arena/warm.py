"""Paying the driver's first-import costs ahead of the critical path."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .. import _cuda
from ..fdshare import pidfd_getfd
from ..memory import Device
from .backing_cuda import _allocation_prop, _granularity, _map_handle, can_access_peer
from .undo import _Undo


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
