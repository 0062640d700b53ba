"""The served-load daemon: keeps staged images mapped and pinned once, and copies them into engines'
exported arenas on request, so an engine pays only the descriptor exchange and the copy."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import (
    FlashBootError,
    LayoutError,
    OutOfMemoryError,
    RendezvousError,
    WaitTimeoutError,
)
from ..fdshare import SCM_MAX_FD, FdStream, readable
from .protocol import (
    PROTOCOL_VERSION, REMOVED_OPS, _error_payload, protocol_note,
)
from .shm import (
    check_ready,
    rank_source,
    open_staged,
    socket_path,
    staged_paths,
)
from .serve_copy import (
    SERVE_CHUNK_BYTES,
    _check_staged_size,
    _collect_digests,
    _digest_copied,
    _pipelined_digests,
    _read_staged,
    _start_piece_digests,
    _warm_cuda_copy,
    serve_pieces,
    wait_without_spinning,
)
from .serve_socket import (
    TURN_AWAY_S,
    _Engine,
    _Listening,
    _FifoLock,
    _descriptor_fd_count,
    _parse_request,
    _request_timeout_s,
)
from .staging import PreloadConfig, StageResult, stage_rank_when_free

_MAX_REPLY_BYTES = 64 << 10
_MAX_MESSAGE_CHARS = 4096
"""An error about a request echoes its fields; one of ~200 KB (found by fuzzing: a 200,000-character
arena id) made a reply longer than one SOCK_SEQPACKET message, and the engine got none."""
MAX_REQUEST_BYTES = 64 << 10
"""A request is a few hundred bytes of JSON (a 1,000-segment descriptor is ~40 KB); a longer one
is refused whole: SOCK_SEQPACKET truncates it and says so (MSG_TRUNC)."""
MAX_REPLY_DIGESTS = 8192
"""A verifying copy's reply holds one JSON int per checksum chunk (~20 bytes): 8,192 keep it within
one SOCK_SEQPACKET message under the default socket buffer (~208 KB); at the default 64 MiB chunks
that is 512 GiB a rank."""
MAX_CONNECTIONS = 64
"""Connections handled at once; one more is answered "busy" and closed, so clients that connect
and never speak cannot make the daemon start threads without bound."""
REQUEST_TIMEOUT_S = 10.0
"""How long a connected client may take to send its request (and the rest of its fds)."""
HANDOVER_TIMEOUT_S = 30.0
HANDOVER_BYTES_PER_S = 1e9
"""How long the whole hand-over of an engine's arena may take once its copy has the device (13.8
GB took 30 ms on the H200): :data:`HANDOVER_TIMEOUT_S` plus a second per GB, as the copy that
takes the fds may run that slowly (a 200 GB ``--no-pin`` rank). Its copy holds the device's
queue, and a client trickling one fd just within :data:`REQUEST_TIMEOUT_S` each held it, and
everyone queued behind, without end."""
CLOSE_TIMEOUT_S = 10.0
"""How long :meth:`PreloadServer.close` waits for all connection handlers together once the loads in
flight are cancelled (or, with none in flight, once it stopped taking requests): well within
``preload --stop``'s 30 s, which also waits for the unpinning and unmapping after it."""
STOP_POLL_S = 0.2
"""How often a request waiting for its rank's staging (or a connection for its request) looks at the
daemon's stop."""
DRAIN_POLL_S = 0.05
"""How often a stopping daemon looks whether its loads in flight are done."""


# ====================================================================== the served-load daemon
@dataclass
class _Resident:
    """One staged rank held by the daemon: mapped and (CUDA) pinned once."""

    rank: int
    event: threading.Event = field(default_factory=threading.Event)
    path: str = ""
    fd: int = -1
    """The staged image, kept open: its size is checked before each copy, and the host backend
    copies from it with pread (a truncated file reads short instead of faulting)."""
    mapping: Any = None
    """The staged image mapped: what copies into CUDA arenas read (pinned where configured)."""
    pinned: Any = None
    nbytes: int = 0
    metadata_sha256: str = ""
    pin_ms: float = 0.0
    warm_ms: float = 0.0
    """Stage-time warm-up of this rank's first copy and verify (:meth:`PreloadServer._warm_rank`)."""
    checksum_chunk_bytes: int = 0
    """The chunk size of the image's checksums (its metadata): a verifying copy digests these."""
    error: BaseException | None = None
    state: str = "staging"


