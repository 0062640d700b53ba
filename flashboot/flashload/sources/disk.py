"""The disk source: the image file streamed straight into the arena through the bounded ring of
:mod:`flashboot.flashload.stream`, when nothing is or will be staged in shared memory (no
preloader runs, it stages other ranks, the staged copy is of another pre-pack, or shared memory
cannot hold the image). Waiting for a ``.ready`` file nobody will write would only end in a timeout.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ...errors import FlashBootError, LayoutError
from ...memory import Device
from ..landing import Beside, timed_views, verify_loaded
from ..report import LoadedImage
from ..stream import StreamConfig, StreamStats, stream_image
from ..want import LoadRequest, Want
from .base import Offer, Source, register_source


# ============================================================================ when to stream
def _shm_free_bytes(path) -> tuple[int, str]:
    """Free bytes of the filesystem that holds ``path`` (its nearest existing ancestor)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize, p


def stream_reason(image_dir, rank: int, source, *, shm_dir=None, stream: bool | None = None) -> str | None:
    """Why a load of rank ``rank`` should stream from disk; None when it should use (or wait for)
    the staged copy in shared memory.

    ``stream``: True always streams, False never does (the load waits for ``.ready`` as before),
    None decides: use the staged copy when its ``.ready`` is there and of this pre-pack; wait for
    it only when a preloader runs, stages this rank and shared memory can hold it (or it is
    already writing it); stream otherwise.
    """
    from ..shm import _read_pid_file, _running_pid, check_ready, pid_file, read_ready, staged_paths

    if stream is True:
        return "stream=True was asked"
    if stream is False:
        return None
    paths = staged_paths(image_dir, rank, shm_dir)
    try:
        check_ready(read_ready(paths.ready), source)
        return None
    except FileNotFoundError:
        staged = f"rank {rank} is not staged"
    except LayoutError as exc:
        staged = f"its staged copy is unusable ({exc})"
    nbytes = source.nbytes
    free, where = _shm_free_bytes(paths.dir)
    room = nbytes <= free
    no_room = f"{where} has {free:,} bytes free, the image needs {nbytes:,}"
    pid = _running_pid(pid_file(image_dir, shm_dir))
    if pid is None:
        return f"no preloader runs for {image_dir} and {staged}" + ("" if room else f"; {no_room}")
    ranks = (_read_pid_file(pid_file(image_dir, shm_dir)) or {}).get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and all(type(r) is int for r in ranks)):
        raise LayoutError(f"{pid_file(image_dir, shm_dir)}: 'ranks' must list ints, found {str(ranks)[:100]}")
    if ranks is not None and rank not in ranks:
        return f"the preloader (pid {pid}) stages ranks {ranks}, not rank {rank}"
    if staged.startswith("its staged copy"):
        return f"{staged}; the preloader (pid {pid}) does not replace it"
    failed = _failed_in_daemon(image_dir, rank, shm_dir) if (_read_pid_file(pid_file(image_dir, shm_dir)) or {}).get(
        "serve") is True else None
    if failed is not None:
        return f"the preloader (pid {pid}) failed to stage rank {rank}: {failed}"
    if paths.partial.exists() or room:
        return None  # the preloader is writing it, or will: wait for .ready
    return f"the preloader (pid {pid}) cannot stage rank {rank}: {no_room}"


DAEMON_STATUS_TIMEOUT_S = 2.0
"""How long :func:`stream_reason` asks a serving preloader whether it failed a rank."""


def _failed_in_daemon(image_dir, rank: int, shm_dir) -> str | None:
    """The error a serving preloader met staging ``rank`` (it keeps serving the others), or None
    where it did not fail it or does not answer. Its rank's ``.ready`` never comes: a load that
    waited for it (a full /dev/shm of inodes, a thread or fd limit) sat out its whole timeout."""
    from ..client import serve_status

    try:
        state = serve_status(image_dir, shm_dir, timeout_s=DAEMON_STATUS_TIMEOUT_S)["ranks"].get(str(rank)) or {}
    except (FlashBootError, OSError, KeyError, AttributeError, TypeError):
        return None  # not answering (starting, stopping): wait for .ready as before
    return str(state.get("error")) if state.get("state") == "failed" else None


