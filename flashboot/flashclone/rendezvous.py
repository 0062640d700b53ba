"""Out-of-band rendezvous for FlashClone: manifests, arena descriptors and a start barrier, over
torch.distributed's ``TCPStore`` (no home-made server).

Who talks to whom:

* the **store** is a plain ``TCPStore``. Host it in a process of its own (``flashboot store
  HOST:PORT``, :class:`~flashboot.flashclone.store.StoreServer`), or use one the caller already
  runs (torchrun's ``MASTER_ADDR:MASTER_PORT`` store, any ``TCPStore(is_master=True)``): then a
  seed that dies takes only its own records with it. Without one, the seed hosts the store
  itself, and its death ends the store for everyone (a clone that already holds every byte keeps
  them and says so in ``report.warnings``);
* the **seed** hosts the store at ``HOST:PORT`` unless one already listens there (then it joins it
  as a client), and publishes its :class:`Manifest` (image key, sizes, per-chunk checksums) and its
  arena descriptor;
* each **clone** connects as a client, reads and checks the seed's manifest, takes a position by
  arrival order (an atomic ``store.add`` counter), publishes its own descriptors, and waits only
  for what it needs (its source's record, a start barrier) -- every wait with a deadline and a
  message naming what was awaited.

Trust: every record is authenticated with a shared token and bound to its key, and the fields
that grant access to memory are sealed (:mod:`flashboot.flashclone.records`): a clone refuses a
record that does not verify before any byte moves. What a clone agrees with is the seed's
:class:`~flashboot.flashclone.manifest.Manifest`.

This module is the records' layer (namespaced keys, signed records and their parts, waits,
counters, barriers); reaching the store (hosting or joining it, bounded calls, a lost store
named, rejoining) is :mod:`flashboot.flashclone.connection`, whose names are importable from
here too.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from typing import Any, Callable, Iterable, Mapping

from ..errors import RendezvousError, StoreLostError, WaitTimeoutError
from ..units import check_timeout
from .connection import StoreConnection, StoreSilentError, open_store
from .records import Record, Token, decode_record, encode_record, resolve_token

# the connection layer's names, importable from here as before the split (importers and tests name them here)
from .connection import (  # noqa: E402,F401
    _JOIN_LOCK, _TCPSTORE_MAGIC, _TCPSTORE_PING, _TCPSTORE_VALIDATE, CALLS_JOIN_S, JOIN_ATTEMPTS, OpenedStore,
    _await_store, _ip_literal, _joined_socket, _names_this_machine, _resolve, _socket_fds, _store_hello, free_port,
    host_tcpstore, parse_address,
)

DEFAULT_TIMEOUT_S = 60.0
KEY_PREFIX = "flashboot/v1"

STORE_SERVER_KEY = f"{KEY_PREFIX}/store-server"
"""Set (to its pid) by a :class:`~flashboot.flashclone.store.StoreServer` in the store it hosts."""

VALUE_PART_BYTES = 4 << 20
"""The most bytes written under one store key: a longer record goes in parts of this size, then a
short pointer to them under its key (:meth:`Rendezvous.publish`). torch's TCPStore server (libuv,
the default since torch 2.4) refuses a message over 8 MiB by dropping the client's connection: a
seed whose image metadata ran past it (an MoE model's ~90k tensors, each rank listing them all
under tensor parallelism: ~18 MB) failed with "lost the rendezvous store", and lost it."""
MAX_KEY_BYTES = 8192 - 64
"""The longest store key (UTF-8), with room for a part's suffix: the libuv TCPStore drops a client
that sends a key over 8 KiB, and the connection was then reported lost."""
_PARTS_TAG = b"flashboot-parts:"
_MAX_PARTS = 1024
"""A pointer naming more parts (4 GiB) is not ours: refused before any is read."""
_ABSENT = b"\x00flashboot-absent"
"""What :meth:`Rendezvous._peek` has compare_set expect: no record or pointer is these bytes."""


WAIT_POLL_S = 0.02
"""The longest sleep between two checks of a key being waited for (a check is one round trip)."""

WAIT_POLL_SHARE = 0.05
"""A wait sleeps at most this share of the time it has waited so far (and 1 ms at least), so a key
that appears is seen within 5 % of the wait's length: a clone waiting 30 ms for its seed's handle
loses at most 1.5 ms, where doubling sleeps (1, 2, 4, 8, 16 ms) could add 16."""


def wait_poll_delay(waited_s: float) -> float:
    """The sleep before the next check of a wait that has lasted ``waited_s``."""
    return min(WAIT_POLL_S, max(0.001, WAIT_POLL_SHARE * waited_s))


class Rendezvous(StoreConnection):
    """A connection to the rendezvous store, scoped to one ``namespace``, that reads and writes
    authenticated records. Build one with :meth:`connect`."""

    def __init__(self, store, address: str, token: Token, namespace: str, is_server: bool, timeout_s: float,
                 conn: socket.socket | None = None, ip: str | None = None):
        super().__init__(store, address, is_server, timeout_s, conn, ip)
        self.token = token
        self.namespace = namespace

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str, token: Token | str | bytes | None = None, *, token_file=None,
                namespace: str = "default", host: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Rendezvous":
        """Connect to the store at ``address`` (``HOST:PORT``).

        ``host=True``: host the store in this process unless one already listens there (then join
        it as a client); the store then lives only as long as this process. Otherwise wait up to
        ``timeout_s`` for a store to appear: one hosted by ``flashboot store``
        (:class:`~flashboot.flashclone.store.StoreServer`) or any ``TCPStore(is_master=True)``, such
        as torchrun's at ``MASTER_ADDR:MASTER_PORT``. The token is resolved first (RendezvousError
        without one), so nothing is exchanged without it. Joining is bounded by ``timeout_s``:
        WaitTimeoutError names the address when nothing there answers TCPStore's handshake in time,
        RendezvousError when what answers is not a store.
        """
        # NaN had raised a bare ValueError from timedelta, inf an OverflowError, and 0 or less a
        # StoreSilentError blaming the link of a store that answered
        timeout_s = check_timeout(timeout_s, "rendezvous timeout_s", RendezvousError)
        tok = resolve_token(token, token_file)
        if not namespace or "/" in namespace:
            raise RendezvousError(f"namespace must be a non-empty name without '/', got {namespace!r}")
        opened = open_store(address, host=host, timeout_s=timeout_s)
        return cls(opened.store, address, tok, namespace, opened.is_server, timeout_s, conn=opened.conn, ip=opened.ip)

    @property
    def where(self) -> str:
        """The store and namespace, for an error about a record read here."""
        return f"the store at {self.address} (namespace {self.namespace!r})"

    # -- keys ------------------------------------------------------------------------------------
    def full_key(self, key: str) -> str:
        full = f"{KEY_PREFIX}/{self.namespace}/{key}"
        if len(full) > MAX_KEY_BYTES // 4 and len(full.encode()) > MAX_KEY_BYTES:
            raise RendezvousError(f"store key {full[:100]!r}... is {len(full.encode()):,} bytes long (namespace "
                                  f"{len(self.namespace.encode()):,}); the store takes keys of at most "
                                  f"{MAX_KEY_BYTES:,}: use a shorter name")
        return full

    # -- records -----------------------------------------------------------------------------
    def publish(self, key: str, body: Mapping[str, Any], sealed: Mapping[str, Any] | None = None) -> None:
        """Write an authenticated record (``sealed`` encrypted) under ``key``; one longer than
        :data:`VALUE_PART_BYTES` in parts, then the pointer to them (readers see the whole record or
        none: the pointer comes last, the parts are named by the record's digest)."""
        full = self.full_key(key)
        raw = encode_record(self.token, full, body, sealed)
        what = f"publishing {key!r}"
        if len(raw) <= VALUE_PART_BYTES:
            self._store_call(what, self.store.set, full, raw)
            return
        digest = hashlib.sha256(raw).hexdigest()[:32]
        count = -(-len(raw) // VALUE_PART_BYTES)
        for i in range(count):
            self._store_call(what, self.store.set, f"{full}/parts/{digest}/{i}",
                             raw[i * VALUE_PART_BYTES:(i + 1) * VALUE_PART_BYTES])
        before = self._pointer(full, what)
        pointer = {"parts": count, "nbytes": len(raw), "sha256": digest}
        self._store_call(what, self.store.set, full, _PARTS_TAG + json.dumps(pointer).encode())
        if before is not None and before.get("sha256") != digest:
            self._delete_parts(full, before, what)  # another version's: they would stay in the store for good

    def _get(self, full: str, key: str) -> bytes:
        """The record's bytes under ``full`` (present), its parts joined."""
        return self._join(full, key, self._store_call(f"reading {key!r}", self.store.get, full))[0]

    def _peek(self, full: str, what: str) -> bytes | None:
        """The value under ``full``, or None when there is none, in one round trip (check, then
        get, took two): compare_set expecting :data:`_ABSENT` writes nothing where the key is
        missing and answers ``_ABSENT``, and answers the value where there is one (rewriting it
        only where it is ``_ABSENT`` itself: the same bytes)."""
        raw = self._store_call(what, self.store.compare_set, full, _ABSENT, _ABSENT)
        return None if raw == _ABSENT else raw

    def _join(self, full: str, key: str, raw: bytes) -> tuple[bytes, dict | None]:
        """The record's bytes from ``raw``, the value read under ``full``: itself, or the parts
        its pointer names, joined; and that pointer (None for a whole record)."""
        what = f"reading {key!r}"
        if not raw.startswith(_PARTS_TAG):
            return raw, None
        for _ in range(2):  # a pointer replaced after we read it: its parts may be gone, the new one's there
            pointer = self._parse_pointer(full, raw)
            names = [f"{full}/parts/{pointer['sha256']}/{i}" for i in range(pointer["parts"])]
            if self._store_call(what, self.store.check, names):
                joined = b"".join(self._store_call(what, self.store.get, name) for name in names)
                if len(joined) != pointer["nbytes"] or hashlib.sha256(joined).hexdigest()[:32] != pointer["sha256"]:
                    raise RendezvousError(f"{full!r} in the store at {self.address}: its {pointer['parts']} parts "
                                          f"hold {len(joined):,} bytes that do not match the {pointer['nbytes']:,} "
                                          f"bytes and digest its pointer names (overwritten by someone?)")
                return joined, pointer
            raw = self._store_call(what, self.store.get, full)
            if not raw.startswith(_PARTS_TAG):
                return raw, None
        raise RendezvousError(f"{full!r} in the store at {self.address} points to {pointer['parts']} parts "
                              f"(digest {pointer['sha256']}) that are not all there (deleted by someone?)")

    def _parse_pointer(self, full: str, raw: bytes) -> dict:
        try:
            pointer = json.loads(raw[len(_PARTS_TAG):])
            ok = (isinstance(pointer, dict) and type(pointer.get("parts")) is int
                  and 0 < pointer["parts"] <= _MAX_PARTS and type(pointer.get("nbytes")) is int
                  and isinstance(pointer.get("sha256"), str) and len(pointer["sha256"]) == 32)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise RendezvousError(f"{full!r} in the store at {self.address} is not a FlashBoot record "
                                  f"(a malformed pointer to parts: {raw[:200]!r})")
        return pointer

    def _pointer(self, full: str, what: str) -> dict | None:
        """The pointer to parts under ``full``, or None (nothing there, or a whole record)."""
        raw = self._peek(full, what)
        if raw is None or not raw.startswith(_PARTS_TAG):
            return None
        try:
            return self._parse_pointer(full, raw)
        except RendezvousError:
            return None  # garbage: no parts of ours to delete

    def _delete_parts(self, full: str, pointer: dict, what: str) -> None:
        for i in range(pointer["parts"]):
            self._store_call(what, self.store.delete_key, f"{full}/parts/{pointer['sha256']}/{i}")

    def agree(self, key: str, body: Mapping[str, Any]) -> Record:
        """Publish ``body`` under ``key`` unless a record is there already (an atomic
        compare-and-set), and return the record that holds: ours, or the first writer's, verified.
        RendezvousError when what is there is not an authentic record (planted garbage)."""
        full = self.full_key(key)
        raw = encode_record(self.token, full, body)
        if len(raw) > VALUE_PART_BYTES:  # one compare-and-set cannot write parts
            raise RendezvousError(f"a record to agree on under {key!r} holds {len(raw):,} bytes; at most "
                                  f"{VALUE_PART_BYTES:,} go in one store value")
        raw = self._store_call(f"agreeing on {key!r}", self.store.compare_set, full, "", raw)
        return decode_record(self.token, full, raw, self.where)

    def read(self, key: str, *, what: str, timeout_s: float | None = None, rejoin: bool = False) -> Record:
        """Wait up to ``timeout_s`` (default: the connection's) for ``key`` and verify it
        (``rejoin``: see :meth:`wait_keys`).

        WaitTimeoutError names ``what`` and the key; RendezvousError for a record that fails
        authentication."""
        full = self.full_key(key)
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        self.wait_keys([key], what=what, timeout_s=t, rejoin=rejoin)
        raw = self._get(full, key)
        return decode_record(self.token, full, raw, self.where)

    def try_read(self, key: str) -> Record | None:
        """The verified record under ``key``, or None when there is none yet."""
        full = self.full_key(key)
        if not self._store_call(f"checking {key!r}", self.store.check, [full]):
            return None
        raw = self._get(full, key)
        return decode_record(self.token, full, raw, self.where)

    def wait_keys(self, keys: Iterable[str], *, what: str, timeout_s: float | None = None,
                  rejoin: bool = False) -> None:
        """Wait up to ``timeout_s`` until every one of ``keys`` is in the store (checked every
        :func:`wait_poll_delay`); WaitTimeoutError names ``what``.

        ``rejoin``: when the store goes away during the wait (its server restarted), join the one
        at the same address again and wait on, all within ``timeout_s``; StoreLostError, saying for
        how long it was retried, when none answers there in time. Only for a wait of a participant
        with nothing of its own in the store yet (a clone waiting for its seed): a restarted store
        holds none of what was written to the one before it."""
        keys = list(keys)
        full = [self.full_key(k) for k in keys]
        # NaN (or inf) is never reached: the wait (a linger, a barrier) had polled for good
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s, f"the wait for {what}: timeout_s",
                                                                   RendezvousError, zero_ok=True)
        start = time.monotonic()
        deadline = start + max(t, 0.001)
        went_away: list[str] = []
        # polled, not store.wait: a signal handler (SIGTERM in `flashboot clone`) runs during the
        # sleep, where store.wait held it off until the wait ended, and short store.wait slices
        # log two c10d warnings each
        while True:
            try:
                if self._store_call(f"waiting for {what}", self.store.check, full):
                    return
            except StoreLostError as exc:
                if not rejoin or self.is_server:  # a store this process hosts cannot restart under it
                    raise
                went_away.append(self._rejoin(exc, what, t, start, deadline))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                again = (f"; the store went away and was joined again ({', '.join(went_away)}), and holds none of "
                         "what was written before" if went_away else "")
                raise WaitTimeoutError(f"waited {t:g} s for {what} (store keys {keys} at {self.address}){again}")
            time.sleep(min(wait_poll_delay(time.monotonic() - start), left))

    def hosted_by_store_server(self) -> bool:
        """Whether a :class:`~flashboot.flashclone.store.StoreServer` (``flashboot store``) hosts this store."""
        return bool(self._store_call("checking who hosts the store", self.store.check, [STORE_SERVER_KEY]))

    def has(self, key: str) -> bool:
        return bool(self._store_call(f"checking {key!r}", self.store.check, [self.full_key(key)]))

    def delete(self, key: str) -> None:
        """Delete the record under ``key`` (and its parts, when it was written in parts): two
        round trips, a look for a pointer to parts and the delete."""
        full, what = self.full_key(key), f"deleting {key!r}"
        pointer = self._pointer(full, what)
        self._store_call(what, self.store.delete_key, full)
        if pointer is not None:
            self._delete_parts(full, pointer, what)

    def delete_if(self, key: str, owned: Callable[[Record], bool]) -> bool:
        """Delete the record under ``key`` (and its parts) when ``owned`` says the verified record
        is ours; returns whether it did. One read serves the check and the parts: a
        :meth:`try_read` then :meth:`delete` read it twice (five round trips, two now; a withdrawing
        seed made two such calls per publish). Another writer's record published between the read
        and the delete is deleted still (a race of one round trip); RendezvousError when what is
        there is not an authentic record."""
        full, what = self.full_key(key), f"deleting {key!r}"
        top = self._peek(full, what)
        if top is None:
            return False
        raw, pointer = self._join(full, key, top)
        if not owned(decode_record(self.token, full, raw, self.where)):
            return False
        self._store_call(what, self.store.delete_key, full)
        if pointer is not None:
            self._delete_parts(full, pointer, what)
        return True

    # -- counters and barriers ---------------------------------------------------------------------
    def add(self, key: str, amount: int = 1) -> int:
        """Atomic ``store.add``: the counter's value after adding ``amount`` (0 reads it)."""
        return int(self._store_call(f"counting {key!r}", self.store.add, self.full_key(key), amount))

    def barrier(self, name: str, count: int, *, timeout_s: float | None = None) -> float:
        """Block until ``count`` participants have entered barrier ``name``; returns ms waited.

        The last to arrive publishes a release key; everyone waits for it with a deadline, and a
        WaitTimeoutError says how many had arrived."""
        t0 = time.perf_counter()
        arrived = self.add(f"barrier/{name}/count", 1)
        # at or past the count: arrivals of an earlier gathering under this name that gave up stay
        # counted, and a retry with fewer (--clones 2 after 2 of 3 came and one died) had waited
        # for a count passed already ('4 of 2 had arrived'), failing every retry on that generation
        if arrived >= count:
            self.publish(f"barrier/{name}/go", {"count": count})
        try:
            self.wait_keys([f"barrier/{name}/go"], what=f"the start barrier {name!r} ({count} participants)",
                           timeout_s=timeout_s)
        except StoreLostError:
            raise  # a store that went silent (a WaitTimeoutError too) cannot be asked who had arrived
        except WaitTimeoutError as exc:
            now = self.add(f"barrier/{name}/count", 0)
            raise WaitTimeoutError(f"{exc}; {now} of {count} had arrived") from None
        self.read(f"barrier/{name}/go", what=f"barrier {name!r}", timeout_s=1.0)  # authenticate the release
        return (time.perf_counter() - t0) * 1e3

    def __repr__(self) -> str:
        role = "hosting" if self.is_server else "client of"
        return f"Rendezvous({role} {self.address}, namespace {self.namespace!r})"


__all__ = ["DEFAULT_TIMEOUT_S", "STORE_SERVER_KEY", "Rendezvous", "StoreLostError", "StoreSilentError", "free_port",
           "parse_address"]
