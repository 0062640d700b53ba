"""Views and launch context for Triton kernels on raw byte ranges.

:func:`span_tensor` turns a raw span into a torch tensor view (no copy) so Triton, which wants
objects with ``data_ptr()`` and ``dtype``, can launch on it; :func:`launch_on` makes a span's
device and a stream current for a launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Any, Iterator

from flashboot.errors import CapabilityError, FlashBootError
from flashboot.memory import Span, stream_handle

_NP_NAMES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def interpreting() -> bool:
    """True when Triton kernels run under ``TRITON_INTERPRET=1`` (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def span_tensor(span: Span, itemsize: int = 1, offset: int = 0, nbytes: int | None = None):
    """A 1-D torch tensor of ``itemsize``-byte integers viewing ``span[offset:offset+nbytes]`` (no copy).

    Host spans become CPU tensors (``torch.frombuffer`` over the memory); CUDA spans go through
    CuPy's ``UnownedMemory`` and DLPack. ``nbytes`` must be a multiple of ``itemsize``; the view
    keeps ``span.owner`` alive.
    """
    import torch

    if nbytes is None:
        nbytes = span.nbytes - offset
    if offset < 0 or nbytes < 0 or offset + nbytes > span.nbytes:
        raise FlashBootError(f"view [{offset:,}, {offset + nbytes:,}) is outside the {span.nbytes:,}-byte span")
    if itemsize not in _NP_NAMES or nbytes % itemsize:
        raise FlashBootError(f"cannot view {nbytes:,} bytes as {itemsize}-byte integers")
    dtype = getattr(torch, _NP_NAMES[itemsize])
    ptr = span.ptr + offset
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, device=str(span.device))
    if not span.device.is_cuda:
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        t = torch.frombuffer(raw, dtype=dtype)
    else:
        import cupy

        mem = cupy.cuda.UnownedMemory(ptr, nbytes, span.owner, span.device.index)
        arr = cupy.ndarray((nbytes // itemsize,), dtype=_NP_NAMES[itemsize], memptr=cupy.cuda.MemoryPointer(mem, 0))
        # stream=-1: DLPack's "no synchronisation". torch.from_dlpack(arr) would make torch's current
        # stream wait on CuPy's (an event on the legacy stream): a dependency the caller never asked for.
        t = torch.from_dlpack(arr.__dlpack__(stream=-1))
    t._flashboot_owner = span.owner  # keep whatever backs the memory alive as long as the view
    return t


@functools.cache
def sm_count(device_index: int) -> int:
    """Number of SMs of a CUDA device (4 under the interpreter, to exercise the grid stride)."""
    if interpreting():
        return 4
    from .launch_ctypes import sm_count as cuda_sm_count

    return cuda_sm_count(device_index)


def require_kernel_memory(span: Span) -> None:
    """CapabilityError unless Triton kernels can touch ``span``: CUDA memory, or host memory
    under the interpreter."""
    if not span.device.is_cuda and not interpreting():
        raise CapabilityError(
            f"Triton kernels need CUDA memory, got a span on {span.device}; use the 'host' mover for host copies"
        )


@contextlib.contextmanager
def launch_on(span: Span, stream: Any) -> Iterator[None]:
    """Make ``span``'s device and ``stream`` current for Triton launches (Triton launches on
    torch's current stream of the current device). Host spans only under the interpreter."""
    require_kernel_memory(span)
    if not span.device.is_cuda:
        yield
        return
    with launch_on_index(span.device.index, stream_handle(stream)):
        yield


@contextlib.contextmanager
def launch_on_index(index: int, handle: int) -> Iterator[None]:
    """Make CUDA device ``index`` and the raw stream ``handle`` (0: the default stream) current."""
    import torch

    with torch.cuda.device(index):
        s = torch.cuda.default_stream(index) if handle == 0 else torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))
        with torch.cuda.stream(s):
            yield


__all__ = ["interpreting", "launch_on", "launch_on_index", "require_kernel_memory", "sm_count", "span_tensor"]
