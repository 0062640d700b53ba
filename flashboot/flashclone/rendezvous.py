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
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from ..errors import RendezvousError, StoreLostError, WaitTimeoutError
from ..units import check_timeout
from .records import Record, Token, decode_record, encode_record, resolve_token

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


class StoreSilentError(StoreLostError, WaitTimeoutError):
    """A bounded store call went unanswered for the connection's timeout: a wait that ran out,
    and a store lost from then on (later calls fail at once), so what a lost store is forgiven
    (a clone that holds every byte keeps them) a silent one is too: a clone had copied and
    verified every byte from a seed stopped mid-clone, then failed on announcing itself."""


# ============================================================================================
# Addresses
# ============================================================================================


def parse_address(address: str, *, any_port: bool = False) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[v6]:PORT"``) -> ``(host, port)``; RendezvousError otherwise.
    ``any_port``: also accept port 0 (a server that lets the kernel pick one)."""
    if not isinstance(address, str) or ":" not in address:
        raise RendezvousError(f"store address must be HOST:PORT, got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise RendezvousError(f"store address {address!r}: port {port_text!r} is not a number") from None
    if not (0 if any_port else 1) <= port < 65536:
        raise RendezvousError(f"store address {address!r}: port {port} is outside "
                              f"{0 if any_port else 1}..65535")
    return host, port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and local runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ============================================================================================
# The store connection
# ============================================================================================


_TCPSTORE_VALIDATE, _TCPSTORE_PING = 0, 13
"""c10d's ``QueryType`` codes (TCPStoreBackend.hpp, the same in torch 2.13 and 2.14.1, checked by
test_rendezvous against the installed torch): a client's first query is VALIDATE with
:data:`_TCPSTORE_MAGIC`, then PING with a nonce that the store sends back."""
_TCPSTORE_MAGIC = 0x3C85F7CE


def host_tcpstore(host: str, port: int, timeout: datetime.timedelta):
    """A ``TCPStore(is_master=True)`` for ``host:port``. An IP literal of this machine is listened
    on alone (TCPStore binds every interface itself, so a store asked for at 127.0.0.1 was
    reachable from the whole network): the socket is bound here and handed over
    (``master_listen_fd``, torch >= 2.4; the store closes it when it goes). A name listens on
    every interface, as TCPStore does: a machine's own name resolves to 127.0.1.1 on Debian and
    Ubuntu, and a NAT or cluster name to an address no interface has, so binding what it resolves
    to made the store unreachable. OSError EADDRINUSE when something listens there, EADDRNOTAVAIL
    when ``host`` is not an address of this machine (the caller may then join a store there).
    Looking a name up ends within ``timeout`` (WaitTimeoutError)."""
    from torch.distributed import TCPStore

    literal = _ip_literal(host)
    if literal is None:
        if not _names_this_machine(host, time.monotonic() + timeout.total_seconds()):
            raise OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address of this machine")
        return TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    if literal.is_unspecified:  # 0.0.0.0 / ::: every interface is what was asked for
        return TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_NUMERICHOST)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own listener does
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(host, sock.getsockname()[1], is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.fileno())
    except BaseException:
        if sock.fileno() != -1:
            sock.close()
        raise
    sock.detach()  # the store owns the fd now and closes it with its server
    return store


def _ip_literal(host: str):
    import ipaddress

    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve(host: str, address: str | None = None, deadline: float | None = None) -> list:
    """``getaddrinfo`` of ``host``; RendezvousError naming it when it does not resolve. Left to
    TCPStore, a name that resolves nowhere was hosted (it then waited its whole timeout and
    printed its C++ frames) or waited for until the deadline, as if no store were up yet.

    ``deadline`` (``time.monotonic()``) bounds the lookup: WaitTimeoutError naming the host and the
    time waited. A name server that does not answer (down, or its packets dropped) held a clone
    given 2 s for the resolver's own timeouts (5 s a try and server by default). The lookup cannot
    be cancelled: its thread ends when the resolver gives up."""
    where = f" (in {address})" if address else ""
    box: dict = {}

    def lookup() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            box["error"] = exc

    t0 = time.monotonic()
    if deadline is None or _ip_literal(host.split("%")[0]) is not None:  # a literal needs no name server
        lookup()
    else:
        thread = threading.Thread(target=lookup, name="flashboot-resolve", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - t0))
        if thread.is_alive():
            raise WaitTimeoutError(f"store host {host!r}{where} did not resolve within {time.monotonic() - t0:.1f} s "
                                   f"(the timeout): is a name server in /etc/resolv.conf reachable from here? "
                                   "An IP address needs no lookup")
    if "error" in box:
        exc = box["error"]
        raise RendezvousError(f"store host {host!r}{where} does not resolve: {exc.strerror or exc}") from None
    return box["infos"]


def _names_this_machine(host: str, deadline: float | None = None) -> bool:
    """Whether ``host`` resolves to at least one address this machine can bind; RendezvousError
    when it resolves nowhere, WaitTimeoutError when it did not resolve by ``deadline``."""
    infos = _resolve(host, deadline=deadline)
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


WAIT_POLL_S = 0.02
"""The longest sleep between two checks of a key being waited for (a check is one round trip)."""

WAIT_POLL_SHARE = 0.05
"""A wait sleeps at most this share of the time it has waited so far (and 1 ms at least), so a key
that appears is seen within 5 % of the wait's length: a clone waiting 30 ms for its seed's handle
loses at most 1.5 ms, where doubling sleeps (1, 2, 4, 8, 16 ms) could add 16."""


def wait_poll_delay(waited_s: float) -> float:
    """The sleep before the next check of a wait that has lasted ``waited_s``."""
    return min(WAIT_POLL_S, max(0.001, WAIT_POLL_SHARE * waited_s))

CALLS_JOIN_S = 1.0
"""How long :meth:`Rendezvous.close` waits for its store thread to finish its last call and end."""

JOIN_ATTEMPTS = 5
"""How many times a join asks TCPStore's client to connect to a store that answered the pre-flight
(a store that keeps refusing after that is not busy: it is refusing)."""


def _await_store(hosts: str | list[str], port: int, deadline: float, address: str) -> str:
    """Speak TCPStore's own opening (validate, then ping) on a plain socket until a store answers it
    or ``deadline`` passes. torch's client constructor waits for the ping's answer without a bound
    and logs every retry with its C++ frames; a store that answers here is then joined at once.
    ``hosts``: the address, or those the store's name resolved to, tried in turn (no lookup per
    try: a slow name server had cost its delay on every one); returns the one that answered.

    Raises WaitTimeoutError when nothing listens, or something listens and does not answer, by the
    deadline; RendezvousError at once when it answers something that is not a store's answer."""
    hosts = [hosts] if isinstance(hosts, str) else hosts
    nonce = os.getpid() & 0xFFFFFFFF
    hello = struct.pack("=BIBI", _TCPSTORE_VALIDATE, _TCPSTORE_MAGIC, _TCPSTORE_PING, nonce)
    delay, last = 0.01, ""
    while True:
        for host in hosts:
            try:
                answer = _store_hello(host, port, hello, deadline)
            except OSError as exc:
                last = exc.strerror or str(exc)
                continue
            if answer == struct.pack("=I", nonce):
                return host
            if answer:
                raise RendezvousError(
                    f"what listens at {address} is not a rendezvous store: it answered TCPStore's ping with "
                    f"{answer.hex()} instead of the nonce {nonce:#x}; is {address} the store's address?")
            last = ("something listens there but did not answer TCPStore's ping" if answer is None else
                    "something listens there and closed the connection without answering TCPStore's ping")
        if time.monotonic() >= deadline:
            err = WaitTimeoutError(
                f"no rendezvous store answered at {address} ({last}); is the store (`flashboot store HOST:PORT`) "
                "or the seed that hosts it (`flashboot seed DIR --store HOST:PORT`) running there?"
            )
            err.reason = last
            raise err
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.2)


