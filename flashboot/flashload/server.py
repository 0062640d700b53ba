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

from .._json import check_fields, finite_at_least, is_str, loads
from ..errors import (
    FlashBootError,
    LayoutError,
    OutOfMemoryError,
    RendezvousError,
    WaitTimeoutError,
)
from ..fdshare import SCM_MAX_FD, recv_more_fds
from .protocol import _error_payload
from .shm import (
    _unlink_quietly,
    check_ready,
    rank_source,
    read_ready,
    socket_path,
    staged_paths,
)
from .staging import PreloadConfig, StageResult, stage_rank

_MAX_REPLY_BYTES = 64 << 10
_MAX_MESSAGE_CHARS = 4096
"""An error about a request echoes its fields; one of ~200 KB (found by fuzzing: a 200,000-character
arena id) made a reply longer than one SOCK_SEQPACKET message, and the engine got none."""
SERVE_CHUNK_BYTES = 1 << 30
"""The daemon's H2D goes in 1 GB chunks (hardware.md: streams and smaller chunks do not help)."""


# ====================================================================== the served-load daemon
@dataclass
class _Resident:
    """One staged rank held by the daemon: mapped and (CUDA) pinned once."""

    rank: int
    event: threading.Event = field(default_factory=threading.Event)
    mapping: Any = None
    pinned: Any = None
    nbytes: int = 0
    metadata_sha256: str = ""
    pin_ms: float = 0.0
    error: BaseException | None = None
    state: str = "staging"


