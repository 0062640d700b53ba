"""Weights that stay: a loaded image's sleep and wake at stable addresses.

:func:`sleep` optionally keeps the bytes in host memory (``level=1``: a D2H into a pinned
backup taken by this process, each segment released as soon as its bytes are out; ``level=2``:
nothing kept), then the arena releases its physical memory and keeps its address range
(:meth:`flashboot.Arena.sleep`). :func:`wake` maps new
segments at the same addresses (:meth:`flashboot.Arena.wake`) and brings the bytes back from the
first of these sources that has them:

1. ``backup``: the level-1 backup (in this process; no other process involved);
2. ``served``: the preloader daemon's pinned copy (``flashboot preload --serve``), through the
   served-load protocol of :mod:`flashboot.flashload.client`;
3. ``disk``: the image file, streamed (:func:`flashboot.flashload.stream.stream_image`).

The report names the source used and, for each one before it, why it was not used (none taken,
no daemon, the daemon failed, the image re-packed since the load). Every view keeps its address,
so tensors bound into a model and pointers captured in a CUDA graph stay valid across the cycle;
reading one while asleep is a fault.

An arena shared with another process for its lifetime (a holder, see
:func:`flashboot.flashclone.holder.hand_over`) refuses to sleep, by name: see
:meth:`flashboot.Arena.sleep`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import FlashBootError, OutOfMemoryError
from ..memory import Span
from ..units import check_timeout

SOURCES = ("backup", "served", "disk")
"""Where :func:`wake` looks for the bytes, in this order (``source="auto"``)."""
STATUS_TIMEOUT_S = 1.0
"""How long :func:`wake` waits for the daemon's answer to "what do you hold?" before passing on."""


# ============================================================================= the reports
@dataclass
class SleepReport:
    """One :func:`sleep`, in ms: ``sync_ms`` (waiting for the device's work first),
    ``backup_ms`` (level 1: the D2H into the backup, from its first copy issued to the last
    segment released behind its copy), ``pin_ms`` (level 1: allocating and pinning the backup; 0
    when an earlier one was kept), ``release_ms`` (the rest of the arena's
    :meth:`~flashboot.Arena.sleep`: memory back to the device), ``total_ms``; ``release_parts``:
    where the arena's sleep went (its ``timings``: ``sync_ms``, ``revoke_ms``, ``drain_ms``,
    ``release_ms``, and ``steps_ms`` per driver call such as ``cuMemUnmap``; for the outgoing
    image of a :func:`swap` by handover, ``donor_ms``: its segments unmapped for the incoming one)."""

    level: int
    nbytes: int
    device: str
    sync_ms: float = 0.0
    backup_ms: float = 0.0
    pin_ms: float = 0.0
    release_ms: float = 0.0
    total_ms: float = 0.0
    release_parts: dict = field(default_factory=dict)

    @property
    def backup_gbps(self) -> float:
        return self.nbytes / (self.backup_ms * 1e6) if self.backup_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "backup_gbps": self.backup_gbps}

    def summary(self) -> str:
        kept = (f"backup {self.backup_ms:.1f} ms ({self.backup_gbps:.1f} GB/s), pin {self.pin_ms:.1f} ms, "
                if self.level == 1 else "no backup (level 2), ")
        return f"sleep level {self.level} of {self.nbytes:,} bytes on {self.device}: {kept}release {self.release_ms:.2f} ms"