class PreloadServer(_Listening):
    """Stages ranks, keeps them mapped and pinned, and copies them into engines' arenas on request.

    Protocol (``SOCK_SEQPACKET``, one JSON message each way): the engine sends
    ``{"op": "load", "rank", "descriptor", "pci_bus_id", "nbytes", "metadata_sha256",
    "timeout_s", "verify"}`` with its arena's fd attached (SCM_RIGHTS); the daemon opens the arena,
    copies, synchronises, closes its mapping and answers ``{"ok": true, "map_ms", "h2d_ms", ...}``
    or ``{"ok": false, "error", "message"}``. With ``"verify": true`` the reply also carries the
    chunk checksums of the bytes it copied, computed in the arena after the copy (``digests``,
    ``checksum_chunk_bytes``, ``checksum_ms``): the engine compares them with its metadata, so
    it never loads a checksum kernel itself (this daemon warmed its own once, at start).
    ``{"op": "status"}`` answers what it holds. Requests and replies name their ``"protocol"``
    (:data:`~flashboot.flashload.protocol.PROTOCOL_VERSION`): an error answered to an engine of
    another FlashBoot version names both.

    What a client does to memory the daemon maps cannot kill it: an engine's host arena must be
    sealed against shrinking (refused at attach otherwise, :meth:`Arena.open`), and a staged image
    is checked for its size before each copy; the host backend copies it with pread, so a file
    truncated during the copy reads short (an error) instead of faulting. Residual windows: a CUDA
    copy reads the staged file's pinned pages, which a truncation cannot take from the daemon (not
    yet run on a GPU); under ``--no-pin`` the driver reads the mapping, so a truncation between the
    size check and the end of the copy can still fault, as it can while the daemon stages and
    verifies the file itself.
    """

    def __init__(self, config: PreloadConfig, *, stop: threading.Event | None = None,
                 cancel: threading.Event | None = None, log: Callable[[str], None] = print):
        self.config = config
        self.stop = stop or threading.Event()
        """Set (SIGTERM): no new request is taken; the loads in flight finish, then :meth:`close` ends."""
        self.cancel = cancel or threading.Event()
        """Set (a second SIGTERM, ``preload --stop``'s timeout): the loads in flight are broken off,
        each engine answered that it was stopped (:class:`~flashboot.flashload.serve_socket._Engine`)."""
        self.log = log
        self._loads: dict[int, _InFlight] = {}
        """The loads in flight, by their handler thread's ident: what a stop waits for, and says it does."""
        self.ranks = config.resolved_ranks()
        self.residents = {r: _Resident(r) for r in self.ranks}
        self.sock_path = socket_path(config.image_dir, config.shm_dir)
        self._listener: socket.socket | None = None
        self._listener_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._copy_locks: dict[str, _FifoLock] = {}
        self._locks_lock = threading.Lock()
        self.uid = os.geteuid()
        self.group = config.allow_gid()
        self.request_timeout_s = REQUEST_TIMEOUT_S
        self.handover_timeout_s = HANDOVER_TIMEOUT_S
        self.max_connections = MAX_CONNECTIONS
        self.refused = 0
        """Connections refused for their credentials (each one logged)."""
        self.warming = False
        """:meth:`_warm_up` runs (the socket answers already)."""

    # ---- residency ---------------------------------------------------------------------------
    def _make_resident(self, rank: int) -> None:
        from ..pinning import MappedFile, register_host

        res = self.residents[rank]
        src = rank_source(self.config.image_dir, rank)
        paths = staged_paths(self.config.image_dir, rank, self.config.shm_dir)
        info, fd = open_staged(paths, os.O_RDWR)  # the image from the folder whose .ready and owner were checked
        res.path, res.fd = str(paths.image), fd
        check_ready(info, src)
        res.nbytes, res.metadata_sha256 = src.nbytes, src.metadata_sha256
        res.checksum_chunk_bytes = src.metadata.checksums.chunk_bytes
        _check_staged_size(res)
        res.mapping = MappedFile(res.path, src.nbytes, fd=res.fd)  # the same file the size checks look at
        dev = self.config.device_for(rank)
        if dev.is_cuda and self.config.pin:
            res.pinned = register_host(res.mapping.ptr, src.nbytes, dev, path=str(paths.image))
            res.pin_ms = res.pinned.pin_ms
        self._warm_rank(res, dev)
        res.state = "pinned" if res.pinned is not None else "mapped"

    def _warm_rank(self, res: _Resident, dev) -> None:
        """Pay now, at stage time, what the rank's first served copy would pay on an engine's
        critical path: an arena of this process exported and opened again as an engine's is (the
        Python and driver path of :meth:`_attach`: 89 ms of a first served load of 40,250 tensors
        on the host backend, 0.2 ms in the second), and on CUDA the checksum kernel compiled for
        exactly the shapes the rank's verify launches (Triton specialises on sizes: the probe of
        :meth:`_warm_up` left ~290 ms in the first verified load of 40,250 tensors) and a first
        H2D from this staged mapping into that arena, with the second stream and the event a
        pipelined verify uses. Best effort: a failure is logged and shows again, named, in the
        copy itself."""
        t0 = time.perf_counter()
        try:
            from ..arena import Arena

            n = min(res.nbytes, 1 << 16)
            with Arena.create(n, dev) as own:
                desc = own.export()
                fds = [os.dup(fd) for fd in desc.fds]  # as received from an engine: ours to close
                try:
                    with Arena.open(desc, device=dev.index if dev.is_cuda else "cpu", fds=fds) as opened:
                        opened.map_range(0, n)
                        if dev.is_cuda:
                            _warm_cuda_copy(res, dev, opened.span(0, n))
                finally:
                    for fd in fds:
                        os.close(fd)
            res.warm_ms = (time.perf_counter() - t0) * 1e3
        except Exception as exc:  # noqa: BLE001 - a warm-up; the copy reports its own failure
            self.log(f"rank {res.rank}: warming its first copy failed ({type(exc).__name__}: {exc}); the first "
                     "served load pays it")

    def _warm_up(self) -> None:
        """Import and construct what a request needs, so the first engine does not pay for it; on
        CUDA that includes the checksum kernel a verifying copy runs (its first call in a process
        costs ~1 s of Triton). The host backend reads the staged file (_read_staged) and digests
        with numba only when an engine asks (verify is off by default there): nothing to warm."""
        from ..arena import warm_import
        from ..fdshare import grow_fd_table
        from ..movers import create_mover

        grow_fd_table()  # every engine's arena arrives as fds: the table's growth is paid here, once
        for dev in {self.config.device_for(r) for r in self.ranks}:
            if dev.is_cuda:
                import cupy

                from flashboot.kernels.checksum import chunk_checksums

                # the first import and mapping of an engine's memory: 8.4 ms in the first served load on
                # the H200, 0.7 ms after (best effort: a failed step shows again in the real open)
                warm_import(dev, peers=[dev.index])
                create_mover("copy_engine")
                with cupy.cuda.Device(dev.index):
                    stream = cupy.cuda.Stream(non_blocking=True)
                    with stream:
                        probe = cupy.zeros(1 << 16, dtype=cupy.uint8)
                    chunk_checksums(probe, 1 << 14, stream=stream)  # returns once the digests are read back

    def run(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Listen, warm up, stage every rank and make it resident, then serve until :attr:`stop` is
        set. It listens first: ``--background`` waits for an answer, and a cold CUDA warm-up on 8
        GPUs can take most of its timeout (status says ``warming`` meanwhile; a load waits for
        its rank as it does while staging)."""
        self.warming = True  # before the first status can be asked
        self._listen()
        accept = threading.Thread(target=self._accept_loop, name="flashboot-serve-accept", daemon=True)
        accept.start()
        try:
            try:
                self._warm_up()
            finally:
                self.warming = False
            for rank in self.ranks:
                res = self.residents[rank]
                try:
                    cb = (lambda d, t, r=rank: progress(r, d, t)) if progress else None
                    r = self._stage(rank, cb)
                    self.log(_describe_stage(r))
                    if self.stop.is_set():  # pinning a large rank takes seconds and nobody is to be served
                        raise FlashBootError(f"the preloader (pid {os.getpid()}) is stopping; rank {rank} was staged "
                                             "but not made resident")
                    self._make_resident(rank)
                    self.log(f"rank {rank}: resident ({res.state}{f', pinned in {res.pin_ms:.0f} ms' if res.pinned else ''}"
                             f"{f', first copy warmed in {res.warm_ms:.0f} ms' if res.warm_ms else ''})")
                except BaseException as exc:
                    res.error, res.state = exc, "failed"
                    self.log(f"rank {rank}: failed: {type(exc).__name__}: {exc}")
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                finally:
                    res.event.set()
                if self.stop.is_set():
                    break
            failed = [r for r in self.ranks if self.residents[r].error is not None]
            if not self.stop.is_set():  # stopped while staging: it serves nothing, and says so as it stops
                self.log(f"serving {len(self.ranks) - len(failed)} rank(s) on {self.sock_path}"
                         + (f"; rank(s) {failed} failed (above): their loads are answered with that error"
                            if failed else ""))
            while not self.stop.wait(0.2):
                pass
        finally:
            self.close()
            accept.join(timeout=2)

    def _stage(self, rank: int, progress) -> StageResult:
        """:func:`stage_rank_when_free` for ``rank``: an engine staging its own copy is waited for."""
        return stage_rank_when_free(self.config.image_dir, rank, shm_dir=self.config.shm_dir,
                                    threads=self.config.threads, io=self.config.io, chunk_bytes=self.config.chunk_bytes,
                                    device=self.config.device_for(rank), numa_policy=self.config.numa_policy,
                                    verify=self.config.verify, force=self.config.force, progress=progress,
                                    stop=self.stop, log=self.log)

    def close(self) -> None:
        """Stop listening, unpin and unmap everything (the staged files stay)."""
        self.stop.set()
        for res in self.residents.values():  # requests waiting for ranks never staged: they answer now
            res.event.set()
        self._stop_listening()
        with self._threads_lock:
            threads = list(self._threads)
        try:
            self._drain(threads)
        finally:  # a second Ctrl-C in that wait (the foreground daemon) cancels, as a second SIGTERM does
            self.cancel.set()  # what is still in flight (past its engine's deadline) is broken off now
            self._close_handlers(threads)

    def _close_handlers(self, threads: list[threading.Thread]) -> None:
        """Join the connection handlers (their loads cancelled), then unpin and unmap the ranks."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S  # one bound for all: 30 s each made --stop give up first
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            self.log(f"{stuck} connection handler(s) still busy {CLOSE_TIMEOUT_S:g} s after stop; closing regardless")
        for res in self.residents.values():
            if res.pinned is not None:
                try:
                    res.pinned.unregister()
                except FlashBootError as exc:
                    self.log(f"rank {res.rank}: unpinning failed: {exc}")
                res.pinned = None
            if res.mapping is not None:
                res.mapping.close()
                res.mapping = None
            if res.fd >= 0:
                os.close(res.fd)
                res.fd = -1

    def _drain(self, threads: list[threading.Thread]) -> None:
        """Wait for the loads in flight to end: a user stopping the daemon mid-rollout has them
        finished, not lost. Until :attr:`cancel` is set or the last one's own deadline, its
        engine's wait for the reply (past it the engine has hung up: each copy looks). Other
        connections are not waited for: an idle one is answered at once (:meth:`_await_request`),
        a status in a moment; what runs still is joined by :meth:`close` within its bound."""
        began, said = time.monotonic(), False
        while not self.cancel.is_set() and any(t.is_alive() for t in threads):
            with self._threads_lock:
                loads = list(self._loads.values())
            if not loads:
                # a request read just as the stop came is counted by then
                if time.monotonic() - began >= 2 * STOP_POLL_S:
                    return
            elif time.monotonic() >= max(load.deadline for load in loads):
                self.log(f"stopping: {_describe_loads(loads)} still in flight past its engine's deadline; cancelled")
                return
            elif not said:
                said = True
                self.log(f"stopping: waiting for {_describe_loads(loads)} to finish; a second SIGTERM (or Ctrl-C) "
                         f"cancels {'it' if len(loads) == 1 else 'them'}")
            self.cancel.wait(DRAIN_POLL_S)

    def _handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        supply: FdStream | None = None
        attached: _Attached | None = None
        try:
            with conn:
                peer = self._admit(conn)
                if peer is None:
                    return
                req: dict = {}
                try:
                    conn.settimeout(self.request_timeout_s)
                    if not self._await_request(conn):
                        self._turn_away(conn, self._stopping(), wait_s=TURN_AWAY_S)
                        return
                    try:
                        msg, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, SCM_MAX_FD)
                    except socket.timeout:
                        raise WaitTimeoutError(f"no request arrived within {self.request_timeout_s:g} s of "
                                               "connecting") from None
                    if flags & socket.MSG_CTRUNC:
                        raise RendezvousError(f"a request carried more than {SCM_MAX_FD} fds in one message")
                    if flags & socket.MSG_TRUNC:
                        raise RendezvousError(f"a request of more than {MAX_REQUEST_BYTES:,} bytes was refused")
                    if not msg:
                        return  # connected and left without a word
                    req = _parse_request(msg)
                    op = req["op"]
                    if op == "status":
                        reply = self.status()
                    elif op == "load":
                        if not fds:
                            raise RendezvousError("load request without the arena's fd attached")
                        count = _descriptor_fd_count(req)
                        self._in_flight(req, peer.pid)
                        # a stop lets the hand-over finish with the load; a cancel breaks it off
                        supply = FdStream(conn, fds, count, timeout_s=self.request_timeout_s,
                                          what=f"the arena of rank {req.get('rank')}'s load", stop=self.cancel,
                                          sender_pid=peer.pid or None)  # 0: another pid namespace
                        # fds_follow: the engine exports the rest while the copy starts (they are due once
                        # the copy has the device: _copy); otherwise all were sent at once (in batches past
                        # SCM_MAX_FD) and are taken now
                        if not req.get("fds_follow"):
                            supply.due_within(self._handover_due_s(req.get("nbytes", 0)))
                        attached = self._attach(req, supply if req.get("fds_follow") else supply.receive_all(),
                                                _Engine(conn, peer.pid, self.cancel))
                        reply = self._copy(attached, supply if req.get("fds_follow") else None)
                    elif op in REMOVED_OPS:  # an older engine's: said as such, not as a typo
                        raise RendezvousError(f"request op {op!r} ({REMOVED_OPS[op]}) is not in this preloader's "
                                              "protocol; it serves load and status")
                    else:
                        raise RendezvousError(f"unknown request op {op!r}; known: load, status")
                except _StagingFailed as exc:  # the staging error's class, with the daemon's words
                    reply = {**_error_payload(exc.error), "message": str(exc)}
                except BaseException as exc:  # every failure goes back to the engine, named
                    reply = _error_payload(exc)
                    self.log(f"request failed: {type(exc).__name__}: {str(exc)[:_MAX_MESSAGE_CHARS]}")
                if not reply.get("ok") and req:  # an engine of another version: both protocols named
                    reply["message"] = reply.get("message", "") + protocol_note(req, "the engine", "this preloader")
                reply["protocol"] = PROTOCOL_VERSION
                conn.settimeout(self.request_timeout_s)
                data = json.dumps(reply).encode()
                if len(data) > _MAX_REPLY_BYTES and not reply.get("ok"):  # it would not fit one message
                    reply = {**reply, "message": reply.get("message", "")[:_MAX_MESSAGE_CHARS] + " [...]", "attrs": {}}
                    data = json.dumps(reply).encode()
                conn.send(data)
                if isinstance(supply, FdStream):  # the rest, unused: closing on unread ones would lose the answer
                    supply.drain()
        except OSError as exc:
            self.log(f"engine connection lost: {exc}")
        finally:
            if attached is not None:
                attached.arena.close()
            for fd in fds:
                os.close(fd)
            with self._threads_lock:  # out of flight once the arena is let go: a stop's wait ends with it
                self._loads.pop(threading.get_ident(), None)

    def _await_request(self, conn: socket.socket) -> bool:
        """Wait for a connection's request (within :attr:`request_timeout_s`); False at a stop, to
        be answered at once: an engine connected but silent is not a load in flight, and a stop
        waiting out its timeout kept the daemon (and its pinned memory) up 10 s for nobody."""
        deadline = time.monotonic() + self.request_timeout_s
        while not readable([conn.fileno()], min(STOP_POLL_S, max(0.0, deadline - time.monotonic()))):
            if self.stop.is_set():
                return False
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"no request arrived within {self.request_timeout_s:g} s of connecting")
        return True

    def _in_flight(self, req: dict, pid: int) -> None:
        """Count this handler's load in flight until its arena is let go (:meth:`_handle`'s end)."""
        nbytes = req.get("nbytes", 0)
        # the engine's own wait for the reply (client.start_served_load): past it, nobody awaits the load
        due_s = _request_timeout_s(req) + 60 + min(max(nbytes, 0), 1 << 44) / 1e9
        with self._threads_lock:
            self._loads[threading.get_ident()] = _InFlight(req.get("rank"), pid, time.monotonic() + due_s)

    def status(self) -> dict:
        with self._threads_lock:
            loads = [{"rank": load.rank, "pid": load.pid} for load in self._loads.values()]
        return {"ok": True, "pid": os.getpid(), "image_dir": self.config.image_dir, "warming": self.warming,
                "stopping": self.stop.is_set(), "loads": loads,
                "ranks": {str(r): {"state": res.state, "nbytes": res.nbytes, "pin_ms": res.pin_ms,
                                   "metadata_sha256": res.metadata_sha256,
                                   "error": str(res.error) if res.error else None,
                                   "error_payload": _error_payload(res.error) if res.error else None}
                          for r, res in self.residents.items()}}

    def _lock_for(self, key: str) -> _FifoLock:
        with self._locks_lock:
            return self._copy_locks.setdefault(key, _FifoLock())

    def _attach(self, req: dict, fds: "list[int] | FdStream", engine: _Engine | None = None) -> "_Attached":
        """Check the request against the resident rank and open the engine's arena (its first
        segment mapped); :meth:`_copy` maps each piece's segments just before issuing its copy,
        so the mapping of the next piece overlaps the copy of this one (mapping all of a 13.8 GB
        arena first only delayed the copy's start). ``fds``: a list, or an
        :class:`~flashboot.fdshare.FdStream` whose later fds arrive while the first pieces copy.
        ``engine``: the requester, whose hang-up ends the waits (here and in :meth:`_copy`)."""
        from ..arena import Arena, ArenaDescriptor

        rank = req.get("rank")
        res = self.residents.get(rank) if isinstance(rank, int) and not isinstance(rank, bool) else None
        if res is None:
            raise LayoutError(f"this preloader serves ranks {self.ranks} of {self.config.image_dir}; rank {rank!r} was asked")
        timeout_s = _request_timeout_s(req)
        deadline = time.monotonic() + timeout_s
        while not res.event.wait(min(STOP_POLL_S, max(0.0, deadline - time.monotonic()))):
            if self.stop.is_set():  # the engine's timeout may be 600 s, and --stop waits 30 s
                break
            if engine is not None:
                engine.check(f"waited for rank {rank} to be staged and made resident")
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"rank {rank} of {self.config.image_dir} was not staged and pinned within "
                                       f"{timeout_s:g} s (daemon pid {os.getpid()}, state {res.state})")
        if res.error is not None:
            raise _StagingFailed(rank, res.error)
        if res.mapping is None:  # stopped before it was staged (close() sets every event), or unmapped since
            raise FlashBootError(f"rank {rank}: the preloader (pid {os.getpid()}) is stopping; rank {rank} of "
                                 f"{self.config.image_dir} was not staged (state {res.state})")
        if req.get("metadata_sha256") != res.metadata_sha256 or req.get("nbytes") != res.nbytes:
            raise LayoutError(f"the daemon holds rank {rank} of another pre-pack ({res.nbytes:,} bytes, metadata "
                              f"{res.metadata_sha256[:12]}) than the engine asked for ({req.get('nbytes')} bytes, "
                              f"{str(req.get('metadata_sha256'))[:12]}); restart the preloader")
        verify = req.get("verify") is True
        if verify:
            _check_reply_digests(res)
        desc = ArenaDescriptor.from_dict(req["descriptor"])
        t0 = time.perf_counter()
        if desc.backend == "cuda":
            index = _device_by_bus_id(req.get("pci_bus_id"), desc.device_index)
            desc = dataclasses.replace(desc, device_index=index)  # the engine's ordinal may differ from ours
            arena = Arena.open(desc, device=index, fds=fds)
        else:
            arena = Arena.open(desc, device="cpu", fds=fds)
        try:
            if arena.nbytes < res.nbytes:
                raise OutOfMemoryError(f"engine arena {desc.arena_id} for rank {rank}", res.nbytes, arena.nbytes)
            stream = verify_stream = None
            if arena.device.is_cuda:
                import cupy

                with cupy.cuda.Device(arena.device.index):
                    stream = cupy.cuda.Stream(non_blocking=True)
                    if verify and _pipelined_digests(res):
                        verify_stream = cupy.cuda.Stream(non_blocking=True)
        except BaseException:
            arena.close()
            raise
        return _Attached(rank, res, arena, stream, (time.perf_counter() - t0) * 1e3, timeout_s,
                         verify=verify, verify_stream=verify_stream, engine=engine)

    def _handover_due_s(self, nbytes: int) -> float:
        """How long an arena's hand-over may take once it started, for a rank of ``nbytes``."""
        return self.handover_timeout_s + min(max(nbytes, 0), 1 << 44) / HANDOVER_BYTES_PER_S

    def _copy(self, attached: "_Attached", supply: FdStream | None = None) -> dict:
        """The resident image into the attached arena, in :func:`serve_pieces`, each piece's
        segments mapped (where not yet) just before its copy is issued; copies into one device
        queue first come, first served (each GPU has its own link: two copies into one would only
        share it, while two GPUs copy at once). The reply's ``copy_map_ms``: mapping done during
        the copy. A verifying request (``attached.verify``) gets the chunk digests of the arena's
        bytes: on CUDA each piece is digested on its own stream as soon as it is copied, while the
        next one copies (SMs beside the copy engine), so only the last piece's digest follows the
        copy; otherwise after the copy, outside the device's queue. ``supply``: the fds still
        arriving, due once the copy has the device (queued behind others, it takes none)."""
        from ..memory import CPU, Span
        from ..movers import create_mover

        res, arena, rank = attached.res, attached.arena, attached.rank
        lock = self._lock_for(str(arena.device))
        t_queue = time.perf_counter()
        engine = attached.engine
        if not lock.acquire(attached.timeout_s + 60, self.cancel, engine.gone if engine is not None else None):
            if engine is not None:
                engine.check(f"waited for {arena.device}, behind {lock.queued} queued copies")
            if self.cancel.is_set():
                raise FlashBootError(f"rank {rank}: the preloader (pid {os.getpid()}) is stopping; its copy into "
                                     f"{arena.device} was not started")
            raise WaitTimeoutError(f"rank {rank}: waited {attached.timeout_s + 60:g} s for {arena.device} behind "
                                   f"{lock.queued} queued copies (daemon pid {os.getpid()})")
        try:
            t1 = time.perf_counter()
            if supply is not None:
                supply.due_within(self._handover_due_s(res.nbytes))
            mapped_ms = arena.map_stats["map_ms"]
            _check_staged_size(res)
            pending = []
            if arena.device.is_cuda:
                import cupy

                src = Span(res.mapping.ptr, res.nbytes, CPU, pinned=res.pinned is not None, owner=res.mapping)
                mover = create_mover("copy_engine")
                pieces = serve_pieces(res.nbytes, res.checksum_chunk_bytes)
                with cupy.cuda.Device(arena.device.index):
                    try:
                        for off, n in pieces:
                            if engine is not None:  # a pageable (--no-pin) piece is copied before the next is issued
                                engine.check(f"was copied ({off:,} of {res.nbytes:,} bytes issued)")
                            mover.copy(arena.span(off, n), src.sub(off, n), stream=attached.stream)
                            if attached.verify_stream is not None:  # piece k digested while k + 1 is copied
                                pending.append(_start_piece_digests(attached, off, n))
                    except BaseException:  # nothing may still read or write the arena the caller closes
                        for stream in (attached.stream, attached.verify_stream):
                            if stream is not None:
                                stream.synchronize()
                        raise
                    wait_without_spinning(attached.stream)
            else:
                _read_staged(res, arena.span(0, res.nbytes), engine)
            h2d_ms = (time.perf_counter() - t1) * 1e3
        finally:
            lock.release()
        reply = {**attached.reply(), "h2d_ms": h2d_ms, "queue_ms": (t1 - t_queue) * 1e3,
                 "copy_map_ms": arena.map_stats["map_ms"] - mapped_ms}
        if attached.verify:
            reply.update(_collect_digests(attached, pending, t1 + h2d_ms / 1e3) if pending else _digest_copied(attached))
        return reply


