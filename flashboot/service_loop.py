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