@dataclass
class WakeReport:
    """One :func:`wake`: ``source`` (``backup``, ``served`` or ``disk``), ``not_used`` (each
    source tried or skipped before it -> why), in ms: ``probe_ms`` (asking the sources whether
    they have the bytes), ``map_ms`` (the new segments created, mapped and granted: the arena's
    ``create_ms + map_ms + access_ms``), ``copy_ms`` (from the first byte's copy issued to the
    last byte back), ``sync_ms`` (backup: the wait for the copies once the last segment was
    mapped; the backup's copies run while the later segments are made, so ``map_ms`` and
    ``copy_ms`` overlap there), ``verify_ms``, ``total_ms``; ``details`` from the arena's wake
    (``wake``: its ``timings``) and the source (the daemon's own map and H2D time, the disk's
    read rate...)."""

    source: str
    nbytes: int
    device: str
    probe_ms: float = 0.0
    map_ms: float = 0.0
    copy_ms: float = 0.0
    sync_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    not_used: dict[str, str] = field(default_factory=dict)
    details: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / (self.copy_ms * 1e6) if self.copy_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "gbps": self.gbps}

    def summary(self) -> str:
        skipped = "".join(f"; not {k}: {v}" for k, v in self.not_used.items())
        lost = self.details.get("refit_version_lost")
        lost = (f"; the image's weights (version 0) replace {_refit_named(lost)}: refit again" if lost else "")
        skipped += f"; not verified: {self.details['verify_skipped']}" if "verify_skipped" in self.details else ""
        return (f"wake of {self.nbytes:,} bytes on {self.device} from {self.source}: {self.total_ms:.1f} ms (map "
                f"{self.map_ms:.2f} ms, copy {self.copy_ms:.1f} ms at {self.gbps:.1f} GB/s, sync {self.sync_ms:.1f} ms)"
                f"{skipped}{lost}")


# ============================================================================= the backup
class HostBackup:
    """A host copy of an image's bytes: one private anonymous mapping (huge pages asked for),
    for a CUDA arena populated by several threads and then pinned with ``cuMemHostRegister`` (the
    D2H and H2D then run at the copy engine's rate; see :func:`~flashboot.pinning.populate` for
    why populated first). :meth:`close` unpins and unmaps it."""

    def __init__(self, nbytes: int, device):
        import ctypes

        from ..fileio import io_buffer
        from ..memory import CPU
        from ..pinning import device_free_bytes, populate, register_host

        self.nbytes = nbytes
        t0 = time.perf_counter()
        if device.is_cuda:  # populating memory the host lacks would wake the OOM killer, not raise
            free = device_free_bytes(CPU)
            if nbytes > free:
                raise OutOfMemoryError(f"a level-1 sleep's host backup (MemAvailable; level 2 keeps nothing on the "
                                       f"host)", nbytes, free)
        self._map = io_buffer(nbytes)
        self._buf = (ctypes.c_uint8 * nbytes).from_buffer(self._map)
        self.ptr = ctypes.addressof(self._buf)
        self._pinned = None
        try:
            if device.is_cuda:
                populate(self._map)
                self._pinned = register_host(self.ptr, nbytes, device)
        except BaseException:
            self.close()
            raise
        self.pin_ms = (time.perf_counter() - t0) * 1e3

    def span(self, nbytes: int) -> Span:
        from ..memory import CPU

        return Span(self.ptr, self.nbytes, CPU, self._pinned is not None, self).sub(0, nbytes)

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.unregister()
            self._pinned = None
        if self._map is not None:
            del self._buf  # the mapping cannot close while a buffer exports it
            self._map.close()
            self._map = None


class _State:
    """What :func:`sleep` left for :func:`wake`: the level, and the backup (level 1, or kept);
    ``lock``: held by each sleep, wake and swap of the image and by its close, which marks it
    ``closed``. A close from another thread had unmapped the backup under the copy into or out
    of it (a segfault)."""

    def __init__(self):
        self.level = 0
        self.backup: HostBackup | None = None
        self.lock = threading.RLock()  # a swap's wake sleeps the outgoing image from within
        self.closed = False

    def drop_backup(self) -> None:
        backup, self.backup = self.backup, None
        if backup is not None:
            backup.close()


def _refit_named(lost) -> str:
    """``details["refit_version_lost"]`` in words: a version, or a failed in-place refit's mix of them."""
    return "failed refit's mix of versions" if lost == "torn" else f"refit version {lost}"


_states_lock = threading.Lock()


def _state(loaded) -> _State:
    with _states_lock:  # two threads' first calls make one state, one lock
        if loaded.lifecycle is None:
            loaded.lifecycle = _State()
        return loaded.lifecycle