_JOIN_LOCK = threading.Lock()
"""Held while a client TCPStore is made, so that the one socket it opens is told apart from those
other joins of this process open at the same time."""


def _socket_fds() -> dict[str, int]:
    """This process's sockets: ``"socket:[inode]"`` -> fd."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since (the listing's own fd among them)
        if target.startswith("socket:"):
            out[target] = int(fd)
    return out


def _joined_socket(before: Mapping[str, int], port: int) -> socket.socket | None:
    """A duplicate of the one socket to ``port`` opened since ``before`` (a client TCPStore's
    connection, which torch does not expose), or None when it is not exactly one: another thread
    of this process connected there meanwhile, or /proc is not there."""
    found = []
    try:
        fds = _socket_fds()
    except OSError:
        return None
    for target, fd in fds.items():
        if target in before:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = s.getpeername()  # (host, port, ...); a Unix socket's is a path
        except OSError:
            peer = None
        if s.type == socket.SOCK_STREAM and isinstance(peer, tuple) and peer[1] == port:
            found.append(s)
        else:
            s.close()
    if len(found) == 1:
        return found[0]
    for s in found:
        s.close()
    return None


def _store_hello(host: str, port: int, hello: bytes, deadline: float) -> bytes | None:
    """Connect, send ``hello`` and read the 4-byte answer by ``deadline``: the answer, b"" when the
    peer closed (or reset) the connection first, None when it stayed silent. OSError when the
    connection cannot be made."""
    with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))) as s:
        answer = b""
        try:
            s.sendall(hello)
            while len(answer) < 4:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                part = s.recv(4 - len(answer))
                if not part:
                    break
                answer += part
        except socket.timeout:
            return None
        except ConnectionError:
            pass
        return answer


class Rendezvous:
    """A connection to the rendezvous store, scoped to one ``namespace``, that reads and writes
    authenticated records. Build one with :meth:`connect`."""

    def __init__(self, store, address: str, token: Token, namespace: str, is_server: bool, timeout_s: float,
                 conn: socket.socket | None = None, ip: str | None = None):
        self.store = store
        self.address = address
        self.token = token
        self.namespace = namespace
        self.is_server = is_server
        self.timeout_s = float(timeout_s)
        self._closed = False
        self.bounded = not is_server
        """Bound every store call by ``timeout_s``: a TCPStore call blocks forever when the store
        stops answering without closing (the link down mid-call, or, on one host too, its process
        stopped: a SIGSTOP, a frozen cgroup, a seed hosting it paused), and every local clone and
        store holder had hung with it. Off where this process hosts the store (it cannot freeze
        without the caller); ~20 us a call."""
        self._broken: str | None = None
        self._calls = None
        self._calls_thread: threading.Thread | None = None
        self._conn = conn
        """A duplicate of the store client's socket (None where it could not be told apart): shut
        down when the store goes silent, so the call stuck on it returns and its thread and socket
        end with :meth:`close`, where they had stayed in the process for good."""
        self.ip = ip
        """The address of the store's host this client joined (its name looked up once, at connect),
        or None (hosting, or made from another connection's store)."""

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
        h, port = parse_address(address)
        started = time.monotonic()
        deadline = started + float(timeout_s)
        # at once: an unresolvable name is no store that is not up yet; then the addresses are
        # joined, not the name (looked up again by every try and by TCPStore, unbounded)
        infos = _resolve(h, address, deadline)
        ips = list(dict.fromkeys(sockaddr[0] for *_, sockaddr in infos))
        from torch.distributed import DistError, TCPStore

        td = datetime.timedelta(seconds=float(timeout_s))
        not_ours = taken = False
        if host:
            try:
                store = host_tcpstore(h, port, td)
                return cls(store, address, tok, namespace, True, timeout_s)
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    raise RendezvousError(f"cannot host a store at {address}: {exc.strerror or exc}") from None
                # someone already serves there, or the address is another host's: join it as a client
                not_ours, taken = exc.errno == errno.EADDRNOTAVAIL, exc.errno == errno.EADDRINUSE
            except DistError as exc:
                if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc):
                    raise RendezvousError(f"cannot host a store at {address}: {str(exc).splitlines()[0]}") from None
                taken = True
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            try:
                ip = _await_store(ips, port, deadline, address)
            except WaitTimeoutError as exc:
                if taken:  # asked to host, and told to run a store there: what holds the port is no store
                    raise WaitTimeoutError(
                        f"cannot host a store at {address}: the port is taken (EADDRINUSE), and what listens there "
                        f"is no store that answers ({exc.reason}, {float(timeout_s):g} s): another program, or a "
                        f"store whose process is stopped? `ss -ltnp 'sport = :{port}'` names it; or use another "
                        "port") from None
                if not not_ours:
                    raise
                # a NAT, ClusterIP or docker-published address: nobody hosts unless told where
                raise WaitTimeoutError(f"{exc}; {h} is not an address of this machine (EADDRNOTAVAIL), so this "
                                       f"process did not host the store there: to host it here, use "
                                       f"0.0.0.0:{port} (every interface) or an address of this machine, and "
                                       f"give the others {address}") from None
            remaining = max(0.5, deadline - time.monotonic())
            try:
                # another join of this process holding the lock longer than our bound: join without it
                # (its socket then cannot be told apart, and a silent store's call is left as it was)
                locked = _JOIN_LOCK.acquire(timeout=remaining)
                try:
                    before = _socket_fds() if locked else None
                    store = TCPStore(ip, port, is_master=False, timeout=datetime.timedelta(seconds=remaining))
                    conn = _joined_socket(before, port) if locked else None
                finally:
                    if locked:
                        _JOIN_LOCK.release()
                break
            except DistError as exc:
                # the store answered the pre-flight a moment ago, so a refused or unanswered connect
                # now is a store too busy to accept (torch's own retries give up early, its backoff
                # longer than what is left): ask again while the bound allows, a few times
                if attempt == JOIN_ATTEMPTS or time.monotonic() >= deadline:
                    raise RendezvousError(f"cannot join the store at {address} ({attempt} attempt(s) in "
                                          f"{time.monotonic() - started:.1f} s of {float(timeout_s):g}): "
                                          f"{str(exc).splitlines()[0]}") from None
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return cls(store, address, tok, namespace, False, timeout_s, conn=conn, ip=ip)

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

    def _store_call(self, what: str, fn, *args):
        from torch.distributed import DistError

        if self._closed:
            raise RendezvousError(f"rendezvous at {self.address} is closed")
        self._check_broken(what)
        try:
            return self._bounded_call(what, fn, args) if self.bounded else fn(*args)
        except DistError as exc:
            raise self._lost(what, exc) from None

    @property
    def lost(self) -> str | None:
        """Why the store connection broke (the call and the error), or None while it works."""
        return self._broken

    def _check_broken(self, what: str) -> None:
        if self._broken is not None:
            raise StoreLostError(f"the store at {self.address} stopped answering earlier ({self._broken}); "
                                 f"not {what}")

    def _lost(self, what: str, exc: BaseException) -> StoreLostError:
        """Remember that the store is gone (later calls fail at once, a dead store does not
        answer a retry either) and name it."""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._broken = f"{what}: {reason}"
        return StoreLostError(f"lost the rendezvous store at {self.address} while {what}: {reason}")

    def _bounded_call(self, what: str, fn, args):
        """``fn(*args)`` on this connection's store thread, waited for at most ``timeout_s``."""
        import queue

        if self._calls is None:
            self._calls = queue.SimpleQueue()
            self._calls_thread = threading.Thread(target=self._serve_calls, args=(self._calls,),
                                                  name="flashboot-store-calls", daemon=True)
            self._calls_thread.start()
        box: dict = {}
        done = threading.Event()
        self._calls.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            self._broken = f"{what}: no answer within {self.timeout_s:g} s"
            self._cut()
            raise StoreSilentError(f"the store at {self.address} did not answer within {self.timeout_s:g} s while "
                                   f"{what} (is the link to it down, or its process stopped?)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _cut(self) -> bool:
        """Shut the store connection down (the stuck call then fails on the store thread); whether
        it could be."""
        if self._conn is None:
            return False
        try:
            self._conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer: the call has returned, or returns now
        return True

    @staticmethod
    def _serve_calls(calls) -> None:
        while True:
            fn, args, box, done = calls.get()
            if fn is None:
                return
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()
                fn = args = box = done = None  # the last call's bound method kept the store's connection open

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

    def _rejoin(self, exc: StoreLostError, what: str, t: float, start: float, deadline: float) -> str:
        """Join the store at our address again, by ``deadline``, after it went away (``exc``) while
        waiting for ``what``; returns when and how long it took. StoreLostError naming the store
        and how long it was retried when none answers there in time."""
        lost_at = time.monotonic()
        if deadline <= lost_at:  # a silent store's call took the whole wait: nothing left to retry in
            raise exc
        reason = self._broken or str(exc)
        reason = reason[len(f"waiting for {what}: "):] if reason.startswith(f"waiting for {what}: ") else reason
        try:
            new = Rendezvous.connect(self.address, self.token, namespace=self.namespace, timeout_s=deadline - lost_at)
        except (RendezvousError, WaitTimeoutError) as err:
            why = err
        else:
            if new.store is not None:  # its calls wait as ours did, not only what was left of this wait
                new.store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
            self._drop_connection()
            self.store, self._conn, self.ip, self._broken = new.store, new._conn, new.ip, None
            new.store, new._conn, new._closed = None, None, True
            return f"{lost_at - start:.1f} s into the wait, back after {time.monotonic() - lost_at:.1f} s"
        raise StoreLostError(f"the store at {self.address} went away while waiting for {what}, {lost_at - start:.1f} s "
                             f"into the wait ({reason}); joining it again was retried for "
                             f"{time.monotonic() - lost_at:.1f} s, until the wait's {t:g} s ran out: {why}") from None

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
        if arrived == count:
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

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the connection (a hosting process stops serving when its last reference goes)."""
        self._closed = True
        self._drop_connection()

    def _drop_connection(self) -> None:
        thread = self._calls_thread
        if self._calls is not None:
            self._calls.put((None, (), {}, None))  # the store thread ends (a stuck one once its call returns)
            if (self._broken is None or self._cut()) and thread is not threading.current_thread():
                # briefly, so the connection it holds is gone when close() returns (a soak counted its fds)
                thread.join(CALLS_JOIN_S)
        self._calls, self._calls_thread = None, None
        self.store = None
        if self._conn is not None:
            self._conn.close()  # our duplicate: the store's own fd closes with the store
            self._conn = None

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "hosting" if self.is_server else "client of"
        return f"Rendezvous({role} {self.address}, namespace {self.namespace!r})"


__all__ = ["DEFAULT_TIMEOUT_S", "STORE_SERVER_KEY", "Rendezvous", "StoreLostError", "StoreSilentError", "free_port",
           "parse_address"]
