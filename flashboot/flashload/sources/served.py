"""The served source: a ``flashboot preload --serve`` daemon holds the image pinned and copies it
into this process's exported arena; this process waits only for the descriptor exchange and the
copy, and reads the metadata and builds the views meanwhile."""

from __future__ import annotations

import time

from ...errors import LayoutError
from ...memory import Device
from ..landing import admit, one_time_costs, timed_views
from ..report import LoadedImage, LoadReport
from ..want import LoadRequest, Want, check_job_request
from .base import Offer, Source, register_source


@register_source
class ServedSource(Source):
    """The preloader daemon's copy into this process's exported arena."""

    name, mode, order = "served", "served", 0
    verified_by_daemon = True
    copies_before_metadata = True

    def offer(self, want: Want) -> Offer:
        daemon = want.daemon
        if daemon is None:
            return Offer(False, "a load takes the daemon when served=True asks for it")
        if daemon.running and daemon.serve:
            return Offer(True, f"a served-load daemon runs (pid {daemon.pid})")
        return Offer(False, "no served-load daemon runs")

    def load(self, request: LoadRequest, rank_source, report, why: str) -> LoadedImage:
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

        from ...arena import Arena
        from ..client import served_ready, start_served_load
        from ..shm import RankSource

        image_dir, rank, dev, t_start = request.image_dir, request.rank, request.device, request.t_start
        timeout_s, verify, shm_dir = request.timeout_s, request.verify, request.shm_dir
        tp, ep, expected_key = request.tp, request.ep, request.expected_key
        report = LoadReport(mode="served", device=str(dev), rank=rank, nbytes=0)
        t0 = time.perf_counter()
        mf = read_metadata_file(image_dir, rank, decode=True)  # the bytes, hashed; the table decoded meanwhile
        sha = mf.sha256
        if mf.job is not None:  # the caller's tp, ep and key are refused before any byte moves
            check_job_request(mf, tp=tp, ep=ep, expected_key=expected_key)
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
            t2 = time.perf_counter()  # the exports go with the request, batch by batch (client.STREAM_BATCH_BYTES)
            copy = start_served_load(arena, image_dir=str(image_dir), rank=rank, nbytes=nbytes, metadata_sha256=sha,
                                     timeout_s=timeout_s, shm_dir=shm_dir, verify=verify)
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
                              "one_time_ms": one_time_costs(report, daemon_map=reply.get("map_ms", 0.0))}
            if verify:  # the daemon digested what it copied, in the arena; no kernel runs in this process
                from ..client import check_daemon_digests

                check_daemon_digests(reply, meta, f"{image.path} (rank {rank}) loaded into {dev}", report)
        except BaseException:
            if copy is not None:
                copy.settle()  # the daemon may still be writing into the arena
            if arena is not None and not arena.closed:
                arena.close()
            raise
        report.total_ms = (time.perf_counter() - t_start) * 1e3
        return LoadedImage(arena, tensors, meta, report, RankSource(str(image_dir), rank, image, sha))

    def start_prepared(self, handle, t: float):
        """Copy first (:attr:`copies_before_metadata`), as a plain served load: the ``.ready`` of
        these metadata bytes, the arena of its size handed to the daemon, which copies at once
        (the fds of later batches follow while the first ones copy, and it maps the segments
        piece by piece); the strict read of the metadata runs while it copies, before
        :func:`flashboot.prepare` returns (the load makes the views). All of that runs on the
        caller's thread unless the ``.ready`` is not there yet (then it is waited for in the
        background); the wait for the daemon's reply is handed to the background. A refusal of
        the metadata waits for the daemon to be done with the arena before it is released."""
        from ..client import served_ready, served_ready_now, start_served_load

        mf = handle.metadata_file
        ready = served_ready_now(handle.image_dir, handle.rank, mf.sha256, shm_dir=handle.shm_dir)
        if ready is None:  # still staging (or another pre-pack's): waited for off the caller's thread
            yield
            ready = served_ready(handle.image_dir, handle.rank, mf.sha256, mf.where, timeout_s=handle.timeout_s,
                                 shm_dir=handle.shm_dir)
        if ready.nbytes == 0:
            raise LayoutError(f"{ready.path}: empty image, nothing to load")
        t = handle.phase("wait", t)
        handle.create_arena(ready.nbytes, flat=False)  # the daemon copies through its own mapping
        t = handle.phase("arena", t)
        handle.session = start_served_load(handle.arena, image_dir=handle.image_dir, rank=handle.rank,
                                           nbytes=ready.nbytes, metadata_sha256=mf.sha256,
                                           timeout_s=handle.timeout_s, shm_dir=handle.shm_dir, verify=handle.verify)
        t_copy = handle.phase("attach", t)
        try:
            handle.arena.bytes()  # the flat tensor the views are cut from, made while the daemon copies
            # The strict read of the decoded table runs while the daemon copies, and prepare()
            # returns after it (~2 ms): after prepare() returned, it would run beside the engine's
            # GIL-bound start-up, where every hand-over of the GIL costs the engine more than it.
            handle.open_metadata(ready.nbytes)
            handle.phase("metadata", t_copy)
        except BaseException:
            handle.session.settle()  # the daemon may still write into it
            raise
        finally:
            handle.copy_issued(waits_in_c=True)  # prepare() returns; the daemon's reply is awaited in the background
        yield
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