def _exclusive(fn):
    """``fn(loaded, ...)`` under ``loaded``'s lifecycle lock (see :class:`_State`)."""

    @functools.wraps(fn)
    def locked(loaded, *args, **kwargs):
        with _state(loaded).lock:
            return fn(loaded, *args, **kwargs)

    return locked


@contextlib.contextmanager
def held_still(loaded):
    """Hold ``loaded``'s lifecycle lock: no sleep, wake, swap or close of it runs meanwhile (a refit
    copying into its arena); yields whether it is closed already (``arena.asleep``: the caller's to check)."""
    with _state(loaded).lock:
        yield _closed(loaded)


def _closed(loaded) -> bool:
    return loaded.arena.closed or _state(loaded).closed


def close_lifecycle(loaded) -> None:
    """Release what :func:`sleep` kept for ``loaded`` (its backup) once a sleep, wake or swap in
    another thread has ended, and refuse the later ones; called by ``LoadedImage.close``."""
    state = _state(loaded)
    with state.lock:
        state.closed = True
        state.drop_backup()


def _synchronize(device) -> None:
    if device.is_cuda:
        import torch

        torch.cuda.synchronize(device.index)  # the engine's kernels may still read or write the weights


def _stream(device):
    """A new private non-blocking stream on ``device``, through the driver (no CuPy import in the
    engine); None on the host backend (its mover is synchronous)."""
    if not device.is_cuda:
        return None
    from ..cuda_streams import Stream

    return Stream(device.index)


def _copy(dst: Span, src: Span, device) -> None:
    """One bulk copy (h2d, d2h or host) on the copy engine or the host mover; returns when done."""
    from .landing import mover_for

    mover, stream = mover_for(device), _stream(device)
    mover.copy(dst, src, stream=stream)
    if stream is not None:
        stream.synchronize()


# ================================================================================ sleep
def sleep(loaded, level: int = 1) -> SleepReport:
    """Put ``loaded`` (a :class:`~flashboot.flashload.report.LoadedImage`) to sleep.

    ``level=1`` first copies the image's bytes into a host backup in this process (pinned on
    CUDA; a backup kept by ``wake(keep_backup=True)`` is reused), ``level=2`` keeps nothing (the
    daemon or the disk brings them back). Then the arena releases its memory and keeps its
    addresses. Sleeping an asleep image is a no-op (its report says level 0), except that level 2
    frees the backup a level-1 sleep kept (its report says level 2: a wake then reads the daemon
    or the disk; vLLM's discard of the weights after its sleep). Raises
    FlashBootError for a bad level or a closed image, ArenaError when the arena is shared with a
    holder (named), OutOfMemoryError / CudaError when the backup cannot be allocated (the image
    stays awake).
    """
    return _sleep(loaded, level, synchronize=True)


@_exclusive
def _sleep(loaded, level: int, *, synchronize: bool) -> SleepReport:
    """:func:`sleep`; ``synchronize=False`` when the caller has already waited for the device's
    work on these weights (:func:`swap`, whose incoming copy may be running meanwhile)."""
    if type(level) is not int or level not in (1, 2):  # True == 1, but is no level
        raise FlashBootError(f"sleep level must be 1 (keep a host backup) or 2 (keep nothing), got {level!r}")
    arena = loaded.arena
    if _closed(loaded):
        raise FlashBootError(f"{loaded!r} is closed; there is nothing to put to sleep")
    report = SleepReport(level=level, nbytes=loaded.nbytes, device=str(arena.device))
    state = _state(loaded)
    if arena.asleep:
        if level == 2 and state.backup is not None:  # level 2 keeps nothing: the pinned backup had stayed
            t0 = time.perf_counter()
            state.drop_backup()
            state.level = 2
            report.release_ms = report.total_ms = (time.perf_counter() - t0) * 1e3
        else:
            report.level = 0
        return report
    # before the backup is taken: a shared or imported arena's refusal had come after it, and the
    # image, awake, kept a pinned backup of its whole size until its next sleep or close
    arena.check_can_sleep()
    t0 = time.perf_counter()
    if synchronize:
        _synchronize(arena.device)
    report.sync_ms = (time.perf_counter() - t0) * 1e3
    drain = settle = None
    if level == 1:
        drain, settle = _drain_into(_backup_for(loaded, report), loaded.nbytes, arena.device)
    else:
        state.drop_backup()
    t2 = time.perf_counter()
    try:
        # waited above (or by swap); level 1: each segment is released once its bytes are in the backup
        arena.sleep(synchronize=False, timings=report.release_parts, drain=drain)
    except BaseException:
        if settle is not None:
            settle()  # the copies issued end before the backup they write can go
        if arena.asleep:  # a copy out failed part-way: the backup lacks bytes, the daemon or the disk has them
            state.drop_backup()
            state.level = 2
        raise
    report.backup_ms = report.release_parts.get("drain_ms", 0.0)
    loaded.release_refit_sources()  # a trainer's arena, mapped for the next refit, would keep its memory in use
    report.release_ms = (time.perf_counter() - t2) * 1e3 - report.backup_ms
    state.level = level
    report.total_ms = (time.perf_counter() - t0) * 1e3
    return report


