"""Private CUDA streams and events through the driver (``cuda.bindings``), for code that must not
import CuPy or share torch's stream pool.

The clone's executor parks ``cuStreamWaitValue32`` waits on its streams, and the copy-engine
mover forks a batch over side streams: both need streams of their own (torch hands out streams
from a small per-device pool that the engine's own work may share) and neither may cost a CuPy
import (~0.2 s with the GIL held, measured in a clone). Each object belongs to the primary
context of its device, is destroyed by :meth:`close` or when it is dropped, and is usable
wherever FlashBoot takes a stream (:func:`flashboot.memory.stream_handle` reads ``.ptr``,
:func:`flashboot.memory.stream_device` reads ``.device_index``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

from . import _cuda
from .memory import stream_handle


@_cuda.keeps_context
def _destroy(destroy, handle, device_index: int, call: str) -> None:
    _cuda.use_device(device_index)  # in the owner's context, whichever thread drops the last reference
    _cuda.check(destroy(handle), call)


class Stream:
    """A non-blocking stream on CUDA device ``device_index``: it never waits for the legacy
    default stream, nor the legacy stream for it (a blocked ``cuStreamWaitValue32`` on it must
    never stall another library's work)."""

    @_cuda.keeps_context
    def __init__(self, device_index: int):
        drv = _cuda.driver()
        _cuda.use_device(device_index)
        self.device_index = device_index
        self.handle = _cuda.check(drv.cuStreamCreate(int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                                  f"cuStreamCreate(cuda:{device_index}, non-blocking)")
        self.ptr = int(self.handle)
        self._finalizer = weakref.finalize(self, _destroy, drv.cuStreamDestroy, self.handle, device_index,
                                           f"cuStreamDestroy(cuda:{device_index})")
        self._finalizer.atexit = False  # the process's exit frees it; the driver may be going by then

    def synchronize(self) -> None:
        """Block until everything queued on the stream has run (the driver's own wait)."""
        _cuda.check(_cuda.driver().cuStreamSynchronize(self.handle), f"cuStreamSynchronize(cuda:{self.device_index})")

    def close(self) -> None:
        """Destroy the stream (work already queued still runs); a second call does nothing."""
        self._finalizer()


class Event:
    """An event of CUDA device ``device_index``; ``timing`` keeps its timestamp for
    :meth:`elapsed_ms` (without it, recording and waiting cost the device less)."""

    @_cuda.keeps_context
    def __init__(self, device_index: int, *, timing: bool = False):
        drv = _cuda.driver()
        _cuda.use_device(device_index)
        self.device_index, self.timing = device_index, timing
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = _cuda.check(drv.cuEventCreate(int(flags)), f"cuEventCreate(cuda:{device_index})")
        self.ptr = int(self.handle)
        self._query = drv.cuEventQuery
        self._ready, self._not_ready = drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_NOT_READY
        self._finalizer = weakref.finalize(self, _destroy, drv.cuEventDestroy, self.handle, device_index,
                                           f"cuEventDestroy(cuda:{device_index})")
        self._finalizer.atexit = False

    def record(self, stream: Any) -> None:
        """Capture the work queued so far on ``stream`` (anything :func:`stream_handle` takes)."""
        drv = _cuda.driver()
        _cuda.check(drv.cuEventRecord(self.handle, drv.CUstream(stream_handle(stream))),
                    f"cuEventRecord(cuda:{self.device_index})")

    @property
    def done(self) -> bool:
        """Whether the captured work has run (a poll; raises CudaError on a device fault)."""
        result = self._query(self.handle)
        if result[0] is self._ready:
            return True
        if result[0] is self._not_ready:
            return False
        _cuda.check(result, f"cuEventQuery(cuda:{self.device_index})")
        return True  # pragma: no cover - check raised

    def synchronize(self) -> None:
        """Block until the captured work has run (``cuEventSynchronize``; the bindings release the
        GIL meanwhile). It has no timeout: :func:`wait_events` bounds it."""
        _cuda.check(_cuda.driver().cuEventSynchronize(self.handle), f"cuEventSynchronize(cuda:{self.device_index})")

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both recorded with ``timing``, both done)."""
        return float(_cuda.check(_cuda.driver().cuEventElapsedTime(self.handle, end.handle),
                                 f"cuEventElapsedTime(cuda:{self.device_index})"))

    def close(self) -> None:
        """Destroy the event; a second call does nothing."""
        self._finalizer()


POOL_KEEP = 16
"""The most idle streams (or events) of one kind and device that :func:`lend_stream` /
:func:`lend_event` keep for the next borrower; more handed back are destroyed."""
_idle: dict[tuple, list] = {}
_idle_lock = threading.Lock()


def _pool_key(obj: Stream | Event) -> tuple:
    return ("stream", obj.device_index) if isinstance(obj, Stream) else ("event", obj.device_index, obj.timing)


def _lend(key: tuple, make):
    with _idle_lock:
        idle = _idle.get(key)
        if idle:
            return idle.pop()
    return make()


def lend_stream(device_index: int) -> Stream:
    """A private non-blocking stream of device ``device_index``: an idle one this process made
    before, or a new one. A refit repeats thousands of times, and making and destroying its
    streams and events cost ~0.2 ms of host time per run, before its copy and after its end."""
    return _lend(("stream", device_index), lambda: Stream(device_index))


def lend_event(device_index: int, *, timing: bool = False) -> Event:
    """An event of device ``device_index`` (as :class:`Event`), idle from an earlier borrower or new."""
    return _lend(("event", device_index, timing), lambda: Event(device_index, timing=timing))


def give_back(*objects: Stream | Event) -> None:
    """Hand streams and events from :func:`lend_stream` / :func:`lend_event` back for reuse. Only
    ones whose queued work has run and that nothing else still holds: a stream with a blocked
    wait or an event someone may still query must be dropped instead."""
    with _idle_lock:
        for obj in objects:
            idle = _idle.setdefault(_pool_key(obj), [])
            if len(idle) < POOL_KEEP and obj._finalizer.alive and obj not in idle:
                idle.append(obj)
                continue
            obj.close()


def wait_event(stream: Any, event: Event) -> None:
    """Make ``stream`` (anything :func:`stream_handle` takes) wait for ``event`` on the device."""
    drv = _cuda.driver()
    _cuda.check(drv.cuStreamWaitEvent(drv.CUstream(stream_handle(stream)), event.handle, 0),
                f"cuStreamWaitEvent(cuda:{event.device_index})")


def wait_events(events: Sequence[Event], timeout_s: float) -> bool:
    """Wait until every event's captured work has run, for at most ``timeout_s``: True when it
    has (the driver's error, a device fault, raised as CudaError), False on the timeout. The
    wait costs no Python meanwhile: a thread of its own blocks in ``cuEventSynchronize`` with the
    GIL released and wakes the caller as the last event passes (a poll would notice it up to a
    period later). After a timeout that thread stays blocked in the driver until the events pass
    (the caller releases the stuck streams); it is a daemon thread and holds nothing else."""
    done, failure = threading.Event(), []

    def wait() -> None:
        try:
            for ev in events:
                ev.synchronize()
        except BaseException as exc:  # handed to the waiting caller, who raises it
            failure.append(exc)
        done.set()

    threading.Thread(target=wait, name="flashboot-event-wait", daemon=True).start()
    if not done.wait(timeout_s):
        return False
    if failure:
        raise failure[0]
    return True


__all__ = ["Event", "POOL_KEEP", "Stream", "give_back", "lend_event", "lend_stream", "wait_event", "wait_events"]
