"""The holder: keeps an arena alive after the engine that made it exits.

An engine hands its arena to a long-lived holder process (:func:`hand_over`). The holder takes the
arena's shareable fd out of the engine (``pidfd_getfd``), maps it -- which keeps the physical
allocation alive -- and re-exports it under a name: the same memory, now described by the
holder's pid and fd. When the engine restarts (a crash, an upgrade), it re-opens the same weights
with :func:`open_held` in milliseconds, without a copy (fault recovery no peer offers).

Where the records live and who may be the one holder: :mod:`.holder_registry`; the engine's calls
(:func:`hand_over`, :func:`open_held`, :func:`release`, ...): :mod:`.holder_client`, both
re-exported here; what an in-place refit made of a held arena's bytes, for a restart:
:mod:`.holder_refit`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import ArenaError, FlashBootError, StoreLostError
from ..fdshare import grow_fd_table, take_fds
from ..procfs import PID_MAX, proc_start_time
from .holder_client import hand_over, held_descriptor, held_record, list_held, open_held, release  # noqa: F401
from .holder_registry import (DEFAULT_TIMEOUT_S, HOLDER_BEAT_S, HOLDER_LEASE_S, HOLDER_PROTOCOL,  # noqa: F401
                              MAX_PENDING_REQUESTS, MAX_RECORD_BYTES, NAME_MAX, OLDER_REQUESTS, REFIT,
                              REQUEST_GRACE_S, REQUESTS, _check_name, _DirKV, _kv, _StoreKV, holder_gone, protocol_refused)

MAX_ERRORS = 100
"""How many problems a holder keeps (planted requests arrive as fast as anyone can write them)."""
OLDER_POLL_S = 0.25
"""How often a holder looks where engines of older protocols ask (to refuse them by name)."""


class ErrorLog(list):
    """A list of the newest ``cap`` messages; ``dropped`` counts the older ones let go. ``echo``,
    where set, is called with each message as it is added (a holder's log, said as it happens)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap, self.dropped = cap, 0
        self.echo = None

    def append(self, item) -> None:
        super().append(item)
        if self.echo is not None:
            self.echo(item)
        self._trim()

    def extend(self, items) -> None:
        items = list(items)
        super().extend(items)
        if self.echo is not None:
            for item in items:
                self.echo(item)
        self._trim()

    def __iadd__(self, items):
        self.extend(items)
        return self

    def _trim(self) -> None:
        extra = len(self) - self.cap
        if extra > 0:
            del self[:extra]
            self.dropped += extra



# ============================================================================================
# The holder process
# ============================================================================================


@dataclass
class HeldArena:
    """One arena the holder keeps: its name, the holder's mapping and the fds it re-exports."""

    name: str
    arena: Any
    fds: list[int]
    descriptor: Any
    since: float

    def close(self) -> None:
        try:
            if not self.arena.closed:
                self.arena.close()
        finally:
            fds, self.fds = self.fds, []
            for fd in fds:
                os.close(fd)


class Holder:
    """Adopts arenas handed over by engines and keeps them until released.

    ``Holder(registry=DIR)`` or ``Holder(store="HOST:PORT")`` (token as for the rendezvous).
    :meth:`poll_once` handles pending requests; :meth:`serve_forever` loops until SIGTERM/SIGINT or
    ``stop``. :meth:`close` releases every held arena.
    """

    def __init__(self, registry=None, store=None, *, poll_s: float = 0.01, **store_options):
        self.kv = _kv(registry, store, host=True, **store_options) if store is not None else _kv(registry)
        if store is not None:  # a store silent a while (stopped, a link down) is waited out, every arena kept:
            self.kv.rdv.bounded = False  # bounded, its first unanswered call would end this holder and drop them all
        try:
            self.kv.lock_for_holder()
        except BaseException:
            self.kv.close()
            raise
        grow_fd_table()  # each adopted arena arrives as fds: the table's growth is paid here, not by an adoption
        self._start = proc_start_time(os.getpid())
        """This process's start time, in its records: a pid is reused (see :func:`holder_gone`)."""
        self.poll_s = poll_s
        self.held: dict[str, HeldArena] = {}
        self.errors = ErrorLog(MAX_ERRORS)
        """The newest :data:`MAX_ERRORS` problems (``errors.dropped``: how many older ones went)."""
        self.errors += self.kv.drain_problems()  # a holder before this one, taken as gone
        self._stop = threading.Event()
        self._next_older_poll = 0.0
        self._answers: dict[str, str] = {}
        self._published: dict[str, str] = {}
        """Name -> the request its published record answers (each answer names the one it replaces)."""
        self._records: dict[str, dict] = {}
        """Name -> the record published for the arena held under it."""
        """Names whose failed adoption this holder answered with an error record: its request id."""
        if isinstance(self.kv, _DirKV):
            try:
                self._drop_stale_records()
            except BaseException:
                self.kv.close()
                raise

    def _drop_stale_records(self) -> None:
        """Remove the records of arenas a holder before this one kept (killed: SIGKILL, the OOM
        killer), and its answers to failed adoptions. This holder has the registry's lock, so no
        other writes there, and their memory went with that holder: they had stayed, listed by
        every ``hold --list`` after, until someone removed them by hand. Each arena's record
        removed is noted in ``errors``.

        A record whose holder still runs, while this one has the lock, is an older FlashBoot's
        holder (it takes no lock): refused, FlashBootError naming its pid. Both had adopted every
        request, and an arena the other kept outlived each release, mapped and never freed."""
        live: dict[int, list[str]] = {}
        for name in self.kv.names("held"):
            try:
                record = self.kv.get("held", name)
                if record and "descriptor" not in record:  # a failed adoption's answer: its holder is gone
                    self.kv.delete("held", name)
                    continue
                gone = holder_gone(record) if record and "descriptor" in record else None
                if gone is not None:
                    self.kv.delete("held", name)
                    self.errors.append(f"{name}: removed the stale record of a holder before this one ({gone}; "
                                       "its memory went with it)")
                elif record and record.get("holder_pid") != os.getpid():
                    live.setdefault(record["holder_pid"], []).append(name)
            except FlashBootError as exc:  # one bad file must not stop the holder
                self.errors.append(f"{name}: stale record not checked: {exc}")
        for name in self.kv.names(REFIT):  # a refit's record of an arena no holder keeps now
            try:
                if self.kv.get("held", name) is None:
                    self.kv.delete(REFIT, name)
            except FlashBootError as exc:
                self.errors.append(f"{name}: stale refit record not checked: {exc}")
        if live:
            pid, names = next(iter(live.items()))
            raise FlashBootError(
                f"{self.kv.where()}: pid {pid} still holds {len(names)} arena(s) here ({', '.join(names[:3])}) "
                f"without the registry's lock {self.kv.LOCK}: a holder of an older FlashBoot, which takes no lock, "
                "serves it; two holders would both adopt every request. Stop that holder first (if pid "
                f"{pid} is no holder, remove held/{names[0]}.json)")

    def adopt(self, name: str, descriptor, request: str = "", image: dict | None = None, *,
              withdrawn: Callable[[], bool] | None = None) -> HeldArena | None:
        """Take the arena ``descriptor`` names into this process and publish it under ``name``
        (with ``image``, the engine's identity of the weights, for a restarted engine to check).
        ``withdrawn``: asked once the arena is mapped, before it is published; True (the engine's
        wait ran out meanwhile and it took its request back) lets it go again and returns None.

        Raises ArenaError when the engine has exited or its fd is not the arena."""
        from ..arena import Arena

        _check_name(name)
        if descriptor.pid > PID_MAX:  # os.pidfd_open's bare OverflowError had ended the loop, every arena dropped
            raise ArenaError(f"the request names engine pid {descriptor.pid}, which no process can have (Linux's "
                             f"pids end at {PID_MAX:,})")
        fds = take_fds(descriptor.pid, descriptor.fds)
        try:
            arena = Arena.open(descriptor, None if descriptor.backend == "host" else descriptor.device_index, fds=fds)
            # mapping every segment keeps the physical allocation alive after the engine is gone
            arena.map_range()
            # mapping a large arena takes a while: an engine whose wait ran out meanwhile said "no
            # holder adopted" and withdrew; kept, it was held (its memory in use) by no one's wish
            gone = withdrawn is not None and withdrawn()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if gone:
            HeldArena(name, arena, fds, descriptor, time.time()).close()
            self.errors.append(f"{name}: the engine (pid {descriptor.pid}) withdrew its hand-over (its wait ran out) "
                               "while its arena was being mapped; let go")
            return None
        held_desc = replace(descriptor, pid=os.getpid(), fds=tuple(fds))
        old = self.held.pop(name, None)
        item = HeldArena(name, arena, fds, held_desc, time.time())
        self.held[name] = item
        try:
            self._publish(name, {"descriptor": held_desc.to_dict(), "request": request, "since": item.since,
                                 "holder_pid": os.getpid(), "holder_start": self._start, "image": image,
                                 "engine_pid": descriptor.pid, "protocol": HOLDER_PROTOCOL})
        except BaseException:
            self.held.pop(name)
            item.close()
            if old is not None:  # its record is still the one published: kept, or it leaked, held by no one
                self.held[name] = old
            raise
        if old is not None:
            old.close()
        return item

    def _publish(self, name: str, record: dict) -> None:
        """Publish ``record`` (the answer to its request) under ``name``, naming the request whose
        answer it replaces: an engine whose arena was adopted, then replaced by another engine's
        under its name before it looked, had waited out its whole timeout ('no holder adopted')."""
        previous = self._published.get(name)
        self.kv.put("held", name, record if previous is None else {**record, "replaces": previous})
        self._published[name] = record["request"]
        if "descriptor" in record:
            self._records[name] = record

    def release(self, name: str) -> bool:
        """Stop holding ``name`` (its memory goes when no one else maps it). False if not held."""
        # the record first: one that cannot be removed keeps its arena held (and releasable again);
        # popped before, the arena had leaked, and closed, its record would name fds reused since.
        # A holder replaced in its store leaves a record the new holder wrote since.
        if not self.kv.superseded or self._names_us(self.kv.get("held", name)):
            self.kv.delete("held", name)
            self._drop_refit(name)
        self._published.pop(name, None)
        self._records.pop(name, None)
        item = self.held.pop(name, None)
        if item is None:
            return False
        item.close()
        return True

    def _drop_refit(self, name: str) -> None:
        """Remove what refits recorded of the arena held as ``name`` (:mod:`.holder_refit`): it goes
        with the arena. One left behind (or of an arena another under the name replaced) names its
        adoption, so no later arena is taken for it."""
        try:
            self.kv.delete(REFIT, name)
        except StoreLostError:
            raise
        except FlashBootError as exc:
            self.errors.append(f"{name}: its refit record stays: {exc}")

    def _names_us(self, record: dict | None) -> bool:
        return bool(record) and record.get("holder_pid") == os.getpid() and record.get("holder_start") == self._start

    def poll_once(self) -> int:
        """Handle every pending request; returns how many. A failed adoption is recorded in
        ``errors`` and answered with an error record, so the engine does not wait in vain; so is
        the request of an engine of an older protocol (:data:`OLDER_REQUESTS`), refused."""
        handled = 0
        self.kv.check_lease()
        kinds = [REQUESTS]
        if time.monotonic() >= self._next_older_poll:
            self._next_older_poll = time.monotonic() + OLDER_POLL_S
            kinds += OLDER_REQUESTS
        for kind in kinds:
            names = self.kv.names(kind)
            self.errors += self.kv.drain_problems()
            handled += sum(self._handle(kind, name) for name in names)
        return handled

    def _handle(self, kind: str, name: str) -> int:
        """Handle the request ``kind/name``; 1 if there was one to handle."""
        from ..arena import ArenaDescriptor

        # one bad request (planted, malformed) is recorded and skipped: it must not stop the
        # holder, which would drop every arena it holds
        try:
            req = self.kv.get(kind, name)
        except StoreLostError:
            raise
        except FlashBootError as exc:  # not JSON, or not an authentic record: nobody to answer
            self.errors.append(f"{name}: request skipped: {exc}")
            self._forget_request(kind, name)
            return 0
        if req is None:
            return 0
        if not isinstance(req, dict):
            self.errors.append(f"{name}: request skipped: it is a {type(req).__name__}, not an object")
            self._forget_request(kind, name)
            return 1
        try:
            _check_name(name)
            if kind != REQUESTS:
                self._refuse_older(kind, name, req)
            elif req.get("op") == "release":
                self.release(name)
            else:
                if "descriptor" not in req:
                    raise FlashBootError("the request carries no descriptor")
                image = req.get("image")
                request = req.get("request", "")
                self.adopt(name, ArenaDescriptor.from_dict(req["descriptor"]),
                           request if isinstance(request, str) else "", image if isinstance(image, dict) else None,
                           withdrawn=lambda: self._withdrawn(kind, name, req))
        except StoreLostError:
            raise
        except (FlashBootError, OSError) as exc:
            self.errors.append(f"{name}: {exc}")
            if req.get("op") != "release" and kind == REQUESTS:  # answered: the engine stops waiting
                self._answer_error(name, req, str(exc))
        # removed once answered (a holder killed before leaves it to the next), and only while it
        # is the one answered: a request written since, by an engine that saw its answer and asked
        # again at once, had been removed with it, unanswered (one at a time: see hand_over)
        self._forget_request(kind, name, req)
        return 1

    def _withdrawn(self, kind: str, name: str, req: dict) -> bool:
        """Whether the request ``req`` under ``name`` is gone (its engine's wait ran out); a store
        that cannot say now does not fail the adoption."""
        try:
            return self.kv.get(kind, name) != req
        except StoreLostError:
            raise
        except FlashBootError:
            return False

    def _answer_error(self, name: str, req: dict, error: str) -> None:
        answer = {"error": error, "request": str(req.get("request", "")), "engine_pid": req.get("pid"),
                  "protocol": HOLDER_PROTOCOL}
        try:
            if name in self.held and name in self._records:
                # the arena held under the name before stays held: its record stays too, the answer
                # on it (replaced by the answer, it had stayed mapped, listed and restarted from by no one)
                self.kv.put("held", name, {**self._records[name], "failed": answer})
                self._published[name] = answer["request"]
                return
            self._publish(name, answer)
            self._answers[name] = answer["request"]
        except FlashBootError as put_exc:
            self.errors.append(f"{name}: could not answer: {put_exc}")

    def _refuse_older(self, kind: str, name: str, req: dict) -> None:
        """Refuse the request of an engine of an older protocol, by name (FlashBootError): a holder
        of that protocol beside this one takes such requests too, and both had adopted them (a
        release through one left the other's mapping). The engine's wait is answered, unless an
        arena is held under ``name``: its record stays (an older release, waiting for the record
        to go, runs out). Protocol 1's only answer is ``held/NAME`` itself: a hand-over's error
        record carries its request id at the top, where a held record's names its adoption (read
        by refits and restarts), and a release has no error answer at all (only the record's
        removal, which it reports as released)."""
        why = (f"this holder ({self.kv.where()}) speaks holder protocol {HOLDER_PROTOCOL} and the engine that asked "
               f"holder protocol {OLDER_REQUESTS[kind]} (an older FlashBoot's): engines and their holder must run "
               "one FlashBoot version")
        if req.get("op") != "release":
            record = self.kv.get("held", name)
            if record is None or "descriptor" not in record:
                self._answer_error(name, req, why)
        raise FlashBootError(f"{'release' if req.get('op') == 'release' else 'hand-over'} refused: {why}")

    def _forget_request(self, kind: str, name: str, answered: dict | None = None) -> None:
        try:
            if answered is not None and self.kv.get(kind, name) not in (None, answered):
                return
            self.kv.delete(kind, name)
        except StoreLostError:
            raise
        except (FlashBootError, OSError) as exc:
            self.errors.append(f"{name}: could not remove the request: {exc}")

    def serve_forever(self, stop: threading.Event | None = None, *, handle_signals: bool = True) -> None:
        """Poll for requests until ``stop`` or SIGTERM/SIGINT (main thread), then :meth:`close`."""
        from ..service_loop import serve_until_stopped

        try:
            serve_until_stopped(self._stop, stop, handle_signals=handle_signals, tick=self.poll_once,
                                period_s=self.poll_s)
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Release every held arena and withdraw its name, and the error records that answered
        failed adoptions (an engine killed before its arena was taken): they had stayed, listed by
        every ``hold --list`` after this holder stopped."""
        for name in list(self.held):
            try:
                self.release(name)
            except FlashBootError as exc:
                self.errors.append(f"{name}: {exc}")
        answers, self._answers = self._answers, {}
        for name, request in answers.items():
            try:
                record = self.kv.get("held", name)
                if record is not None and "error" in record and record.get("request") == request:
                    self.kv.delete("held", name)
            except FlashBootError as exc:
                self.errors.append(f"{name}: its error record stays: {exc}")
        self.kv.close()

    def __enter__(self) -> "Holder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



__all__ = ["Holder", "HeldArena", "hand_over", "held_descriptor", "held_record", "holder_gone", "list_held", "open_held",
           "release"]
