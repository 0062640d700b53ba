"""The holder: keeps an arena alive after the engine that made it exits.

An engine hands its arena to a long-lived holder process (:func:`hand_over`). The holder takes the
arena's shareable fd out of the engine (``pidfd_getfd``), maps it -- which keeps the physical
allocation alive -- and re-exports it under a name: the same memory, now described by the
holder's pid and fd. When the engine restarts (a crash, an upgrade), it re-opens the same weights
with :func:`open_held` in milliseconds, without a copy (fault recovery no peer offers).

Where the names live (one of):

* a registry **directory** (``registry=DIR``; created mode 0700 and refused if others can write
  it): ``requests/NAME.json`` from engines, ``held/NAME.json`` from the holder, files replaced
  atomically;
* the rendezvous **store** (``store=HOST:PORT``): the same records, authenticated with the shared
  token (see :mod:`flashboot.flashclone.records`), requests numbered by an atomic counter.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._json import loads
from ..errors import ArenaError, FlashBootError, StoreLostError, WaitTimeoutError
from ..fdshare import grow_fd_table, take_fds
from ..fileio import lock_signer, read_regular, sign_lock
from ..procfs import PID_MAX, STOPPED, proc_start_time, process_state

DEFAULT_TIMEOUT_S = 30.0
MAX_PENDING_REQUESTS = 64
"""The most store request numbers a holder follows at once (the newest: older ones are skipped)."""
REQUEST_GRACE_S = 5.0
"""How long a counted store request may take to be written before it is skipped."""

MAX_RECORD_BYTES = 16 << 20
"""The largest registry record read (a descriptor of 1,024 segments with fabric handles is ~0.2 MB)."""

MAX_ERRORS = 100
"""How many problems a holder keeps (planted requests arrive as fast as anyone can write them)."""

HOLDER_BEAT_S = 0.5
"""How often a store's holder counts its beat (in a thread of its own: a long adoption does not
pause it)."""
HOLDER_LEASE_S = 5.0
"""A store's holder whose beat has not moved for this long is gone (killed, its host down): the
next holder takes its place. One that was only paused that long stops when it runs again."""


class ErrorLog(list):
    """A list of the newest ``cap`` messages; ``dropped`` counts the older ones let go."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap, self.dropped = cap, 0

    def append(self, item) -> None:
        super().append(item)
        self._trim()

    def extend(self, items) -> None:
        super().extend(items)
        self._trim()

    def __iadd__(self, items):
        self.extend(items)
        return self

    def _trim(self) -> None:
        extra = len(self) - self.cap
        if extra > 0:
            del self[:extra]
            self.dropped += extra


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


