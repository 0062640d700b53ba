"""The engine's side of the served load: wait for the staged rank, hand the daemon an exported
arena, read its reply."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from ..errors import (
    FlashBootError,
    LayoutError,
    RendezvousError,
    WaitTimeoutError,
)
from ..procfs import STOPPED, process_state
from .protocol import PROTOCOL_VERSION, _raise_remote, peer_credentials, protocol_note
from .shm import (
    _POLL_S,
    PRELOADER_UID_ENV,
    RankSource,
    ReadyInfo,
    _running_pid,
    check_socket_path,
    pid_file,
    read_ready,
    socket_path,
    staged_paths,
    trusted_uids,
    wait_ready,
)


# ========================================================================= the engine's side
def _connect(path: Path, timeout_s: float) -> socket.socket:
    """A socket connected to the preloader at ``path``, tried until ``timeout_s`` has passed.

    The socket has ``timeout_s`` as its timeout from the start: a blocking ``connect`` to a daemon
    that accepts nothing (stopped or hung, its queue of connections full) would wait forever,
    where a timed one fails at once (EAGAIN) and is tried again; every send on it is bounded
    too (the replies' reads set their own timeouts)."""
    check_socket_path(path)
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            _check_daemon(s, path)
            return s
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            s.close()
            last = type(exc).__name__
        except BlockingIOError:
            s.close()
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"the preloader at {path} accepted no connection within {timeout_s:g} s: its "
                                       "queue of connections is full (is it stopped or hung? see `flashboot preload "
                                       "DIR --status`)") from None
            time.sleep(_POLL_S)
            continue
        except PermissionError:
            s.close()
            st = path.stat()
            raise RendezvousError(f"not permitted to connect to the preloader's socket {path} (owner uid {st.st_uid}, "
                                  f"group {st.st_gid}, mode {oct(st.st_mode & 0o777)}; this process runs as uid "
                                  f"{os.geteuid()}): run the engine as the preloader's user, or start the preloader "
                                  "with --allow-group GROUP") from None
        except OSError as exc:  # ENOTDIR (the staging root is a file), ELOOP...: no daemon can ever listen there
            s.close()
            if isinstance(exc, TimeoutError):
                raise WaitTimeoutError(f"the preloader at {path} accepted no connection within {timeout_s:g} s") from None
            blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
            why = f"{blocker} is not a directory" if blocker is not None else exc.strerror
            raise RendezvousError(f"cannot connect to the preloader's socket {path}: {why}") from None
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(f"waited {timeout_s:g} s for the preloader's socket {path} ({last}); "
                                   + (_dead_daemon(path) or "is `flashboot preload DIR --serve` running?"))
        time.sleep(_POLL_S)


def _dead_daemon(sock: Path) -> str:
    """Where the pid file beside ``sock`` names a preloader that is gone (killed: a clean stop
    removes it), that it has exited; '' otherwise."""
    from .shm import PID_FILE, dead_pid  # its socket's folder is its pid file's

    dead = dead_pid(sock.with_name(PID_FILE))
    return "" if dead is None else (f"its preloader (pid {dead}) has exited without stopping (killed?): start "
                                    "`flashboot preload DIR --serve` again")


def _check_daemon(sock: socket.socket, path: Path) -> None:
    """Refuse a socket served by another user than this one, root or ``$FLASHBOOT_PRELOADER_UID``:
    the request hands over the arena's fd, and anyone who could create the staging directory
    first could listen at its name. Closes ``sock`` when it refuses."""
    peer = peer_credentials(sock)
    if peer.uid not in trusted_uids():
        sock.close()
        raise RendezvousError(f"the preloader socket {path} is served by pid {peer.pid} running as uid {peer.uid}, "
                              f"not by this user (uid {os.geteuid()}) or root: refusing to hand it an arena (if that "
                              f"user runs the preloader for your group, set {PRELOADER_UID_ENV}={peer.uid})")


def _request(path: Path, req: dict, *, connect_timeout_s: float, reply_timeout_s: float) -> dict:
    what = f"{req.get('op')!r}" + (f" for rank {req['rank']}" if "rank" in req else "")
    with _connect(path, connect_timeout_s) as s:
        s.sendall(json.dumps(req).encode())
        # a running daemon answers these at once: a stopped one is named as such, not waited for
        return _read_reply(s, path, what, reply_timeout_s, stopped_after=time.monotonic())


