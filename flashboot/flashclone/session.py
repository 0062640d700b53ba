"""What one clone acquired (store connection, arenas, mappings), released in reverse order."""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import FlashBootError, WaitTimeoutError
from .rendezvous import Rendezvous

LANES_JOIN_S = 10.0
"""How long closing a session waits for the copy threads of a run it gave up on to leave their copy."""


class _Session:
    """Everything one clone acquired, released in reverse order on failure or close."""

    def __init__(self, rdv: Rendezvous):
        self.rdv = rdv
        self.arena = None
        self.borrowed_arena = False
        """True when ``arena`` belongs to the caller (``clone(into=...)``): close() leaves it open."""
        self.flags = None
        self.opened: dict[int, list] = {}
        self.extra: list = []
        self.status_key: str | None = None
        self.dependents: list[str] = []
        """Status keys of participants that read from us: :func:`linger` waits for them."""
        self.dependents_of: Callable[[], list[str]] | None = None
        self.on_leave: Callable[[Rendezvous], None] | None = None
        """Called with the store connection as a finished participant leaves (a ring's last member
        clears the run's keys)."""
        self.lanes_running: list[threading.Thread] = []
        """Copy threads of a run given up on while inside a copy (see :meth:`run`)."""
        self.wrote = False
        """Whether a write into ``arena`` was issued (a copy run started, a broadcast or READs posted):
        until then a failed clone left a borrowed arena's bytes as they were."""
        self.timeout_s = rdv.timeout_s if rdv is not None else 60.0
        self._pending_arena: tuple[threading.Thread, dict, int, Any] | None = None

    @classmethod
    def connect(cls, store: str, token, token_file, name: str, *, host: bool, timeout_s: float,
                keep=None) -> "_Session":
        """Connect to the store at ``store``; ``keep`` (a NIXL agent warm-up, say) is released with the
        session, or at once when the store cannot be reached."""
        try:
            rdv = Rendezvous.connect(store, token, token_file=token_file, namespace=name, host=host,
                                     timeout_s=timeout_s)
        except BaseException:
            if keep is not None:
                keep.close()
            raise
        session = cls(rdv)
        if keep is not None:
            session.extra.append(keep)
        return session

    def start_arena(self, into, nbytes: int, dev) -> None:
        """Start making the new arena :meth:`take_arena` will take, in a background thread: its
        driver calls (a 13.8 GB arena: ~30 ms on an H200) overlap the exchange, and so does its
        export for later clones (the record the clone publishes carries it; each segment's first
        export cost ~0.6 ms on an H200). Nothing for the caller's ``into``."""
        if into is not None:
            _check_into(into, nbytes, dev)  # before the exchange maps anything for it
            return
        if self._pending_arena is not None:
            return
        from ..arena import Arena

        box: dict = {}

        def make() -> None:
            try:
                arena = Arena.create(nbytes, dev)
            except BaseException as exc:  # noqa: BLE001 - raised in the clone's thread by take_arena
                box["error"] = exc
                return
            box["arena"] = arena  # closed by whoever takes it or the session, also when the export failed
            try:
                arena.export()
            except BaseException as exc:  # noqa: BLE001 - as above
                box["error"] = exc

        thread = threading.Thread(target=make, name="flashboot-clone-arena", daemon=True)
        thread.start()
        self._pending_arena = (thread, box, nbytes, dev)

    @property
    def arena_in_progress(self) -> bool:
        """Whether the arena :meth:`start_arena` began is still being made."""
        return self._pending_arena is not None and self._pending_arena[0].is_alive()

    def _finish_arena(self):
        """The arena :meth:`start_arena` made, waited for at most the session's timeout; its error
        when it failed (WaitTimeoutError naming the size and device when it did not finish)."""
        thread, box, nbytes, dev = self._pending_arena
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise WaitTimeoutError(f"making the clone's arena of {nbytes:,} bytes on {dev} did not finish within "
                                   f"{self.timeout_s:g} s")
        self._pending_arena = None
        if "error" in box:
            if "arena" in box:  # made, then its export failed: released here, the error raised
                box["arena"].close()
            raise box["error"]
        return box["arena"]

    def take_arena(self, into, nbytes: int, dev) -> None:
        """The arena to copy into: the caller's ``into`` (never closed here), else a new one (the
        one :meth:`start_arena` began, when it did)."""
        from ..arena import Arena

        self.borrowed_arena = into is not None
        if into is not None:
            _check_into(into, nbytes, dev)
            self.arena = into
        elif self._pending_arena is not None:
            self.arena = self._finish_arena()
        else:
            self.arena = Arena.create(nbytes, dev)

    def run(self, executor):
        """``executor.run()``. A host run that gives up while a lane is inside a copy (which cannot
        be interrupted) names its threads: they are kept, and :meth:`close` leaves mapped the
        memory they may still write, where unmapping it faulted the process."""
        self.wrote = True
        try:
            return executor.run()
        except BaseException as exc:
            self.lanes_running += getattr(exc, "lanes_running", None) or []
            raise

    def _copies_still_running(self) -> int:
        """How many kept copy threads are still inside their copy after a bounded wait."""
        deadline = time.monotonic() + LANES_JOIN_S
        for t in self.lanes_running:
            t.join(max(0.0, deadline - time.monotonic()))
        self.lanes_running = [t for t in self.lanes_running if t.is_alive()]
        return len(self.lanes_running)

    def close_opened(self, participant: int | None = None) -> None:
        keys = list(self.opened) if participant is None else [participant]
        for k in keys:
            for a in reversed(self.opened.pop(k, [])):
                if not a.closed:
                    a.close()

    def close(self, keep_arena: bool, *, keep_viewed: bool = False) -> None:
        if self.lanes_running and self._copies_still_running():
            warnings.warn(f"flashboot: {len(self.lanes_running)} copy thread(s) of an abandoned clone run are still "
                          f"copying after {LANES_JOIN_S:g} s; the clone's arenas and the sources it mapped stay "
                          "mapped until the process exits (unmapping them under a copy faults the process)",
                          RuntimeWarning, stacklevel=2)
            self._leave_store(keep_arena)  # no copy touches it: its connection had stayed open, the run's keys kept
            return
        first: BaseException | None = None
        try:
            self.close_opened()
        except BaseException as exc:  # still release the rest
            first = exc
        for obj in reversed(self.extra):
            try:
                obj.close()
            except BaseException as exc:
                first = first or exc
        self.extra = []
        if self._pending_arena is not None:  # started, never taken: the clone failed during the exchange
            try:
                self._finish_arena().close()
            except BaseException as exc:
                first = first or exc
            self._pending_arena = None
        for attr in ("flags",) + (() if keep_arena or self.borrowed_arena else ("arena",)):
            obj = getattr(self, attr)
            if obj is not None and not obj.closed:
                try:
                    if keep_viewed and attr == "arena":  # views the caller still holds keep its memory
                        obj.close(keep_viewed=True)
                    else:
                        obj.close()
                except BaseException as exc:
                    first = first or exc
            setattr(self, attr, None)
        self._leave_store(keep_arena)
        if first is not None:
            raise first

    def _leave_store(self, keep_arena: bool) -> None:
        """Say this participant left (unless it keeps its arena as a source) and close the store's connection."""
        if self.rdv is not None:
            if self.status_key is not None and not keep_arena:
                try:  # no longer a source for anyone
                    self.rdv.publish(self.status_key + "/left", {"pid": os.getpid()})
                    if self.on_leave is not None:
                        self.on_leave(self.rdv)
                except FlashBootError:
                    pass
            self.rdv.close()
            self.rdv = None


