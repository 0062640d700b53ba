"""The served-load daemon's socket, apart from what it serves: who it admits, the device queue
granted in arrival order, the listening socket bound private from its first moment, and a
request's fields checked, and the listener (:class:`_Listening`: accept, turn away, close at the
stop). :mod:`~flashboot.flashload.server` serves the loads."""

from __future__ import annotations

import collections
import json
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from .._json import check_fields, finite_at_least, is_str, loads
from ..errors import FlashBootError, RendezvousError
from ..fdshare import readable
from ..units import is_finite_number
from .protocol import PeerCredentials, _error_payload, peer_credentials
from .shm import _unlink_quietly, check_socket_path, make_dir


def admits(peer: PeerCredentials, *, uid: int, group: int | None) -> bool:
    """Whether the daemon of user ``uid`` (sharing with group ``group``, or None) serves ``peer``:
    the same user, or a member of the configured group."""
    if peer.uid == uid:
        return True
    return group is not None and (peer.gid == group or group in peer.groups)


class _FifoLock:
    """A lock granted in arrival order, so a request queued for a device is never overtaken by a
    later one (``threading.Lock`` promises no order). One per device: a copy has the device's
    link to itself, and two GPUs, each with its own link, copy at once."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._waiting: collections.deque[threading.Event] = collections.deque()
        self._held = False

    def acquire(self, timeout_s: float, stop: threading.Event | None = None,
                gone: Callable[[], bool] | None = None) -> bool:
        """Whether it was granted within ``timeout_s``; False too once ``stop`` is set or ``gone()``."""
        me = threading.Event()
        with self._mutex:
            if not self._held and not self._waiting:
                self._held = True
                return True
            self._waiting.append(me)
        deadline = time.monotonic() + timeout_s
        while not me.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()) or (gone is not None and gone()):
                break
        else:
            return True
        with self._mutex:
            if me.is_set():  # granted just as the wait ran out
                return True
            self._waiting.remove(me)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._waiting:
                self._waiting.popleft().set()  # handed straight to the next in line: stays held
            else:
                self._held = False

    @property
    def queued(self) -> int:
        return len(self._waiting)


class _Engine:
    """The engine at the other end of a load's connection, while the load waits (for its rank, for
    the device) or copies: whether it hung up (killed, or gave up), so that its arena is let go
    then, not held (GPU memory on CUDA) until the wait or the copy ends, copied into for nobody. A write side shut (a
    broken-off hand-over awaiting its answer) is no hang-up: only POLLHUP, both sides gone, is. ``cancel``: the
    daemon's own end of the load (set by a second SIGTERM or ``preload --stop``'s timeout: the loads in flight,
    which a first stop lets finish, are broken off), which the same checks end it at."""

    def __init__(self, conn: socket.socket, pid: int, cancel: threading.Event | None = None):
        self.pid, self._conn, self._cancel = pid, conn, cancel

    def gone(self) -> bool:
        if self._cancel is not None and self._cancel.is_set():
            return True
        poll = select.poll()  # one each time: the host copy's threads ask at once, and a poll object refuses that
        poll.register(self._conn, select.POLLHUP)
        return bool(poll.poll(0))

    def check(self, during: str) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise FlashBootError(f"the preloader (pid {os.getpid()}) was stopped while this load {during}, and "
                                 "cancelled it (a second SIGTERM or Ctrl-C, or `flashboot preload --stop` ran out "
                                 "of its --timeout); its arena is let go: load again once a preloader serves")
        if self.gone():
            raise RendezvousError(f"the engine (pid {self.pid}) hung up while its load {during}; its arena is let go")


_UMASK_LOCK = threading.Lock()


def _bind_private(path: Path, group: int | None) -> socket.socket:
    """A listening SOCK_SEQPACKET socket at ``path`` that nobody else can reach at any moment.

    bind() creates the file with the process umask's mode; a chmod afterwards would leave a
    window in which another user can connect. So the socket is bound under umask 0177 (mode
    0600 from the start), and only then widened to 0660 for an allowed group."""
    check_socket_path(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _UMASK_LOCK:  # the umask is the process's: restore it at once
            old = os.umask(0o177)
            try:
                s.bind(str(path))
            except OSError as exc:
                raise FlashBootError(f"cannot bind the served-load socket {path}: {exc.strerror}") from None
            finally:
                os.umask(old)
        if group is not None:
            os.chown(path, -1, group)
            os.chmod(path, 0o660)  # requests carry descriptors of GPU memory: the group only
        s.listen(64)
        s.settimeout(0.2)
    except BaseException:
        s.close()
        raise
    return s


def _descriptor_fd_count(req: dict) -> int:
    desc = req.get("descriptor")
    fds = desc.get("fds") if isinstance(desc, dict) else None
    if not isinstance(fds, list):
        raise RendezvousError(f"load request without a descriptor listing its fds (got {type(desc).__name__})")
    return len(fds)


def _request_timeout_s(req: dict) -> float:
    value = req.get("timeout_s", 60)
    if not is_finite_number(value) or value < 0:
        raise RendezvousError(f"timeout_s must be a finite number >= 0, got {value!r}")
    return min(float(value), 24 * 3600.0)


_LOAD_FIELDS = {
    "rank": ("an int", lambda v: type(v) is int),
    "descriptor": ("an object with a list of fds", lambda v: type(v) is dict and type(v.get("fds")) is list),
    "nbytes": ("an int", lambda v: type(v) is int),
    "metadata_sha256": ("a string", is_str),
    "timeout_s": ("a finite number >= 0", finite_at_least(0)),
    "pci_bus_id": ("null or a string", lambda v: v is None or is_str(v)),
    "fds_follow": ("true (the fds after the first batch follow the request)", lambda v: v is True),
}
"""The fields of a load request, what each must be (in words) and its test; all optional but the
descriptor (defaults: see :meth:`PreloadServer._serve_load`)."""


def _parse_request(msg: bytes) -> dict:
    """An engine's request: a JSON object with a string ``op`` and, for ``load``, typed fields;
    RendezvousError naming the field otherwise (the daemon answers it and keeps serving)."""
    req = loads(msg, "request", RendezvousError)
    if not isinstance(req, dict) or type(req.get("op")) is not str:
        raise RendezvousError(f"request must be a JSON object with a string 'op', found {str(req)[:200]}")
    if req["op"] == "load":
        if "descriptor" not in req:
            raise RendezvousError(f"{req['op']} request without a descriptor")
        check_fields(req, _LOAD_FIELDS, RendezvousError, "load request: ")
    return req


# ============================================================================ the listener
TURN_AWAY_S = 0.05
"""How long a connection turned away at a stop is read for its request before it is closed (see
:meth:`_Listening._turn_away`)."""
ACCEPT_BACKOFF_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
"""A failed accept() (out of fds: EMFILE) is retried after this pause, doubled up to the maximum
while it keeps failing: fds come back as handlers finish."""


class _Listening:
    """The served-load daemon's listening socket, as :class:`~flashboot.flashload.server.PreloadServer`
    runs it: bound private, accepted in a thread (each connection handed to ``_handle``), turned
    away busy or stopping with an answer, refused for its credentials, and closed at the stop with
    the queued connections answered."""

    def _listen(self) -> None:
        make_dir(self.sock_path.parent)
        try:
            _unlink_quietly(self.sock_path)  # a leftover of a dead daemon (the pid file says we own the dir)
        except OSError as exc:
            kind = "a folder" if self.sock_path.is_dir() else "something"
            raise FlashBootError(f"cannot take the socket path {self.sock_path}: {kind} is in the way "
                                 f"({exc.strerror}); remove it") from None
        self._listener = _bind_private(self.sock_path, self.group)

    def _stop_listening(self) -> None:
        """Close the listener and remove its socket (idempotent): a stop takes no new request, and
        the socket's absence tells ``preload --stop`` the daemon is stopping already (signalled
        again, it would cancel the loads in flight)."""
        with self._listener_lock:
            listener, self._listener = self._listener, None
            if listener is None:
                return
            _unlink_quietly(self.sock_path)  # first: no connection joins the queue below meanwhile
            try:
                # the connections queued already are answered, not reset ("did it exit?"): told to ask
                # again, an engine waits for a restarted preloader's socket within its timeout
                while readable([listener.fileno()], 0):
                    try:
                        conn, _ = listener.accept()  # its 0.2 s timeout, where the accept loop took this one
                    except OSError:  # that timeout, or out of fds: those left are reset
                        break
                    self._turn_away(conn, self._stopping(), wait_s=TURN_AWAY_S)
            finally:
                listener.close()

    def _stopping(self) -> FlashBootError:
        """The answer to a request that arrives once the daemon is stopping: retried by the client
        (``busy``), it finds the next preloader's socket, or none within its timeout."""
        exc = FlashBootError(f"the preloader (pid {os.getpid()}) is stopping and takes no new request; asked "
                             "again, a preloader started in its place serves it")
        exc.busy = True
        return exc

    def _accept_loop(self) -> None:
        try:
            self._accept_until_stopped()
        finally:  # at the stop itself, not once staging (a rank's pinning, deaf to stop) has ended
            if self.stop.is_set():
                self._stop_listening()

    def _accept_until_stopped(self) -> None:
        backoff_s = ACCEPT_BACKOFF_S
        while not self.stop.is_set():
            listener = self._listener
            if listener is None or listener.fileno() < 0:
                return
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self.stop.is_set() or self._listener is not listener:
                    return  # close() shut the listener under us
                # EMFILE/ENFILE/ENOBUFS/ECONNABORTED pass: the connection waits in the backlog; ending this
                # thread left a daemon that looked alive and never answered again
                self.log(f"accepting a connection on {self.sock_path} failed ({exc}); retrying in {backoff_s:g} s")
                self.stop.wait(backoff_s)
                backoff_s = min(2 * backoff_s, ACCEPT_BACKOFF_MAX_S)
                continue
            backoff_s = ACCEPT_BACKOFF_S
            self._threads = [x for x in self._threads if x.is_alive()]
            if len(self._threads) >= self.max_connections:
                busy = FlashBootError(f"busy: {len(self._threads)} connections are being handled (at most "
                                      f"{self.max_connections}); retry")
                busy.busy = True  # travels in the reply's attrs: a client retries within its timeout
                self._turn_away(conn, busy, wait_s=0.1)
                continue
            t = threading.Thread(target=self._handle, args=(conn,), name="flashboot-serve-conn", daemon=True)
            with self._threads_lock:  # close() joins only started threads, and none starts after it looked
                stopping = self.stop.is_set()
                if not stopping:
                    t.start()
                    self._threads.append(t)
            if stopping:
                self._turn_away(conn, self._stopping(), wait_s=TURN_AWAY_S)
                return

    def _turn_away(self, conn: socket.socket, exc: FlashBootError, wait_s: float) -> None:
        """Answer ``exc``, log it, and close: the request is read without room for fds, so the kernel
        discards any it carried and none enters this process. Reading it (up to ``wait_s``) before
        closing lets the client finish its send and read the answer instead of a broken pipe."""
        self.log(str(exc))
        try:
            conn.settimeout(wait_s)
            conn.send(json.dumps(_error_payload(exc)).encode())
            # the request and any batches of fds sent behind it: closed with one unread, the client's
            # connection is reset and the answer lost. Within ``wait_s`` in all: the accept loop waits
            deadline = time.monotonic() + wait_s
            while conn.recv(1) and time.monotonic() < deadline:
                conn.settimeout(max(1e-3, deadline - time.monotonic()))
        except OSError:
            pass
        finally:
            conn.close()

    def _admit(self, conn: socket.socket) -> PeerCredentials | None:
        """The peer, when it may talk to this daemon; a stranger is answered, logged and dropped (None)."""
        peer = peer_credentials(conn)
        if admits(peer, uid=self.uid, group=self.group):
            return peer
        self.refused += 1
        allowed = f"uid {self.uid}" + (f" or group {self.group}" if self.group is not None else "")
        self._turn_away(conn, RendezvousError(
            f"refused: pid {peer.pid} runs as uid {peer.uid} (gid {peer.gid}); this preloader serves {allowed} only"),
            wait_s=self.request_timeout_s)
        return None
