"""FlashLoad: one rank's staged image -> an arena in one bulk copy; every weight a view into it.

Paper sections 3.4-3.5. The preloader (:mod:`flashboot.flashload.staging`) has put the image in shared
memory; :func:`load` admits it against the device's free memory (before any allocation),
creates one arena of the image's size, fills it with a few large copies, and hands out
zero-copy views at the offsets the image records. :func:`bind` then points a meta-initialised
torch module's parameters and buffers at those views: one copy of the weights in device memory.

Three ways to pay the pin (``cuMemHostRegister``, about a third of the H2D rate):

* ``load(dir)``: pin on the critical path (map, pin, copy);
* ``load(dir, staged=flashboot.stage(dir, ...))``: pinned early, while the engine built its model;
* ``load(dir, served=True)``: the preloader daemon holds the image pinned and copies it into the
  engine's exported arena; the engine waits only for the descriptor exchange and the copy.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import (
    ChecksumMismatchError,
    FlashBootError,
    LayoutError,
    OutOfMemoryError,
)
from ..memory import Device
from ..pinning import device_free_bytes
from .views import make_views

DEFAULT_CHUNK_BYTES = 1 << 30
"""H2D chunk: a few large copies keep the copy engine busy (hardware.md: 1 GB chunks, one stream)."""
ARENA_ROUNDING = 2 << 20
"""Arenas round up to the 2 MiB allocation granularity; admission counts the rounded size."""


# ================================================================================ the report
@dataclass
class LoadReport:
    """Where the time of one load went, as the engine saw it (milliseconds).

    ``wait_ms``: waiting for the staged image (``.ready``, mapping, or what was left of an early
    pin; served: reading ``metadata.json``'s bytes and waiting for the ``.ready`` of them);
    ``metadata_ms``: the strict read and validation of ``metadata.json`` (pinned early: waiting
    for :func:`flashboot.stage`'s, done in the background); ``pin_ms``: pinning on the critical
    path; ``pinned_early_ms``: pinning paid before ``load`` was called (off the critical path, for
    reference); ``alloc_ms``: arena creation (and export, served); ``h2d_ms``: the bulk copy
    including its synchronisation; ``exchange_ms`` (served): descriptor exchange and the daemon's
    mapping of the arena; ``verify_ms``; ``bind_ms``: building the views; ``total_ms``: from the
    call to the return. ``overlapped`` names the phases that ran while the copy was in flight:
    their time is inside ``h2d_ms`` (or hidden by it), not added to it.
    """

    mode: str
    device: str
    rank: int
    nbytes: int
    tensors: int = 0
    wait_ms: float = 0.0
    metadata_ms: float = 0.0
    pin_ms: float = 0.0
    pinned_early_ms: float = 0.0
    alloc_ms: float = 0.0
    exchange_ms: float = 0.0
    h2d_ms: float = 0.0
    verify_ms: float = 0.0
    bind_ms: float = 0.0
    total_ms: float = 0.0
    chunks: int = 0
    overlapped: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    @property
    def h2d_gbps(self) -> float:
        """Bytes over the copy time alone."""
        return self.nbytes / (self.h2d_ms * 1e-3) / 1e9 if self.h2d_ms > 0 else float("inf")

    @property
    def gbps(self) -> float:
        """Bytes over the whole engine-visible time."""
        return self.nbytes / (self.total_ms * 1e-3) / 1e9 if self.total_ms > 0 else float("inf")

    @property
    def other_ms(self) -> float:
        """What the phases do not account for: the first use of modules this call imported, setting up
        the copy path, Python between the phases (the total minus the phases not marked overlapped)."""
        names = ("wait", "metadata", "pin", "alloc", "exchange", "h2d", "verify", "bind")
        timed = sum(getattr(self, f"{n}_ms") for n in names if n not in self.overlapped)
        return max(0.0, self.total_ms - timed)

    def phases(self) -> dict[str, float]:
        """The non-zero phases in order, in ms; ``other`` is :attr:`other_ms` (so the phases not
        marked overlapped add up to the total)."""
        names = ("wait", "metadata", "pin", "alloc", "exchange", "h2d", "verify", "bind")
        out = {n: getattr(self, f"{n}_ms") for n in names if getattr(self, f"{n}_ms") > 0}
        if self.other_ms >= 0.05:
            out["other"] = self.other_ms
        return out

    def verified_text(self) -> str:
        """"verified: N chunks match ..." or why nothing was checked."""
        if self.details.get("verified"):
            return f"verified: {self.details['verified']}"
        return "not verified: " + self.details.get("verify_skipped", "verify=False")

    def to_dict(self) -> dict:
        return {**asdict(self), "h2d_gbps": self.h2d_gbps, "gbps": self.gbps}

    def summary(self) -> str:
        from ..units import format_rate

        parts = ", ".join(f"{k} {v:.1f}{'*' if k in self.overlapped else ''}" for k, v in self.phases().items())
        during = f" (*: {OVERLAP_MEANING.get(self.mode.split(',')[-1].strip(), OVERLAP_MEANING[''])})" \
            if self.overlapped else ""
        early = f"; pinned early in {self.pinned_early_ms:.0f} ms" if self.pinned_early_ms else ""
        note = f"; {self.details['note']}" if self.details.get("note") else ""
        return (f"rank {self.rank} -> {self.device} ({self.mode}): {self.nbytes:,} bytes, {self.tensors} tensors in "
                f"{self.total_ms:.1f} ms ({format_rate(self.nbytes, self.total_ms)} end to end; H2D "
                f"{format_rate(self.nbytes, self.h2d_ms)}) [{parts} ms]{during}{early}; {self.verified_text()}{note}")


OVERLAP_MEANING = {"": "while the copy ran",
                   "prepared": "started by flashboot.prepare before the call; the call waited for what was left"}
"""What a ``*`` on a phase of :meth:`LoadReport.summary` means (by the last word of the mode)."""


# ============================================================================ the loaded image
class LoadedImage:
    """One rank's weights in an arena: ``arena``, ``tensors`` (name -> zero-copy view),
    ``metadata`` (:class:`~flashboot.layouts.ImageMetadata`), ``report`` (:class:`LoadReport`).

    The views are valid while the arena is open; :meth:`close` (or ``with``) releases it.
    :meth:`sleep` / :meth:`wake` release the memory and bring it back at the same addresses
    (:mod:`flashboot.flashload.lifecycle`).
    """

    def __init__(self, arena, tensors: dict, metadata, report: LoadReport, source, release_thread=None):
        self.arena, self.tensors, self.metadata, self.report = arena, tensors, metadata, report
        self.source = source
        self.release_thread = release_thread
        """The background unpin/unmap of a staged image that :func:`load` made itself (or None);
        benchmarks join it so one repeat's unpin does not overlap the next one's pin."""
        self.lifecycle = None  # what sleep() keeps for wake() (flashboot.flashload.lifecycle)
        self.version = 0
        """The weights' version: 0 as loaded from the image, then the one each :meth:`refit` made live."""
        self.refit_sources: dict = {}
        """The trainer's arena as :meth:`refit` mapped it, kept for the next version (released by :meth:`close`)."""

    @property
    def device(self) -> Device:
        return self.arena.device

    @property
    def nbytes(self) -> int:
        return self.report.nbytes

    def sleep(self, level: int = 1):
        """Release the weights' memory, keeping every view's address; ``level=1`` keeps a host
        backup first. Returns a SleepReport (see :func:`flashboot.flashload.lifecycle.sleep`)."""
        from .lifecycle import sleep

        return sleep(self, level)

    def wake(self, **options):
        """Bring the weights back at the same addresses, from the backup, the daemon or the disk.
        Returns a WakeReport naming the source (see :func:`flashboot.flashload.lifecycle.wake`)."""
        from .lifecycle import wake

        return wake(self, **options)

    def refit(self, store: str, version: int, **options):
        """Take the weights a trainer published as ``version`` at ``store``, in place under the same
        views; atomic by default. Returns a RefitReport (see :func:`flashboot.weight_update.refit`)."""
        from flashboot.weight_update.engine import refit

        return refit(self, store, version, **options)

    def close(self) -> None:
        """Release the arena (views must not be used afterwards). Idempotent."""
        from .lifecycle import close_lifecycle

        from flashboot.flashclone.sources import release_held_sources

        self.tensors = {}
        release_held_sources(self.refit_sources)
        close_lifecycle(self)
        if not self.arena.closed:
            self.arena.close()

    def __enter__(self) -> "LoadedImage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoadedImage(rank {self.report.rank}, {len(self.tensors)} tensors, {self.nbytes:,} bytes on {self.device})"


# ================================================================================ admission
def admit(nbytes: int, device: Device, *, free_bytes: int | None = None) -> int:
    """Refuse a load that cannot fit, before anything is allocated.

    ``nbytes`` is rounded up to the arena granularity; ``free_bytes`` defaults to what the device
    reports (``cuMemGetInfo``; MemAvailable on the host backend). Returns the free bytes seen;
    raises OutOfMemoryError with bytes needed and free.
    """
    needed = -(-nbytes // ARENA_ROUNDING) * ARENA_ROUNDING
    free = device_free_bytes(device) if free_bytes is None else free_bytes
    if needed > free:
        raise OutOfMemoryError(f"loading a {nbytes:,}-byte image into {device}", needed, free)
    return free


# ===================================================================================== load
def _mover_for(device: Device):
    """The mover of the bulk copy (created, and its backend imported, before the copy is timed)."""
    from ..movers import create_mover

    return create_mover("copy_engine" if device.is_cuda else "host")


def _bulk_copy(mover, arena, src_span, nbytes: int, chunk_bytes: int, *, meanwhile=None) -> tuple[int, Any]:
    """Copy ``nbytes`` from the staged span into the arena in ``chunk_bytes`` pieces, running
    ``meanwhile()`` while the copy is in flight; returns (#chunks, what ``meanwhile`` returned).

    CUDA: the chunks are enqueued on one stream, ``meanwhile`` runs on this thread, then the
    stream is synchronised. Host backend: the host mover's copy into the memfd arena (one call:
    the mover splits it over its threads, without the GIL) runs on this thread and ``meanwhile``
    in a helper thread. Either way the copy has ended when this returns or raises (also when
    ``meanwhile`` failed), so the caller may close the arena.
    """
    if not arena.device.is_cuda:
        side = _Beside(meanwhile) if meanwhile is not None else None
        try:
            mover.copy(arena.span(0, nbytes), src_span.sub(0, nbytes), stream=None)
        finally:
            result = side.join() if side is not None else None  # the copy's error, if any, wins
        return 1, result
    import cupy

    with cupy.cuda.Device(arena.device.index):
        stream = cupy.cuda.Stream(non_blocking=True)
        n = 0
        try:
            for off in range(0, nbytes, chunk_bytes):
                size = min(chunk_bytes, nbytes - off)
                mover.copy(arena.span(off, size), src_span.sub(off, size), stream=stream)
                n += 1
            result = meanwhile() if meanwhile is not None else None
        except BaseException:
            try:
                stream.synchronize()  # what was enqueued must end before the arena can be released
            except Exception:
                pass  # the first error is the one to report
            raise
        stream.synchronize()
    return n, result


class _Beside:
    """``fn()`` in a helper thread; :meth:`join` returns its result or raises its error."""

    def __init__(self, fn):
        self._fn, self._result, self._error = fn, None, None
        self._thread = threading.Thread(target=self._run, name="flashboot-load-views", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # handed to join()
            self._error = exc

    def join(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def verify_loaded(arena, metadata, where: str, report=None) -> int:
    """Recompute the image's chunk checksums on the arena's bytes (GPU kernel on CUDA, numba on the
    host); raises ChecksumMismatchError naming the first bad chunk. Returns the chunk count; sets
    ``report.verify_ms`` when a report is given."""
    t0 = time.perf_counter()  # the checksum module's import and first call are part of what verify costs
    from flashboot.kernels.checksum import chunk_checksums

    found = chunk_checksums(arena.span(0, metadata.image_nbytes), metadata.checksums.chunk_bytes)
    count = compare_digests(found, metadata, where)
    if report is not None:
        report.verify_ms = (time.perf_counter() - t0) * 1e3
        report.details["verified"] = f"{count} chunks match the pre-pack's checksums"
    return count


def compare_digests(found, metadata, where: str) -> int:
    """``found`` (chunk digests of the loaded bytes) against the metadata's: ChecksumMismatchError
    naming the first bad chunk, LayoutError for another chunk count. Returns the count."""
    cs, nbytes = metadata.checksums, metadata.image_nbytes
    if len(found) != len(cs.digests):
        raise LayoutError(f"{where}: {len(found)} chunks computed, the metadata records {len(cs.digests)}")
    for k, (want, got) in enumerate(zip(cs.digests, found)):
        if int(want) != int(got):
            start, n = cs.chunk_range(k, nbytes)
            raise ChecksumMismatchError(where, k, start, n, int(want), int(got))
    return len(found)


def load(image_dir, rank: int = 0, device: Any = None, *, timeout_s: float = 60.0, served: bool = False,
         staged=None, prepared=None, verify: bool | None = None, shm_dir=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         tp: int | None = None, ep: int | None = None, expected_key=None, stream: bool | None = None,
         stream_buffer_bytes=None, holder=None) -> LoadedImage:
    """Load rank ``rank`` of the pre-packed image in ``image_dir`` onto ``device``.

    ``device``: an int, ``"cuda:N"``, ``"cpu"`` (host backend) or None (cuda:0 where present).
    The rank is copied from its staged copy in shared memory (``flashboot preload``); while a
    preloader stages it, the load waits up to ``timeout_s`` for its ``.ready`` file. When nothing
    will stage it (no preloader runs, it stages other ranks, shared memory cannot hold the image)
    the image is streamed straight from disk through a ring buffer of at most
    ``stream_buffer_bytes`` (default 256 MiB or ``$FLASHBOOT_STREAM_BUFFER_BYTES``; an int, a dict
    or a :class:`~flashboot.flashload.stream.StreamConfig`), and the report says so and why.
    ``stream``: True always streams, False never does (waits for ``.ready``). ``staged``: a
    :func:`flashboot.stage` result (pinned early); ``served``: have the running preloader daemon
    copy into this process's arena; ``prepared``: a :func:`flashboot.prepare` handle made at
    engine start-up, which has paid every one-time cost already (metadata, arena, the daemon's
    attachment or the pin, views): the load is the copy. Without it the report's
    ``details["one_time_ms"]`` says what this call paid that ``prepare`` would have paid at
    start-up. ``verify`` recomputes the
    chunk checksums on the device and the report says they passed; None (the default) verifies on
    CUDA (the kernel costs ~2 % of the copy) and not on the host backend (~2x the copy there; the
    report says it did not). ``tp``/``ep``/``expected_key``: what the caller expects the
    image to be (LayoutError otherwise). ``holder``: a holder registry path (or a dict /
    :class:`~flashboot.flashload.restart.HolderOption`): a restarted engine maps the arena held for
    this image instead of loading (no copy), and a fresh load is handed over to the holder
    (:mod:`flashboot.flashload.restart`).

    The views are built while the bulk copy runs. Served, the strict read of the metadata runs
    then too (see :func:`_load_served`), so an image refused for its tp, ep or key is refused
    after its bytes were copied (into an arena that is then released).

    Raises LayoutError (bad image, wrong rank/tp/ep/model), OutOfMemoryError before any
    allocation when the device lacks the bytes, WaitTimeoutError naming what was awaited,
    ChecksumMismatchError (verify) naming the chunk. A failed load releases its arena.
    """
    import torch  # noqa: F401  (an engine has it loaded; its import is not part of a load)

    if holder is not None:
        from .restart import load_or_restore

        return load_or_restore(image_dir, rank, device, holder, timeout_s=timeout_s, served=served, staged=staged,
                               prepared=prepared, verify=verify, shm_dir=shm_dir, chunk_bytes=chunk_bytes, tp=tp,
                               ep=ep, expected_key=expected_key, stream=stream,
                               stream_buffer_bytes=stream_buffer_bytes)

    t_start = time.perf_counter()
    dev = Device.parse(device)
    if verify is not None:
        verify, why_not = bool(verify), "verify=False"
    elif prepared is None:  # a prepared handle chose when it knew its mode: _load_prepared takes its choice
        verify, why_not = _verify_default(dev, by_daemon=served)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise LayoutError(f"rank must be a non-negative int, got {rank!r}")
    if chunk_bytes <= 0:
        raise FlashBootError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if served and staged is not None:
        raise FlashBootError("served=True and staged= exclude each other: the daemon holds the pinned image")
    if stream and (served or staged is not None):
        raise FlashBootError("stream=True excludes served=True and staged=: a streamed load reads the image from disk")
    _check_staged(staged, image_dir, rank)
    if prepared is not None:
        from .boot import PreparedLoad

        if not isinstance(prepared, PreparedLoad):
            raise FlashBootError(f"prepared must come from flashboot.prepare(), got {type(prepared).__name__}")
        if served or staged is not None or stream:
            raise FlashBootError("prepared= excludes served=, staged= and stream=: the handle already chose its mode "
                                 f"({prepared.requested_mode})")
        loaded = _load_prepared(prepared, image_dir, rank, dev, t_start, verify=verify, chunk_bytes=chunk_bytes,
                                tp=tp, ep=ep, expected_key=expected_key)
    elif served:
        loaded = _load_served(image_dir, rank, dev, t_start, timeout_s=timeout_s, verify=verify, shm_dir=shm_dir,
                              tp=tp, ep=ep, expected_key=expected_key)
    else:
        loaded = _load_staged(image_dir, rank, dev, t_start, staged=staged, timeout_s=timeout_s, verify=verify,
                              shm_dir=shm_dir, chunk_bytes=chunk_bytes, tp=tp, ep=ep, expected_key=expected_key,
                              stream=stream, stream_buffer_bytes=stream_buffer_bytes)
    if "verified" not in loaded.report.details:
        loaded.report.details["verify_skipped"] = prepared.verify_skipped if verify is None else why_not
    return loaded


def _check_staged(staged, image_dir, rank: int) -> None:
    from .stage import StagedImage

    if staged is not None:
        if not isinstance(staged, StagedImage):
            raise FlashBootError(f"staged must come from flashboot.stage(), got {type(staged).__name__}")
        if staged.rank != rank or os.path.realpath(staged.image_dir) != os.path.realpath(image_dir):
            raise FlashBootError(f"staged image is rank {staged.rank} of {staged.image_dir}; load asked for rank "
                                 f"{rank} of {image_dir}")


VERIFY_BY_DEFAULT_ON_HOST = False
"""The host backend's checksum (numba) runs at about half the host copy's rate (1.2 vs 2.5-3 GB/s
on 2 cores), so checking costs ~2x the load there: opt in with ``verify=True``. On CUDA the kernel
runs ~2.7 TB/s against a ~54 GB/s H2D (2 % of the load), but its first call in a process costs
~1 s (Triton's import, launcher, cache; 0.95-1.3 s on the H200 machine): so a served load is
verified by default by the daemon, which warmed its kernel once, and an in-process load only
where this process has run the kernel already."""


def _verify_default(dev: Device, *, by_daemon: bool) -> tuple[bool, str]:
    """Whether a load verifies when the caller did not say; when not, why (the report's
    ``verify_skipped``). ``by_daemon``: the served-load daemon computes the digests."""
    if not dev.is_cuda:
        return VERIFY_BY_DEFAULT_ON_HOST, ("off by default on the host backend, where it costs ~2x the copy; "
                                           "verify=True checks")
    from flashboot.kernels.checksum import gpu_checksum_loaded

    if by_daemon or gpu_checksum_loaded(dev.index):
        return True, ""
    return False, ("off by default for a load in this process: the checksum kernel's first call in a process "
                   "costs ~1 s, more than the load (a served load is verified by the daemon); verify=True checks")


def _one_time(report: LoadReport, **more: float) -> dict[str, float]:
    """What a load without :func:`flashboot.prepare` paid itself that ``prepare`` pays at start-up
    (some of it while the copy ran: see ``overlapped``)."""
    paid = {"metadata": report.metadata_ms, "arena": report.alloc_ms, "views": report.bind_ms, **more}
    return {k: round(v, 3) for k, v in paid.items() if v}


def _timed_views(arena, meta, report: LoadReport):
    """:func:`make_views`, its time recorded as ``bind_ms``."""
    t0 = time.perf_counter()
    views = make_views(arena, meta)
    report.bind_ms = (time.perf_counter() - t0) * 1e3
    return views


def _load_staged(image_dir, rank: int, dev: Device, t_start: float, *, staged, timeout_s: float, verify: bool,
                 shm_dir, chunk_bytes: int, tp, ep, expected_key, stream: bool | None = None,
                 stream_buffer_bytes=None) -> LoadedImage:
    """Pin on the critical path (``staged`` None: this call stages) or pinned early; or, when
    nothing is or will be staged, stream from disk (:mod:`flashboot.flashload.stream`)."""
    from flashboot.layouts.image import check_request

    from ..arena import Arena
    from .shm import rank_source
    from .stage import StagedImage

    report = LoadReport(mode="", device=str(dev), rank=rank, nbytes=0)
    t0 = time.perf_counter()
    if staged is not None:
        # stage() validated the metadata in the background (the strict reader, rank and job
        # checked): only what this call asks for is left to check.
        source = staged.wait_source()
        check_request(source.metadata, str(source.image.metadata_path), tp=tp, ep=ep, expected_key=expected_key)
        report.details["metadata_validated_by"] = "stage()"
    else:
        source = rank_source(image_dir, rank, tp=tp, ep=ep, expected_key=expected_key)
    report.metadata_ms = (time.perf_counter() - t0) * 1e3
    meta = source.metadata
    nbytes = report.nbytes = source.nbytes
    report.tensors = len(meta.tensors)
    if nbytes == 0:
        raise LayoutError(f"{source.path}: empty image, nothing to load")
    admit(nbytes, dev)
    if staged is None:
        from .stream import StreamConfig, load_streamed, stream_reason

        config = StreamConfig.of(stream_buffer_bytes)  # a bad option is refused whether or not it streams
        why = stream_reason(image_dir, rank, source, shm_dir=shm_dir, stream=stream)
        if why is not None:
            return load_streamed(source, dev, report, t_start, reason=why, config=config, verify=verify)
    arena = None
    own_staged = None
    try:
        if staged is None:
            own_staged = staged = StagedImage(image_dir, rank, dev, timeout_s=timeout_s, shm_dir=shm_dir,
                                              source=source)
        was_done = staged.done
        t0 = time.perf_counter()
        arena = Arena.create(nbytes, dev)  # overlaps the pin when this call staged
        mover = _mover_for(dev)
        t1 = time.perf_counter()
        staged.wait()
        t2 = time.perf_counter()
        report.alloc_ms = (t1 - t0) * 1e3
        if own_staged is not None:
            report.mode = "pin on critical path" if dev.is_cuda else "host"
            report.wait_ms = own_staged.wait_ms
            report.pin_ms = own_staged.pin_ms
        else:
            report.mode = "pinned early" if dev.is_cuda else "host (staged early)"
            report.wait_ms = (t2 - t1) * 1e3
            report.pinned_early_ms = staged.pin_ms
            report.details["staged_done_before_load"] = was_done
        if dev.is_cuda and not staged.pinned:
            report.details["pageable"] = "the staged image is not pinned: the copy runs at pageable speed"
        t3 = time.perf_counter()
        # Views are only pointers into the arena: they are made while the DMA fills it.
        report.chunks, tensors = _bulk_copy(mover, arena, staged.span(), nbytes, chunk_bytes,
                                            meanwhile=lambda: _timed_views(arena, meta, report))
        report.h2d_ms = (time.perf_counter() - t3) * 1e3
        report.overlapped = ["bind"]
        report.details["one_time_ms"] = _one_time(report, pin=report.pin_ms)
        if staged.ready is not None:
            report.details.update(io_mode=staged.ready.io_mode, numa_node=staged.ready.numa_node)
        if verify:
            verify_loaded(arena, meta, f"{source.path} (rank {rank}) loaded into {dev}", report)
    except BaseException:
        if arena is not None and not arena.closed:
            arena.close()
        if own_staged is not None:
            own_staged.close()
        raise
    release = own_staged.close_in_background() if own_staged is not None else None  # not the engine's wait
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    return LoadedImage(arena, tensors, meta, report, source, release)


def _load_prepared(prepared, image_dir, rank: int, dev: Device, t_start: float, *, verify: bool | None, chunk_bytes: int,
                   tp, ep, expected_key) -> LoadedImage:
    """Wait for the copy a :func:`flashboot.prepare` handle started itself (everything else was
    paid at start-up), check that the image is still the one it copied, verify (``None``: as the
    handle chose once it knew its mode)."""
    from flashboot.layouts.image import check_request

    from .shm import RankSource

    prepared.check_request(image_dir, rank, dev)
    prepared.claim(f"the load called at {time.strftime('%H:%M:%S')}")
    report = LoadReport(mode="", device=str(dev), rank=rank, nbytes=0)
    try:
        ready_before = prepared.done
        t0 = time.perf_counter()
        prepared.wait()
        report.wait_ms = (time.perf_counter() - t0) * 1e3
        if verify is None:
            verify = prepared.verify
        arena, meta = prepared.arena, prepared.metadata
        check_request(meta, str(prepared.image.metadata_path), tp=tp, ep=ep, expected_key=expected_key)
        prepared.check_unchanged()  # a re-packed image: the early copy's bytes are discarded with the arena
        report.nbytes, report.tensors = prepared.nbytes, len(meta.tensors)
        copy = prepared.copy
        report.h2d_ms = copy["h2d_ms"]
        report.overlapped = ["h2d"]  # the copy ran before the call or while the load waited: in wait_ms, not added
        report.details = {"prepared": dict(prepared.phases_ms), "prepared_mode_why": prepared.why,
                          "prepare_total_ms": (prepared.finished - prepared.started) * 1e3,
                          "prepared_before_load": ready_before,
                          "copy_started_after_prepare_ms": copy["started_after_prepare_ms"],
                          # > 0: the weights were in place that long before the load was called
                          "ready_before_load_ms": max(0.0, (t_start - prepared.finished) * 1e3)}
        if prepared.mode == "served":
            reply = copy["reply"]
            report.mode = "served, prepared"
            report.pinned_early_ms = reply.get("pin_ms", 0.0)
            report.chunks = -(-report.nbytes // (1 << 30))
            report.details.update(daemon_pid=reply.get("pid"), daemon_map_ms=reply.get("map_ms"),
                                  daemon_pinned=reply.get("pinned"))
        elif prepared.mode == "stream":
            from .stream import report_stream

            report.mode = "streamed from disk, prepared"
            report_stream(report, copy["stats"], prepared.why, report.nbytes)
            report.overlapped = ["h2d"]
        else:
            report.mode = ("pinned early, prepared" if copy["pinned"] else "staged, prepared") if dev.is_cuda else \
                "host, prepared"
            report.pinned_early_ms = copy["pin_ms"]
            report.chunks = copy["chunks"]
            if dev.is_cuda and not copy["pinned"]:
                report.details["pageable"] = "the staged image is not pinned: the copy runs at pageable speed"
        if verify and copy.get("verified"):
            report.details["verified"] = copy["verified"] + " (checked by flashboot.prepare once its copy ended)"
        elif verify:
            verify_loaded(arena, meta, f"{prepared.image.path} (rank {rank}) loaded into {dev}", report)
    except BaseException:
        prepared._release()
        raise
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    source = RankSource(prepared.image_dir, rank, prepared.image, prepared.metadata_sha256)
    return LoadedImage(arena, prepared.tensors, meta, report, source, prepared.release_thread)


def _check_job_request(mf, *, tp, ep, expected_key) -> None:
    """LayoutError where the job file (``prepack.json``) says the image is not what the caller
    expects: the checks of :func:`flashboot.layouts.image.check_request` that need no tensor table."""
    from flashboot.layouts.image import JOB_FILE, check_key

    key, where = mf.job.key, str(mf.job.path / JOB_FILE)
    if tp is not None and tp != key.tp_size:
        raise LayoutError(f"{where}: packed for tp={key.tp_size}, requested tp={tp}")
    if ep is not None and ep != key.ep_size:
        raise LayoutError(f"{where}: packed for ep={key.ep_size}, requested ep={ep}")
    check_key(key, where, expected_key)


def _load_served(image_dir, rank: int, dev: Device, t_start: float, *, timeout_s: float, verify: bool, shm_dir,
                 tp, ep, expected_key) -> LoadedImage:
    """The daemon copies; the strict read of the metadata and the views run meanwhile.

    Why the copy may start before this process has validated the metadata: the bytes of
    ``metadata.json`` are read first and identified by their sha256; the ``.ready`` the arena
    is sized from must carry that same sha256, and the preloader writes ``.ready`` only after its
    strict reader accepted exactly those bytes (and the daemon re-checks the sha256 and size of
    what it holds before it copies). So the copy is of an image whose metadata has been
    validated; this process then validates the very bytes it hashed (plus its own rank, tp, ep,
    key and the job, which only it knows) while the DMA runs. If that fails, the load waits for
    the daemon to be done with the arena, releases it and raises: no tensor is handed out.
    """
    from flashboot.layouts.image import open_image, read_metadata_file

    from ..arena import Arena
    from .client import served_ready, start_served_load
    from .shm import RankSource

    report = LoadReport(mode="served", device=str(dev), rank=rank, nbytes=0)
    t0 = time.perf_counter()
    mf = read_metadata_file(image_dir, rank)  # finds the rank and reads the bytes; parses only prepack.json
    sha = mf.sha256
    if mf.job is not None:  # the caller's tp, ep and key are refused before any byte moves
        _check_job_request(mf, tp=tp, ep=ep, expected_key=expected_key)
    ready = served_ready(image_dir, rank, sha, mf.where, timeout_s=timeout_s, shm_dir=shm_dir)
    nbytes = report.nbytes = ready.nbytes
    report.wait_ms = (time.perf_counter() - t0) * 1e3
    if nbytes == 0:
        raise LayoutError(f"{ready.path}: empty image, nothing to load")
    admit(nbytes, dev)
    arena = copy = None
    try:
        t1 = time.perf_counter()
        arena = Arena.create(nbytes, dev)
        arena.export()
        t2 = time.perf_counter()
        copy = start_served_load(arena, image_dir=str(image_dir), rank=rank, nbytes=nbytes, metadata_sha256=sha,
                                 timeout_s=timeout_s, shm_dir=shm_dir, verify=verify)
        t3 = time.perf_counter()
        image = open_image(mf, rank, tp=tp, ep=ep, expected_key=expected_key)
        meta = image.metadata
        if image.nbytes != nbytes:
            raise LayoutError(f"{ready.path} records {nbytes:,} bytes, {mf.where} {image.nbytes:,}")
        t4 = time.perf_counter()
        tensors = _timed_views(arena, meta, report)
        t5 = time.perf_counter()
        reply = copy.wait()
        t6 = time.perf_counter()
        report.alloc_ms = (t2 - t1) * 1e3
        report.metadata_ms = (t4 - t3) * 1e3
        report.tensors = len(meta.tensors)
        report.h2d_ms = reply["h2d_ms"]
        daemon_ms = reply["h2d_ms"] + reply.get("checksum_ms", 0.0)
        # Request to reply ran beside our own work (metadata + views): the exchange is what exceeds both.
        report.exchange_ms = max(0.0, (t6 - t2) * 1e3 - max(daemon_ms, (t5 - t2) * 1e3))
        report.overlapped = ["metadata", "bind"]
        report.pinned_early_ms = reply.get("pin_ms", 0.0)
        report.chunks = -(-nbytes // (1 << 30))
        report.details = {"daemon_pid": reply.get("pid"), "daemon_map_ms": reply.get("map_ms"),
                          "daemon_pinned": reply.get("pinned"), "copy_wait_ms": (t6 - t5) * 1e3,
                          # where a first call's extra time hides (H200, shape C: 503 ms first, 130 ms second):
                          # before the phases (imports, argument checks) and connecting + sending the request
                          "setup_ms": (t0 - t_start) * 1e3, "request_ms": (t3 - t2) * 1e3,
                          "one_time_ms": _one_time(report, daemon_map=reply.get("map_ms", 0.0))}
        if verify:  # the daemon digested what it copied, in the arena; no kernel runs in this process
            from .client import check_daemon_digests

            check_daemon_digests(reply, meta, f"{image.path} (rank {rank}) loaded into {dev}", report)
    except BaseException:
        if copy is not None:
            copy.settle()  # the daemon may still be writing into the arena
        if arena is not None and not arena.closed:
            arena.close()
        raise
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    return LoadedImage(arena, tensors, meta, report, RankSource(str(image_dir), rank, image, sha))


__all__ = ["LoadedImage", "LoadReport", "admit", "load", "make_views", "verify_loaded"]