def _backup_for(loaded, report: SleepReport) -> HostBackup:
    """``loaded``'s level-1 backup: the one kept, when it is large enough, else a new one (its
    allocation and pin time go into ``report.pin_ms``)."""
    state = _state(loaded)
    if state.backup is None or state.backup.nbytes < loaded.nbytes:
        state.drop_backup()
        state.backup = HostBackup(loaded.nbytes, loaded.arena.device)
        report.pin_ms = state.backup.pin_ms
    return state.backup


def _drain_into(backup: HostBackup, nbytes: int, device):
    """``(drain, settle)`` for :meth:`Arena.sleep`: ``drain`` issues the copy of one segment's
    bytes into ``backup`` on one stream and returns the wait for it (an event; None on the host
    backend, whose mover copies synchronously); ``settle`` waits for every copy issued."""
    from .landing import mover_for

    mover, stream, dst = mover_for(device), _stream(device), backup.span(nbytes)

    def drain(offset: int, segment: Span):
        n = min(segment.nbytes, nbytes - offset)
        if n <= 0:
            return None  # capacity past the image's bytes
        mover.copy(dst.sub(offset, n), segment.sub(0, n), stream=stream)
        if stream is None:
            return None
        from ..cuda_streams import Event

        done = Event(device.index)
        done.record(stream)
        return done.synchronize

    return drain, (stream.synchronize if stream is not None else (lambda: None))


# ================================================================================= wake
def _served_why_not(source, shm_dir) -> str | None:
    """Why the preloader daemon cannot bring rank ``source.rank`` back (None: it can): asked with
    a status request, which a stale socket refuses within :data:`STATUS_TIMEOUT_S`."""
    from .client import serve_status
    from .shm import socket_path

    sock = socket_path(source.image_dir, shm_dir)
    if not sock.exists():
        return f"no preloader serves {source.image_dir} (no socket {sock})"
    try:
        status = serve_status(source.image_dir, shm_dir, timeout_s=STATUS_TIMEOUT_S)
    except FlashBootError as exc:
        return f"the preloader at {sock} does not answer: {type(exc).__name__}: {exc}"
    rank = status.get("ranks", {}).get(str(source.rank))
    if rank is None:
        return f"the preloader (pid {status.get('pid')}) does not hold rank {source.rank}"
    if rank.get("error"):
        return f"the preloader (pid {status.get('pid')}) failed to stage rank {source.rank}: {rank['error']}"
    return None