def _check_into(into, nbytes: int, dev) -> None:
    """The caller's ``clone(into=...)`` arena must be open, on ``dev`` and of the seed's capacity:
    a smaller one aborted the process in the broadcast fallback (gloo's size check), and a wrong
    size was blamed on "different allocation granularity"."""
    from ..errors import ArenaError

    if into.closed:
        raise ArenaError("clone(into=...): the arena given is closed")
    if into.nbytes != nbytes or into.device != dev:
        raise ArenaError(f"clone(into=...): the arena given holds {into.nbytes:,} bytes on {into.device}; the seed's "
                         f"image needs one of exactly {nbytes:,} bytes on {dev} (the seed's arena capacity)")


@dataclass
class CloneContext:
    """What a transport that runs the whole clone itself (``Transport.run``) is handed, once the
    seed's record checked out and a position is taken."""

    session: _Session
    dev: Any
    schedule: str
    manifest: Any
    gen: str
    report: Any
    t_start: float
    seed_rec: Any
    verify: bool
    timeout_s: float
    chunk_bytes: int | None
    clones: int | None
    retry: bool
    hook: Callable | None
    read_metadata: Callable[[], Any]
    nixl_warm: Any = None
    """A :class:`~flashboot.flashclone.transports.nixl.AgentWarmup` started while connecting, if any."""
    into: Any = None
    """The caller's arena to copy into (``clone(into=...)``), or None: the transport makes one
    with :meth:`_Session.take_arena`."""
