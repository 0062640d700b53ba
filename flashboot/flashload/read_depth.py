"""How many reads a streamed load keeps in flight, and how large: chosen on the disk itself.

Measured on the lent H200 machines (VMs whose disk is a file of the host), 2026-12-04: one
16 MiB ``O_DIRECT`` read at a time read 10-25 % faster than four 32 MiB reads in flight on some
machines, and level on others. NVMe drives and parallel filesystems want reads in flight. So no
fixed setting wins everywhere, and a long stream measures both on its own first bytes:

- setting **A** is the configured one (``threads`` reads of a slot each in flight); setting **B**
  is one read at a time, each slot read as sequential pieces of about :data:`SINGLE_READ_BYTES`
  (the default slot, 4 MiB, is one piece: :func:`single_read_bytes`);
- after a lead-in window at A that is not measured (the stream's start: the ring's first fill,
  the first copies, and in a fresh process the views built beside the reads; the first window
  was the slowest of the four in two of three fresh-process loads on the H200 machines, which
  biased the choice towards B), windows of each, in the order A B B A, so that a drift of the
  disk linear in time weighs on both alike. A window starts with no read in flight, so its reads
  run only beside reads of the same setting;
- the rest of the stream keeps the faster, and B on a tie: A only when it beats B by
  :data:`MARGIN`.

Nothing is read twice: the windows are the stream's own first chunks. A stream shorter than
:data:`PROBE_SHARE` x the windows keeps A. Readers ask the gate before each chunk
(:meth:`ReadDepth.enter`), so at one read in flight the chunks are read in file order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SINGLE_READ_BYTES = 16 << 20
"""B's largest read: a dd-like ``bs=16M`` stream, the fastest sample on the machines above
before the slots shrank to 4 MiB (:data:`~flashboot.flashload.stream.SLOT_BYTES`); a larger
configured slot is read in pieces of this size."""
ORDER = "ABBA"
MARGIN = 1.03
"""A (reads in flight) is kept only when it reads this much faster than B; a tie keeps one read
at a time, which leaves fewer ring slots in turn and less CPU. On the lent H200 VMs the probe's
two settings came within 3 % of each other in three loads of six, and every load that kept one
4 MiB read at a time reached 0.83-1.07x the disk's best sample, every one that kept four in
flight 0.78-0.86x (`bench stream`, 2026-12-04; the tie kept A then). Where reads in flight pay
(NVMe drives, parallel filesystems) they read a large multiple of one stream, far past 3 %."""
PROBE_SHARE = 3
"""The windows (the lead-in included) take at most 1/PROBE_SHARE of the stream."""
_WAIT_S = 0.05
"""How often a waiting reader looks at the stop flag (the load's own stall timeout bounds the wait)."""


def single_read_pieces(slot_bytes: int) -> int:
    """How many sequential reads setting B makes of one slot: one per whole :data:`SINGLE_READ_BYTES`
    (at least one), so each is about that size or the whole slot when it is smaller."""
    return max(1, slot_bytes // SINGLE_READ_BYTES)


def single_read_bytes(slot_bytes: int) -> int:
    """The size of each of B's reads of a ``slot_bytes`` slot."""
    return ReadSetting(1, single_read_pieces(slot_bytes)).piece_bytes(slot_bytes)


@dataclass(frozen=True)
class ReadSetting:
    """``in_flight`` chunk reads at once, each chunk read as ``pieces`` sequential reads."""

    in_flight: int
    pieces: int

    def piece_bytes(self, slot_bytes: int) -> int:
        """One of the sequential reads of a ``slot_bytes`` slot: its share, rounded up to whole
        4 KiB blocks (``O_DIRECT`` asks whole blocks)."""
        return -(-slot_bytes // self.pieces // 4096) * 4096

    def label(self, slot_bytes: int) -> str:
        from ..units import format_bytes

        return f"{self.in_flight} x {format_bytes(-(-slot_bytes // self.pieces))}"


@dataclass
class _Window:
    setting: str  # "A" or "B"
    reads: int
    measured: bool = True  # False: the lead-in
    done: int = 0
    nbytes: int = 0
    first_issue: float = float("inf")
    last_done: float = 0.0


def _gbps(window: _Window) -> float | None:
    span = window.last_done - window.first_issue
    return round(window.nbytes / span / 1e9, 3) if span > 0 else None


def _share(idle_s: float, window: _Window) -> float | None:
    """The part of a window's span (first read issued to last returned) the disk was idle."""
    span = window.last_done - window.first_issue
    return round(idle_s / span, 4) if span > 0 else None


class ReadDepth:
    """The reads-in-flight gate of one stream, and its probe (see the module docstring).

    ``readers`` is the stream's reader threads (setting A's reads in flight); ``chunks`` and
    ``slot_bytes`` the stream's; ``window_bytes`` one window's bytes (rounded to whole chunks, at
    least twice A's reads in flight); ``probe`` False keeps A throughout.
    """

    def __init__(self, readers: int, chunks: int, slot_bytes: int, *, window_bytes: int, probe: bool = True):
        self.slot_bytes = slot_bytes
        self.settings = {"A": ReadSetting(readers, 1), "B": ReadSetting(1, single_read_pieces(slot_bytes))}
        per_window = max(2 * readers, window_bytes // slot_bytes)  # A's windows reach their depth
        probing = (probe and self.settings["A"] != self.settings["B"]
                   and PROBE_SHARE * (1 + len(ORDER)) * per_window <= chunks)
        lead = _Window("A", per_window, measured=False)
        self.windows = [lead] + [_Window(s, per_window) for s in ORDER] if probing else []
        self.chosen = "A"
        self.rates_gbps: dict[str, float] = {}
        self._cond = threading.Condition()
        self._window = 0
        self._issued = 0  # reads issued in the current window
        self._active = 0
        # the disk's idle time: no read (piece) in flight between the stream's first read and its
        # last, by window (the probe's) and after them; see read_started
        self._busy = threading.Lock()
        self._reading = 0
        self._idle_since: float | None = None
        self.idle_s = [0.0] * (len(self.windows) + 1)
        self.gaps = [0] * (len(self.windows) + 1)

    @property
    def steady(self) -> ReadSetting:
        return self.settings[self.chosen]

    def enter(self, stop: threading.Event) -> tuple[int, ReadSetting, float] | None:
        """Wait until a read may start; returns a ticket (window, setting, issue time) to hand to
        :meth:`leave` and :meth:`completed`, or None once ``stop`` is set."""
        with self._cond:
            while not stop.is_set():
                w = self._window
                if w < len(self.windows):
                    win = self.windows[w]
                    setting = self.settings[win.setting]
                    if self._issued == win.reads:
                        if self._active == 0:  # the window has drained: the next one starts
                            self._window, self._issued = w + 1, 0
                            self._cond.notify_all()  # its reads in flight start together
                            continue
                    elif self._active < setting.in_flight:
                        self._issued += 1
                        self._active += 1
                        return w, setting, time.perf_counter()
                elif self._active < self.steady.in_flight:
                    self._active += 1
                    return w, self.steady, time.perf_counter()
                self._cond.wait(_WAIT_S)
            return None

    def read_started(self) -> None:
        """A read (one piece of a chunk) is issued: the time since the last one returned, with no
        read in flight meanwhile, is the disk's idle time: the hand-off between two reads (at one
        read in flight, its thread's wait for the GIL among it), a wait for a free slot, a window's
        drain. Counted against the window the stream is in."""
        now = time.perf_counter()
        with self._busy:
            if self._reading == 0 and self._idle_since is not None:
                w = min(self._window, len(self.windows))
                self.idle_s[w] += now - self._idle_since
                self.gaps[w] += 1
            self._reading += 1

    def read_ended(self) -> None:
        now = time.perf_counter()
        with self._busy:
            self._reading -= 1
            if self._reading == 0:
                self._idle_since = now

    def leave(self) -> None:
        """A read that :meth:`enter` let start has ended (read, failed, or found no chunk left).

        At one read in flight no other reader is woken: the one that leaves comes back for the
        next read itself, where a woken reader would first have to be scheduled and take the GIL,
        the disk idle meanwhile (B's windows at 4 MiB reads sat idle 8.5-10.7 % of their time on
        the H200 VMs, against 0.2-0.9 % for A's: `bench stream`, 2026-12-04). The others still
        look at the gate every :data:`_WAIT_S` and are woken when a window of more starts."""
        with self._cond:
            self._active -= 1
            if self._in_force().in_flight > 1:
                self._cond.notify_all()

    def _in_force(self) -> ReadSetting:
        w = self._window
        return self.settings[self.windows[w].setting] if w < len(self.windows) else self.steady

    def wake(self) -> None:
        """Wake the readers waiting in :meth:`enter` (the stream has stopped)."""
        with self._cond:
            self._cond.notify_all()

    def completed(self, ticket: tuple[int, ReadSetting, float], nbytes: int, read_end: float) -> None:
        """On the loading thread, for each chunk read (``read_end``: when its read returned, by
        ``time.perf_counter``): once every window is done, the faster setting is kept for the rest
        of the stream."""
        w, _, issued = ticket
        if w >= len(self.windows):
            return
        win = self.windows[w]
        win.done += 1
        win.nbytes += nbytes
        win.first_issue = min(win.first_issue, issued)
        win.last_done = max(win.last_done, read_end)
        if any(x.done < x.reads for x in self.windows):
            return
        for name in self.settings:
            mine = [x for x in self.windows if x.setting == name and x.measured]
            span = sum(x.last_done - x.first_issue for x in mine)
            self.rates_gbps[name] = sum(x.nbytes for x in mine) / span / 1e9 if span > 0 else 0.0
        with self._cond:
            self.chosen = "A" if self.rates_gbps["A"] > MARGIN * self.rates_gbps["B"] else "B"
            self._cond.notify_all()

    def summary(self) -> dict:
        """The settings, what each window measured (GB/s) and the one kept."""
        out = {"kept": self.steady.label(self.slot_bytes),
               "settings": {k: v.label(self.slot_bytes) for k, v in self.settings.items()}}
        out["idle_ms"] = round(sum(self.idle_s) * 1e3, 3)
        out["idle_gaps"] = sum(self.gaps)
        if self.windows:
            out["probe"] = {"order": ORDER, "window_bytes": self.windows[0].reads * self.slot_bytes,
                            "lead_in_gbps": _gbps(self.windows[0]),
                            "windows_gbps": [_gbps(x) for x in self.windows[1:]],
                            "gbps": {k: round(v, 3) for k, v in self.rates_gbps.items()},
                            # the disk idle in each window (ms): between its reads and before its first
                            "windows_idle_ms": [round(x * 1e3, 3) for x in self.idle_s[1:len(self.windows)]],
                            "windows_idle_share": [_share(i, x) for i, x in zip(self.idle_s[1:], self.windows[1:])]}
            out["after_probe_idle_ms"] = round(self.idle_s[-1] * 1e3, 3)
        return out


__all__ = ["ReadDepth", "ReadSetting", "SINGLE_READ_BYTES", "MARGIN", "single_read_bytes"]