def _read_reply(sock: socket.socket, path: Path, what: str, timeout_s: float, *,
                deadline: float | None = None, stopped_after: float | None = None) -> dict:
    """The daemon's JSON reply on ``sock``, waiting at most ``timeout_s`` (or until ``deadline``,
    a ``time.monotonic()``, where the wait began earlier); errors name ``what``.

    ``stopped_after`` (a ``time.monotonic()``): from then on, a daemon found stopped (SIGSTOP, a
    frozen cgroup) ends the wait at once, naming its pid. A load's reply is allowed its timeout
    plus a copy's allowance (queued behind other engines, a large H2D); a stopped daemon had held
    every engine's load for that allowance, a minute past the timeout the engine asked for."""
    end = time.monotonic() + timeout_s if deadline is None else deadline
    while True:
        now = time.monotonic()
        wake = end if stopped_after is None else min(end, max(stopped_after, now + _STOPPED_POLL_S))
        sock.settimeout(max(1e-3, wake - now))
        try:
            raw = sock.recv(1 << 20)
            break
        except socket.timeout:
            if time.monotonic() < end:  # woke to look at the daemon
                _raise_if_stopped(sock, path, what, stopped_after)
                continue
            raise WaitTimeoutError(f"the preloader at {path} did not answer {what} within {timeout_s:g} s") from None
        except OSError as exc:  # ECONNRESET: the daemon died with the request still in its queue
            raise RendezvousError(f"the preloader at {path} dropped the connection before answering {what} "
                                  f"({type(exc).__name__}); did it exit? see `flashboot preload DIR --status`") from None
    if not raw:
        raise RendezvousError(f"the preloader at {path} closed the connection without answering {what}; did it "
                              "exit? see `flashboot preload DIR --status`")
    try:
        reply = json.loads(raw)
    except ValueError:
        raise RendezvousError(f"the preloader at {path} answered {what} with {len(raw):,} bytes that are not "
                              "JSON") from None
    if not isinstance(reply, dict):
        raise RendezvousError(f"the preloader at {path} answered {what} with a JSON {type(reply).__name__}")
    return reply


_STOPPED_POLL_S = 0.25
"""How often a load past its own timeout looks at whether the daemon it waits for is stopped."""


def _raise_if_stopped(sock: socket.socket, path: Path, what: str, since: float | None) -> None:
    """WaitTimeoutError naming the daemon's pid when it is stopped (state T or t in /proc: a
    SIGSTOP, a debugger, a frozen cgroup), where the wait has passed ``since``."""
    if since is None or time.monotonic() < since:
        return
    try:
        pid = peer_credentials(sock).pid
    except OSError:
        return
    state = process_state(pid)  # pid 0 (another pid namespace), or gone: "X", and the reply's wait says so
    if state in STOPPED:
        raise WaitTimeoutError(f"the preloader at {path} (pid {pid}) is stopped (process state {state}: SIGSTOP, a "
                               f"debugger or a frozen cgroup) and did not answer {what} within the load's timeout; "
                               "resume it (kill -CONT) or restart it")


_STATUS = {"op": "status", "protocol": PROTOCOL_VERSION}


def serve_status(image_dir, shm_dir=None, *, timeout_s: float = 10.0) -> dict:
    """Ask a running served-load daemon what it holds (asked again while it answers busy, within
    ``timeout_s``)."""
    path = socket_path(image_dir, shm_dir)
    retry = _BusyRetry(timeout_s)
    while True:  # each ask within what is left of the timeout: a retry must not start a fresh one
        left = retry.left()
        reply = _request(path, _STATUS, connect_timeout_s=left, reply_timeout_s=left)
        if reply.get("ok") or not (_is_busy(reply) and retry.wait()):
            break
    if not reply.get("ok"):
        _raise_remote(reply, f"preloader at {path}")
    return reply


BUSY_BACKOFF_S = 0.05
BUSY_BACKOFF_MAX_S = 1.0
"""A daemon that answers busy (all its connection handlers taken) is asked again after this pause,
doubled up to the maximum, while the caller's timeout lasts: with 100 loads at once, 7 of them
had failed after 1.3 s of a 20 s budget."""


