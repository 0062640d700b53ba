"""The served source: a ``flashboot preload --serve`` daemon holds the image pinned and copies it
into this process's exported arena; this process waits only for the descriptor exchange and the
copy, and reads the metadata and builds the views meanwhile."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import LayoutError
from ...memory import Device
from ..landing import admit, one_time_costs, timed_views
from ..report import LoadedImage, LoadReport
from ..want import LoadRequest, Want, check_job_request
from .base import Offer, Source, register_source


@dataclass
class StartedCopy:
    """What :func:`copy_first` started: the arena the daemon copies into, its request, the
    ``.ready`` it was sized from, the metadata bytes read (and checked against the ``.ready``), and
    the milliseconds of each step: before the arena (``wait_ms``, the ``.ready`` awaited),
    ``alloc_ms`` (the first batch's segments), ``request_ms`` (its exports and the request sent:
    the copy starts, at ``requested_at``), ``handover_ms`` (the later batches made, exported and
    sent, while the daemon copies), ``metadata_ms`` (read, hashed and the table decoded: beside
    the copy where ``metadata_beside_copy``)."""

    arena: Any
    copy: Any
    ready: Any
    metadata_file: Any
    wait_ms: float
    alloc_ms: float
    request_ms: float
    handover_ms: float
    metadata_ms: float
    requested_at: float
    metadata_beside_copy: bool


def copy_first(image_dir, rank: int, dev: Device, **kwargs) -> StartedCopy:
    """:func:`copy_first_steps` run through on the caller's thread (a plain served load)."""
    steps = copy_first_steps(image_dir, rank, dev, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def copy_first_steps(image_dir, rank: int, dev: Device, *, shm_dir, timeout_s: float, verify: bool, resolved, tp,
                     ep, expected_key, ready=None, make_arena: Callable[[int], Any] | None = None,
                     rest_later: bool = False, read_beside: Callable[[], bool] = lambda: False):
    """Start the daemon's copy of rank ``rank`` into a new arena before this process reads the
    metadata, then read it (the bytes hashed, the table decoded) while the daemon copies. A
    generator whose value is the :class:`StartedCopy`; with ``rest_later`` it yields the
    :class:`~flashboot.flashload.client.ServedCopy` once, as soon as the request with the
    arena's first batch is out: what follows (the later batches made, exported and handed over,
    the metadata read, without threads of its own, and checked) is then the next step's, which an early call runs in its
    background thread beside the engine (their driver calls and file reads release the GIL).

    The arena is sized from the rank's ``.ready`` as it is now (``ready``: one already read); the
    request names the ``.ready``'s metadata sha256, which the daemon checks against what it holds.
    The metadata read next must be those bytes; where it is not (the image was re-packed since
    it was staged), the copy is discarded (the daemon done with the arena, the arena released) and
    the load goes the other way round: the metadata first, then the ``.ready`` of those bytes
    awaited (:func:`~flashboot.flashload.client.served_ready`: waited for while a preloader
    re-stages, refused otherwise). With no ``.ready`` yet, that order from the start. Before
    any of it, the job file's tp, ep and key are checked against ``tp``, ``ep`` and
    ``expected_key`` (``resolved``: :func:`~flashboot.layouts.image.resolve_rank`'s result), so
    those are refused before any byte moves. ``make_arena(nbytes)``: how the arena is made
    (default: admitted on ``dev``, then created). ``read_beside()``: asked, with ``rest_later``,
    before and after the later batches are handed over: True reads the metadata's files in
    threads of their own after all (the load is waiting for them, with nothing of the engine's to
    run beside), before the hand-over if it says so then, so that they are read meanwhile.
    A failure releases what it made."""
    from flashboot.layouts.image import begin_metadata_read, read_metadata_file

    from ...arena import Arena
    from ..client import first_batch_segments, served_ready, served_ready_now, start_served_load

    if make_arena is None:
        def make_arena(nbytes: int):
            admit(nbytes, dev)
            return Arena.create(nbytes, dev, segments_now=first_batch_segments())

    t0 = time.perf_counter()
    reads_later = rest_later
    if resolved[1] is not None:
        check_job_request(resolved[1], tp=tp, ep=ep, expected_key=expected_key)
    mf, metadata_ms = None, 0.0
    if ready is None:
        ready = served_ready_now(image_dir, rank, shm_dir=shm_dir)
    while True:
        if ready is None:  # nothing staged yet, or staged from other bytes: the metadata first, then its .ready
            if mf is None:
                tm = time.perf_counter()
                mf = read_metadata_file(image_dir, rank, decode=True, resolved=resolved)
                metadata_ms += (time.perf_counter() - tm) * 1e3
            ready = served_ready(image_dir, rank, mf.sha256, mf.where, timeout_s=timeout_s, shm_dir=shm_dir)
        if ready.nbytes == 0:
            raise LayoutError(f"{ready.path}: empty image, nothing to load")
        t1 = time.perf_counter()
        waited_ms = (t1 - t0) * 1e3 - metadata_ms  # the metadata read before the arena is metadata_ms's
        beside = mf is None
        # both files read (and hashed) in threads while the arena is made and the copy asked for:
        # those release the GIL too; the table is decoded once the daemon copies. The early call
        # reads them in its background thread after the hand-over instead, without threads of
        # their own while its load is not called yet: nothing waits for them then, and beside the
        # engine's Python each thread started or joined is another wait for the GIL (and the
        # caller's return is sooner)
        pending = begin_metadata_read(image_dir, rank, resolved=resolved) if beside and not reads_later else None
        arena = make_arena(ready.nbytes)
        copy = None
        try:
            t2 = time.perf_counter()  # the exports go with the request, batch by batch (client.STREAM_BATCH_BYTES)
            copy = start_served_load(arena, image_dir=str(image_dir), rank=rank, nbytes=ready.nbytes,
                                     metadata_sha256=ready.metadata_sha256, timeout_s=timeout_s, shm_dir=shm_dir,
                                     verify=verify, rest_later=rest_later)
            if rest_later:
                rest_later = False  # once: a retry below runs through
                yield copy
                if beside and read_beside():  # the load waits already: the
                    pending = begin_metadata_read(image_dir, rank, resolved=resolved)  # reads beside the hand-over
                copy.hand_over_rest()
            t3 = time.perf_counter()
            if beside:
                # in threads after all once the load waits for them (an engine with no start-up
                # work of its own), as a plain load does: C's 40,250 tensors at W = 0 on the H200
                # took 30 ms in turn, 21.5 in threads
                mf = (pending or begin_metadata_read(image_dir, rank, resolved=resolved, beside=read_beside())).finish()
                metadata_ms += (time.perf_counter() - t3) * 1e3
        except BaseException:
            if copy is not None:
                copy.settle()  # the daemon may still be writing into the arena
            if not arena.closed:
                arena.close()
            raise
        if mf.sha256 == ready.metadata_sha256:
            return StartedCopy(arena, copy, ready, mf, wait_ms=waited_ms, alloc_ms=(t2 - t1) * 1e3,
                               request_ms=(copy.sent_at - t2) * 1e3, handover_ms=copy.handover_ms,
                               metadata_ms=metadata_ms, requested_at=copy.sent_at, metadata_beside_copy=beside)
        copy.settle()  # re-packed since it was staged: these bytes are another pre-pack's, never served
        arena.close()
        ready = None


@register_source
class ServedSource(Source):
    """The preloader daemon's copy into this process's exported arena."""

    name, mode, order = "served", "served", 0
    verified_by_daemon = True
    copies_staged = True  # the daemon copies what it staged
    copies_before_metadata = True

    def offer(self, want: Want) -> Offer:
        daemon = want.daemon
        if daemon is None:
            return Offer(False, "a load takes the daemon when served=True asks for it")
        if daemon.running and daemon.serve:
            return Offer(True, f"a served-load daemon runs (pid {daemon.pid})")
        return Offer(False, "no served-load daemon runs")

    def load(self, request: LoadRequest, rank_source, report, why: str) -> LoadedImage:
        """The daemon copies; the metadata is read and validated and the views built meanwhile.

        Why the copy may start before this process has read the metadata: the preloader writes a
        rank's ``.ready`` only after its strict reader accepted the metadata bytes whose sha256 it
        records there, and the daemon re-checks that sha256 and the size of what it holds before
        it copies. So the arena is sized from the ``.ready`` and the daemon asked at once, naming
        that sha256 (:func:`copy_first`); this process then reads the metadata bytes, which must be
        those very bytes (else the image was re-packed since it was staged: that copy is
        discarded and the load goes on as if no ``.ready`` had been there, waiting for the
        re-staged one or refusing), validates them and its own rank, tp, ep, key and job, and
        builds the views, all while the DMA runs. The job file's tp, ep and key are checked before
        any byte moves. If a check fails, the load waits for the daemon to be done with the
        arena, releases it and raises: no tensor is handed out.
        """
        from flashboot.layouts.image import open_image, resolve_rank

        from ..shm import RankSource

        image_dir, rank, dev, t_start = request.image_dir, request.rank, request.device, request.t_start
        timeout_s, verify, shm_dir = request.timeout_s, request.verify, request.shm_dir
        tp, ep, expected_key = request.tp, request.ep, request.expected_key
        report = LoadReport(mode="served", device=str(dev), rank=rank, nbytes=0)
        t0 = time.perf_counter()
        arena = copy = None
        try:
            started = copy_first(image_dir, rank, dev, shm_dir=shm_dir, timeout_s=timeout_s, verify=verify,
                                 resolved=resolve_rank(image_dir, rank), tp=tp, ep=ep, expected_key=expected_key)
            arena, copy, ready, mf = started.arena, started.copy, started.ready, started.metadata_file
            nbytes = report.nbytes = ready.nbytes
            report.wait_ms, report.alloc_ms = started.wait_ms, started.alloc_ms
            t3 = time.perf_counter()
            image = open_image(mf, rank, tp=tp, ep=ep, expected_key=expected_key)
            meta = image.metadata
            if image.nbytes != nbytes:
                raise LayoutError(f"{ready.path} records {nbytes:,} bytes, {mf.where} {image.nbytes:,}")
            t4 = time.perf_counter()
            tensors = timed_views(arena, meta, report)
            t5 = time.perf_counter()
            reply = copy.wait()
            t6 = time.perf_counter()
            t_requested = started.requested_at
            report.metadata_ms = started.metadata_ms + (t4 - t3) * 1e3
            report.tensors = len(meta.tensors)
            report.h2d_ms = reply["h2d_ms"]
            daemon_ms = reply["h2d_ms"] + reply.get("checksum_ms", 0.0)
            # Request to reply ran beside our own work (metadata + views): the exchange is what exceeds both.
            report.exchange_ms = max(0.0, (t6 - t_requested) * 1e3 - max(daemon_ms, (t5 - t_requested) * 1e3))
            report.overlapped = ["metadata", "bind"]
            report.pinned_early_ms = reply.get("pin_ms", 0.0)
            report.chunks = -(-nbytes // (1 << 30))
            report.details = {"daemon_pid": reply.get("pid"), "daemon_map_ms": reply.get("map_ms"),
                              "daemon_pinned": reply.get("pinned"), "copy_wait_ms": (t6 - t5) * 1e3,
                              # where a first call's extra time hides (H200, shape C: 503 ms first, 130 ms second):
                              # before the phases (imports, argument checks) and connecting + sending the request
                              "setup_ms": (t0 - t_start) * 1e3, "request_ms": started.request_ms,
                              "handover_ms": started.handover_ms,
                              "metadata_beside_copy": started.metadata_beside_copy,
                              "one_time_ms": one_time_costs(report, daemon_map=reply.get("map_ms", 0.0))}
            if verify:  # the daemon digested what it copied, in the arena; no kernel runs in this process
                from ..client import check_daemon_digests

                where = self.bytes_from(image.path, image_dir, rank, shm_dir)
                check_daemon_digests(reply, meta, f"{where} (rank {rank}) loaded into {dev}", report)
        except BaseException:
            if copy is not None:
                copy.settle()  # the daemon may still be writing into the arena
            if arena is not None and not arena.closed:
                arena.close()
            raise
        report.total_ms = (time.perf_counter() - t_start) * 1e3
        return LoadedImage(arena, tensors, meta, report, RankSource(str(image_dir), rank, image, mf.sha256))

    def start_prepared(self, handle, t: float):
        """Copy first (:attr:`copies_before_metadata`), as a plain served load (:func:`copy_first`):
        the arena of the ``.ready``'s size handed to the daemon, which copies at once (it maps the
        segments piece by piece). Up to that request the steps run on the caller's thread (unless
        the ``.ready`` is not there yet: then it is waited for in the background), and
        :func:`flashboot.prepare` returns. The background thread then makes, exports and hands
        over the later batches while the first ones copy, reads the metadata, checks it against
        the ``.ready`` and validates it strictly (the load makes the views), and waits for the
        daemon's reply. Why not on the caller's thread: those are ~50 driver calls, file reads
        and a hash that release the GIL (B, 11.8 GB: 7-8 ms of hand-over and ~4 ms of the
        metadata's reads on the H200), which beside the engine's start-up cost it only their
        Python. A refusal of the metadata waits for the daemon to be done with the arena before
        it is released."""
        from ..client import first_batch_segments, served_ready_now

        ready = served_ready_now(handle.image_dir, handle.rank, shm_dir=handle.shm_dir)
        if ready is None:  # still staging (or none yet): copy_first waits for it, off the caller's thread
            yield
        t = handle.phase("wait", t)

        def make_arena(nbytes: int):
            # the daemon copies through its own mapping; the first batch's segments are made now,
            # the rest as they are handed over (client.first_batch_segments)
            handle.create_arena(nbytes, flat=False, segments_now=first_batch_segments())
            return handle.arena

        steps = copy_first_steps(handle.image_dir, handle.rank, handle.device, shm_dir=handle.shm_dir,
                                 timeout_s=handle.timeout_s, verify=handle.verify, resolved=handle.resolved,
                                 tp=handle.tp, ep=handle.ep, expected_key=handle.expected_key, ready=ready,
                                 make_arena=make_arena, rest_later=True, read_beside=lambda: handle.load_called)
        handle.session = next(steps)  # the request is out with the arena's first batch: the daemon copies
        # prepare() returns now; the later batches and the metadata follow in the background
        # thread, at the lowered switch interval (their driver calls and reads release the GIL)
        handle.copy_issued()
        yield
        try:
            started = yield from steps
        except BaseException:
            handle.session = None  # settled and released by copy_first_steps
            raise
        handle.session, handle.metadata_file = started.copy, started.metadata_file
        handle.metadata_sha256 = started.metadata_file.sha256
        handle.handover_cpu_ms = started.copy.handover_cpu_ms  # part of its thread's CPU: see PreparedLoad
        for name, ms in (("wait", started.wait_ms), ("arena", started.alloc_ms), ("attach", started.request_ms),
                         ("handover", started.handover_ms), ("metadata", started.metadata_ms)):
            handle.phases_ms[name] = handle.phases_ms.get(name, 0.0) + ms
        t_copy = started.requested_at
        try:
            t = time.perf_counter()
            handle.arena.bytes()  # the flat tensor the views are cut from, made while the daemon copies
            # the strict read of the decoded table, still at the lowered interval: its numpy passes
            # release the GIL too, and at the engine's 5 ms each took that long to get it back (B
            # on the H200: ~110 ms for ~4 ms of work, ending as W = 0.25 s did, so the load waited)
            handle.open_metadata(started.ready.nbytes, viewable=False)
            handle.phase("metadata", t)
        except BaseException:
            handle.session.settle()  # the daemon may still write into it
            raise
        handle.copy_issued(waits_in_c=True)  # the interval back (only the wait in C is left), then viewable
        yield handle.session  # (or on the load's thread, if the load waits for it first)
        reply = handle.session.wait()
        handle.phases_ms["daemon_map"] = float(reply.get("map_ms", 0.0))
        handle.copy = {"h2d_ms": reply["h2d_ms"], "reply": reply}
        return t_copy

    def verify_prepared(self, handle, where: str, checked: LoadReport) -> None:
        """The daemon digested what it copied, in the arena: its digests are compared."""
        from ..client import check_daemon_digests

        check_daemon_digests(handle.copy["reply"], handle.metadata, where, checked)

    def report_prepared(self, report, prepared, dev: Device) -> None:
        reply = prepared.copy["reply"]
        report.mode = "served, prepared"
        report.pinned_early_ms = reply.get("pin_ms", 0.0)
        report.chunks = -(-report.nbytes // (1 << 30))
        report.details.update(daemon_pid=reply.get("pid"), daemon_map_ms=reply.get("map_ms"),
                              daemon_pinned=reply.get("pinned"))


__all__ = ["ServedSource"]
