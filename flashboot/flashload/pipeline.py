"""FlashLoad as one pipeline: one rank's pre-packed image -> an arena, every weight a view into it.

Paper sections 3.4-3.5. Whatever the bytes come from (:mod:`flashboot.flashload.sources`: the
served-load daemon, the staged image pinned here, the disk), a load runs the same steps: read and
validate the metadata, admit the image against the device's free memory before any allocation
(:mod:`flashboot.flashload.landing`), create one arena of the image's size, have the source fill
it while the views are built, verify, report (:mod:`flashboot.flashload.report`). :func:`bind`
then points a meta-initialised torch module's parameters and buffers at those views: one copy of
the weights in device memory.

Three ways to pay the pin (``cuMemHostRegister``, about a third of the H2D rate):

* ``load(dir)``: pin on the critical path (map, pin, copy);
* ``load(dir, staged=flashboot.stage(dir, ...))``: pinned early, while the engine built its model;
* ``load(dir, served=True)``: the preloader daemon holds the image pinned and copies it into the
  engine's exported arena; the engine waits only for the descriptor exchange and the copy.

"""

from __future__ import annotations

import time
from typing import Any

from ..errors import FlashBootError, LayoutError
from .choose import choose
from .landing import DEFAULT_CHUNK_BYTES, admit, one_time_costs
from .prepared import PreparedLoad, load_prepared
from .report import LoadedImage, LoadReport
from .sources import source_for_mode
from .stream import StreamConfig
from .want import LoadRequest, Want, check_options, check_same_root, flag_of, image_path, load_request


# ===================================================================================== load
DEFAULT_LOAD_TIMEOUT_S = 60.0
"""A load's ``timeout_s`` unless given (a prepared load's: its handle's :attr:`PreparedLoad.wait_bound_s`)."""


def load(image_dir, rank: int = 0, device: Any = None, *, timeout_s: float | None = None, served: bool = False,
         staged=None, prepared=None, verify: bool | None = None, shm_dir=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         tp: int | None = None, ep: int | None = None, expected_key=None, stream: bool | None = None,
         stream_buffer_bytes=None, holder=None) -> LoadedImage:
    """Load rank ``rank`` of the pre-packed image in ``image_dir`` onto ``device``.

    ``device``: an int, ``"cuda:N"``, ``"cpu"`` (host backend) or None (cuda:0 where present).
    The rank is copied from its staged copy in shared memory (``flashboot preload``); while a
    preloader stages it, the load waits up to ``timeout_s`` (default 60 s) for its ``.ready`` file. When nothing
    will stage it (no preloader runs, it stages other ranks, shared memory cannot hold the image)
    the image is streamed straight from disk through a ring buffer of at most
    ``stream_buffer_bytes`` (default 256 MiB or ``$FLASHBOOT_STREAM_BUFFER_BYTES``; an int, a dict
    or a :class:`~flashboot.flashload.stream.StreamConfig`), and the report says so and why.
    ``stream``: True always streams, False never does (waits for ``.ready``). ``staged``: a
    :func:`flashboot.stage` result (pinned early); ``served``: have the running preloader daemon
    copy into this process's arena; ``prepared``: a :func:`flashboot.prepare` handle made at
    engine start-up, which has paid the one-time costs already (metadata, arena, the daemon's
    attachment or the pin): the load makes the views and waits for the copy, at most ``timeout_s``
    (default: the handle's ``timeout_s`` plus 120 s for a pin). Without it the report's
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
    then too (see :meth:`~flashboot.flashload.sources.served.ServedSource.load`), so an image refused
    for its tp, ep or key is refused after its bytes were copied (into an arena that is then
    released). Which source fills the arena: :mod:`flashboot.flashload.choose`.

    Raises LayoutError (bad image, wrong rank/tp/ep/model), OutOfMemoryError before any
    allocation when the device lacks the bytes, WaitTimeoutError naming what was awaited,
    ChecksumMismatchError (verify) naming the chunk. A failed load releases its arena.
    """
    import torch  # noqa: F401  (an engine has it loaded; its import is not part of a load)

    image_dir = image_path(image_dir)
    served, stream = bool(flag_of(served, "served")), flag_of(stream, "stream")  # served=None: not served
    verify = flag_of(verify, "verify")
    if timeout_s is None:
        timeout_s = prepared.wait_bound_s if isinstance(prepared, PreparedLoad) else DEFAULT_LOAD_TIMEOUT_S
    if holder is not None:
        from .restart import load_or_restore

        # checked before a held arena is mapped: a restart that maps one had taken any option unchecked
        rank, tp, ep = check_options(image_dir, rank, timeout_s=timeout_s, served=served, staged=staged,
                                     prepared=prepared, shm_dir=shm_dir, chunk_bytes=chunk_bytes, tp=tp, ep=ep,
                                     expected_key=expected_key, stream=stream,
                                     stream_buffer_bytes=stream_buffer_bytes, prepared_class=PreparedLoad)
        if stream_buffer_bytes is not None:  # refused whether or not it would stream (want.py may not import stream)
            StreamConfig.of(stream_buffer_bytes)
        return load_or_restore(image_dir, rank, device, holder, timeout_s=timeout_s, served=served, staged=staged,
                               prepared=prepared, verify=verify, shm_dir=shm_dir, chunk_bytes=chunk_bytes, tp=tp,
                               ep=ep, expected_key=expected_key, stream=stream,
                               stream_buffer_bytes=stream_buffer_bytes)

    request = load_request(image_dir, rank, device, t_start=time.perf_counter(), timeout_s=timeout_s, served=served,
                           staged=staged, prepared=prepared, verify=verify, shm_dir=shm_dir, chunk_bytes=chunk_bytes,
                           tp=tp, ep=ep, expected_key=expected_key, stream=stream,
                           stream_buffer_bytes=stream_buffer_bytes, prepared_class=PreparedLoad)
    if stream_buffer_bytes is not None:  # refused whether or not it streams, on every path
        request.stream_config = StreamConfig.of(stream_buffer_bytes)
    if prepared is not None:
        _check_same_as_prepared(prepared, shm_dir, stream_buffer_bytes, request.stream_config)
    if prepared is not None:
        loaded = load_prepared(request)
        source, why = prepared.load_source, prepared.why
    elif served:  # the daemon's copy starts before this process has read the metadata: the source reads it
        source, why = source_for_mode("served"), "served=True was asked"
        loaded = source.load(request, None, None, why)
    else:
        rank_source, report = _begin(request)
        if staged is not None:
            source, why = source_for_mode("staged"), "staged= was given"
        else:
            request.stream_config = StreamConfig.of(stream_buffer_bytes)  # refused whether or not it streams
            source, why, _ = choose(Want(request.image_dir, request.rank, rank_source, shm_dir=shm_dir, stream=stream))
        loaded = source.load(request, rank_source, report, why)
    # where the bytes came from, and why: the mode names the copy ("host" on the host backend
    # whatever the source), so a load from the staged copy had not said so
    loaded.report.details.setdefault("source", source.name)
    loaded.report.details.setdefault("source_why", why)
    if prepared is None:  # every source's plain load says what prepare() would have paid at start-up (a stream had not)
        loaded.report.details.setdefault("one_time_ms", one_time_costs(loaded.report, pin=loaded.report.pin_ms))
    if "verified" not in loaded.report.details:
        loaded.report.details["verify_skipped"] = prepared.verify_skipped if request.verify is None else \
            request.why_not_verified
    return loaded