def _is_busy(reply: dict) -> bool:
    return (reply.get("attrs") or {}).get("busy") is True


class _BusyRetry:
    """The pauses between asks of a busy daemon, within ``timeout_s`` from now."""

    def __init__(self, timeout_s: float):
        self.until = time.monotonic() + timeout_s
        self.pause_s = BUSY_BACKOFF_S

    def left(self) -> float:
        """The seconds left of the timeout (a little at least: a request is still tried once)."""
        return max(1e-3, self.until - time.monotonic())

    def wait(self) -> bool:
        """Sleep the next pause and return True, or False when it would end past the timeout."""
        if time.monotonic() + self.pause_s >= self.until:
            return False
        time.sleep(self.pause_s)
        self.pause_s = min(2 * self.pause_s, BUSY_BACKOFF_MAX_S)
        return True


class _Busy(FlashBootError):
    """A streamed hand-over the daemon turned away as busy (it took none of the fds)."""


def served_ready_now(image_dir, rank: int, metadata_sha256: str | None = None, *, shm_dir=None) -> ReadyInfo | None:
    """The ``.ready`` of rank ``rank`` when it is there now and staged from the metadata whose
    sha256 is ``metadata_sha256`` (None: whichever it was staged from; the caller compares it with
    the metadata it reads next); None otherwise (:func:`served_ready` waits for it, or refuses)."""
    try:
        info = read_ready(staged_paths(image_dir, rank, shm_dir).ready)
    except (FileNotFoundError, LayoutError):
        return None
    return info if metadata_sha256 in (None, info.metadata_sha256) else None


