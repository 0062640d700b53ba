"""The CUDA driver calls of a cubin's launch (:mod:`flashboot.kernels.cubin`), through ctypes on
``libcuda.so.1``: the device attributes a launch grid needs (SM count, compute capability), the
device's primary context, ``cuModuleLoadData`` / ``cuModuleGetFunction`` and ``cuLaunchKernel``.

Why ctypes and not ``cuda.bindings``: the checksum kernel's first call in a fresh process has a
20 ms budget, and importing ``cuda.bindings.driver`` alone cost 17.5 ms of it on an H200 host,
whose torch had not imported it. torch has loaded ``libcuda.so.1`` with its CUDA context, so
opening it here costs a ``dlopen`` of a library already mapped. The rest of FlashBoot (arenas,
VMM) keeps ``cuda.bindings`` (:mod:`flashboot._cuda`).

Every result goes through :func:`check`, which raises :class:`~flashboot.errors.CudaError` naming
the call and the driver's error (``cuGetErrorName``, ``cuGetErrorString``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from types import SimpleNamespace
from typing import Iterator

from flashboot.errors import CapabilityError, CudaError

_HANDLE = ctypes.c_void_p  # CUcontext, CUmodule, CUfunction, CUstream: opaque pointers
_U = ctypes.c_uint
PROTOTYPES = {
    "cuInit": (_U,),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_HANDLE), ctypes.c_int),
    "cuCtxGetCurrent": (ctypes.POINTER(_HANDLE),),
    "cuCtxSetCurrent": (_HANDLE,),
    "cuModuleLoadData": (ctypes.POINTER(_HANDLE), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(_HANDLE), _HANDLE, ctypes.c_char_p),
    # function, grid x/y/z, block x/y/z, dynamic shared bytes, stream, kernelParams (void**), extra
    "cuLaunchKernel": (_HANDLE, _U, _U, _U, _U, _U, _U, _U, _HANDLE, _HANDLE, _HANDLE),
}
"""The argument types of each driver call used here (each returns a ``CUresult``, an int)."""

MULTIPROCESSOR_COUNT, COMPUTE_CAPABILITY_MAJOR, COMPUTE_CAPABILITY_MINOR = 16, 75, 76  # CUdevice_attribute


def bind(functions) -> SimpleNamespace:
    """The driver calls of :data:`PROTOTYPES` bound to ``functions``: a ``ctypes.CDLL`` (the
    driver) or a dict of name to Python callable (a test's fake driver, called through the same
    C types as the real one)."""
    calls = {}
    for name, argtypes in PROTOTYPES.items():
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)
        calls[name] = proto(functions[name]) if isinstance(functions, dict) else proto((name, functions))
    return SimpleNamespace(**calls)


@functools.cache
def _driver() -> SimpleNamespace:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CapabilityError(f"no CUDA driver on this machine: libcuda.so.1 cannot be loaded ({exc})") from None
    try:
        drv = bind(lib)
    except AttributeError as exc:  # a driver older than any CUDA FlashBoot supports
        raise CapabilityError(f"libcuda.so.1 lacks a driver call the kernel launch needs ({exc})") from None
    err = drv.cuInit(0)
    if err:
        raise CapabilityError(f"cuInit failed: {_error_text(drv.cuGetErrorName, err) or 'unknown CUresult'} ({err})")
    return drv


def _error_text(fn, code: int) -> str:
    text = ctypes.c_char_p()
    if fn(code, ctypes.byref(text)) or not text.value:
        return ""  # a code this driver does not know
    return text.value.decode(errors="replace")


def check(result: int, call: str) -> None:
    """Raise CudaError naming ``call`` and the driver's error unless ``result`` is CUDA_SUCCESS."""
    if result:
        drv = _driver()
        raise CudaError(call, result, _error_text(drv.cuGetErrorName, result) or "unknown CUresult",
                        _error_text(drv.cuGetErrorString, result))