def _check_reply_digests(res: "_Resident") -> None:
    """Refuse a verifying request before any byte moves when its digests would not fit one reply."""
    chunks = -(-res.nbytes // res.checksum_chunk_bytes)
    if chunks > MAX_REPLY_DIGESTS:
        raise LayoutError(f"rank {res.rank}: {chunks:,} checksum chunks of {res.checksum_chunk_bytes:,} bytes; a "
                          f"verifying served reply carries at most {MAX_REPLY_DIGESTS:,} digests (one socket "
                          "message): re-pack with larger chunks, or load with verify=False and call verify_loaded")


@dataclass(frozen=True)
class _InFlight:
    """A load a connection handler is serving: what a stop waits for (:meth:`PreloadServer._drain`)."""

    rank: Any
    pid: int
    """The engine's (0: in another pid namespace)."""
    deadline: float
    """``time.monotonic()`` past which its engine no longer waits for the reply."""


def _describe_loads(loads: "list[_InFlight] | list[dict]") -> str:
    """``1 load in flight (rank 0, engine pid 4242)``: what a stop waits for, in words."""
    def one(load) -> str:
        rank, pid = (load.get("rank"), load.get("pid")) if isinstance(load, dict) else (load.rank, load.pid)
        return f"rank {rank}, engine pid {pid}" if pid else f"rank {rank}"
    return (f"{len(loads)} load{'s' if len(loads) != 1 else ''} in flight ("
            + "; ".join(one(load) for load in loads) + ")")


class _StagingFailed(Exception):
    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"staging rank {rank} failed in the daemon: {error}")
        self.error = error


