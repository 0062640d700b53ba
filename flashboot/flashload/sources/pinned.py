"""The pinned-here source: the preloader staged the rank in shared memory (no daemon serves it);
this process maps and pins the staged file (:class:`~flashboot.flashload.stage.StagedImage`) and
copies it to the arena in one bulk H2D. The pin is paid on the critical path (``load(dir)``),
early (``load(dir, staged=flashboot.stage(...))``) or by :func:`flashboot.prepare`."""

from __future__ import annotations

import time

from ...memory import Device
from ..landing import DEFAULT_CHUNK_BYTES, bulk_copy, mover_for, one_time_costs, timed_views, verify_loaded, warm_copy
from ..report import LoadedImage
from ..want import LoadRequest, Want
from .base import Offer, Source, register_source


def _note_pageable(report, dev: Device, pinned: bool) -> None:
    if dev.is_cuda and not pinned:
        report.details["pageable"] = "the staged image is not pinned: the copy runs at pageable speed"


@register_source
class PinnedSource(Source):
    """The staged image in shared memory, pinned in this process and copied in bulk."""

    name, mode, order = "pinned", "staged", 2
    copies_staged = True

    def offer(self, want: Want) -> Offer:
        daemon = want.daemon
        if daemon is None:
            return Offer(True, "the staged copy is (or will be) in shared memory")
        if daemon.running:
            return Offer(True, f"a preloader without --serve runs (pid {daemon.pid}): pinning its staged copy here")
        return Offer(True, "no served-load daemon runs: pinning the staged copy here")

    def load(self, request: LoadRequest, rank_source, report, why: str) -> LoadedImage:
        """Pin here (no ``staged=``: this call stages) or take the early pin, create the arena
        meanwhile, copy in bulk while the views are built, verify."""
        from ...arena import Arena
        from ..stage import StagedImage

        source, dev, staged, rank = rank_source, request.device, request.staged, request.rank
        meta, nbytes = source.metadata, source.nbytes
        arena = None
        own_staged = None
        try:
            if staged is None:
                own_staged = staged = StagedImage(request.image_dir, rank, dev, timeout_s=request.timeout_s,
                                                  shm_dir=request.shm_dir, source=source)
            was_done = staged.done
            t0 = time.perf_counter()
            arena = Arena.create(nbytes, dev)  # overlaps the pin when this call staged
            mover = mover_for(dev)
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
            _note_pageable(report, dev, staged.pinned)
            t3 = time.perf_counter()
            # Views are only pointers into the arena: they are made while the DMA fills it.
            report.chunks, tensors = bulk_copy(mover, arena, staged.span(), nbytes, request.chunk_bytes,
                                               meanwhile=lambda: timed_views(arena, meta, report))
            report.h2d_ms = (time.perf_counter() - t3) * 1e3
            report.overlapped = ["bind"]
            report.details["one_time_ms"] = one_time_costs(report, pin=report.pin_ms)
            if staged.ready is not None:
                report.details.update(io_mode=staged.ready.io_mode, numa_node=staged.ready.numa_node)
            if request.verify:
                where = self.bytes_from(source.path, request.image_dir, rank, staged.shm_dir)  # stage()'s root
                verify_loaded(arena, meta, f"{where} (rank {rank}) loaded into {dev}", report)
        except BaseException:
            if arena is not None and not arena.closed:
                arena.close()
            if own_staged is not None:
                own_staged.close()
            raise
        release = own_staged.close_in_background() if own_staged is not None else None  # not the engine's wait
        report.total_ms = (time.perf_counter() - request.t_start) * 1e3
        return LoadedImage(arena, tensors, meta, report, source, release)

    def start_prepared(self, handle, t: float):
        """The pin of the staged file starts in the background and the copy path is warmed
        meanwhile; the bulk H2D is issued once the pin is done. All of it runs in the background
        thread (the arena was made there too: a thread's CUDA state stays with it)."""
        from ..stage import StagedImage

        yield

        handle.staged = StagedImage(handle.image_dir, handle.rank, handle.device, timeout_s=handle.timeout_s,
                                    shm_dir=handle.shm_dir, source=handle.rank_source)
        t = handle.phase("stage_start", t)
        handle.copy_issued()  # the pin runs in the driver; the copy follows it
        handle.mover = mover_for(handle.device)
        warm_copy(handle.device, handle.mover)
        t = handle.phase("warm", t)
        handle.staged.wait()
        t_copy = handle.phase("pin_wait", t)
        chunks, _ = bulk_copy(handle.mover, handle.arena, handle.staged.span(), handle.nbytes, DEFAULT_CHUNK_BYTES)
        handle.copy = {"h2d_ms": (time.perf_counter() - t_copy) * 1e3, "chunks": chunks,
                       "pinned": handle.staged.pinned, "pin_ms": handle.staged.pin_ms}
        handle.release_thread = handle.staged.close_in_background()  # the unpin (~170 ms for 8 GB) is nobody's wait
        return t_copy

    def report_prepared(self, report, prepared, dev: Device) -> None:
        copy = prepared.copy
        report.mode = ("pinned early, prepared" if copy["pinned"] else "staged, prepared") if dev.is_cuda else \
            "host, prepared"
        report.pinned_early_ms = copy["pin_ms"]
        report.chunks = copy["chunks"]
        _note_pageable(report, dev, copy["pinned"])


__all__ = ["PinnedSource"]