class PreloadServer:
    """Stages ranks, keeps them mapped and pinned, and copies them into engines' arenas on request.

    Protocol (``SOCK_SEQPACKET``, one JSON message each way): the engine sends
    ``{"op": "load", "rank", "descriptor", "pci_bus_id", "nbytes", "metadata_sha256",
    "timeout_s"}`` with its arena's fd attached (SCM_RIGHTS); the daemon opens the arena, copies,
    synchronises, closes its mapping and answers ``{"ok": true, "map_ms", "h2d_ms", ...}`` or
    ``{"ok": false, "error", "message"}``. ``{"op": "status"}`` answers what it holds.
    """

    def __init__(self, config: PreloadConfig, *, stop: threading.Event | None = None, log: Callable[[str], None] = print):
        self.config = config
        self.stop = stop or threading.Event()
        self.log = log
        self.ranks = config.resolved_ranks()
        self.residents = {r: _Resident(r) for r in self.ranks}
        self.sock_path = socket_path(config.image_dir, config.shm_dir)
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._copy_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # ---- residency ---------------------------------------------------------------------------
    def _make_resident(self, rank: int) -> None:
        from ..pinning import MappedFile, register_host

        res = self.residents[rank]
        src = rank_source(self.config.image_dir, rank)
        paths = staged_paths(self.config.image_dir, rank, self.config.shm_dir)
        check_ready(read_ready(paths.ready), src)
        res.mapping = MappedFile(str(paths.image), src.nbytes)
        res.nbytes, res.metadata_sha256 = src.nbytes, src.metadata_sha256
        dev = self.config.device_for(rank)
        if dev.is_cuda and self.config.pin:
            res.pinned = register_host(res.mapping.ptr, src.nbytes, dev, path=str(paths.image))
            res.pin_ms = res.pinned.pin_ms
        res.state = "pinned" if res.pinned is not None else "mapped"

    def _warm_up(self) -> None:
        """Import and construct what a request needs, so the first engine does not pay for it."""
        from .. import arena  # noqa: F401
        from ..movers import create_mover

        devices = {self.config.device_for(r) for r in self.ranks}
        for dev in devices:
            mover = create_mover("copy_engine" if dev.is_cuda else "host")
            if not dev.is_cuda:  # compile the host mover's parallel loop (it runs above 1 MiB)
                import numpy as np

                a, b = np.zeros(2 << 20, np.uint8), np.ones(2 << 20, np.uint8)
                mover.copy(a, b, stream=None)
            else:
                import cupy

                with cupy.cuda.Device(dev.index):
                    cupy.cuda.Stream(non_blocking=True).synchronize()

    def run(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Listen, stage every rank and make it resident, then serve until :attr:`stop` is set."""
        self._warm_up()
        self._listen()
        accept = threading.Thread(target=self._accept_loop, name="flashboot-serve-accept", daemon=True)
        accept.start()
        try:
            for rank in self.ranks:
                res = self.residents[rank]
                try:
                    cb = (lambda d, t, r=rank: progress(r, d, t)) if progress else None
                    r = stage_rank(self.config.image_dir, rank, shm_dir=self.config.shm_dir, threads=self.config.threads,
                                   io=self.config.io, chunk_bytes=self.config.chunk_bytes,
                                   device=self.config.device_for(rank), numa_policy=self.config.numa_policy,
                                   verify=self.config.verify, force=self.config.force, progress=cb, stop=self.stop)
                    self.log(_describe_stage(r))
                    self._make_resident(rank)
                    self.log(f"rank {rank}: resident ({res.state}{f', pinned in {res.pin_ms:.0f} ms' if res.pinned else ''})")
                except BaseException as exc:
                    res.error, res.state = exc, "failed"
                    self.log(f"rank {rank}: failed: {type(exc).__name__}: {exc}")
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                finally:
                    res.event.set()
                if self.stop.is_set():
                    break
            self.log(f"serving {len(self.ranks)} rank(s) on {self.sock_path}")
            while not self.stop.wait(0.2):
                pass
        finally:
            self.close()
            accept.join(timeout=2)

    def close(self) -> None:
        """Stop listening, unpin and unmap everything (the staged files stay)."""
        self.stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            _unlink_quietly(self.sock_path)
        for t in list(self._threads):
            t.join(timeout=30)
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

    # ---- the socket --------------------------------------------------------------------------
    def _listen(self) -> None:
        self.sock_path.parent.mkdir(parents=True, exist_ok=True)
        _unlink_quietly(self.sock_path)  # a leftover of a dead daemon (the pid file says we own the dir)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o600)  # same user only: requests carry descriptors of GPU memory
        s.listen(64)
        s.settimeout(0.2)
        self._listener = s

    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), name="flashboot-serve-conn", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            with conn:
                try:
                    conn.settimeout(10)
                    msg, fds, _flags, _ = socket.recv_fds(conn, 1 << 20, SCM_MAX_FD)
                    if not msg:
                        return
                    req = _parse_request(msg)
                    op = req["op"]
                    if op == "status":
                        reply = self.status()
                    elif op == "load":
                        if not fds:
                            raise RendezvousError("load request without the arena's fd attached")
                        count = len(req["descriptor"]["fds"])
                        recv_more_fds(conn, fds, count, timeout_s=10)  # arenas of > SCM_MAX_FD segments
                        reply = self._serve_load(req, fds)
                    else:
                        raise FlashBootError(f"unknown request op {op!r}; known: load, status")
                except BaseException as exc:  # every failure goes back to the engine, named
                    reply = _error_payload(exc)
                    self.log(f"request failed: {type(exc).__name__}: {str(exc)[:_MAX_MESSAGE_CHARS]}")
                conn.settimeout(10)
                data = json.dumps(reply).encode()
                if len(data) > _MAX_REPLY_BYTES and not reply.get("ok"):  # it would not fit one message
                    reply = {**reply, "message": reply.get("message", "")[:_MAX_MESSAGE_CHARS] + " [...]", "attrs": {}}
                    data = json.dumps(reply).encode()
                conn.send(data)
        except OSError as exc:
            self.log(f"engine connection lost: {exc}")
        finally:
            for fd in fds:
                os.close(fd)

    def status(self) -> dict:
        return {"ok": True, "pid": os.getpid(), "image_dir": self.config.image_dir,
                "ranks": {str(r): {"state": res.state, "nbytes": res.nbytes, "pin_ms": res.pin_ms,
                                   "error": str(res.error) if res.error else None}
                          for r, res in self.residents.items()}}

    def _lock_for(self, key: str) -> threading.Lock:
        with self._locks_lock:
            return self._copy_locks.setdefault(key, threading.Lock())

    def _serve_load(self, req: dict, fds: list[int]) -> dict:
        from ..arena import Arena, ArenaDescriptor
        from ..movers import create_mover

        rank = req.get("rank")
        res = self.residents.get(rank)
        if res is None:
            raise LayoutError(f"this preloader serves ranks {self.ranks} of {self.config.image_dir}; rank {rank!r} was asked")
        timeout_s = float(req.get("timeout_s", 60))
        if not res.event.wait(timeout_s):
            raise WaitTimeoutError(f"rank {rank} of {self.config.image_dir} was not staged and pinned within "
                                   f"{timeout_s:g} s (daemon pid {os.getpid()}, state {res.state})")
        if res.error is not None:
            return {**_error_payload(res.error), "message": f"staging rank {rank} failed in the daemon: {res.error}"}
        if req.get("metadata_sha256") != res.metadata_sha256 or req.get("nbytes") != res.nbytes:
            raise LayoutError(f"the daemon holds rank {rank} of another pre-pack ({res.nbytes:,} bytes, metadata "
                              f"{res.metadata_sha256[:12]}) than the engine asked for ({req.get('nbytes')} bytes, "
                              f"{str(req.get('metadata_sha256'))[:12]}); restart the preloader")
        desc = ArenaDescriptor.from_dict(req["descriptor"])
        t0 = time.perf_counter()
        if desc.backend == "cuda":
            index = _device_by_bus_id(req.get("pci_bus_id"), desc.device_index)
            desc = dataclasses.replace(desc, device_index=index)  # the engine's ordinal may differ from ours
            arena = Arena.open(desc, device=index, fds=fds)
        else:
            arena = Arena.open(desc, device="cpu", fds=fds)
        try:
            map_ms = (time.perf_counter() - t0) * 1e3
            if arena.nbytes < res.nbytes:
                raise OutOfMemoryError(f"engine arena {desc.arena_id} for rank {rank}", res.nbytes, arena.nbytes)
            from ..memory import CPU, Span

            src = Span(res.mapping.ptr, res.nbytes, CPU, pinned=res.pinned is not None, owner=res.mapping)
            with self._lock_for(str(arena.device)):
                t1 = time.perf_counter()
                if arena.device.is_cuda:
                    import cupy

                    mover = create_mover("copy_engine")
                    with cupy.cuda.Device(arena.device.index):
                        stream = cupy.cuda.Stream(non_blocking=True)
                        for off in range(0, res.nbytes, SERVE_CHUNK_BYTES):
                            n = min(SERVE_CHUNK_BYTES, res.nbytes - off)
                            mover.copy(arena.span(off, n), src.sub(off, n), stream=stream)
                        stream.synchronize()
                else:
                    create_mover("host").copy(arena.span(0, res.nbytes), src, stream=None)
                h2d_ms = (time.perf_counter() - t1) * 1e3
        finally:
            arena.close()
        return {"ok": True, "rank": rank, "nbytes": res.nbytes, "map_ms": map_ms, "h2d_ms": h2d_ms,
                "pinned": res.pinned is not None, "pin_ms": res.pin_ms, "pid": os.getpid()}


_LOAD_FIELDS = {
    "rank": ("an int", lambda v: type(v) is int),
    "descriptor": ("an object with a list of fds", lambda v: type(v) is dict and type(v.get("fds")) is list),
    "nbytes": ("an int", lambda v: type(v) is int),
    "metadata_sha256": ("a string", is_str),
    "timeout_s": ("a finite number >= 0", finite_at_least(0)),
    "pci_bus_id": ("null or a string", lambda v: v is None or is_str(v)),
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
            raise RendezvousError("load request without a descriptor")
        check_fields(req, _LOAD_FIELDS, RendezvousError, "load request: ")
    return req


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
        return f"rank {r.rank}: already staged at {r.staged} ({r.nbytes:,} bytes)"
    how = r.io_mode + (f" ({r.io_reason})" if r.io_reason else "")
    numa = f"NUMA node {r.numa_node}" if r.numa_node is not None else f"no NUMA binding: {r.numa_reason}"
    return (f"rank {r.rank}: staged {r.nbytes:,} bytes in {r.read_s:.3f} s ({r.gbps:.2f} GB/s), {r.threads} threads, "
            f"{how}; {numa}{'; verified' if r.verified else ''}")

