"""The loop of a long-lived FlashBoot process (seed, holder): run until asked to stop."""

from __future__ import annotations

import signal
import threading
from typing import Callable


def serve_until_stopped(own_stop: threading.Event, stop: threading.Event | None, *, handle_signals: bool,
                        tick: Callable[[], None] | None = None, period_s: float = 0.2) -> None:
    """Call ``tick`` every ``period_s`` until ``own_stop`` or ``stop`` is set, or SIGTERM/SIGINT
    arrives (handled only in the main thread, where Python delivers signals; the previous
    handlers are restored on the way out)."""
    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: own_stop.set())
    try:
        while not own_stop.is_set() and not (stop is not None and stop.is_set()):
            if tick is not None:
                tick()
            own_stop.wait(period_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