# ============================================================================ the load
def report_stream(report, stats: StreamStats, reason: str, nbytes: int) -> None:
    """Fill a :class:`~flashboot.flashload.report.LoadReport` with what a streamed load did: the read
    rate, the ring's size and peak, and how much faster the copy of a staged image would be."""
    from ...units import format_bytes

    report.pin_ms = stats.pin_ms
    report.h2d_ms = stats.seconds * 1e3
    report.overlapped = ["bind"]
    report.chunks = stats.chunks
    staged_ms = nbytes / (stats.copy_gbps * 1e9) * 1e3 if stats.copy_s > 0 else 0.0
    faster = report.h2d_ms / staged_ms if staged_ms > 0 else float("inf")
    report.details.update(
        streamed_from_disk=True, stream_reason=reason, io_mode=stats.io_mode, io_reason=stats.io_reason,
        read_gbps=stats.read_gbps, buffer_bytes=stats.buffer_bytes, buffer_cap_bytes=stats.buffer_cap_bytes,
        peak_buffer_bytes=stats.peak_buffer_bytes, slots=stats.slots, slot_bytes=stats.slot_bytes,
        threads=stats.threads, reads=stats.reads, bulk_copy_gbps=stats.copy_gbps, staged_copy_ms_estimate=staged_ms,
        staged_speedup_estimate=faster,
        note=(f"streamed from disk ({stats.io_mode}) because {reason}: read {stats.read_gbps:.2f} GB/s "
              f"({stats.reads.get('kept', '?')} in flight) through "
              f"a {format_bytes(stats.buffer_bytes)} ring (peak {format_bytes(stats.peak_buffer_bytes)} in use, "
              f"cap {format_bytes(stats.buffer_cap_bytes)}); staged, the copy would take ~{staged_ms:.1f} ms "
              f"at {stats.copy_gbps:.1f} GB/s ({faster:.1f}x faster): run `flashboot preload`"))


def _stream_beside_views(path, nbytes: int, arena, config: StreamConfig, build_views, identity=None
                         ) -> tuple[StreamStats, Any]:
    """Stream the image into ``arena`` while ``build_views()`` runs in a helper thread, started once
    the reads are; returns (the stream's stats, what ``build_views`` returned). The helper has
    ended when this returns or raises (the views go with the arena); the stream's error is the
    one raised when both fail."""
    side = None

    def start_views():
        nonlocal side
        side = Beside(build_views)

    try:
        stats = stream_image(path, nbytes, arena, config, on_start=start_views, identity=identity)
    except BaseException:
        if side is not None:
            try:
                side.join()
            except BaseException:
                pass  # the stream's error is the one to report
        raise
    return stats, (side.join() if side is not None else build_views())


# ============================================================================ the source
@register_source
class DiskSource(Source):
    """The image file streamed into the arena through the bounded ring."""

    name, mode, order = "disk", "stream", 1

    def offer(self, want: Want) -> Offer:
        why = stream_reason(want.image_dir, want.rank, want.source, shm_dir=want.shm_dir, stream=want.stream)
        return Offer(True, why) if why is not None else Offer(False, "the staged copy is (or will be) in shared memory")

    def load(self, request: LoadRequest, rank_source, report, why: str) -> LoadedImage:
        """The arena is created, the image streamed into it while the views are built, then
        (``verify``) its chunk checksums recomputed. A failure releases the arena and the ring; no
        view is returned. The report says it streamed, why, the read rate, the ring's size and
        peak, and the copy time a staged load would have (the bulk copy rate measured on the
        ring's own copies)."""
        from ...arena import Arena

        dev, meta, nbytes = request.device, rank_source.metadata, rank_source.nbytes
        report.mode = "streamed from disk"
        arena = None
        try:
            t0 = time.perf_counter()
            arena = Arena.create(nbytes, dev)
            arena.bytes()  # its flat tensor made here, not in the views' thread (torch/CuPy device state is per thread)
            report.alloc_ms = (time.perf_counter() - t0) * 1e3
            stats, views = _stream_beside_views(rank_source.path, nbytes, arena, StreamConfig.of(request.stream_config),
                                                lambda: timed_views(arena, meta, report),
                                                rank_source.image.file_identity)
            report_stream(report, stats, why, nbytes)
            if request.verify:
                verify_loaded(arena, meta, f"{rank_source.path} (rank {rank_source.rank}) streamed into {dev}", report)
        except BaseException:
            if arena is not None and not arena.closed:
                arena.close()
            raise
        report.total_ms = (time.perf_counter() - request.t_start) * 1e3
        return LoadedImage(arena, views, meta, report, rank_source)

    def start_prepared(self, handle, t: float):
        """The reads start at once (the arena exists), in the background thread."""
        yield
        handle.copy_issued()
        stats = stream_image(handle.image.path, handle.nbytes, handle.arena, handle.stream_config,
                             identity=handle.image.file_identity, cancel=handle.cancelled)
        handle.copy = {"h2d_ms": stats.seconds * 1e3, "stats": stats}
        return t

    def report_prepared(self, report, prepared, dev: Device) -> None:
        report.mode = "streamed from disk, prepared"
        report_stream(report, prepared.copy["stats"], prepared.why, report.nbytes)
        # the ring was pinned by prepare's thread, not by this call (as the pinned source's pin):
        # its pin had been listed among the load's phases, beside the wait that holds what was left
        report.pinned_early_ms, report.pin_ms = report.pin_ms, 0.0
        report.overlapped = ["h2d"]


__all__ = ["DiskSource", "report_stream", "stream_reason"]