def served_ready(image_dir, rank: int, metadata_sha256: str, where: str, *, timeout_s: float,
                 shm_dir=None) -> ReadyInfo:
    """Wait for the ``.ready`` of rank ``rank`` staged from the metadata whose sha256 is
    ``metadata_sha256`` (read from ``where``); returns it. The preloader writes ``.ready`` only
    after its strict reader accepted that metadata and the image was staged, so its ``nbytes``
    is the validated image size.

    A ``.ready`` of another pre-pack is waited out while a preloader runs (it may be re-staging)
    and refused otherwise, or at ``timeout_s`` (LayoutError naming both). WaitTimeoutError names
    the ``.ready`` path, and the daemon's socket when none listens.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # in slices, so a daemon that failed to stage this rank is heard at once, not at the timeout
            info = wait_ready(image_dir, rank, timeout_s=min(_STATUS_EVERY_S, max(0.0, deadline - time.monotonic())),
                              shm_dir=shm_dir)
        except WaitTimeoutError:
            sock = socket_path(image_dir, shm_dir)
            if time.monotonic() < deadline:
                _raise_if_never_staged(sock, image_dir, rank)
                continue
            running = _running_pid(pid_file(image_dir, shm_dir))
            who = f"a preloader is running (pid {running})" if running else "no preloader is running"
            listens = (f"its socket is {sock}" if sock.exists() else f"no served-load daemon listens at {sock}: is "
                       f"`flashboot preload {image_dir} --serve` running?")
            raise WaitTimeoutError(f"waited {timeout_s:g} s for {staged_paths(image_dir, rank, shm_dir).ready} "
                                   f"(rank {rank} of {image_dir} staged); {who}; {listens}") from None
        if info.metadata_sha256 == metadata_sha256:
            return info
        held = _daemon_holds_other_prepack(socket_path(image_dir, shm_dir), rank, metadata_sha256,
                                           staged_sha256=info.metadata_sha256)
        if held:  # it never re-stages while it serves: refuse now rather than at the timeout
            raise LayoutError(f"the preloader (pid {held['pid']}) serving {image_dir} holds rank {rank} of another "
                              f"pre-pack ({held['nbytes']:,} bytes, metadata sha256 {held['metadata_sha256'][:12]}"
                              f"{held.get('said', '')}) than {where} ({metadata_sha256[:12]}): the image was "
                              f"re-packed; restart it: `flashboot preload {image_dir} --stop`, then `--serve` again")
        if _running_pid(pid_file(image_dir, shm_dir)) is None or time.monotonic() >= deadline:
            raise LayoutError(
                f"{info.path}: staged rank {rank} is of another pre-pack ({info.nbytes:,} bytes, metadata sha256 "
                f"{info.metadata_sha256[:12]}) than {where} ({metadata_sha256[:12]}); re-run flashboot preload "
                f"{image_dir}")
        time.sleep(_POLL_S)


_STATUS_EVERY_S = 0.25
"""While a served load waits for ``.ready``, how often it asks the daemon whether staging failed."""


def _daemon_holds_other_prepack(sock: Path, rank: int, metadata_sha256: str, *,
                                staged_sha256: str | None = None) -> dict | None:
    """The daemon's account of ``rank`` (with its ``pid``) when it holds it resident from another
    pre-pack than ``metadata_sha256``; None when it holds this one, still stages, or none answers.
    ``staged_sha256``: the pre-pack its ``.ready`` names, for a daemon that holds the rank but
    does not say which pre-pack (an older FlashBoot's: it wrote that ``.ready`` when it staged
    and never re-stages while it serves; the load had waited its whole timeout for it)."""
    reply = _daemon_status(sock)
    held = (reply.get("ranks") or {}).get(str(rank)) or {}
    if held.get("state") in ("pinned", "mapped") and "metadata_sha256" not in held and staged_sha256:
        held = {**held, "metadata_sha256": staged_sha256,
                "said": " by its .ready: a preloader of an older FlashBoot, whose status does not say"}
    if (held.get("state") not in ("pinned", "mapped") or not isinstance(held.get("metadata_sha256"), str)
            or not isinstance(held.get("nbytes"), int)):
        return None
    if held["metadata_sha256"] == metadata_sha256:
        return None
    return {**held, "pid": reply.get("pid")}


def _daemon_status(sock: Path) -> dict:
    """The daemon's status reply, or ``{}`` when none answers (absent, not listening yet, busy,
    or not ours to ask)."""
    if not sock.exists():
        return {}
    try:
        reply = _request(sock, _STATUS, connect_timeout_s=0.0, reply_timeout_s=1.0)
    except (FlashBootError, OSError):
        return {}
    return reply if reply.get("ok") else {}


def _raise_if_never_staged(sock: Path, image_dir, rank: int) -> None:
    """Raise the daemon's own error (its class, its numbers) when it reports that staging ``rank``
    failed, and LayoutError when it does not serve ``rank`` at all (``--ranks``: its .ready never
    comes); return quietly when no daemon answers or it is still staging."""
    reply = _daemon_status(sock)  # none answers: the wait goes on and says so at its end
    ranks = reply.get("ranks")
    if isinstance(ranks, dict) and ranks and str(rank) not in ranks:
        served = sorted(int(r) for r in ranks if str(r).isdigit())
        raise LayoutError(f"the preloader (pid {reply.get('pid')}) for {image_dir} serves ranks {served}, not rank "
                          f"{rank}: restart it with that rank too (`flashboot preload {image_dir} --stop`, then `--serve` "
                          f"with `--ranks {' '.join(map(str, sorted({*served, rank})))}`), or load it without served=True")
    state = (ranks or {}).get(str(rank)) or {}
    if state.get("state") == "failed":
        payload = state.get("error_payload") or {"error": "FlashBootError", "message": state.get("error")}
        _raise_remote(payload, f"the preloader (pid {reply.get('pid')}) could not stage rank {rank}")


class ServedCopy:
    """A served load in flight: the request, with the arena's fd, is with the daemon, which maps
    the arena and copies into it; :meth:`wait` reads its reply. Made by :func:`start_served_load`."""

    def __init__(self, sock: socket.socket, path: Path, rank: int, reply_timeout_s: float, sent_at: float,
                 rest=None, resend: Callable | None = None, retry: _BusyRetry | None = None,
                 timeout_s: float | None = None):
        self._resend, self._retry = resend, retry  # a busy daemon is asked again (``_send_arena``'s result)
        self._sock: socket.socket | None = sock
        self.path, self.rank, self.reply_timeout_s = path, rank, reply_timeout_s
        self.sent_at = sent_at  # perf_counter when the request (with the first batch's fds) went out
        self._rest = rest  # the later batches' hand-over, where the caller runs it (hand_over_rest)
        self.handover_ms = 0.0
        # the hand-over's CPU time on the thread that ran it: its driver calls (segments made and
        # exported) and sends, which release the GIL, and the Python between them
        self.handover_cpu_ms = 0.0
        self.deadline = time.monotonic() + reply_timeout_s  # the reply is due by then, however it is awaited
        # past the load's own timeout, a stopped daemon ends the wait (the rest is a copy's allowance)
        self.stopped_after = None if timeout_s is None else time.monotonic() + timeout_s
        self._reply: dict | None = None
        self._error: BaseException | None = None

    def fileno(self) -> int:
        """The socket the reply arrives on (for ``poll``), while it is awaited; -1 after."""
        return -1 if self._sock is None else self._sock.fileno()

    def wait(self) -> dict:
        """Block until the daemon answers (at most ``reply_timeout_s`` from the request); returns
        its reply (``h2d_ms``, ``map_ms``, ``pinned``...) or raises the daemon's error with its class.
        Later batches not handed over yet are handed over first (the daemon copies them all). A
        daemon that answered busy is asked again, within the load's timeout."""
        return self._wait(resend=True)

    def _wait(self, *, resend: bool) -> dict:
        while True:
            if self._rest is not None:
                self.hand_over_rest()  # a busy daemon's answer is kept in self._error: asked again below
            if self._sock is not None:
                sock, self._sock = self._sock, None
                try:
                    reply = _read_reply(sock, self.path, f"'load' for rank {self.rank}", self.reply_timeout_s,
                                        deadline=self.deadline, stopped_after=self.stopped_after)
                    if not reply.get("ok"):
                        if _is_busy(reply):
                            raise _Busy(f"served load of rank {self.rank} by the preloader at {self.path}: "
                                        f"{reply.get('message')}")
                        _raise_remote(reply, f"served load of rank {self.rank} by the preloader at {self.path}")
                    self._reply = reply
                except BaseException as exc:
                    self._error = exc
                finally:
                    sock.close()
            if not (resend and isinstance(self._error, _Busy) and self._resend is not None and self._retry.wait()):
                break
            self._error = None
            self._sock, self.path, self.sent_at, self._rest = self._resend()
        if self._error is not None:
            raise self._error
        return self._reply

    def settle(self) -> None:
        """Wait for the daemon to be done with the arena, ignoring how it went: a failing load
        calls this before it closes the arena. Batches not handed over yet are not: the hand-over
        is broken off (the daemon stops copying and answers)."""
        if self._rest is not None and self._sock is not None:
            self._rest, sock, self._sock = None, self._sock, None
            self._error = FlashBootError(f"the served load of rank {self.rank} was broken off before its later "
                                         "batches were handed over")
            _stop_streamed(sock, self.path, self.rank, self.reply_timeout_s)
            return
        try:
            self._wait(resend=False)  # a busy daemon took none of the arena: never a new request into it
        except Exception:
            pass

    def hand_over_rest(self) -> None:
        """Make, export and send the later batches of the arena (a request sent with
        ``rest_later``; a no-op otherwise or once done). On a failure the daemon has stopped
        copying and answered before this raises (:func:`_stop_streamed`); :meth:`wait` raises
        the same error. A daemon that turned the request away as busy (it took none of the fds)
        raises nothing here: :meth:`wait` asks it again."""
        rest, self._rest = self._rest, None
        if rest is None or self._sock is None:
            return
        t0, cpu0 = time.perf_counter(), time.thread_time()
        sock = self._sock
        try:
            rest(sock)
        except BaseException as exc:
            self._sock, self._error = None, exc  # the socket was closed once the daemon answered
            if not isinstance(exc, _Busy):
                raise
        finally:
            self.handover_ms = (time.perf_counter() - t0) * 1e3
            self.handover_cpu_ms = (time.thread_time() - cpu0) * 1e3

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Hang up without the reply (idempotent): only once the daemon is done with the arena
        (after :meth:`wait` or :meth:`settle`, which close it themselves)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