def _disk_why_not(source) -> str | None:
    from ..layouts.image import read_metadata_file

    path = source.path
    if not os.path.exists(path):
        return f"the image file {path} is gone"
    # the rank directory the load read, its links resolved then (source.path is in it): read
    # through image_dir, a link a deployment has flipped to another image since had refused
    # the loaded image, still whole, as "re-packed"
    rank_dir = source.image.dir
    try:
        sha = read_metadata_file(rank_dir, source.rank).sha256
    except FlashBootError as exc:
        return f"the image's metadata cannot be read any more: {exc}"
    if sha != source.metadata_sha256:
        return (f"{rank_dir} was re-packed since the load (metadata {sha[:12]}, loaded "
                f"{source.metadata_sha256[:12]})")
    return None


def _from_served(loaded, source, report: WakeReport, shm_dir, timeout_s: float, meanwhile: "_Once") -> None:
    from .client import start_served_load

    copy = start_served_load(loaded.arena, image_dir=source.image_dir, rank=source.rank, nbytes=source.nbytes,
                             metadata_sha256=source.metadata_sha256, timeout_s=timeout_s, shm_dir=shm_dir)
    try:
        meanwhile()  # while the daemon copies
    except BaseException:
        copy.settle()  # the daemon may still be writing into the arena
        raise
    reply = copy.wait()
    report.details.update(daemon_pid=reply.get("pid"), daemon_h2d_ms=reply.get("h2d_ms"),
                          daemon_map_ms=reply.get("map_ms"), daemon_copy_map_ms=reply.get("copy_map_ms"),
                          daemon_pinned=reply.get("pinned"))


def _from_disk(loaded, source, report: WakeReport, stream_config) -> None:
    from .stream import stream_image

    stats = stream_image(source.path, loaded.nbytes, loaded.arena, stream_config,
                         identity=getattr(source.image, "file_identity", None))
    report.details.update(io_mode=stats.io_mode, read_gbps=stats.read_gbps, buffer_bytes=stats.buffer_bytes)


def _map_ms(parts: dict) -> float:
    """Creating, mapping and granting new segments, from :meth:`Arena.wake`'s ``timings`` (the host
    backend grants nothing)."""
    return parts["create_ms"] + parts["map_ms"] + parts.get("access_ms", 0.0)


class _MeanwhileFailed(Exception):
    """``meanwhile`` failed: the wake ends (asleep) and its error is raised as it was, never taken
    for a source's failure."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _Once:
    """``meanwhile`` of :func:`wake`, run at most once, at the first point where the copy is in flight."""

    def __init__(self, fn: Callable[[], None] | None):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            try:
                fn()
            except Exception as exc:
                raise _MeanwhileFailed(exc) from exc


class _CopyFailed(Exception):
    """A copy issued into a segment during the pipelined wake failed (the source's failure, not the arena's)."""

    def __init__(self, error: FlashBootError):
        super().__init__(str(error))
        self.error = error


def _wake_from_backup(loaded, backup: HostBackup, report: WakeReport, meanwhile: _Once, donor) -> None:
    """Wake ``loaded``'s arena and copy the backup into it, pipelined: each segment's copy is
    issued as soon as the segment is mapped, while the next ones are created, then the copies
    are awaited. A failed copy ends the wake rolled back (asleep) and raises _CopyFailed; the
    arena's own failures (OutOfMemoryError, CudaError) pass through as they are."""
    from .landing import mover_for

    arena, device, nbytes = loaded.arena, loaded.arena.device, loaded.nbytes
    mover, stream, src = mover_for(device), _stream(device), backup.span(nbytes)
    first_issued: list[float] = []

    def fill(offset: int, segment: Span) -> None:
        n = min(segment.nbytes, nbytes - offset)
        if n <= 0:
            return  # capacity past the image's bytes
        if not first_issued:
            first_issued.append(time.perf_counter())
        try:
            mover.copy(segment.sub(0, n), src.sub(offset, n), stream=stream)
        except FlashBootError as exc:
            raise _CopyFailed(exc) from exc

    parts: dict = {}
    t0 = time.perf_counter()
    arena.wake(fill, settle=stream.synchronize if stream is not None else None, timings=parts, donor=donor)
    try:
        meanwhile()  # while the copy engine drains the copies issued
    finally:
        t = time.perf_counter()
        if stream is not None:
            stream.synchronize()  # also when meanwhile failed: the caller releases these segments next
    done = time.perf_counter()
    report.map_ms = _map_ms(parts)
    report.sync_ms = (done - t) * 1e3
    report.copy_ms = (done - first_issued[0]) * 1e3 if first_issued else 0.0
    report.details["wake"] = parts
    if first_issued:
        report.details["first_copy_issued_ms"] = (first_issued[0] - t0) * 1e3


