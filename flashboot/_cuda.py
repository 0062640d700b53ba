"""Access to the CUDA driver through ``cuda.bindings.driver``, with one checker for every result.

The driver is loaded lazily: importing FlashBoot on a machine without CUDA must work, and
:func:`cuda_available` says whether the host backend will be used instead. The launches of
kernels compiled ahead of time (the checksum's cubin) and the SM count make their few calls
through ctypes instead (:mod:`flashboot.kernels.launch_ctypes`): this module's import costs more
than a fresh process's first checksum may.
"""

from __future__ import annotations

import functools
import os
import threading

from .errors import CapabilityError, CudaError


@functools.cache
def _load_driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        raise CapabilityError(f"cuda-bindings is not importable: {exc}") from exc
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # the bindings raise when libcuda.so cannot be found
        raise CapabilityError(f"no CUDA driver on this machine ({type(exc).__name__}: {exc})") from exc
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CapabilityError(f"cuInit failed: {_error_name(driver, err)} ({int(err)})")
    return driver


def driver():
    """The ``cuda.bindings.driver`` module, initialised; raises CapabilityError without CUDA."""
    return _load_driver()


def _error_name(drv, err) -> str:
    e, name = drv.cuGetErrorName(err)
    return name.decode() if e == drv.CUresult.CUDA_SUCCESS and name else str(err)


def check(result, call: str):
    """Unpack a ``cuda.bindings`` result tuple ``(err, *values)``; raise CudaError on failure.

    Returns None, the single value, or a tuple of values.
    """
    err, *values = result if isinstance(result, tuple) else (result,)
    drv = _load_driver()
    if int(err) != 0:
        e, desc = drv.cuGetErrorString(err)
        raise CudaError(call, int(err), _error_name(drv, err), desc.decode() if desc else "")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def cuda_available() -> bool:
    """True when a CUDA driver is present and reports at least one device."""
    if os.environ.get("FLASHBOOT_FORCE_HOST") == "1":
        return False
    try:
        drv = _load_driver()
    except CapabilityError:
        return False
    err, count = drv.cuDeviceGetCount()
    return int(err) == 0 and count > 0


def device_count() -> int:
    """Number of CUDA devices, 0 without CUDA."""
    if not cuda_available():
        return 0
    return check(driver().cuDeviceGetCount(), "cuDeviceGetCount")


_primary_contexts: dict[int, object] = {}
_primary_contexts_lock = threading.RLock()
"""Re-entrant: finalizers call :func:`use_device` (a stream's or event's in
:mod:`flashboot.cuda_streams`, an arena's release list dropped unclosed), and the collector may
run one on a thread already inside the lock."""


def _primary_context(index: int):
    """Device ``index``'s primary context (the one torch and CuPy use), retained once per process
    and kept: it outlives every arena."""
    drv = driver()
    with _primary_contexts_lock:
        ctx = _primary_contexts.get(index)
        if ctx is None:
            dev = check(drv.cuDeviceGet(index), f"cuDeviceGet({index})")
            ctx = _primary_contexts[index] = check(drv.cuDevicePrimaryCtxRetain(dev),
                                                   f"cuDevicePrimaryCtxRetain({index})")
    return ctx


def use_device(index: int) -> None:
    """Make device ``index``'s primary context current in this thread, and leave it so (for
    code that owns the thread; library entry points restore the caller's with
    :func:`keeps_context`)."""
    check(driver().cuCtxSetCurrent(_primary_context(index)), "cuCtxSetCurrent")


def keeps_context(fn):
    """Decorate a function that may switch the current CUDA context (:func:`use_device`) so its
    caller's is restored on return: the current context is torch's current device, and a library
    call must not move it. A thread that had none keeps the one the call made current. A no-op
    without CUDA."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not cuda_available():
            return fn(*args, **kwargs)
        drv = driver()
        previous = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        try:
            return fn(*args, **kwargs)
        finally:
            # A thread with no context yet keeps ours: unbinding it would leave the CUDA runtime
            # (CuPy, torch) believing in a device whose context is no longer current.
            if int(previous) and int(check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")) != int(previous):
                check(drv.cuCtxSetCurrent(previous), "cuCtxSetCurrent(restore)")

    return wrapper