NAME_MAX = 200
"""The longest held-arena name: a registry's temporary file adds 14 bytes, and file names take 255."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS or name.startswith("."):
        raise FlashBootError(f"held-arena name must be letters, digits, '.', '_' or '-' (not starting with '.'), "
                             f"got {name!r}")
    if len(name) > NAME_MAX:  # a registry could not write it (ENAMETOOLONG): every hand-over had failed
        raise FlashBootError(f"held-arena name is {len(name)} characters, more than {NAME_MAX}: {name[:40]!r}...")
    return name


# ============================================================================================
# Where records live
# ============================================================================================


class _DirKV:
    """Records as JSON files in a private directory (atomic replace)."""

    superseded = None
    """A registry's holder is never replaced while it runs (see :meth:`lock_for_holder`)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True):
        self.path = Path(path)
        self._lock_fd: int | None = None
        if not create and not self.path.exists():  # a read: a mistyped path had left an empty registry behind
            return
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise FlashBootError(f"cannot create holder registry {str(self.path)!r}: {exc.strerror}") from None
        mode = self.path.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise FlashBootError(f"holder registry {str(self.path)!r} is writable by others (mode {oct(mode & 0o777)}); "
                                 "anyone could plant a descriptor there: chmod 700 it")
        for sub in ("requests", "held") if create else ():
            try:
                (self.path / sub).mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                raise FlashBootError(f"cannot create {str(self.path / sub)!r} in the holder registry: "
                                     f"{exc.strerror}") from None

    def where(self) -> str:
        return f"registry {str(self.path)!r}"

    LOCK = "holder.lock"

    def lock_for_holder(self) -> None:
        """Be this registry's one holder until :meth:`close` (an exclusive flock, which the kernel
        drops when the process dies). Two holders had both adopted requests: an arena one of them
        kept outlived every release and `hold --list`, still mapped, never freed."""
        import errno
        import fcntl

        path = self.path / self.LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise FlashBootError(f"{self.where()}: cannot open its holder lock {self.LOCK}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            other = lock_signer(path)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FlashBootError(f"{self.where()}: cannot lock {self.LOCK}: {exc.strerror}") from None
            raise FlashBootError(f"another holder{f' (pid {other})' if other.isdigit() else ''} already serves "
                                 f"{self.where()}; a registry has one holder at a time (stop it first, or use "
                                 "another registry)") from None
        sign_lock(fd)  # who holds it, for the next one refused
        self._lock_fd = fd

    # Every OSError is a FlashBootError naming the file: a bare one (a full disk at a hand-over, a
    # directory or unreadable file among the requests) had failed an engine's finished load, and
    # ended the holder's loop, which drops every arena it holds.
    def put(self, kind: str, name: str, body: dict) -> None:
        target = self.path / kind / f"{name}.json"
        tmp = target.with_name(f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a full disk: no half-written temporary left behind
                tmp.unlink()
            raise FlashBootError(f"{self.where()}: cannot write {kind}/{name}.json: {exc.strerror or exc}") from None

    def get(self, kind: str, name: str) -> dict | None:
        path = self.path / kind / f"{name}.json"
        try:  # a regular file of a bounded size: a named pipe in its place had blocked every ask
            raw = read_regular(path, MAX_RECORD_BYTES, FlashBootError)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise FlashBootError(f"{self.where()}: cannot read {kind}/{name}.json: {exc.strerror or exc}") from None
        record = loads(raw, f"{self.where()}: {kind}/{name}.json")  # nested deeply: RecursionError, no ValueError
        if not isinstance(record, dict):  # every reader takes fields of it: a list was a bare AttributeError
            raise FlashBootError(f"{self.where()}: {kind}/{name}.json is a JSON {type(record).__name__}, not an object")
        return record

    def delete(self, kind: str, name: str) -> None:
        try:
            (self.path / kind / f"{name}.json").unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise FlashBootError(f"{self.where()}: cannot remove {kind}/{name}.json: {exc.strerror or exc}") from None

    def names(self, kind: str) -> list[str]:
        return sorted(p.stem for p in (self.path / kind).glob("*.json"))

    def drain_problems(self) -> list[str]:
        return []

    def check_lease(self) -> None:
        """A registry's holder keeps its flock until it exits: no lease to lose."""

    def close(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # drops the flock: the next holder may start


class _StoreKV:
    """Records in the rendezvous store, signed with the token; requests numbered by a counter."""

    def __init__(self, address: str, *, token=None, token_file=None, namespace: str = "default", host: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        from .rendezvous import Rendezvous

        self.rdv = Rendezvous.connect(address, token, token_file=token_file, namespace=namespace, host=host,
                                      timeout_s=timeout_s)
        self._seen = 0
        self._pending: dict[int, float] = {}
        """Request numbers counted but not yet written, with when they were first seen."""
        self._problems: list[str] = []
        self._lease: int | None = None
        """The lease generation this process holds as the namespace's holder (None: not a holder)."""
        self._beating: threading.Thread | None = None
        self._beaten = 0.0
        """When the last beat was counted (monotonic)."""
        self._stop_beating = threading.Event()
        self.superseded: str | None = None
        """Why this holder lost its lease (who took it), or None."""

    def where(self) -> str:
        return f"store {self.rdv.address}, namespace {self.rdv.namespace!r}"

    # One holder per namespace, by a lease: generation G is the record ``hold/holder/G``, won by an
    # atomic compare-and-set, kept alive by the counter ``hold/holder/G/beat`` and given back by
    # ``hold/holder/G/free``. A store has no lock that dies with its owner (the registry's flock
    # does), so a holder that stops beating for HOLDER_LEASE_S is taken as gone. Two holders had
    # both adopted requests: a release taken by the one not holding the arena removed its record
    # while the other kept it mapped, listed nowhere.
    def lock_for_holder(self) -> None:
        """Be this namespace's one holder until :meth:`close`; FlashBootError naming the holder
        that beats there already."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": proc_start_time(os.getpid()),
              "nonce": secrets.token_hex(8)}
        gen = self.rdv.add("hold/holder/gen", 0)
        while self.rdv.has(f"hold/holder/{gen + 1}"):  # a winner that died before counting its generation
            gen += 1
        if gen:
            self._wait_out(gen)
        won = self.rdv.agree(f"hold/holder/{gen + 1}", me).body
        if won != me:  # another holder started at the same moment and won the generation
            raise FlashBootError(f"another holder ({_describe_holder(won)}) already serves {self.where()}; a "
                                 "namespace has one holder at a time (stop it first, or use another namespace)")
        self.rdv.add("hold/holder/gen", 1)
        self._lease = gen + 1
        self._beaten = time.monotonic()
        self._beating = threading.Thread(target=self._beat, name="flashboot-holder-lease", daemon=True)
        self._beating.start()

    def _wait_out(self, gen: int) -> None:
        """Return once generation ``gen``'s holder has given its lease back or stayed silent for
        :data:`HOLDER_LEASE_S`; FlashBootError naming it when it beats."""
        record = self.rdv.try_read(f"hold/holder/{gen}")
        who = _describe_holder(record.body if record is not None else {})
        beat = self.rdv.add(f"hold/holder/{gen}/beat", 0)
        deadline = time.monotonic() + HOLDER_LEASE_S
        while self.rdv.try_read(f"hold/holder/{gen}/free") is None:
            if self.rdv.add(f"hold/holder/{gen}/beat", 0) != beat:
                raise FlashBootError(f"another holder ({who}) already serves {self.where()}; a namespace has one "
                                     "holder at a time (stop it first, or use another namespace)")
            if time.monotonic() >= deadline:
                self._problems.append(f"the holder before this one ({who}) was silent for {HOLDER_LEASE_S:g} s "
                                      "and is taken as gone; its arenas went with it")
                return
            time.sleep(min(0.05, HOLDER_BEAT_S / 4))

    def _beat(self) -> None:
        """Count a beat every :data:`HOLDER_BEAT_S` until closed or replaced."""
        gen = self._lease
        while not self._stop_beating.wait(HOLDER_BEAT_S):
            try:
                # paused past the lease (SIGSTOP, a frozen VM): taken over meanwhile
                if self._superseded_by(self.rdv.try_read(f"hold/holder/{gen + 1}")):
                    return
                self.rdv.add(f"hold/holder/{gen}/beat", 1)
            except FlashBootError as exc:  # the loop's next store call says so too
                self._problems.append(f"the lease's beat failed: {exc}")
                continue
            self._beaten = time.monotonic()

    def check_lease(self) -> None:
        """FlashBootError once another holder has taken this one's lease. Asked of the store itself
        when the beat is late: a holder resumed after a pause polls before its beat thread runs."""
        if self._lease is not None and not self.superseded and time.monotonic() - self._beaten > 1.5 * HOLDER_BEAT_S:
            self._superseded_by(self.rdv.try_read(f"hold/holder/{self._lease + 1}"))
        if self.superseded:
            raise FlashBootError(self.superseded)

    def _superseded_by(self, newer) -> bool:
        """Note the record of the holder that took the lease over, if any; whether there is one."""
        if newer is not None and not self.superseded:
            self.superseded = (f"another holder ({_describe_holder(newer.body)}) took over {self.where()} while "
                               f"this one was silent for over {HOLDER_LEASE_S:g} s; this one stops")
        return newer is not None

    def put(self, kind: str, name: str, body: dict) -> None:
        self.rdv.publish(f"hold/{kind}/{name}", body)
        if kind == "requests":
            k = self.rdv.add("hold/requests/count", 1)
            self.rdv.publish(f"hold/requests/#{k}", {"name": name})

    def get(self, kind: str, name: str) -> dict | None:
        rec = self.rdv.try_read(f"hold/{kind}/{name}")
        return None if rec is None or rec.body.get("deleted") else rec.body

    def delete(self, kind: str, name: str) -> None:
        self.rdv.publish(f"hold/{kind}/{name}", {"deleted": True})

    def names(self, kind: str) -> list[str]:
        if kind != "requests":
            raise FlashBootError("the store does not list held names; ask for one by name")
        from ..errors import RendezvousError

        # Anyone who reaches the store can bump the counter or plant garbage (only a denial of
        # service: every record is authenticated), so nothing here may raise or wait: a number
        # not written yet is asked for again at the next poll, for REQUEST_GRACE_S, and only the
        # last MAX_PENDING_REQUESTS numbers are followed (a counter bumped by 10**7 is skipped).
        n = self.rdv.add("hold/requests/count", 0)
        if n - self._seen > MAX_PENDING_REQUESTS:
            self._problems.append(f"request counter jumped from {self._seen} to {n}; skipped "
                                  f"#{self._seen + 1}..#{n - MAX_PENDING_REQUESTS}")
            self._seen = n - MAX_PENDING_REQUESTS
        now = time.monotonic()
        while self._seen < n:
            self._seen += 1
            self._pending[self._seen] = now
        out = []
        for k, since in sorted(self._pending.items())[-MAX_PENDING_REQUESTS:]:
            try:
                rec = self.rdv.try_read(f"hold/requests/#{k}")
                if rec is None:
                    if now - since > REQUEST_GRACE_S:
                        raise FlashBootError(f"was counted but never written within {REQUEST_GRACE_S:g} s")
                    continue
                name = rec.body.get("name")
                _check_name(name)
                out.append(name)
            except RendezvousError as exc:
                if isinstance(exc, StoreLostError):
                    raise
                self._problems.append(f"request #{k} skipped: {exc}")
            except FlashBootError as exc:
                self._problems.append(f"request #{k} skipped: {exc}")
            del self._pending[k]
        for k in sorted(self._pending)[:-MAX_PENDING_REQUESTS]:
            del self._pending[k]
        return out

    def drain_problems(self) -> list[str]:
        out, self._problems = self._problems, []
        return out

    def close(self) -> None:
        beating, self._beating = self._beating, None
        if beating is not None:  # once: a holder's close may come twice (serve_forever's, then the caller's)
            self._stop_beating.set()
            beating.join(self.rdv.timeout_s)
            if not self.superseded:  # given back: the next holder starts at once
                with contextlib.suppress(FlashBootError):  # else it waits out the lease
                    self.rdv.publish(f"hold/holder/{self._lease}/free", {"pid": os.getpid()})
        self.rdv.close()


def _describe_holder(record: dict) -> str:
    """``pid P on HOST`` of a lease record (the fields a planted-but-authentic one may lack)."""
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}"


def _kv(registry=None, store=None, *, create: bool = True, **kw):
    if (registry is None) == (store is None):
        raise FlashBootError("name where held arenas live: registry=DIR or store=HOST:PORT (exactly one)")
    return _DirKV(registry, create=create) if registry is not None else _StoreKV(store, **kw)


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
        self._answers: dict[str, str] = {}
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
        if live:
            pid, names = next(iter(live.items()))
            raise FlashBootError(
                f"{self.kv.where()}: pid {pid} still holds {len(names)} arena(s) here ({', '.join(names[:3])}) "
                f"without the registry's lock {self.kv.LOCK}: a holder of an older FlashBoot, which takes no lock, "
                "serves it; two holders would both adopt every request. Stop that holder first (if pid "
                f"{pid} is no holder, remove held/{names[0]}.json)")

    def adopt(self, name: str, descriptor, request: str = "", image: dict | None = None) -> HeldArena:
        """Take the arena ``descriptor`` names into this process and publish it under ``name``
        (with ``image``, the engine's identity of the weights, for a restarted engine to check).

        Raises ArenaError when the engine has exited or its fd is not the arena."""
        from ..arena import Arena

        _check_name(name)
        fds = take_fds(descriptor.pid, descriptor.fds)
        try:
            arena = Arena.open(descriptor, None if descriptor.backend == "host" else descriptor.device_index, fds=fds)
            # mapping every segment keeps the physical allocation alive after the engine is gone
            arena.map_range()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        held_desc = replace(descriptor, pid=os.getpid(), fds=tuple(fds))
        old = self.held.pop(name, None)
        item = HeldArena(name, arena, fds, held_desc, time.time())
        self.held[name] = item
        try:
            self.kv.put("held", name, {"descriptor": held_desc.to_dict(), "request": request, "since": item.since,
                                       "holder_pid": os.getpid(), "holder_start": self._start, "image": image})
        except BaseException:
            self.held.pop(name)
            item.close()
            if old is not None:  # its record is still the one published: kept, or it leaked, held by no one
                self.held[name] = old
            raise
        if old is not None:
            old.close()
        return item

    def release(self, name: str) -> bool:
        """Stop holding ``name`` (its memory goes when no one else maps it). False if not held."""
        # the record first: one that cannot be removed keeps its arena held (and releasable again);
        # popped before, the arena had leaked, and closed, its record would name fds reused since.
        # A holder replaced in its store leaves a record the new holder wrote since.
        if not self.kv.superseded or self._names_us(self.kv.get("held", name)):
            self.kv.delete("held", name)
        item = self.held.pop(name, None)
        if item is None:
            return False
        item.close()
        return True

    def _names_us(self, record: dict | None) -> bool:
        return bool(record) and record.get("holder_pid") == os.getpid() and record.get("holder_start") == self._start

    def poll_once(self) -> int:
        """Handle every pending request; returns how many. A failed adoption is recorded in
        ``errors`` and answered with an error record, so the engine does not wait in vain."""
        from ..arena import ArenaDescriptor

        handled = 0
        self.kv.check_lease()
        names = self.kv.names("requests")
        self.errors += self.kv.drain_problems()
        for name in names:
            # one bad request (planted, malformed) is recorded and skipped: it must not stop the
            # holder, which would drop every arena it holds
            try:
                req = self.kv.get("requests", name)
            except StoreLostError:
                raise
            except FlashBootError as exc:  # not JSON, or not an authentic record: nobody to answer
                self.errors.append(f"{name}: request skipped: {exc}")
                self._forget_request(name)
                continue
            if req is None:
                continue
            handled += 1
            if not isinstance(req, dict):
                self.errors.append(f"{name}: request skipped: it is a {type(req).__name__}, not an object")
                self._forget_request(name)
                continue
            try:
                _check_name(name)
                if req.get("op") == "release":
                    self.release(name)
                else:
                    if "descriptor" not in req:
                        raise FlashBootError("the request carries no descriptor")
                    image = req.get("image")
                    request = req.get("request", "")
                    self.adopt(name, ArenaDescriptor.from_dict(req["descriptor"]),
                               request if isinstance(request, str) else "", image if isinstance(image, dict) else None)
            except StoreLostError:
                raise
            except (FlashBootError, OSError) as exc:
                self.errors.append(f"{name}: {exc}")
                if req.get("op") != "release":  # answered: the engine stops waiting
                    try:
                        self.kv.put("held", name, {"error": str(exc), "request": str(req.get("request", ""))})
                        self._answers[name] = str(req.get("request", ""))
                    except FlashBootError as put_exc:
                        self.errors.append(f"{name}: could not answer: {put_exc}")
            self._forget_request(name)
        return handled

    def _forget_request(self, name: str) -> None:
        try:
            self.kv.delete("requests", name)
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


# ============================================================================================
# The engine side
# ============================================================================================


def hand_over(arena, name: str, *, registry=None, store=None, timeout_s: float = DEFAULT_TIMEOUT_S,
              image: dict | None = None, **store_options):
    """Ask the holder to keep ``arena`` under ``name``; returns the holder's descriptor once it has
    mapped it (after which this process may exit). From then on ``arena.sleep()`` is refused,
    naming the holder. WaitTimeoutError when no holder answers within ``timeout_s``; ArenaError
    when the holder could not adopt it. ``image``: what the weights are (a JSON-ready dict,
    :func:`flashboot.flashload.restart.image_identity`), published with the held arena."""
    from ..arena import ArenaDescriptor
    from ..units import check_timeout

    _check_name(name)
    check_timeout(timeout_s, "hand_over timeout_s")  # NaN: no deadline is ever reached, a wait for no holder never ended
    # a store that does not answer is bounded by the same timeout, not the store's 30 s default
    kv = _kv(registry, store, **({"timeout_s": timeout_s, **store_options} if store is not None else store_options))
    try:
        request = secrets.token_hex(8)
        kv.put("requests", name, {"descriptor": arena.export().to_dict(), "request": request, "pid": os.getpid(),
                                  "image": image})
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            held = kv.get("held", name)
            if held is not None and held.get("request") == request:
                if "error" in held:
                    raise ArenaError(f"the holder ({kv.where()}) could not adopt {name!r}: {held['error']}")
                arena.share(f"holder {name!r} ({kv.where()})")  # its sleep would free nothing the holder maps
                return ArenaDescriptor.from_dict(held["descriptor"])
            if time.monotonic() > deadline:
                kv.delete("requests", name)
                raise WaitTimeoutError(f"no holder adopted {name!r} within {timeout_s:g} s ({kv.where()}); "
                                       + (_holder_fate(kv) or "is `flashboot hold` running there?"))
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        kv.close()


def _holder_fate(kv) -> str:
    """What became of a registry's holder, for a wait that ran out (its lock file names its pid):
    exited (killed: the engine had been asked whether one runs at all), stopped, or '' (running,
    or not known: a store's)."""
    if not isinstance(kv, _DirKV):
        return ""
    pid = lock_signer(kv.path / kv.LOCK)
    if not pid.isdigit():
        return ""
    state = process_state(pid)
    if state == "X":
        return f"its holder (pid {pid}) has exited: start `flashboot hold --registry {kv.path}` again"
    if state in STOPPED:
        return f"its holder (pid {pid}) is stopped (process state {state}): resume it (kill -CONT) or restart it"
    return ""


def holder_gone(record: dict) -> str | None:
    """Why the holder that wrote ``record`` keeps its arena no more (a killed holder's record stays
    behind it), or None while it runs. A pid that now names another process is gone too: a holder
    restarted in a fresh container gets the old one's pid, and the old record's fds, taken from
    it, were another arena's (the holder runs on this host: it maps arenas through pidfds)."""
    pid = record.get("holder_pid")
    if type(pid) is not int or not 0 < pid <= PID_MAX:  # past it, os.kill raised OverflowError
        return f"the record names no holder pid (holder_pid {pid!r})"
    others = False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its holder (pid {pid}) has exited"
    except PermissionError:  # another user's process: its start time still says whether it is the holder
        others = True
    start = record.get("holder_start")
    if start is None:  # a record of a holder that did not write its start time: the pid alone
        return None
    now = proc_start_time(pid)
    if now is None and others:  # /proc hides other users' processes (hidepid): it exists, unknown whose
        return None
    if now != start:
        return (f"its holder (pid {pid}) has exited" if now is None else
                f"its holder (pid {pid}) has exited; pid {pid} now names another process (started at tick {now}, "
                f"the holder at {start})")
    return None


def held_record(name: str, *, registry=None, store=None, **store_options) -> dict | None:
    """The holder's whole record for ``name`` (descriptor, image, since, holder_pid; or the error
    of a failed adoption), None when nothing is held under it."""
    _check_name(name)
    kv = _kv(registry, store, create=False, **store_options)
    try:
        return kv.get("held", name)
    finally:
        kv.close()


def held_descriptor(name: str, *, registry=None, store=None, **store_options):
    """The descriptor the holder publishes for ``name``; ArenaError when nothing is held under it."""
    from ..arena import ArenaDescriptor

    _check_name(name)
    kv = _kv(registry, store, create=False, **store_options)
    try:
        held = kv.get("held", name)
        if held is None or "descriptor" not in held:
            raise ArenaError(f"no arena is held as {name!r} in {kv.where()}"
                             + (f" (last adoption failed: {held['error']})" if held and "error" in held else ""))
        gone = holder_gone(held)
        if gone is not None:  # its fds, taken by pid, would be nothing, or another process's
            raise ArenaError(f"the arena held as {name!r} in {kv.where()} is gone: {gone}")
        return ArenaDescriptor.from_dict(held["descriptor"])
    finally:
        kv.close()


def open_held(name: str, device: Any = None, *, registry=None, store=None, **store_options):
    """Map the arena held as ``name`` (the same memory, no copy). ``device`` as for
    :meth:`flashboot.Arena.open` (default: where it lives). ArenaError when it is not held or the
    holder has exited."""
    from ..arena import Arena

    desc = held_descriptor(name, registry=registry, store=store, **store_options)
    if desc.backend == "host":
        return Arena.open(desc)
    return Arena.open(desc, device)


def release(name: str, *, registry=None, store=None, timeout_s: float = DEFAULT_TIMEOUT_S, **store_options) -> None:
    """Ask the holder to drop ``name`` and wait until it has. WaitTimeoutError if it does not;
    ArenaError when nothing holds ``name`` (or its holder has exited)."""
    from ..units import check_timeout

    _check_name(name)
    check_timeout(timeout_s, "release timeout_s")  # NaN had waited forever for a holder that is not there
    # the store's connect is bounded by the same timeout, not the store's 30 s default
    kv = _kv(registry, store, create=False,
             **({"timeout_s": timeout_s, **store_options} if store is not None else store_options))
    try:
        # a name nothing holds had returned at once, as if released: a typo went unnoticed
        held = kv.get("held", name)
        if held is None:
            raise ArenaError(f"nothing is held as {name!r} in {kv.where()}")
        gone = holder_gone(held) if "descriptor" in held else None
        if gone is not None:  # no holder will answer the request: the wait had run out blaming it
            raise ArenaError(f"{name!r} is held no more in {kv.where()}: {gone}, and its memory went with it")
        kv.put("requests", name, {"op": "release"})
        deadline = time.monotonic() + timeout_s
        while kv.get("held", name) is not None:
            if time.monotonic() > deadline:
                fate = _holder_fate(kv)
                raise WaitTimeoutError(f"the holder did not release {name!r} within {timeout_s:g} s ({kv.where()})"
                                       + (f"; {fate}" if fate else ""))
            time.sleep(0.01)
    finally:
        kv.close()


def list_held(registry) -> dict[str, dict]:
    """``name -> record`` of everything held in a registry directory."""
    kv = _DirKV(registry, create=False)
    return {n: kv.get("held", n) for n in kv.names("held")}


__all__ = ["Holder", "HeldArena", "hand_over", "held_descriptor", "held_record", "holder_gone", "list_held", "open_held",
           "release"]