def _damaged(loaded, name: str, report: WakeReport, verify: bool, where: str) -> bool:
    """Whether ``verify`` found the bytes source ``name`` just copied damaged: the report names the
    chunk and the wake passes to the next source, which copies every byte again. A damaged backup is
    dropped: kept, it had failed this wake unsaid to the daemon or the disk, and a later wake without
    ``verify`` took its bytes as the image's."""
    if not verify:
        return False
    if name == "backup" and loaded.version != 0:
        # the image's checksums are version 0's: checked against them, a refit's bytes kept
        # whole by the backup had failed as a ChecksumMismatchError and the wake was undone
        # (None: a failed in-place refit's mix of versions, see ``loaded.refit_torn``)
        held = "a mix of refit versions" if loaded.version is None else f"refit version {loaded.version}"
        report.details["verify_skipped"] = f"the backup holds {held}; the image's checksums describe version 0"
        return False
    from ..errors import ChecksumMismatchError
    from .landing import verify_loaded

    tv = time.perf_counter()
    try:
        verify_loaded(loaded.arena, loaded.metadata, f"{where}, from {name}")
    except ChecksumMismatchError as exc:
        report.not_used[name] = f"failed verify: {exc}"
        if name == "backup":
            _state(loaded).drop_backup()
        return True
    finally:
        report.verify_ms += (time.perf_counter() - tv) * 1e3
    return False


def _check_wake_options(source: str = "auto", served_timeout_s: float = 10.0, **_) -> None:
    if source != "auto" and source not in SOURCES:
        raise FlashBootError(f"unknown wake source {source!r}; known: auto, {', '.join(SOURCES)}")
    # inf had raised a raw OverflowError from the daemon's client, a str a TypeError, NaN a timeout "within nan s"
    check_timeout(served_timeout_s, "wake served_timeout_s")


