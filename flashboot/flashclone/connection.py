"""The connection to a rendezvous store: parsing its address, hosting a ``TCPStore`` or joining
the one that listens there (the name looked up once and bounded, TCPStore's handshake spoken first,
a refused join asked again), every call on it bounded by a timeout on a thread of its own, a
lost or silent store named, and a store that went away joined again during a wait.

What travels over it (namespaced keys, signed records, waits, barriers) is
:class:`~flashboot.flashclone.rendezvous.Rendezvous`, built on :class:`StoreConnection`.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import struct
import threading
import time
from typing import Any, Mapping, NamedTuple

from ..errors import RendezvousError, StoreLostError, WaitTimeoutError


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


class OpenedStore(NamedTuple):
    """What :func:`open_store` made: the TCPStore, whether this process hosts it, a duplicate of a
    client's socket (None where it could not be told apart, or hosting) and the address joined."""

    store: Any
    is_server: bool
    conn: socket.socket | None = None
    ip: str | None = None


def open_store(address: str, *, host: bool, timeout_s: float) -> OpenedStore:
    """Host the store at ``address`` (``host=True``, unless one already listens there) or join
    the one there, waiting up to ``timeout_s`` (checked by the caller) for it to answer (see
    :meth:`Rendezvous.connect <flashboot.flashclone.rendezvous.Rendezvous.connect>`)."""
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
            return OpenedStore(host_tcpstore(h, port, td), True)
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
    return OpenedStore(store, False, conn, ip)


class StoreConnection:
    """A connection to a TCPStore whose every call is bounded (:attr:`bounded`) and named when it
    fails: a store lost (closed, or silent for ``timeout_s``) stays lost, later calls failing at
    once, until a wait rejoins it. The base of :class:`~flashboot.flashclone.rendezvous.Rendezvous`,
    which reads and writes records through :meth:`_store_call`."""

    def __init__(self, store, address: str, is_server: bool, timeout_s: float, conn: socket.socket | None = None,
                 ip: str | None = None):
        self.store = store
        self.address = address
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

    # -- rejoining ----------------------------------------------------------------------------
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
            new = open_store(self.address, host=False, timeout_s=deadline - lost_at)
        except (RendezvousError, WaitTimeoutError) as err:
            why = err
        else:
            new.store.set_timeout(datetime.timedelta(seconds=self.timeout_s))  # its calls wait as ours did
            self._drop_connection()
            self.store, self._conn, self.ip, self._broken = new.store, new.conn, new.ip, None
            return f"{lost_at - start:.1f} s into the wait, back after {time.monotonic() - lost_at:.1f} s"
        raise StoreLostError(f"the store at {self.address} went away while waiting for {what}, {lost_at - start:.1f} s "
                             f"into the wait ({reason}); joining it again was retried for "
                             f"{time.monotonic() - lost_at:.1f} s, until the wait's {t:g} s ran out: {why}") from None

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

    def __enter__(self) -> "StoreConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CALLS_JOIN_S", "JOIN_ATTEMPTS", "OpenedStore", "StoreConnection", "StoreSilentError", "free_port",
           "host_tcpstore", "open_store", "parse_address"]
