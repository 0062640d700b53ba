"""Where a holder's records live, and what a record says: the wire side of
:mod:`flashboot.flashclone.holder`.

One of:

* a registry **directory** (``registry=DIR``; created mode 0700 and refused if others can write
  it): ``requests.v2/NAME.json`` from engines, ``held/NAME.json`` from the holder, files replaced
  atomically;
* the rendezvous **store** (``store=HOST:PORT``): the same records, authenticated with the shared
  token (see :mod:`flashboot.flashclone.records`), requests numbered by an atomic counter.

Each also decides who is its one holder (the registry's flock, the store's lease).

Engines and their holder speak one :data:`HOLDER_PROTOCOL`: an engine asks where only a holder of
its protocol looks (:data:`REQUESTS`), and every record a holder writes names its protocol.
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
from pathlib import Path

from .._json import loads
from ..errors import FlashBootError, StoreLostError
from ..fileio import lock_signer, read_regular, sign_lock
from ..procfs import PID_MAX, proc_start_time

DEFAULT_TIMEOUT_S = 30.0
MAX_PENDING_REQUESTS = 64
"""The most store request numbers a holder follows at once (the newest: older ones are skipped)."""
REQUEST_GRACE_S = 5.0
"""How long a counted store request may take to be written before it is skipped."""

MAX_RECORD_BYTES = 16 << 20
"""The largest registry record read (a descriptor of 1,024 segments with fabric handles is ~0.2 MB)."""

HOLDER_PROTOCOL = 2
"""What this FlashBoot's holder and engines speak. 1: every FlashBoot before 2026-12-05's holder
lock, whose records name no protocol and whose holders take no lock or lease: one of them beside
this one had adopted requests too (an arena released through one stayed mapped by the other)."""
REQUESTS = f"requests.v{HOLDER_PROTOCOL}"
"""Where engines of this protocol ask (a registry's folder, a store's key prefix): a holder of
protocol 1 does not look there, so it never takes this protocol's requests."""
OLDER_REQUESTS = {"requests": 1}
"""Where engines of older protocols ask, and their protocol: a holder refuses them by name."""
REFIT = "refit"
"""Where engines record what an in-place refit made of a held arena (:mod:`.holder_refit`): a
registry's folder, a store's key prefix (``hold/refit/NAME``)."""