@_exclusive
def wake(loaded, *, source: str = "auto", keep_backup: bool = False, shm_dir=None, served_timeout_s: float = 10.0,
         stream_config=None, verify: bool = False, meanwhile: Callable[[], None] | None = None,
         _donor=None) -> WakeReport:
    """Wake ``loaded``: new segments at the same addresses, then its bytes from the first source
    that has them (``source="auto"``: backup, served, disk; or name one of :data:`SOURCES`).

    ``keep_backup``: keep the level-1 backup for the next ``sleep(level=1)`` (no new pin then)
    instead of freeing it. ``shm_dir``: the preloader's staging root, when not the default.
    ``served_timeout_s``: how long to wait for the daemon's socket. ``verify``: recompute the
    chunk checksums after each source's copy; a source whose bytes fail them passes to the next, the
    report naming the chunk, and a damaged backup is dropped (not for a refit version from the
    backup: the image's checksums are version 0's; ``details["verify_skipped"]`` says so). Waking an
    awake image is a no-op (source ``"awake"``).
    ``meanwhile``: called once while the bytes are being copied (served: while the daemon copies;
    backup: once every segment's copy is issued), or after a source that copies synchronously
    (disk); never when the wake fails before a copy starts or the image is awake (:func:`swap`
    releases the outgoing image there).

    Raises OutOfMemoryError (bytes needed and free) when the device has no room: the image stays
    asleep and can be woken later. When no source can be used, or every usable one failed,
    FlashBootError names each source and why, and the image stays asleep. A source that fails
    (the daemon gone mid-request) passes to the next, and the report says so. ``_donor``
    (private, :func:`swap`'s handover): an awake arena whose segments the arena takes as it
    wakes (:meth:`Arena.wake`'s ``donor``).

    After a refit (``loaded.version`` > 0), only the backup holds that version: a wake from the
    daemon or the disk brings the image's weights back, sets ``loaded.version`` to 0 and says so
    (``details["refit_version_lost"]``, the summary); refit again then.
    """
    _check_wake_options(source, served_timeout_s)
    arena = loaded.arena
    if _closed(loaded):
        raise FlashBootError(f"{loaded!r} is closed; there is nothing to wake")
    report = WakeReport(source="awake", nbytes=loaded.nbytes, device=str(arena.device))
    if not arena.asleep:
        return report
    state = _state(loaded)
    rank_source = loaded.source
    why_not = {  # asked only when the sources before have not brought the bytes back
        "backup": lambda: (None if state.backup is not None else
                           "sleep(level=2) kept no backup" if state.level == 2 else "no backup was taken"),
        "served": lambda: _served_why_not(rank_source, shm_dir),
        "disk": lambda: _disk_why_not(rank_source),
    }
    where = f"waking rank {rank_source.rank} of {rank_source.image_dir} ({loaded.nbytes:,} bytes on {arena.device})"
    meanwhile = _Once(meanwhile)
    t0 = time.perf_counter()
    try:
        for name in SOURCES if source == "auto" else (source,):
            tp = time.perf_counter()
            why = why_not[name]()
            report.probe_ms += (time.perf_counter() - tp) * 1e3
            if why is not None:
                report.not_used[name] = why
                continue
            if name == "backup" and arena.asleep:
                try:
                    _wake_from_backup(loaded, state.backup, report, meanwhile, _donor)  # OutOfMemoryError: still asleep
                except _CopyFailed as exc:
                    report.not_used[name] = f"failed: {type(exc.error).__name__}: {exc.error}"
                    continue
                if _damaged(loaded, name, report, verify, where):
                    continue
                report.source = name
                break
            if arena.asleep:
                parts: dict = {}
                arena.wake(timings=parts, donor=_donor)  # OutOfMemoryError here leaves it asleep
                report.map_ms = _map_ms(parts)
                report.details["wake"] = parts
            t2 = time.perf_counter()
            try:
                if name == "backup":  # the arena woke for a source that failed after it
                    _copy(arena.span(0, loaded.nbytes), state.backup.span(loaded.nbytes), arena.device)
                elif name == "served":
                    _from_served(loaded, rank_source, report, shm_dir, served_timeout_s, meanwhile)
                else:
                    _from_disk(loaded, rank_source, report, stream_config)
            except FlashBootError as exc:
                if isinstance(exc, OutOfMemoryError):
                    raise
                report.not_used[name] = f"failed: {type(exc).__name__}: {exc}"
                continue
            report.copy_ms = (time.perf_counter() - t2) * 1e3
            meanwhile()  # a no-op where it ran during the copy
            if _damaged(loaded, name, report, verify, where):
                continue
            report.source = name
            break
        else:
            tried = "every source failed" if not arena.asleep else "no source has the bytes"
            raise FlashBootError(f"{where}: {tried}; " + "; ".join(f"{s}: {why}" for s, why in report.not_used.items()))
    except BaseException as exc:
        arena.sleep()  # nothing half-woken is handed back (a no-op when it never woke)
        if isinstance(exc, _MeanwhileFailed):
            raise exc.error from None
        raise
    if not keep_backup:
        state.drop_backup()
    state.level = 0
    if report.source != "backup" and loaded.version != 0:
        # the daemon and the disk hold the image as pre-packed: a refit's version (or a failed
        # refit's mix) did not survive; the bytes are the image's whole again
        report.details["refit_version_lost"] = "torn" if loaded.version is None else loaded.version
        loaded.version, loaded.refit_torn = 0, None
        from flashboot.flashclone.holder_refit import remember

        remember(loaded.arena, None)  # a later hand-over holds the image's bytes
    report.total_ms = (time.perf_counter() - t0) * 1e3
    return report


__all__ = ["HostBackup", "SOURCES", "SleepReport", "WakeReport", "close_lifecycle", "held_still", "sleep", "wake"]