def _out(kind, call: str, fn, *args):
    value = kind()
    check(fn(ctypes.byref(value), *args), call)
    return value.value


def device_attribute(index: int, attribute: int) -> int:
    """The ``CUdevice_attribute`` ``attribute`` (an int) of CUDA device ``index``."""
    drv = _driver()
    dev = _out(ctypes.c_int, f"cuDeviceGet({index})", drv.cuDeviceGet, index)
    return _out(ctypes.c_int, f"cuDeviceGetAttribute({attribute}, cuda:{index})", drv.cuDeviceGetAttribute,
                attribute, dev)


@functools.cache
def sm_count(index: int) -> int:
    """Number of SMs of CUDA device ``index`` (one attribute; torch's device properties fill every field)."""
    return device_attribute(index, MULTIPROCESSOR_COUNT)


@functools.cache
def compute_capability(index: int) -> int:
    """CUDA device ``index``'s compute capability as Triton's target number (90 for sm_90)."""
    return device_attribute(index, COMPUTE_CAPABILITY_MAJOR) * 10 + device_attribute(index, COMPUTE_CAPABILITY_MINOR)


_primary_contexts: dict[int, int] = {}
_primary_contexts_lock = threading.Lock()


def _primary_context(index: int) -> int:
    """Device ``index``'s primary context (torch's), retained once per process and kept."""
    with _primary_contexts_lock:
        ctx = _primary_contexts.get(index)
        if ctx is None:
            drv = _driver()
            dev = _out(ctypes.c_int, f"cuDeviceGet({index})", drv.cuDeviceGet, index)
            ctx = _primary_contexts[index] = _out(_HANDLE, f"cuDevicePrimaryCtxRetain({index})",
                                                  drv.cuDevicePrimaryCtxRetain, dev)
    return ctx


@contextlib.contextmanager
def in_primary_context(index: int) -> Iterator[None]:
    """Make device ``index``'s primary context current, and the caller's again on exit: a library
    call must not move torch's current device. A thread that had none keeps this one (unbinding
    it would leave the CUDA runtime believing in a device whose context is not current)."""
    drv = _driver()
    previous = _out(_HANDLE, "cuCtxGetCurrent", drv.cuCtxGetCurrent)
    ctx = _primary_context(index)
    if previous != ctx:
        check(drv.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(cuda:{index})")
    try:
        yield
    finally:
        if previous and previous != ctx:
            check(drv.cuCtxSetCurrent(previous), "cuCtxSetCurrent(restore)")


def load_function(image: bytes, name: str, device: int, where: str) -> int:
    """Load the cubin ``image`` into device ``device``'s primary context (kept for the process)
    and return its function ``name``'s ``CUfunction``; ``where`` names the cubin in errors."""
    drv = _driver()
    with in_primary_context(device):
        module = _out(_HANDLE, f"cuModuleLoadData({where} on cuda:{device})", drv.cuModuleLoadData, image)
        return _out(_HANDLE, f"cuModuleGetFunction({name!r}, {where} on cuda:{device})", drv.cuModuleGetFunction,
                    module, name.encode())


def launch_kernel(function: int, grid: tuple[int, int, int], threads: int, shared: int, stream: int,
                  params: ctypes.Array, call: str) -> None:
    """``cuLaunchKernel`` of ``function`` on ``grid`` with ``threads`` threads per block in x,
    ``shared`` bytes of dynamic shared memory, on the raw ``stream`` handle, with ``params`` the
    array of pointers to each argument's value (``kernelParams``). ``call`` names the launch in errors."""
    gx, gy, gz = grid
    check(_driver().cuLaunchKernel(function, gx, gy, gz, threads, 1, 1, shared, stream, ctypes.addressof(params), None),
          call)


__all__ = ["PROTOTYPES", "bind", "check", "compute_capability", "device_attribute", "in_primary_context",
           "launch_kernel", "load_function", "sm_count"]