HOLDER_BEAT_S = 0.5
"""How often a store's holder counts its beat (in a thread of its own: a long adoption does not
pause it)."""
HOLDER_LEASE_S = 5.0
"""A store's holder whose beat has not moved for this long is gone (killed, its host down): the
next holder takes its place. One that was only paused that long stops when it runs again."""


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
        for sub in (REQUESTS, "held", REFIT) if create else ():
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
        self._write(kind, name, body, os.replace)

    def put_request(self, name: str, body: dict, announce: bool = True) -> dict | None:
        """Ask (``REQUESTS/NAME``) unless a request under ``name`` is pending: None when asked,
        else the pending one (``{}`` when it went meanwhile, or cannot be read)."""
        try:  # the whole file linked in or not at all: a link does not replace
            self._write(REQUESTS, name, body, os.link)
            return None
        except FileExistsError:
            pass
        try:
            return self.get(REQUESTS, name) or {}
        except FlashBootError:
            return {}

    def _write(self, kind: str, name: str, body: dict, place) -> None:
        target = self.path / kind / f"{name}.json"
        tmp = target.with_name(f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            place(tmp, target)
        except FileExistsError:
            raise
        except OSError as exc:
            raise FlashBootError(f"{self.where()}: cannot write {kind}/{name}.json: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(OSError):  # a full disk, a link: no temporary left behind
                tmp.unlink()

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
        self._seen: dict[str, int] = {}
        """The last request number counted, by where requests are asked (:data:`REQUESTS`, ...)."""
        self._pending: dict[str, dict[int, float]] = {}
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
        if kind == REQUESTS or kind in OLDER_REQUESTS:
            k = self.rdv.add(f"hold/{kind}/count", 1)
            self.rdv.publish(f"hold/{kind}/#{k}", {"name": name})

    def put_request(self, name: str, body: dict, announce: bool = True) -> dict | None:
        """As :meth:`_DirKV.put_request`, by a compare-and-set. ``announce``: count a pending
        request again, so that one whose engine died before counting it is taken (and answered)."""
        pending = self.rdv.agree(f"hold/{REQUESTS}/{name}", body).body
        # ours by its id: compared whole, a tuple asked (a list once stored) read as another's
        mine = "request" in body and pending.get("request") == body["request"]
        if mine or announce:
            k = self.rdv.add(f"hold/{REQUESTS}/count", 1)
            self.rdv.publish(f"hold/{REQUESTS}/#{k}", {"name": name})
        return None if mine else pending

    def get(self, kind: str, name: str) -> dict | None:
        rec = self.rdv.try_read(f"hold/{kind}/{name}")
        return None if rec is None or rec.body.get("deleted") else rec.body

    def delete(self, kind: str, name: str) -> None:
        if kind == "held":
            self.rdv.publish(f"hold/{kind}/{name}", {"deleted": True})
        else:  # gone, not marked: the next request under the name is a compare-and-set
            self.rdv.delete(f"hold/{kind}/{name}")

    def names(self, kind: str) -> list[str]:
        if kind != REQUESTS and kind not in OLDER_REQUESTS:
            raise FlashBootError("the store does not list held names; ask for one by name")
        from ..errors import RendezvousError

        # Anyone who reaches the store can bump the counter or plant garbage (only a denial of
        # service: every record is authenticated), so nothing here may raise or wait: a number
        # not written yet is asked for again at the next poll, for REQUEST_GRACE_S, and only the
        # last MAX_PENDING_REQUESTS numbers are followed (a counter bumped by 10**7 is skipped).
        n = self.rdv.add(f"hold/{kind}/count", 0)
        seen, pending = self._seen.get(kind, 0), self._pending.setdefault(kind, {})
        if n - seen > MAX_PENDING_REQUESTS:
            self._problems.append(f"{kind} counter jumped from {seen} to {n}; skipped "
                                  f"#{seen + 1}..#{n - MAX_PENDING_REQUESTS}")
            seen = n - MAX_PENDING_REQUESTS
        now = time.monotonic()
        while seen < n:
            seen += 1
            pending[seen] = now
        self._seen[kind] = seen
        out = []
        for k, since in sorted(pending.items())[-MAX_PENDING_REQUESTS:]:
            try:
                rec = self.rdv.try_read(f"hold/{kind}/#{k}")
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
                self._problems.append(f"{kind} #{k} skipped: {exc}")
            except FlashBootError as exc:
                self._problems.append(f"{kind} #{k} skipped: {exc}")
            del pending[k]
        for k in sorted(pending)[:-MAX_PENDING_REQUESTS]:
            del pending[k]
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



def protocol_refused(record: dict) -> str | None:
    """Why a held record that a holder of another protocol wrote is not used (an older FlashBoot's
    names none), or None when it speaks :data:`HOLDER_PROTOCOL`."""
    protocol = record.get("protocol", 1)
    if protocol == HOLDER_PROTOCOL:
        return None
    older = type(protocol) is int and protocol < HOLDER_PROTOCOL
    return (f"its holder (pid {record.get('holder_pid', '?')}) speaks holder protocol {protocol!r} "
            f"({'an older' if older else 'another'} FlashBoot's); this FlashBoot speaks holder protocol "
            f"{HOLDER_PROTOCOL}: engines and their holder must run one FlashBoot version")


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



__all__ = ["DEFAULT_TIMEOUT_S", "HOLDER_BEAT_S", "HOLDER_LEASE_S", "HOLDER_PROTOCOL", "MAX_PENDING_REQUESTS",
           "MAX_RECORD_BYTES", "NAME_MAX", "OLDER_REQUESTS", "REFIT", "REQUESTS", "REQUEST_GRACE_S", "holder_gone",
           "protocol_refused"]