STREAM_BATCH_BYTES = 1 << 30
"""A load's arena is handed to the daemon in batches of segments of this many bytes (the daemon's
copy pieces, :data:`~flashboot.flashload.serve_copy.SERVE_CHUNK_BYTES`): the request carries the
first batch, and the daemon copies it while the next ones are exported (30 ms of exports for
13.8 GB on the H200, once before the copy's first byte)."""


def first_batch_segments() -> int:
    """How many segments an arena made for a served load makes at once (``Arena.create``'s
    ``segments_now``): the request's batch. The others are made as their batches are handed over
    (:func:`_send_arena` exports them), while the daemon copies the first."""
    from ..arena.segments import SEGMENT_BYTES

    return max(1, STREAM_BATCH_BYTES // SEGMENT_BYTES)


def _send_arena(arena, *, image_dir, rank: int, nbytes: int, metadata_sha256: str, timeout_s: float,
                connect_timeout_s: float | None = None, shm_dir=None,
                **extra) -> tuple[socket.socket, Path, float, Callable | None]:
    """Connect to the daemon for ``image_dir`` (waiting up to ``timeout_s`` for its socket) and send
    a load of rank ``rank`` with ``arena``'s descriptor and its fds attached; returns the socket.
    ``connect_timeout_s``: the wait for the socket and each send where not ``timeout_s`` (a
    retry's, what is left of the load's timeout).

    A ``load`` of more than one batch (:data:`STREAM_BATCH_BYTES`) sends the fds of the first batch
    with the request (``fds_follow``) and the others as they are exported (an arena made with
    ``segments_now`` makes each batch's segments first); if an export fails
    meanwhile, the daemon is told (the socket's write side shut) and its answer awaited, so it
    no longer copies into the arena when the error reaches the caller. Returns the socket, its
    path, when the request went out (``time.perf_counter()``) and the hand-over of the later
    batches (``later(sock)``; None when there are none), which the caller runs
    (:meth:`ServedCopy.hand_over_rest`)."""
    from ..fdshare import send_fds

    segments = arena.segments
    per = max(1, STREAM_BATCH_BYTES // arena.segment_bytes)
    streamed = segments > per
    if streamed:
        desc, first = arena.socket_descriptor(), arena.export_segments(0, per)
    else:
        desc = arena.export()
        first = list(desc.fds)
    req = {"op": "load", "protocol": PROTOCOL_VERSION, "rank": rank, "descriptor": desc.to_dict(),
           "nbytes": nbytes, "metadata_sha256": metadata_sha256, "timeout_s": timeout_s, "pci_bus_id": None, **extra}
    if streamed:
        req["fds_follow"] = True
    if arena.device.is_cuda:
        from ..pinning import gpu_pci_bus_id

        req["pci_bus_id"] = gpu_pci_bus_id(arena.device)
    path = socket_path(image_dir, shm_dir)
    connect_s = timeout_s if connect_timeout_s is None else connect_timeout_s
    sock = _connect(path, connect_s)
    try:
        send_fds(sock, first, json.dumps(req).encode())
        sent_at = time.perf_counter()
    except BaseException as exc:
        sock.close()
        if isinstance(exc, OSError):
            raise _went_away(path, rank, exc, connect_s) from None
        raise
    if not streamed:
        return sock, path, sent_at, None

    def later(sock: socket.socket) -> None:
        try:
            for lo in range(per, segments, per):
                send_fds(sock, arena.export_segments(lo, min(segments, lo + per)))
        except BaseException as exc:
            reply = _stop_streamed(sock, path, rank, timeout_s + 60 + nbytes / 1e9)
            if isinstance(exc, OSError):
                if reply is not None and _is_busy(reply):
                    raise _Busy(f"served load of rank {rank} by the preloader at {path}: {reply.get('message')}") from None
                if reply is not None and not reply.get("ok"):  # it refused the request and hung up: its reason
                    _raise_remote(reply, f"served load of rank {rank} by the preloader at {path}")
                raise _went_away(path, rank, exc, connect_s) from None
            raise

    return sock, path, sent_at, later


def _went_away(path: Path, rank: int, exc: OSError, timeout_s: float) -> FlashBootError:
    if isinstance(exc, TimeoutError):  # a send found the daemon's queue full for the whole timeout
        return WaitTimeoutError(f"the preloader at {path} took no more of rank {rank}'s arena within {timeout_s:g} s; "
                                "is it stopped or hung? see `flashboot preload DIR --status`")
    return RendezvousError(f"the preloader at {path} went away while rank {rank}'s arena was handed to it "
                           f"({type(exc).__name__}); did it exit? see `flashboot preload DIR --status`")


def _stop_streamed(sock: socket.socket, path: Path, rank: int, timeout_s: float) -> dict | None:
    """A streamed hand-over broke off on this side: shut the write side (the daemon's next fd
    receive ends, it stops copying and answers), wait for that answer and hang up; returns the
    answer, or None when the daemon is gone. Either way it no longer writes into the arena."""
    try:
        sock.shutdown(socket.SHUT_WR)
        return _read_reply(sock, path, f"the broken-off 'load' for rank {rank}", timeout_s)
    except (FlashBootError, OSError):
        return None
    finally:
        sock.close()


def start_served_load(arena, *, image_dir, rank: int, nbytes: int, metadata_sha256: str, timeout_s: float,
                      shm_dir=None, verify: bool = False, rest_later: bool = False) -> ServedCopy:
    """Send the daemon for ``image_dir`` a request to copy rank ``rank`` (``nbytes``, staged from
    the metadata with sha256 ``metadata_sha256``) into ``arena``; returns at once.

    The arena's descriptor travels with its fd attached. The daemon refuses a request whose
    sha256 or size differ from what it holds. The socket's appearance is awaited up to
    ``timeout_s``; the reply (:meth:`ServedCopy.wait`) up to ``timeout_s`` (the daemon's
    staging) plus 60 s plus 1 s per GB. ``verify``: the reply carries the chunk digests of the
    copied bytes, computed by the daemon (check them with :func:`check_daemon_digests`).
    ``rest_later``: return once the request with the first batch is out; the later batches are
    handed over by :meth:`ServedCopy.hand_over_rest` (an early call's background thread), or by
    :meth:`ServedCopy.wait` at the latest.
    """
    retry = _BusyRetry(timeout_s)

    def send():  # asked again while busy: within what is left of the timeout, not a fresh one
        return _send_arena(arena, image_dir=image_dir, rank=rank, nbytes=nbytes, metadata_sha256=metadata_sha256,
                           timeout_s=timeout_s, connect_timeout_s=retry.left(), shm_dir=shm_dir, verify=verify)

    sock, path, sent_at, later = send()
    copy = ServedCopy(sock, path, rank, timeout_s + 60 + nbytes / 1e9, sent_at, later, resend=send, retry=retry,
                      timeout_s=timeout_s)
    if not rest_later:
        copy.hand_over_rest()
    return copy


def check_daemon_digests(reply: dict, metadata, where: str, report=None) -> int:
    """Compare the chunk digests a verifying daemon computed in the arena after its copy (its
    ``reply``) with the image's metadata checksums: ChecksumMismatchError naming the first bad chunk,
    as :func:`~flashboot.flashload.landing.verify_loaded` does; RendezvousError for a reply without
    them or of another chunk size. Returns the chunk count; fills ``report`` (``verify_ms``: the
    daemon's checksum time) when given."""
    from .landing import compare_digests

    digests, chunk_bytes = reply.get("digests"), reply.get("checksum_chunk_bytes")
    want = metadata.checksums.chunk_bytes
    if not isinstance(digests, list) or not all(type(d) is int and 0 <= d < 1 << 64 for d in digests):
        raise RendezvousError(f"{where}: the preloader's reply carries no chunk digests (64-bit unsigned ints) "
                              "although verify was asked"
                              + (protocol_note(reply, "the preloader", "this engine") or " (restart the preloader)"))
    if chunk_bytes != want:
        raise RendezvousError(f"{where}: the preloader digested chunks of {chunk_bytes} bytes, the metadata records "
                              f"{want:,}")
    count = compare_digests(digests, metadata, where)
    if report is not None:
        report.verify_ms = float(reply.get("checksum_ms", 0.0))
        report.details["verified"] = f"{count} chunks match the pre-pack's checksums (verified by the daemon)"
    return count


def served_load(arena, source: RankSource, *, timeout_s: float, shm_dir=None) -> dict:
    """Have the daemon for ``source.image_dir`` copy rank ``source.rank`` into ``arena`` and wait
    for it (:func:`start_served_load` then :meth:`ServedCopy.wait`); returns the daemon's reply
    (``map_ms``, ``h2d_ms``...)."""
    return start_served_load(arena, image_dir=source.image_dir, rank=source.rank, nbytes=source.nbytes,
                             metadata_sha256=source.metadata_sha256, timeout_s=timeout_s, shm_dir=shm_dir).wait()