def _check_same_as_prepared(prepared, shm_dir, stream_buffer_bytes, stream_config) -> None:
    """FlashBootError where a load given ``prepared=`` also names a staging root or stream options
    other than the handle's: the handle's are the ones used (others had been ignored unsaid)."""
    check_same_root(shm_dir, prepared.shm_dir, "prepare()", "which the prepared load uses")
    if stream_config is not None and stream_config != prepared.stream_config:
        raise FlashBootError(f"stream_buffer_bytes={stream_buffer_bytes!r} differs from the stream options "
                             f"flashboot.prepare() was given ({prepared.stream_config}), which the prepared load "
                             "uses; pass them to prepare()")


def _begin(request: LoadRequest):
    """(the validated :class:`~flashboot.flashload.shm.RankSource`, the report with its metadata
    time): the metadata read here (or validated by :func:`flashboot.stage`), the image admitted
    against the device's free memory before any allocation."""
    from flashboot.layouts.image import check_request

    from .shm import rank_source

    staged, tp, ep, expected_key = request.staged, request.tp, request.ep, request.expected_key
    report = LoadReport(mode="", device=str(request.device), rank=request.rank, nbytes=0)
    t0 = time.perf_counter()
    if staged is not None:
        # stage() validated the metadata in the background (the strict reader, rank and job
        # checked): only what this call asks for is left to check.
        source = staged.wait_source()
        check_request(source.metadata, str(source.image.metadata_path), tp=tp, ep=ep, expected_key=expected_key)
        report.details["metadata_validated_by"] = "stage()"
    else:
        source = rank_source(request.image_dir, request.rank, tp=tp, ep=ep, expected_key=expected_key)
    report.metadata_ms = (time.perf_counter() - t0) * 1e3
    nbytes = report.nbytes = source.nbytes
    report.tensors = len(source.metadata.tensors)
    if nbytes == 0:
        raise LayoutError(f"{source.path}: empty image, nothing to load")
    admit(nbytes, request.device)
    return source, report


__all__ = ["LoadedImage", "LoadReport", "load"]
