"""FlashClone: replicate a resident arena GPU->GPU by mapping it, with no NCCL communicator.

A **seed** (:func:`seed`) holds the weights in an arena, exports it once, publishes its
:class:`~flashboot.rendezvous.Manifest` and descriptor to the rendezvous store and stays passive.
A **clone** (:func:`clone`) checks the manifest and the token, takes a position by arrival order,
creates its own arena (and a small flags arena), maps its source's arena and copies it with a
registry mover, following a plan from :mod:`flashboot.schedulers`:

* ``star``: every clone reads every chunk from the seed;
* ``chain``: clone k reads from clone k-1 (the seed for k = 1), chunk by chunk, each chunk as
  soon as its predecessor's flag says it is in place, so all links run at once;
* ``ring``: N members each load a 1/N byte shard of a host image, then gather the rest from their
  predecessor (:func:`ring_load`, or ``clone(schedule="ring", image=..., clones=N)``).

Transport: the source's arena is opened with a POSIX fd taken by ``pidfd_getfd`` on the same host,
a fabric handle across hosts where an IMEX channel exists, and otherwise through an NCCL
broadcast from the seed over torch.distributed (gloo on the host backend); the report's
``transport`` says which, and ``transport_note`` why.

Faults: every wait has a deadline. A source that exits (or stalls) mid-transfer stops the run with
a named error; with ``retry=True`` (default) the clone re-attaches upstream (the source's own
source), or to another clone that holds the whole image, or to the host image (``image=``), and
finishes; otherwise it releases what it mapped and raises.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import (ArenaError, ChecksumMismatchError, FlashBootError, RendezvousError,
                     WaitTimeoutError)
from .executor import Endpoint, Executor, StepFailure, create_flags, rewire
from .memory import CPU, Device, Span
from .rendezvous import DEFAULT_TIMEOUT_S, Manifest, Rendezvous
from .schedulers import HOST, Plan, Step, build_plan, shard_bounds

SEED_KEY = "seed"
METADATA_KEY = "metadata"
SCHEDULES = ("chain", "star", "ring")
TRANSPORTS = ("auto", "posix_fd", "fabric", "nccl")
ENV_STEP_DELAY = "FLASHBOOT_TEST_STEP_DELAY_S"
"""Test hook: seconds to sleep before each step (slows a transfer so a test can kill a peer mid-way)."""
_SEED_INDEX = 0
_FALLBACK_INDEX = 10_000
"""Participant index given to a retry source outside the plan (another clone's full copy)."""


class CloneError(RendezvousError):
    """A clone could not finish: names the step, the peer and what was tried."""


# ============================================================================================
# Report and result
# ============================================================================================


@dataclass
class CloneReport:
    """Where one clone's time went (milliseconds) and how it got its bytes.

    ``transport``: ``"posix_fd"``, ``"fabric"`` or ``"nccl"`` (``transport_note`` says why a
    fallback was taken). ``exchange_ms``: from requesting the seed's record (descriptor) to every
    source's arena (and flags) opened, its first segment mapped and readable: store get +
    authentication + decryption, taking a position, and per source its record, ``pidfd_getfd`` of
    every segment, reserve, and the first segment's import, map and set access, and the flags arena
    (``exchange_detail`` splits it; ``manifest_ms`` is its first part). It is the part NCCL's
    communicator setup would replace; our own arena's allocation is ``alloc_ms``, after it. The
    sources' other segments are mapped during the transfer, each just ahead of its first copy:
    ``map_during_copy_ms`` (host time, overlapped with copies already issued) and
    ``segments_mapped_during_copy``. ``warm_ms``: the one-time driver warm-up (:func:`flashboot.arena.warm_import`) run
    before the descriptor is requested, overlapped with connecting. ``transfer_ms``: the copy
    (from the first step issued to the last byte in place, pipeline fill included).
    ``ready_ms``: from the call to the weights in place (verification not included; ``verify_ms``
    is separate, ``total_ms`` includes it). ``recovered``: what happened when a source failed.
    """

    schedule: str
    position: int
    device: str
    nbytes: int
    transport: str = "posix_fd"
    transport_note: str = ""
    source: str = ""
    mover: str = ""
    chunk_bytes: int = 0
    connect_ms: float = 0.0
    warm_ms: float = 0.0
    warm_note: str = ""
    manifest_ms: float = 0.0
    alloc_ms: float = 0.0
    exchange_ms: float = 0.0
    exchange_detail: dict = field(default_factory=dict)
    barrier_ms: float = 0.0
    load_ms: float = 0.0
    pin_ms: float = 0.0
    pin_early: bool = False
    """Ring: the shard was mapped and pinned before the start barrier (off the critical path)."""
    transfer_ms: float = 0.0
    map_during_copy_ms: float = 0.0
    segments_mapped_during_copy: int = 0
    ready_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    verified: bool | None = None
    recovered: list[str] = field(default_factory=list)
    redone_bytes: int = 0
    lanes: list[dict] = field(default_factory=list)
    ready_unix: float = 0.0
    """Wall clock (``time.time()``) when the weights were in place (before verification), for
    "from process start" timings."""
    finished_unix: float = 0.0
    """Wall clock when the call returned (after verification, if asked)."""

    @property
    def gbps(self) -> float:
        """Bytes over the transfer time as the host saw it (issue to last completion), GB/s (1e9)."""
        return self.nbytes / (self.transfer_ms * 1e-3) / 1e9 if self.transfer_ms > 0 else 0.0

    @property
    def stream_gbps(self) -> float:
        """Bytes over the slowest lane's own time (CUDA events from the lane's start to its last
        copy, pipeline fill included), GB/s; 0 when the transfer was not a plan run (broadcast)."""
        seconds = max((l.get("seconds", 0.0) for l in self.lanes), default=0.0)
        return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        d["stream_gbps"] = self.stream_gbps
        return d

    def summary(self) -> str:
        parts = [f"{self.schedule} #{self.position} on {self.device}: {self.nbytes / 1e9:.3f} GB via {self.transport}",
                 f"from {self.source}" if self.source else "",
                 f"exchange+map {self.exchange_ms:.2f} ms, transfer {self.transfer_ms:.1f} ms ({self.gbps:.1f} GB/s)",
                 f"ready {self.ready_ms:.1f} ms" + (f" (+ verify {self.verify_ms:.1f} ms)" if self.verify_ms else ""),
                 f"total {self.total_ms:.1f} ms"]
        if self.verified is not None:
            parts.append("verified byte-exact" if self.verified else "NOT verified")
        if self.recovered:
            parts.append("recovered: " + "; ".join(self.recovered))
        return ", ".join(p for p in parts if p)


class CloneResult:
    """A finished clone: ``arena`` (the weights), ``tensors`` (name -> zero-copy view, when the seed
    published its image metadata), ``report`` (:class:`CloneReport`).

    While it is open, this process keeps serving as a source (later clones may read from it).
    :meth:`close` withdraws it and releases the arena, its flags and every mapping it made.
    """

    def __init__(self, arena, tensors: dict, report: CloneReport, *, metadata=None, _session=None):
        self.arena, self.tensors, self.report, self.metadata = arena, tensors, report, metadata
        self._session = _session

    def close(self) -> None:
        """Release everything (idempotent). Views must not be used afterwards."""
        self.tensors = {}
        if self._session is not None:
            self._session.close(keep_arena=False)
            self._session = None
        elif not self.arena.closed:
            self.arena.close()

    def __enter__(self) -> "CloneResult":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CloneResult({self.report.summary()})"


# ============================================================================================
# Helpers shared by seed and clone
# ============================================================================================


def _gkey(generation: str, *parts: Any) -> str:
    return "/".join(["g", generation, *map(str, parts)])


def _descriptor_from(d: Mapping[str, Any]):
    from .arena import ArenaDescriptor

    return ArenaDescriptor.from_dict(dict(d))


def _same_host(desc) -> bool:
    return desc.hostname in ("", socket.gethostname())


def _step_hook(step_delay_s: float | None) -> Callable[[Step], None] | None:
    if step_delay_s is None:
        env = os.environ.get(ENV_STEP_DELAY)
        step_delay_s = float(env) if env else None
    if not step_delay_s:
        return None
    return lambda _step: time.sleep(step_delay_s)


def _default_mover(dev: Device, mover: Any) -> Any:
    if mover is not None:
        return mover
    return "copy_engine" if dev.is_cuda else "host"


def _check_mover(dev: Device, mover: Any):
    """Create the mover now, so a mover that cannot run here fails before anything is published."""
    from flashboot.movers import create_mover

    m = create_mover(mover) if isinstance(mover, str) else mover
    need = "host" if not dev.is_cuda else "d2d"
    if need not in m.paths and not (dev.is_cuda and "p2p" in m.paths):
        raise FlashBootError(f"mover {m.name!r} cannot copy between {dev} arenas (it supports {sorted(m.paths)})")
    return m


class _Warmup:
    """:func:`flashboot.arena.warm_import` in a background thread, started before the descriptor is
    requested (overlapping connecting to the store), joined before it is: the one-time driver cost
    of a first peer mapping moves off the exchange, which stays timed from request to mapped."""

    def __init__(self, dev: Device):
        self.result: dict = {}
        self._thread = None
        if dev.is_cuda:
            self._thread = threading.Thread(target=self._run, args=(dev,), name="flashboot-warm-import", daemon=True)
            self._thread.start()

    def _run(self, dev: Device) -> None:
        from .arena import warm_import

        try:
            self.result = warm_import(dev)
        except Exception as exc:  # noqa: BLE001 - best effort: named in the report; the real open raises its own
            self.result = {"warm_ms": 0.0, "errors": [f"{type(exc).__name__}: {exc}"]}

    def join(self, report: "CloneReport", timeout_s: float) -> None:
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WaitTimeoutError(f"the driver warm-up on {report.device} did not finish within {timeout_s:g} s")
        self._thread = None
        report.warm_ms = float(self.result.get("warm_ms", 0.0))
        peers = self.result.get("peers", [])
        errors = self.result.get("errors", [])
        report.warm_note = (f"warmed import+map from {', '.join(f'cuda:{p}' for p in peers)}" if peers else "") + \
            (f"; warm-up failed: {'; '.join(errors)}" if errors else "")


class _HostImage:
    """An image's bytes mapped on the host: the preloader's staged copy in /dev/shm when there is
    one (same pages, no copy), else the image file. On CUDA, ``pin`` = (offset, nbytes) is
    page-locked so the copy engine can read it (only a ring member's shard, not the whole image)."""

    def __init__(self, source: Any, device: Device, *, rank: int = 0, pin: tuple[int, int] | None = None):
        import mmap

        self.metadata = None
        self._mm = None
        self._pinned = None
        path = Path(source)
        if path.is_dir():
            from flashboot.layouts import read_image

            image = read_image(path, rank)
            self.metadata = image.metadata
            file_path, self.nbytes = image.path, image.nbytes
            try:
                from .flashload.shm import staged_paths

                staged = staged_paths(path, rank)
                if staged.ready.exists() and staged.image.exists() and staged.image.stat().st_size >= self.nbytes:
                    file_path = staged.image
            except FlashBootError:
                pass
        elif path.is_file():
            file_path, self.nbytes = path, path.stat().st_size
        else:
            raise FlashBootError(f"host image {str(path)!r} is neither an image directory nor a file")
        if self.nbytes <= 0:
            raise FlashBootError(f"host image {str(file_path)!r} is empty")
        self.path = str(file_path)
        if os.access(file_path, os.W_OK):
            # shared: the page-cache (or /dev/shm) pages themselves, so pinning copies nothing; never written
            fd = os.open(file_path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        else:
            with open(file_path, "rb") as f:
                # private copy-on-write, so its address can be taken (pinning it copies the pages)
                self._mm = mmap.mmap(f.fileno(), self.nbytes, access=mmap.ACCESS_COPY)
        import ctypes

        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        if pin is not None and device.is_cuda and pin[1] > 0:
            from .pinning import register_host

            page = mmap.PAGESIZE
            lo = pin[0] // page * page
            hi = min(self.nbytes, -(-(pin[0] + pin[1]) // page) * page)
            try:
                self._pinned = register_host(self.ptr + lo, hi - lo, device, path=self.path, offset=lo)
            except BaseException:
                self.close()
                raise

    def span(self) -> Span:
        return Span(self.ptr, self.nbytes, CPU, pinned=self._pinned is not None, owner=self)

    @property
    def pin_ms(self) -> float:
        return self._pinned.pin_ms if self._pinned is not None else 0.0

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.unregister()
            self._pinned = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def _open_arena(desc, dev: Device, transport: str, detail: dict | None = None, prefix: str = ""):
    """Map an exported arena on ``dev`` by ``transport`` ("posix_fd" or "fabric"). ``detail``
    (optional) accumulates :meth:`Arena.open`'s timings, keys prefixed with ``prefix``."""
    from .arena import Arena

    timings: dict = {}
    t0 = time.perf_counter()
    if desc.backend == "host":
        arena = Arena.open(desc, timings=timings)
    else:
        arena = Arena.open(desc, dev, via="fabric" if transport == "fabric" else "pidfd", timings=timings)
    if detail is not None:
        timings["open_ms"] = (time.perf_counter() - t0) * 1e3
        for k, v in timings.items():
            detail[prefix + k] = detail.get(prefix + k, 0.0) + v
    return arena


def _choose_transport(desc, dev: Device, requested: str) -> tuple[str, str]:
    """``(transport, note)`` for reading the arena ``desc`` describes from ``dev``."""
    if requested not in TRANSPORTS:
        raise FlashBootError(f"transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested != "auto":
        if requested == "posix_fd" and not _same_host(desc):
            raise RendezvousError(f"transport posix_fd needs the seed on this host; it runs on {desc.hostname!r}")
        if requested == "fabric" and desc.fabric_handles is None:
            raise RendezvousError(f"transport fabric asked for, but the seed's arena has no fabric handles "
                                  f"({desc.handle_type})")
        return requested, "asked for"
    if (desc.backend == "host") != (not dev.is_cuda):
        raise RendezvousError(f"the seed's arena is a {desc.backend} arena; a clone on {dev} cannot map it "
                              f"(use device {'cpu' if desc.backend == 'host' else 'cuda:N'})")
    if _same_host(desc):
        return "posix_fd", ""
    if desc.fabric_handles is not None and dev.is_cuda:
        from .arena import fabric_preflight

        pre = fabric_preflight(dev.index)
        if pre.supported:
            return "fabric", f"seed on {desc.hostname!r}, mapped by fabric handle"
        return "nccl", f"seed on {desc.hostname!r}; no fabric here ({pre.reason}): NCCL broadcast"
    return "nccl", (f"seed on {desc.hostname!r} with no fabric handle ({desc.handle_type}): "
                    f"{'NCCL' if dev.is_cuda else 'gloo'} broadcast")


def _pg_backend(dev: Device) -> str:
    return "nccl" if dev.is_cuda else "gloo"


def _process_group(rdv: Rendezvous, prefix: str, rank: int, dev: Device, timeout_s: float):
    """A 2-rank process group (NCCL on CUDA, gloo on the host backend) over the rendezvous store."""
    import datetime

    import torch.distributed as dist

    store = dist.PrefixStore(rdv.full_key(prefix), rdv.store)
    if dev.is_cuda:
        import torch

        torch.cuda.set_device(dev.index)
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))


def _broadcast(pg, tensor, dev: Device, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = pg.broadcast([tensor], opts)
    if not work.wait(datetime.timedelta(seconds=timeout_s)):
        raise WaitTimeoutError(f"broadcast of {tensor.numel():,} bytes did not finish within {timeout_s:g} s")
    if dev.is_cuda:
        import torch

        torch.cuda.synchronize(dev.index)


def _shutdown_pg(pg) -> None:
    for name in ("shutdown", "abort"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort: the group is finished either way
                pass
            return


def _views(arena, metadata) -> dict:
    if metadata is None:
        return {}
    return {name: arena.view(t.offset, t.shape, t.dtype, t.stride) for name, t in metadata.tensors.items()}


def _parse_metadata(d: Mapping[str, Any] | None, where: str):
    if d is None:
        return None
    from flashboot.layouts import ImageMetadata

    return ImageMetadata.from_dict(d, where)


# ============================================================================================
# Seed
# ============================================================================================


class Seed:
    """A published arena. Built by :func:`seed`; passive: clones map its memory themselves.

    ``arena``, ``manifest``, ``generation`` (a fresh id per publication), ``rendezvous``.
    :meth:`serve_forever` blocks until stopped (SIGTERM/SIGINT or ``stop``); it also answers the
    NCCL-broadcast fallback for clones that cannot map the arena. :meth:`close` withdraws the
    records and releases what the seed owns.
    """

    def __init__(self, rdv: Rendezvous, arena, manifest: Manifest, generation: str, *, metadata=None,
                 owned: list | None = None, serve_nccl: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rendezvous, self.arena, self.manifest, self.generation = rdv, arena, manifest, generation
        self.metadata = metadata
        self.timeout_s = timeout_s
        self._owned = owned or []
        self._stop = threading.Event()
        self._closed = False
        self._nccl_error: BaseException | None = None
        self.nccl_served = 0
        self._thread = None
        if serve_nccl:
            self._thread = threading.Thread(target=self._nccl_service, name="flashboot-seed-nccl", daemon=True)
            self._thread.start()

    @property
    def address(self) -> str:
        return self.rendezvous.address

    def _nccl_service(self) -> None:
        """Answer broadcast requests (the fallback transport), one at a time."""
        rdv = self.rendezvous
        dev = self.arena.device
        count_key = _gkey(self.generation, "nccl", "count")
        while not self._stop.wait(0.05):
            try:
                n = rdv.add(count_key, 0)
                while self.nccl_served < n and not self._stop.is_set():
                    self.nccl_served += 1
                    rid = self.nccl_served
                    try:
                        rdv.read(_gkey(self.generation, "nccl", "req", rid), what=f"broadcast request {rid}",
                                 timeout_s=self.timeout_s)  # authenticated: no token, no weights
                        pg = _process_group(rdv, _gkey(self.generation, "nccl", "pg", rid), 0, dev, self.timeout_s)
                        try:
                            _broadcast(pg, self.arena.bytes()[: self.manifest.nbytes], dev, self.timeout_s)
                        finally:
                            _shutdown_pg(pg)
                    except FlashBootError as exc:
                        self._nccl_error = exc  # one bad request must not stop the seed
            except RendezvousError as exc:
                self._nccl_error = exc
                return
            except Exception as exc:  # noqa: BLE001 - torch.distributed errors; reported by serve_forever
                self._nccl_error = exc

    def serve_forever(self, stop: threading.Event | None = None, *, handle_signals: bool = True) -> None:
        """Block until ``stop`` is set or SIGTERM/SIGINT arrives (main thread), then :meth:`close`."""
        from .service_loop import serve_until_stopped

        try:
            serve_until_stopped(self._stop, stop, handle_signals=handle_signals)
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Withdraw the seed's records, stop the NCCL service, release what it owns (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
        try:
            self.rendezvous.delete(SEED_KEY)
        except FlashBootError:
            pass  # the store may be gone already (we might have been hosting it)
        for obj in reversed(self._owned):
            try:
                obj.close()
            except FlashBootError:
                pass
        self.rendezvous.close()

    def __enter__(self) -> "Seed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Seed({self.manifest.describe()}, on {self.arena.device}, store {self.address}, gen {self.generation})"


def _load_seed_source(source: Any, dev: Device, rank: int, timeout_s: float):
    """``(arena, metadata, owned)`` for a seed: an Arena, a LoadedImage/CloneResult, or an image
    directory (FlashLoad when the preloader has staged it, else a direct read of the image file)."""
    from .arena import Arena

    if isinstance(source, Arena):
        return source, None, []
    if hasattr(source, "arena") and hasattr(source, "metadata"):  # LoadedImage, CloneResult
        return source.arena, source.metadata, []
    path = Path(source)
    if not path.exists():
        raise FlashBootError(f"seed source {str(path)!r} does not exist (pass an image directory or an Arena)")
    try:
        from .flashload.shm import staged_paths

        staged = staged_paths(path, rank).ready.exists()
    except FlashBootError:
        staged = False
    if staged:
        from .flashload.load import load

        loaded = load(path, rank, dev, timeout_s=timeout_s)
        return loaded.arena, loaded.metadata, [loaded]
    img = _HostImage(path, dev, rank=rank)
    try:
        arena = Arena.create(img.nbytes, dev)
        try:
            if dev.is_cuda:
                import torch

                with torch.cuda.device(dev.index):
                    arena.bytes()[: img.nbytes].copy_(torch.frombuffer(img._mm, dtype=torch.uint8), non_blocking=False)
                    torch.cuda.synchronize(dev.index)
            else:
                import ctypes

                # a one-off load off the critical path: a plain memmove, no thread pool to spin up
                ctypes.memmove(arena.ptr, img.ptr, img.nbytes)
        except BaseException:
            arena.close()
            raise
        return arena, img.metadata, [arena]
    finally:
        img.close()


def seed(store: str, source: Any, device: Any = None, *, token=None, token_file=None, name: str = "default",
         rank: int = 0, nbytes: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, serve_nccl: bool = True,
         checksum_chunk_bytes: int | None = None, manifest: Manifest | None = None) -> Seed:
    """Publish an arena for cloning at the rendezvous store ``store`` (``HOST:PORT``).

    ``source``: an image directory (rank ``rank``; loaded with :func:`flashboot.load` when the
    preloader staged it, else read from the image file), an :class:`~flashboot.Arena` (``nbytes``:
    how much of it to replicate, default all; ``manifest``: its checksums when already known,
    else they are computed on the device), or a LoadedImage/CloneResult. The seed hosts the
    store at ``store`` unless one already listens there. The token (``token``, ``token_file`` or
    ``$FLASHBOOT_TOKEN``) signs every record. Returns a :class:`Seed`; call ``serve_forever()``
    or keep it open while clones run, then ``close()``.
    """
    dev = Device.parse(device) if device is not None else None
    from .rendezvous import resolve_token

    tok = resolve_token(token, token_file)  # before loading anything
    if dev is None:
        from .arena import Arena

        if isinstance(source, Arena):
            dev = source.device
        elif hasattr(source, "arena"):
            dev = source.arena.device
        else:
            dev = Device.parse(None)
    arena, metadata, owned = _load_seed_source(source, dev, rank, timeout_s)
    try:
        if manifest is not None:
            if manifest.arena_nbytes != arena.nbytes:
                raise RendezvousError(f"the given manifest is for a {manifest.arena_nbytes:,}-byte arena; this one "
                                      f"holds {arena.nbytes:,}")
        elif metadata is not None:
            manifest = Manifest.from_metadata(metadata, arena.nbytes)
        else:
            manifest = Manifest.of_arena(arena, nbytes, checksum_chunk_bytes or 64 << 20)
        descriptor = arena.export()
        rdv = Rendezvous.connect(store, tok, namespace=name, host=True, timeout_s=timeout_s)
    except BaseException:
        for obj in reversed(owned):
            obj.close()
        raise
    generation = secrets.token_hex(6)
    try:
        rdv.publish(METADATA_KEY, {"generation": generation,
                                   "metadata": metadata.to_dict() if metadata is not None else None})
        rdv.publish(SEED_KEY, {"generation": generation, "pid": os.getpid(), "host": socket.gethostname(),
                               "device": str(arena.device), "manifest": manifest.to_dict(), "nccl": serve_nccl,
                               "published_at": time.time()},
                    sealed={"arena": descriptor.to_dict()})
    except BaseException:
        rdv.close()
        for obj in reversed(owned):
            obj.close()
        raise
    return Seed(rdv, arena, manifest, generation, metadata=metadata, owned=owned, serve_nccl=serve_nccl,
                timeout_s=timeout_s)


# ============================================================================================
# Clone
# ============================================================================================


class _Session:
    """Everything one clone acquired, released in reverse order on failure or close."""

    def __init__(self, rdv: Rendezvous):
        self.rdv = rdv
        self.arena = None
        self.flags = None
        self.opened: dict[int, list] = {}
        self.extra: list = []
        self.status_key: str | None = None
        self.dependents: list[str] = []
        """Status keys of participants that read from us: :func:`linger` waits for them."""
        self.dependents_of: Callable[[], list[str]] | None = None

    def close_opened(self, participant: int | None = None) -> None:
        keys = list(self.opened) if participant is None else [participant]
        for k in keys:
            for a in reversed(self.opened.pop(k, [])):
                if not a.closed:
                    a.close()

    def close(self, keep_arena: bool) -> None:
        first: BaseException | None = None
        try:
            self.close_opened()
        except BaseException as exc:  # still release the rest
            first = exc
        for obj in reversed(self.extra):
            try:
                obj.close()
            except BaseException as exc:
                first = first or exc
        self.extra = []
        for attr in ("flags",) + (() if keep_arena else ("arena",)):
            obj = getattr(self, attr)
            if obj is not None and not obj.closed:
                try:
                    obj.close()
                except BaseException as exc:
                    first = first or exc
            setattr(self, attr, None)
        if self.rdv is not None:
            if self.status_key is not None and not keep_arena:
                try:  # no longer a source for anyone
                    self.rdv.publish(self.status_key + "/left", {"pid": os.getpid()})
                except FlashBootError:
                    pass
            self.rdv.close()
            self.rdv = None
        if first is not None:
            raise first


def clone(store: str, device: Any = None, schedule: str = "chain", *, verify: bool = False,
          timeout_s: float = DEFAULT_TIMEOUT_S, mover: Any = None, chunk_bytes: int | None = None,
          token=None, token_file=None, name: str = "default", clones: int | None = None, expect: Any = None,
          image: Any = None, rank: int = 0, transport: str = "auto", retry: bool = True,
          step_delay_s: float | None = None, pin_early: bool = False) -> CloneResult:
    """Clone the seed published at ``store`` (``HOST:PORT``) into a new arena on ``device``.

    ``schedule``: ``"chain"`` (default), ``"star"`` or ``"ring"`` (see :func:`ring_load`; needs
    ``image`` and ``clones``). Processes calling ``clone`` on the same store join one chain/star
    in arrival order. ``clones``: how many will join; when given, all start together (a start
    barrier). ``verify``: recompute the per-chunk checksums and compare with the seed's manifest
    (ChecksumMismatchError otherwise). ``mover``: a registry mover name (default ``copy_engine``
    on CUDA, ``host`` on the host backend). ``chunk_bytes``: the pipeline chunk (default the
    schedulers' default). ``expect``: what the caller expects (a Manifest, ImageMetadata, ImageKey
    or dict of key fields / ``nbytes``): a mismatch is refused before any byte moves.
    ``image``: a host image (directory or file) to fall back to when no source is left.
    ``transport``: ``"auto"`` or one of ``posix_fd``, ``fabric``, ``nccl``. ``retry``: re-attach
    to another source when one fails mid-transfer. ``timeout_s`` bounds every wait. ``pin_early``
    (ring): pin the shard before the start barrier (see :func:`ring_load`).

    Raises RendezvousError (no store, wrong token, mismatched manifest), WaitTimeoutError naming
    what was awaited, CloneError when a source failed and no other could take over.
    """
    if schedule not in SCHEDULES:
        raise FlashBootError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "ring":
        if image is None or clones is None:
            raise FlashBootError("schedule 'ring' loads a shard of a host image on each member: pass image= and clones=")
        return ring_load(store, image, device, members=clones, rank=rank, verify=verify, timeout_s=timeout_s,
                         mover=mover, chunk_bytes=chunk_bytes, token=token, token_file=token_file, name=name,
                         expect=expect, step_delay_s=step_delay_s, pin_early=pin_early)
    if clones is not None and (not isinstance(clones, int) or clones < 1):
        raise FlashBootError(f"clones must be a positive int, got {clones!r}")
    t_start = time.perf_counter()
    dev = Device.parse(device)
    mover_obj = _check_mover(dev, _default_mover(dev, mover))
    warm = _Warmup(dev)  # overlaps connecting; joined before the descriptor is requested
    rdv = Rendezvous.connect(store, token, token_file=token_file, namespace=name, host=False, timeout_s=timeout_s)
    session = _Session(rdv)
    try:
        return _clone(session, dev, schedule, mover_obj, t_start, verify=verify, timeout_s=timeout_s,
                      chunk_bytes=chunk_bytes, clones=clones, expect=expect, image=image, rank=rank,
                      transport=transport, retry=retry, hook=_step_hook(step_delay_s), warm=warm)
    except BaseException as exc:
        try:
            if session.status_key is not None and session.rdv is not None:
                session.rdv.publish(session.status_key, {"state": "failed", "error": str(exc)[:2000],
                                                         "pid": os.getpid()})
        except FlashBootError:
            pass
        session.close(keep_arena=False)
        raise


class _Sources:
    """Opens and remembers the endpoints a clone reads from: the seed, earlier clones, a retry
    source, the host image."""

    def __init__(self, session: _Session, dev: Device, generation: str, schedule: str, manifest: Manifest,
                 seed_desc, seed_pid: int, transport: str, timeout_s: float, rank: int = 0):
        self.session, self.dev, self.gen, self.schedule = session, dev, generation, schedule
        self.rank = rank
        self.manifest, self.seed_desc, self.seed_pid = manifest, seed_desc, seed_pid
        self.transport, self.timeout_s = transport, timeout_s
        self.endpoints: dict[int, Endpoint] = {}
        self.pids: dict[int, int | None] = {}
        """Source process ids, kept after a source is dropped (to tell a dead one from a slow one)."""
        self.host_image: _HostImage | None = None
        self.detail: dict[str, float] = {}
        """Where opening sources took its time (ms, summed over sources): see CloneReport.exchange_detail."""

    @property
    def rdv(self) -> Rendezvous:
        return self.session.rdv

    def _pid_if_local(self, desc, pid: int) -> int | None:
        return pid if _same_host(desc) else None

    def open(self, participant: int) -> Endpoint:
        """Map ``participant``'s arena (and flags) on our device; ArenaError/RendezvousError if gone."""
        if participant in self.endpoints:
            return self.endpoints[participant]
        if participant == _SEED_INDEX:
            arena = _open_arena(self.seed_desc, self.dev, self.transport, self.detail)
            self.session.opened[participant] = [arena]
            ep = Endpoint(participant, "seed", arena, None, self._pid_if_local(self.seed_desc, self.seed_pid))
        else:
            key = _gkey(self.gen, self.schedule, "member", participant)
            tr = time.perf_counter()
            rec = self.rdv.read(key, what=f"the descriptors of clone #{participant}", timeout_s=self.timeout_s)
            self.detail["member_record_ms"] = self.detail.get("member_record_ms", 0.0) + (time.perf_counter() - tr) * 1e3
            if rec.body.get("manifest_digest") != self.manifest.digest:
                raise RendezvousError(f"clone #{participant} holds another image (manifest {rec.body.get('manifest_digest')}, "
                                      f"the seed's is {self.manifest.digest}); refusing to read from it")
            arena_desc = _descriptor_from(rec.sealed["arena"])
            flags_desc = _descriptor_from(rec.sealed["flags"])
            opened = []
            self.session.opened[participant] = opened
            arena = _open_arena(arena_desc, self.dev, self.transport, self.detail)
            opened.append(arena)
            flags = _open_arena(flags_desc, self.dev, self.transport, self.detail, prefix="flags_")
            opened.append(flags)
            ep = Endpoint(participant, f"clone #{participant}", arena, flags,
                          self._pid_if_local(arena_desc, int(rec.body["pid"])))
        self.endpoints[participant] = ep
        self.pids[participant] = ep.pid
        return ep

    def drop(self, participant: int) -> None:
        self.endpoints.pop(participant, None)
        self.session.close_opened(participant)

    def full_copy(self, dead: set[int]) -> tuple[int, str] | None:
        """Another live process that holds every byte (a finished clone), opened as a retry source."""
        n = self.rdv.add(_gkey(self.gen, "done", "count"), 0)
        for k in range(n, 0, -1):
            rec = self.rdv.try_read(_gkey(self.gen, "done", k))
            if rec is None or rec.body.get("manifest_digest") != self.manifest.digest:
                continue
            if int(rec.body["pid"]) == os.getpid() or (rec.body["schedule"], rec.body["position"]) in dead:
                continue
            if self.rdv.has(_gkey(self.gen, rec.body["schedule"], "status", rec.body["position"], "left")):
                continue
            desc = _descriptor_from(rec.sealed["arena"])
            index = _FALLBACK_INDEX + k
            try:
                arena = _open_arena(desc, self.dev, self.transport)
            except FlashBootError:
                dead.add((rec.body["schedule"], rec.body["position"]))
                continue
            self.session.opened[index] = [arena]
            who = f"{rec.body['schedule']} clone #{rec.body['position']} (pid {rec.body['pid']})"
            self.endpoints[index] = Endpoint(index, who, arena, None, self._pid_if_local(desc, int(rec.body["pid"])))
            return index, who
        return None

    def image(self, source: Any) -> tuple[int, str]:
        if self.host_image is None:
            img = _HostImage(source, self.dev, rank=self.rank, pin=(0, self.manifest.nbytes))
            self.session.extra.append(img)
            if img.metadata is not None:
                self.manifest.require(img.metadata, f"host image {img.path}")
            elif img.nbytes < self.manifest.nbytes:
                raise RendezvousError(f"host image {img.path} holds {img.nbytes:,} bytes; the seed's image is "
                                      f"{self.manifest.nbytes:,}")
            self.host_image = img
        return HOST, f"the host image {self.host_image.path}"


def _clone(session: _Session, dev: Device, schedule: str, mover, t_start: float, *, verify: bool, timeout_s: float,
           chunk_bytes: int | None, clones: int | None, expect: Any, image: Any, rank: int, transport: str,
           retry: bool, hook, warm: _Warmup | None = None) -> CloneResult:
    from .arena import Arena

    rdv = session.rdv
    report = CloneReport(schedule, 0, str(dev), 0, mover=mover.name)
    if warm is not None:
        warm.join(report, timeout_s)
    # exchange: from here (descriptor requested) to every source mapped; nothing else in between
    t0 = time.perf_counter()
    seed_rec = rdv.read(SEED_KEY, what="the seed's manifest and descriptor")  # authenticates: wrong token stops here
    manifest = Manifest.from_dict(seed_rec.body["manifest"])
    manifest.require(expect, f"the seed at {rdv.address}")
    gen = str(seed_rec.body["generation"])
    seed_desc = _descriptor_from(seed_rec.sealed["arena"])
    t1 = time.perf_counter()
    report.nbytes = manifest.nbytes
    report.connect_ms, report.manifest_ms = (t0 - t_start) * 1e3, (t1 - t0) * 1e3
    chosen, note = _choose_transport(seed_desc, dev, transport)
    report.transport, report.transport_note = chosen, note

    position = rdv.add(_gkey(gen, schedule, "join"), 1)
    t2 = time.perf_counter()
    report.position = position
    status_key = _gkey(gen, schedule, "status", position)
    session.status_key = status_key

    def read_metadata():
        if not rdv.has(METADATA_KEY):
            return None
        meta_rec = rdv.read(METADATA_KEY, what="the seed's image metadata", timeout_s=timeout_s)
        if meta_rec.body.get("generation") != gen:
            return None
        return _parse_metadata(meta_rec.body.get("metadata"), f"metadata published at {rdv.address}")

    if chosen == "nccl":
        return _clone_nccl(session, dev, manifest, read_metadata(), gen, report, t_start, verify=verify,
                           timeout_s=timeout_s)

    n = max(position, clones or 1)
    plan = build_plan(schedule, n, manifest.nbytes, chunk_bytes)
    report.chunk_bytes = plan.chunk_bytes
    sources = _Sources(session, dev, gen, schedule, manifest, seed_desc, int(seed_rec.body["pid"]), chosen, timeout_s,
                       rank)
    my_steps = list(plan.steps_into(position))
    upstream = {s.src for s in my_steps}
    dead: set[int] = set()
    tx = time.perf_counter()
    for p in sorted(upstream):
        try:
            sources.open(p)
        except (ArenaError, RendezvousError) as exc:
            if not retry:
                raise CloneError(f"clone #{position}: cannot map its source {'seed' if p == 0 else f'clone #{p}'}: "
                                 f"{exc}") from exc
            dead.add(p)
            report.recovered.append(f"source #{p} could not be mapped ({exc}); re-attaching")
    t3 = time.perf_counter()
    report.exchange_ms = (t3 - t0) * 1e3
    report.exchange_detail = {"seed_record_ms": report.manifest_ms, "join_ms": (t2 - t1) * 1e3,
                              **{k: round(v, 4) for k, v in sources.detail.items()},
                              "open_sources_ms": (t3 - tx) * 1e3}
    metadata = read_metadata()
    ta = time.perf_counter()
    session.arena = Arena.create(manifest.arena_nbytes, dev)
    if session.arena.nbytes != manifest.arena_nbytes:
        raise RendezvousError(f"our arena on {dev} rounds to {session.arena.nbytes:,} bytes, the seed's to "
                              f"{manifest.arena_nbytes:,} (different allocation granularity)")
    session.flags = create_flags(plan.flag_count(position), dev)
    me = Endpoint(position, f"clone #{position}", session.arena, session.flags)
    rdv.publish(_gkey(gen, schedule, "member", position),
                {"position": position, "pid": os.getpid(), "host": socket.gethostname(), "device": str(dev),
                 "manifest_digest": manifest.digest},
                sealed={"arena": session.arena.export().to_dict(), "flags": session.flags.export().to_dict()})
    report.alloc_ms = (time.perf_counter() - ta) * 1e3
    if clones is not None:
        report.barrier_ms = rdv.barrier(_gkey(gen, schedule, "start"), clones, timeout_s=timeout_s)

    steps = my_steps
    fallback: int | None = None
    for p in sorted(dead):
        steps, fallback = _reroute(plan, steps, p, dead, sources, image, report, fallback)
    done_ids: set[int] = set()
    tainted: set[int] = set()
    ran: dict[int, Step] = {}  # the version of each step that put its bytes in place
    ttx = time.perf_counter()
    lanes = []
    for attempt in range(len(plan.participants) + 4):
        endpoints = dict(sources.endpoints)
        endpoints[position] = me
        host_span = sources.host_image.span() if sources.host_image is not None else None
        try:
            ex = Executor(plan, endpoints, position, mover=mover, host_image=host_span, timeout_s=timeout_s,
                          steps=steps, skip=done_ids, step_hook=hook)
            rep = ex.run()
            lanes += [l.__dict__ | {"gbps": l.gbps} for l in rep.lanes]
            ran.update({s.id: s for s in steps if s.id not in done_ids})
            done_ids |= {s.id for s in steps}
            break
        except StepFailure as failure:
            ran.update({s.id: s for s in steps if s.id in failure.valid_steps and s.id not in done_ids})
            done_ids |= failure.valid_steps
            tainted |= failure.tainted_steps
            if not retry or failure.peer is None:
                raise CloneError(f"clone #{position} on {dev}: {failure}") from failure
            lost = failure.peer
            dead.add(lost)
            what = "seed" if lost == _SEED_INDEX else sources.endpoints[lost].name if lost in sources.endpoints \
                else f"source #{lost}"
            if sources.pids.get(lost):
                what += f" (pid {sources.pids[lost]})"
            report.recovered.append(f"{what} {'exited' if failure.peer_exited else 'stalled'} at step "
                                    f"{failure.step.id if failure.step else '?'}")
            sources.drop(lost)
            steps, fallback = _reroute(plan, [s for s in steps if s.id not in done_ids], lost, dead, sources, image,
                                       report, fallback)
    else:
        raise CloneError(f"clone #{position}: gave up after {len(plan.participants) + 4} attempts ({report.recovered})")
    report.transfer_ms = (time.perf_counter() - ttx) * 1e3
    report.lanes = lanes
    _note_lazy_mapping(report, sources.endpoints.values())

    # Upstream clones that released blocked streams (CUDA) may have let us copy bytes they later redid.
    redone = _repair_from_upstream(plan, position, list(ran.values()), sources, session, mover, timeout_s, report,
                                   dead)
    redone |= tainted
    report.redone_bytes = sum(plan.steps[i].nbytes for i in redone)
    report.ready_ms = (time.perf_counter() - t_start) * 1e3
    report.ready_unix = time.time()
    if verify:
        tv = time.perf_counter()
        _verify(session.arena, manifest, f"clone #{position} on {dev}")
        report.verify_ms = (time.perf_counter() - tv) * 1e3
        report.verified = True
    used = sorted({s.src for s in ran.values()})
    report.source = ", ".join("the host image" if p == HOST else sources.endpoints[p].name if p in sources.endpoints
                              else ("seed" if p == _SEED_INDEX else f"clone #{p}") for p in used)
    _publish_done(rdv, gen, schedule, position, manifest, session, redone, plan)
    if schedule == "chain":
        def successors() -> list[str]:
            joined = max(session.rdv.add(_gkey(gen, schedule, "join"), 0), clones or 0)
            return [_gkey(gen, schedule, "status", position + 1)] if joined > position else []
        session.dependents_of = successors
    # mappings of our sources are no longer needed; our own arena and flags stay exported
    session.close_opened()
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    report.finished_unix = time.time()
    return CloneResult(session.arena, _views(session.arena, metadata), report, metadata=metadata, _session=session)


def _reroute(plan: Plan, steps: list[Step], lost: int, dead: set, sources: _Sources, image: Any,
             report: CloneReport, fallback: int | None) -> tuple[list[Step], int | None]:
    """Re-attach ``steps`` that read from ``lost``: upstream first, then a full copy elsewhere,
    then the host image. Opens whatever new source that needs."""
    for _ in range(len(plan.participants) + 2):
        try:
            new = rewire(plan, steps, lost, fallback=fallback, dead={d for d in dead if isinstance(d, int)})
        except FlashBootError:
            if fallback is None:
                found = sources.full_copy(set())
                if found is not None:
                    fallback, who = found
                    report.recovered.append(f"re-attached to {who}")
                    continue
                if image is not None:
                    fallback, who = sources.image(image)
                    report.recovered.append(f"loading the rest from {who}")
                    continue
            raise CloneError(f"clone #{report.position}: its source {'seed' if lost == 0 else f'#{lost}'} is gone "
                             f"and no other holds the bytes (no finished clone alive, no image=); "
                             f"history: {'; '.join(report.recovered)}") from None
        # open any new upstream participant the rewired steps read from or wait on
        need = {s.src for s in new if s.src != HOST} | {plan.flag_of(w)[0] for s in new for w in s.waits}
        need.discard(report.position)
        failed = None
        for p in sorted(need):
            if p in sources.endpoints:
                continue
            try:
                sources.open(p)
            except (ArenaError, RendezvousError) as exc:
                failed = (p, exc)
                break
        if failed is None:
            srcs = sorted({s.src for s in new})
            names = [sources.endpoints[p].name if p in sources.endpoints else "the host image" for p in srcs]
            report.recovered.append(f"re-attached to {', '.join(names)}")
            return new, fallback
        p, exc = failed
        dead.add(p)
        report.recovered.append(f"{'seed' if p == 0 else f'source #{p}'} could not be mapped ({exc})")
        steps, lost = new, p
        if p == fallback:
            fallback = None
    raise CloneError(f"clone #{report.position}: no source left ({'; '.join(report.recovered)})")


def _repair_from_upstream(plan: Plan, position: int, run_steps: list[Step], sources: _Sources,
                          session: _Session, mover, timeout_s: float, report: CloneReport, dead: set[int]) -> set[int]:
    """Re-copy ranges an upstream clone reports as redone (after it released blocked CUDA streams).

    Waits (bounded, and only while it lives) for the final status of each clone we read from; a
    clone that was killed never released a stream, so the flags it raised were honest. Returns our
    step ids redone."""
    rdv = session.rdv
    gen, schedule = sources.gen, sources.schedule
    redone: set[int] = set()
    read_from: dict[int, list[Step]] = {}
    for s in run_steps:
        if s.kind == "copy" and 0 < s.src < _FALLBACK_INDEX and s.src not in dead:
            read_from.setdefault(s.src, []).append(s)
    for p, steps in read_from.items():
        key = _gkey(gen, schedule, "status", p)
        pid = sources.pids.get(p)
        deadline = time.monotonic() + timeout_s
        rec = None
        while rec is None:
            try:
                rec = rdv.read(key, what=f"the final status of clone #{p}", timeout_s=0.25)
            except WaitTimeoutError:
                if pid is not None and not _alive(pid):
                    break
                if time.monotonic() > deadline:
                    raise WaitTimeoutError(f"clone #{position}: waited {timeout_s:g} s for the final status of its "
                                           f"source clone #{p} (pid {pid})") from None
        if rec is None:
            continue
        if rec.body.get("state") != "done":
            raise CloneError(f"clone #{position}: its source clone #{p} failed after we copied from it "
                             f"({rec.body.get('error', '?')}); its bytes cannot be trusted")
        ranges = [tuple(r) for r in rec.body.get("redone", [])]
        bad = [s for s in steps if any(lo < s.end and s.offset < lo + n for lo, n in ranges)]
        if bad:
            fixes = [replace(s, waits=()) for s in bad]
            Executor(plan, {**sources.endpoints, position: Endpoint(position, "self", session.arena, session.flags)},
                     position, mover=mover, timeout_s=timeout_s, steps=fixes).run()
            redone |= {s.id for s in bad}
            report.recovered.append(f"re-copied {len(bad)} chunk(s) clone #{p} redid")
    return redone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _publish_done(rdv: Rendezvous, gen: str, schedule: str, position: int, manifest: Manifest, session: _Session,
                  redone: set[int], plan: Plan) -> None:
    ranges = [[plan.steps[i].offset, plan.steps[i].nbytes] for i in sorted(redone)]
    rdv.publish(_gkey(gen, schedule, "status", position), {"state": "done", "redone": ranges, "pid": os.getpid()})
    k = rdv.add(_gkey(gen, "done", "count"), 1)
    rdv.publish(_gkey(gen, "done", k), {"schedule": schedule, "position": position, "pid": os.getpid(),
                                        "host": socket.gethostname(), "manifest_digest": manifest.digest},
                sealed={"arena": session.arena.export().to_dict()})


def _note_lazy_mapping(report: CloneReport, sources) -> None:
    """Add the sources' segments mapped on first use during the transfer to ``report``."""
    for ep in sources:
        for arena in (ep.arena, ep.flags):
            if arena is not None and not arena.closed:
                stats = arena.map_stats
                report.map_during_copy_ms += stats["map_ms"]
                report.segments_mapped_during_copy += int(stats["segments"])


def _verify(arena, manifest: Manifest, where: str) -> None:
    """Per-chunk checksums of ``arena`` against the manifest; ChecksumMismatchError on the first bad one."""
    from flashboot.kernels.checksum import chunk_checksums

    found = chunk_checksums(arena.span(0, manifest.nbytes), manifest.checksum_chunk_bytes)
    for k, (want, got) in enumerate(zip(manifest.checksums, found)):
        if int(want) != int(got):
            start, n = manifest.chunk_range(k)
            raise ChecksumMismatchError(where, k, start, n, int(want), int(got))


def _clone_nccl(session: _Session, dev: Device, manifest: Manifest, metadata, gen: str, report: CloneReport,
                t_start: float, *, verify: bool, timeout_s: float) -> CloneResult:
    """The fallback: ask the seed for a broadcast over a fresh 2-rank process group."""
    from .arena import Arena

    rdv = session.rdv
    ta = time.perf_counter()
    session.arena = Arena.create(manifest.arena_nbytes, dev)
    report.alloc_ms = (time.perf_counter() - ta) * 1e3
    tx = time.perf_counter()
    rid = rdv.add(_gkey(gen, "nccl", "count"), 1)  # the seed reads (and authenticates) the request next
    rdv.publish(_gkey(gen, "nccl", "req", rid), {"pid": os.getpid(), "device": str(dev), "position": report.position})
    pg = _process_group(rdv, _gkey(gen, "nccl", "pg", rid), 1, dev, timeout_s)
    report.exchange_ms = (time.perf_counter() - tx) * 1e3
    tt = time.perf_counter()
    try:
        _broadcast(pg, session.arena.bytes()[: manifest.nbytes], dev, timeout_s)
    finally:
        _shutdown_pg(pg)
    report.transfer_ms = (time.perf_counter() - tt) * 1e3
    report.ready_ms = (time.perf_counter() - t_start) * 1e3
    report.ready_unix = time.time()
    report.source = "seed (broadcast)"
    report.mover = _pg_backend(dev)
    if verify:
        tv = time.perf_counter()
        _verify(session.arena, manifest, f"clone #{report.position} on {dev} (broadcast)")
        report.verify_ms = (time.perf_counter() - tv) * 1e3
        report.verified = True
    rdv.publish(session.status_key, {"state": "done", "redone": [], "pid": os.getpid(), "transport": "nccl"})
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    report.finished_unix = time.time()
    return CloneResult(session.arena, _views(session.arena, metadata), report, metadata=metadata, _session=session)


def linger(result: CloneResult, *, timeout_s: float = DEFAULT_TIMEOUT_S, forever: bool = False) -> None:
    """Keep a finished clone available to those who read from it.

    ``forever``: until SIGTERM/SIGINT (the clone serves as a source, e.g. for retries). Otherwise
    until the participants that read from it (a chain successor, a ring successor) have reported
    a final status, at most ``timeout_s``; returns quietly when nobody depends on it.
    """
    session = result._session
    if session is None or session.rdv is None:
        return
    if forever:
        stop = threading.Event()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: stop.set())
        try:
            while not stop.wait(0.2):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return
    keys = list(session.dependents) + (session.dependents_of() if session.dependents_of else [])
    if keys:
        try:
            session.rdv.wait_keys(keys, what="the participants reading from this clone to finish", timeout_s=timeout_s)
        except WaitTimeoutError:
            pass  # they hold their own mapping by now or will re-attach upstream; we only waited to be polite


# ============================================================================================
# Ring all-gather load
# ============================================================================================


def ring_load(store: str, image: Any, device: Any = None, *, members: int, rank: int = 0, verify: bool = False,
              timeout_s: float = DEFAULT_TIMEOUT_S, mover: Any = None, chunk_bytes: int | None = None, token=None,
              token_file=None, name: str = "default", run: str = "ring", expect: Any = None,
              step_delay_s: float | None = None, pin_early: bool = False) -> CloneResult:
    """Load ``image`` on ``members`` processes at once: each loads a 1/N byte shard from the host
    and gathers the rest from its predecessor in a ring (paper §3.6).

    Member positions come by arrival order at the store (the first to arrive hosts it unless one
    listens there already). All members must hold the same image (manifests compared before any
    byte moves). ``run`` names this gathering (use a fresh one per load on a shared store).
    ``pin_early``: map and pin the shard before the start barrier (off the critical path, as
    FlashLoad's pin-early and served modes do) instead of after it; ``load_ms``/``pin_ms`` say
    what it cost either way. Pinning needs the image in anonymous or tmpfs-backed memory (stage
    it into /dev/shm); a file on disk is refused with a CapabilityError that says so.
    """
    from .arena import Arena

    if not isinstance(members, int) or members < 1:
        raise FlashBootError(f"members must be a positive int, got {members!r}")
    t_start = time.perf_counter()
    dev = Device.parse(device)
    mover_obj = _check_mover(dev, _default_mover(dev, mover))
    hook = _step_hook(step_delay_s)
    warm = _Warmup(dev)  # overlaps connecting; joined before any descriptor is requested
    rdv = Rendezvous.connect(store, token, token_file=token_file, namespace=name, host=True, timeout_s=timeout_s)
    session = _Session(rdv)
    try:
        warm_report = CloneReport("ring", 0, str(dev), 0)
        warm.join(warm_report, timeout_s)
        t0 = time.perf_counter()
        from flashboot.layouts import read_image_metadata

        path = Path(image)
        meta = read_image_metadata(path, rank) if path.is_dir() else None
        if meta is not None:
            manifest = Manifest.from_metadata(meta)
        else:
            nbytes = path.stat().st_size
            from flashboot.kernels.checksum import chunk_checksums

            probe = _HostImage(path, CPU)
            try:
                manifest = Manifest(nbytes, -(-nbytes // (2 << 20)) * (2 << 20), 64 << 20,
                                    tuple(chunk_checksums(probe.span(), 64 << 20)))
            finally:
                probe.close()
        manifest.require(expect, f"image {str(path)!r}")
        position = rdv.add(f"{run}/join", 1)
        if position > members:
            raise RendezvousError(f"ring {run!r} already has its {members} members (this is arrival {position}); "
                                  "use another run name")
        me = position - 1
        report = CloneReport("ring", position, str(dev), manifest.nbytes, mover=mover_obj.name,
                             connect_ms=(t0 - t_start) * 1e3, warm_ms=warm_report.warm_ms,
                             warm_note=warm_report.warm_note, pin_early=pin_early)
        plan = build_plan("ring", members, manifest.nbytes, chunk_bytes)
        report.chunk_bytes = plan.chunk_bytes
        shard_off, shard_n = shard_bounds(manifest.nbytes, members)[me]

        def map_shard() -> _HostImage:
            tl = time.perf_counter()
            img = _HostImage(path, dev, rank=rank, pin=(shard_off, shard_n))
            session.extra.append(img)
            report.load_ms = (time.perf_counter() - tl) * 1e3  # mapping (and pinning the shard)
            report.pin_ms = img.pin_ms
            return img

        img = map_shard() if pin_early else None
        ta = time.perf_counter()
        session.arena = Arena.create(manifest.arena_nbytes, dev)
        session.flags = create_flags(plan.flag_count(me), dev)
        rdv.publish(f"{run}/member/{me}", {"member": me, "pid": os.getpid(), "host": socket.gethostname(),
                                           "device": str(dev), "manifest_digest": manifest.digest},
                    sealed={"arena": session.arena.export().to_dict(), "flags": session.flags.export().to_dict()})
        session.status_key = f"{run}/status/{me}"
        report.alloc_ms = (time.perf_counter() - ta) * 1e3
        report.barrier_ms = rdv.barrier(f"{run}/start", members, timeout_s=timeout_s)
        # every member must hold the same image before any byte moves
        tx = time.perf_counter()
        pred = (me - 1) % members
        endpoints = {me: Endpoint(me, f"member {me}", session.arena, session.flags)}
        for j in range(members):
            if j == me:
                continue
            rec = rdv.read(f"{run}/member/{j}", what=f"ring member {j}'s descriptors", timeout_s=timeout_s)
            if rec.body.get("manifest_digest") != manifest.digest:
                raise RendezvousError(f"ring member {j} holds another image (manifest {rec.body.get('manifest_digest')}, "
                                      f"ours {manifest.digest}); refused before any byte moved")
            if j == pred:
                arena_desc = _descriptor_from(rec.sealed["arena"])
                transport, _ = _choose_transport(arena_desc, dev, "auto")
                if transport == "nccl":
                    raise RendezvousError(f"ring member {j} on {arena_desc.hostname!r} cannot be mapped from here "
                                          "(no fabric); the ring needs mappable peers")
                opened = [_open_arena(arena_desc, dev, transport)]
                session.opened[j] = opened
                opened.append(_open_arena(_descriptor_from(rec.sealed["flags"]), dev, transport))
                report.transport = transport
                endpoints[j] = Endpoint(j, f"member {j}", opened[0], opened[1],
                                        int(rec.body["pid"]) if _same_host(arena_desc) else None)
        report.exchange_ms = (time.perf_counter() - tx) * 1e3
        if img is None:
            img = map_shard()
        tt = time.perf_counter()
        try:
            rep = Executor(plan, endpoints, me, mover=mover_obj, host_image=img.span(), timeout_s=timeout_s,
                           step_hook=hook).run()
        except StepFailure as failure:
            # re-attach upstream: whatever the lost member would have passed on, load from the host image
            report.recovered.append(f"member {failure.peer} {'exited' if failure.peer_exited else 'stalled'}")
            remaining = [s for s in plan.steps_into(me) if s.id not in failure.valid_steps]
            new = rewire(plan, remaining, failure.peer, fallback=HOST, dead=set(range(members)) - {me})
            session.close_opened(failure.peer)
            endpoints.pop(failure.peer, None)
            rep = Executor(plan, endpoints, me, mover=mover_obj, host_image=img.span(), timeout_s=timeout_s,
                           steps=new).run()
            report.recovered.append("loaded the rest from the host image")
        report.transfer_ms = (time.perf_counter() - tt) * 1e3
        report.lanes = [l.__dict__ | {"gbps": l.gbps} for l in rep.lanes]
        _note_lazy_mapping(report, (ep for j, ep in endpoints.items() if j != me))
        report.ready_ms = (time.perf_counter() - t_start) * 1e3
        report.ready_unix = time.time()
        report.source = f"host shard {shard_off:,}..{shard_off + shard_n:,} + member {pred}"
        if verify:
            tv = time.perf_counter()
            _verify(session.arena, manifest, f"ring member {me} on {dev}")
            report.verify_ms = (time.perf_counter() - tv) * 1e3
            report.verified = True
        rdv.publish(session.status_key, {"state": "done", "pid": os.getpid()})
        session.dependents = [f"{run}/status/{(me + 1) % members}"] if members > 1 else []
        session.close_opened()
        img.close()
        session.extra.remove(img)
        report.total_ms = (time.perf_counter() - t_start) * 1e3
        report.finished_unix = time.time()
        return CloneResult(session.arena, _views(session.arena, meta), report, metadata=meta, _session=session)
    except BaseException:
        session.close(keep_arena=False)
        raise


__all__ = ["CloneError", "CloneReport", "CloneResult", "Seed", "clone", "linger", "ring_load", "seed"]
