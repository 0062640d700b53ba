"""The loop of a long-lived FlashBoot process (seed, holder, store, preloader): run until asked to stop."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_WATCHER_JOIN_S = 5.0


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, signals: tuple[int, ...] = STOP_SIGNALS, *,
                    again: threading.Event | None = None) -> Iterator[None]:
    """Set ``stop`` when one of ``signals`` arrives, for the duration of the block (main thread
    only, where Python delivers signals; elsewhere a no-op), and ``again`` (where given) when
    one arrives with ``stop`` set already: a second SIGTERM, for a service that winds down its
    work in flight after the first. The previous handlers and wakeup fd are restored on the
    way out.

    The handler itself takes no lock. Python runs a handler on the main thread between two
    bytecodes, possibly while that thread holds ``stop``'s own lock inside ``stop.wait()``;
    ``stop.set()`` there waits for that lock forever and the process never stops (CI saw a
    store keep listening 20 s after SIGTERM). So the C-level handler only writes the signal's
    number to a pipe (``signal.set_wakeup_fd``), and a watcher thread sets ``stop``.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
    watcher = threading.Thread(target=_set_on_signal, args=(read_fd, stop, frozenset(signals), again),
                               name="flashboot-stop-signals", daemon=True)
    previous = {}
    previous_fd = None
    try:
        watcher.start()
        # the pipe first, then the handlers: a signal between the two must not be lost
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in signals:
            previous[sig] = signal.signal(sig, _wake_only)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous_fd is not None:
            signal.set_wakeup_fd(previous_fd)
        if watcher.is_alive():
            os.write(write_fd, b"\0")  # 0 is no signal: the watcher's cue to end
            watcher.join(_WATCHER_JOIN_S)
        os.close(write_fd)
        if not watcher.is_alive():  # else it still reads the pipe: leave it open (the thread is a daemon)
            os.close(read_fd)


def _wake_only(signum, frame) -> None:
    """A Python-level handler must exist for the C handler to write to the wakeup fd; the work
    is done by the watcher thread."""


def _set_on_signal(read_fd: int, stop: threading.Event, signals: frozenset[int],
                   again: threading.Event | None = None) -> None:
    while True:
        data = os.read(read_fd, 64)
        if not data or 0 in data:
            return
        for signum in data:  # each one: two signals may arrive in one read
            if signum not in signals:
                continue
            if stop.is_set() and again is not None:
                again.set()
            stop.set()


def serve_until_stopped(own_stop: threading.Event, stop: threading.Event | None, *, handle_signals: bool,
                        tick: Callable[[], None] | None = None, period_s: float = 0.2) -> None:
    """Call ``tick`` every ``period_s`` until ``own_stop`` or ``stop`` is set, or SIGTERM/SIGINT
    arrives (see :func:`stop_on_signals`)."""
    with stop_on_signals(own_stop) if handle_signals else contextlib.nullcontext():
        while not own_stop.is_set() and not (stop is not None and stop.is_set()):
            if tick is not None:
                tick()
            own_stop.wait(period_s)


def announce_and_serve(service, announce: Callable[[], None]) -> None:
    """Say the service is ready (``announce``), then serve it until SIGTERM/SIGINT, and close it.

    The stop signals are taken before the line is written: a supervisor that signals as soon as it
    reads "ready" had found the CLI's interrupt handler still in place, so the process ended with
    143, "interrupted before it finished", and without closing the service (CI saw a seed do so)."""
    stop = threading.Event()
    try:
        with stop_on_signals(stop):
            announce()
            service.serve_forever(stop, handle_signals=False)
    finally:
        service.close()  # idempotent; serve_forever closes too, but not if announce() raised


class Service:
    """A long-lived object served until stopped (a seed, a store): subclasses set ``self._stop``
    (a threading.Event) and define :meth:`close`, which must be idempotent."""

    _stop: threading.Event

    def serve_forever(self, stop: threading.Event | None = None, *, handle_signals: bool = True) -> None:
        """Block until ``stop`` is set, :meth:`stop` is called or SIGTERM/SIGINT arrives (main
        thread), then :meth:`close`."""
        try:
            serve_until_stopped(self._stop, stop, handle_signals=handle_signals)
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