@dataclass
class _Attached:
    """An engine's arena opened by the daemon for one copy of a resident rank."""

    rank: int
    res: _Resident
    arena: Any
    stream: Any
    map_ms: float
    timeout_s: float
    verify: bool = False
    """The engine asked for the chunk digests of what was copied (see :func:`_digest_copied`)."""
    verify_stream: Any = None
    """CUDA: the stream the digests of each copied piece run on, beside the copy's."""
    engine: _Engine | None = None
    """The requester: its hang-up ends the wait for the device (:meth:`PreloadServer._copy`)."""

    def reply(self) -> dict:
        return {"ok": True, "rank": self.rank, "nbytes": self.res.nbytes, "map_ms": self.map_ms,
                "pinned": self.res.pinned is not None, "pin_ms": self.res.pin_ms, "pid": os.getpid()}


def _device_by_bus_id(bus_id: str | None, fallback: int) -> int:
    """This process's ordinal of the GPU with PCI address ``bus_id`` (CUDA_VISIBLE_DEVICES may differ)."""
    if not bus_id:
        return fallback
    from .. import _cuda

    drv = _cuda.driver()
    dev = _cuda.check(drv.cuDeviceGetByPCIBusId(bus_id.encode()), f"cuDeviceGetByPCIBusId({bus_id})")
    return int(dev)


def _describe_stage(r: StageResult) -> str:
    if r.skipped:
        note = r.io_reason.partition("; ")[2]  # why a verification went unrecorded
        return (f"rank {r.rank}: already staged at {r.staged} ({r.nbytes:,} bytes{'; verified' if r.verified else ''}"
                f"{'; ' + note if note else ''})")
    how = r.io_mode + (f" ({r.io_reason})" if r.io_reason else "")
    numa = f"NUMA node {r.numa_node}" if r.numa_node is not None else f"no NUMA binding: {r.numa_reason}"
    again = f" again ({r.restaged_because})" if r.restaged_because else ""
    return (f"rank {r.rank}: staged{again} {r.nbytes:,} bytes in {r.read_s:.3f} s ({r.gbps:.2f} GB/s), {r.threads} "
            f"threads, {how}; {numa}{'; verified' if r.verified else ''}")

