"""The ``copy_engine`` mover: ``cuMemcpyAsync`` through the driver (cuda-bindings), on the caller's stream.

The copy engines (DMA) move the bytes, so no SM is used: this is the ceiling the other movers
are judged against (H2D 54 GB/s pinned, D2D ~2.1 TB/s, P2P ~394 GB/s over NVLink on an H200).
It imports no CuPy (a clone in an engine's process would pay ~0.2 s for it, GIL held): copies,
side streams and events go through the driver, which the arena already uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashboot import _cuda
from flashboot._cuda import cuda_available
from flashboot.cuda_streams import Event, Stream, wait_event
from flashboot.errors import MoverError
from flashboot.memory import Span, stream_handle

from .base import Mover
from .batch import ChunkBatch
from .registry import register_mover

MAX_BATCH_STREAMS = 16


@register_mover
class CopyEngineMover(Mover):
    """cuMemcpyAsync on the copy engines (h2d, d2h, d2d, p2p); no SMs used."""

    name = "copy_engine"
    paths = frozenset({"h2d", "d2h", "d2d", "p2p"})
    alignment = 1
    overlap = False  # cuMemcpyAsync: "the memory areas may not overlap"
    batched = ("runs of contiguous chunks merged into one copy each, then cuMemcpyBatchAsync (CUDA >= 12.8), "
               "else one cuMemcpyAsync per copy from pre-built lists; batch_streams > 1 spreads the chunks "
               "over that many streams")

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if not cuda_available():
            return False, "no CUDA device; the host mover copies host->host"
        return True, ""

    def __init__(self, batch_streams: int = 1, merge_contiguous: bool = True) -> None:
        """``batch_streams``: how many streams a batch spreads its chunks over (joined to the
        caller's stream by events), so that copies run on several copy engines at once; 1 issues
        the whole batch on the caller's stream. ``merge_contiguous``: a batch issues each run of
        chunks that continue one another in both ranges as one copy (a copy costs the engine ~5 us
        of device time on an H200 whatever its size, batched or not); False issues one per chunk."""
        # True is an int: it made one stream where "spread the batch" was meant
        if not isinstance(batch_streams, int) or isinstance(batch_streams, bool) \
                or not 1 <= batch_streams <= MAX_BATCH_STREAMS:
            raise MoverError(f"copy_engine: batch_streams must be an int in 1..{MAX_BATCH_STREAMS}, got {batch_streams!r}")
        if not isinstance(merge_contiguous, bool):
            raise MoverError(f"copy_engine: merge_contiguous must be a bool, got {merge_contiguous!r}")
        super().__init__()
        self.batch_streams, self.merge_contiguous = batch_streams, merge_contiguous
        drv = _cuda.driver()
        # looked up once: the per-call path is two driver calls taking plain ints (the bindings
        # wrap them in C), compared by identity with the success code
        self._ctx_device, self._memcpy, self._ok = drv.cuCtxGetDevice, drv.cuMemcpyAsync, drv.CUresult.CUDA_SUCCESS
        self._device_handles: dict[int, int] = {}

    def _device_handle(self, index: int) -> int:
        handle = self._device_handles.get(index)
        if handle is None:
            handle = self._device_handles[index] = int(_cuda.check(_cuda.driver().cuDeviceGet(index),
                                                                   f"cuDeviceGet({index})"))
        return handle

    def _copy(self, dst: Span, src: Span, nbytes: int, path: str, stream: Any) -> None:
        # The copy is issued from the device that owns the stream: the destination for h2d,
        # d2d and p2p (a push from the peer would need the source's stream), the source for d2h.
        owner = (src if path == "d2h" else dst).device.index
        handle = stream_handle(stream)
        err, current = self._ctx_device()  # fails (no context) in a thread that has none yet
        if err is self._ok and int(current) == self._device_handles.get(owner, -1):  # the common case: no switch
            result = self._memcpy(dst.ptr, src.ptr, nbytes, handle)
        else:
            self._device_handle(owner)
            result = _copy_on(owner, self._memcpy, dst.ptr, src.ptr, nbytes, handle)
        if result[0] is not self._ok:
            _cuda.check(result, f"cuMemcpyAsync({path}, dst {dst.ptr:#x}, src {src.ptr:#x}, {nbytes:,} bytes, "
                                f"stream {handle:#x}, cuda:{owner})")

    def _prepare_batch(self, batch: ChunkBatch) -> "_EngineBatch":
        return _EngineBatch(batch, self.batch_streams, self.merge_contiguous)

    def _copy_batch(self, batch: ChunkBatch, stream: Any) -> None:
        batch.prepared.run(stream_handle(stream))


@_cuda.keeps_context
def _copy_on(owner: int, memcpy, dst: int, src: int, nbytes: int, handle: int):
    """``memcpy`` issued from device ``owner``'s context, the caller's restored after (as a
    CuPy device scope did); returns the driver's result."""
    _cuda.use_device(owner)
    return memcpy(dst, src, nbytes, handle)


def stream_groups(nbytes: np.ndarray, streams: int) -> list[tuple[int, int]]:
    """At most ``streams`` contiguous, non-empty index ranges ``[a, b)`` covering every chunk,
    cut at the chunk boundary nearest each ``1/streams`` of the total bytes. (Cut before the chunk
    that passes it, a first chunk over its share swallowed the cut: chunks of 6 and 4 MiB on 2
    streams went on one.)"""
    n = int(nbytes.size)
    before = np.concatenate([[0], np.cumsum(nbytes)])  # bytes before each boundary 0..n
    targets = int(before[-1]) * np.arange(1, streams) / streams
    upper = np.searchsorted(before, targets, side="left")  # the first boundary at or past each target
    lower = np.maximum(upper - 1, 0)
    cuts = np.where(targets - before[lower] < before[upper] - targets, lower, upper)
    bounds = [0, *sorted({int(c) for c in cuts} - {0, n}), n]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _location(drv, span: Span):
    loc = drv.CUmemLocation()
    loc.type = (drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE if span.device.is_cuda
                else drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST)
    loc.id = span.device.index if span.device.is_cuda else 0
    return loc


def engine_copies(batch: ChunkBatch, streams: int, merge_contiguous: bool) -> list[tuple[list, list, list]]:
    """The copies a batch issues, per stream: ``(dst addresses, src addresses, sizes)`` of each
    group of :func:`stream_groups`, with the runs of contiguous chunks in a group merged into
    one copy when ``merge_contiguous`` (the batch was validated before: merging moves the same bytes)."""
    out = []
    for a, b in stream_groups(batch.nbytes, streams):
        d, s, n = batch.runs(a, b) if merge_contiguous else (batch.dst_offsets[a:b], batch.src_offsets[a:b],
                                                            batch.nbytes[a:b])
        out.append(((batch.dst.ptr + d).tolist(), (batch.src.ptr + s).tolist(), n.tolist()))
    return out


class _EngineBatch:
    """The driver's arguments of one batch, built once: ``cuMemcpyBatchAsync`` where the driver
    and the bindings have it (``method`` says which path runs), else one ``cuMemcpyAsync`` per
    copy from pre-built lists; the copies are :func:`engine_copies` (``copies`` counts them).
    With ``streams > 1`` the chunks are split into that many contiguous groups of about equal
    bytes, each issued on a stream of its own that waits for the caller's stream and that the
    caller's stream then waits for (streams and events made once here, destroyed with the batch)."""

    def __init__(self, batch: ChunkBatch, streams: int, merge_contiguous: bool = True):
        drv = _cuda.driver()
        self.drv = drv
        self.owner = (batch.src if batch.path == "d2h" else batch.dst).device.index
        per_stream = engine_copies(batch, streams, merge_contiguous)
        self.copies = sum(len(n) for _, _, n in per_stream)
        version = _cuda.check(drv.cuDriverGetVersion(), "cuDriverGetVersion")
        self.method = "cuMemcpyBatchAsync" if hasattr(drv, "cuMemcpyBatchAsync") and version >= 12080 else "cuMemcpyAsync loop"
        if self.method == "cuMemcpyBatchAsync":
            attrs = drv.CUmemcpyAttributes()
            attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            attrs.srcLocHint, attrs.dstLocHint = _location(drv, batch.src), _location(drv, batch.dst)
            self.groups = [([drv.CUdeviceptr(p) for p in dsts], [drv.CUdeviceptr(p) for p in srcs], sizes,
                            len(sizes), [attrs], [0], 1) for dsts, srcs, sizes in per_stream]
        else:
            self.groups = [list(zip(dsts, srcs, sizes)) for dsts, srcs, sizes in per_stream]
        self.side: list[Stream] = []
        if len(self.groups) > 1:  # streams and events belong to the owner's context
            self.side = [Stream(self.owner) for _ in self.groups]
            self.fork = Event(self.owner)
            self.joins = [Event(self.owner) for _ in self.groups]

    def _issue(self, group, handle: int) -> None:
        drv = self.drv
        if self.method == "cuMemcpyBatchAsync":
            if handle != 0 and group[3] > 1:
                _cuda.check(drv.cuMemcpyBatchAsync(*group, drv.CUstream(handle)),
                            f"cuMemcpyBatchAsync({group[3]} of {self.copies} copies)")
                return
            # one copy (chunks merged into one run: a refit's or a star's whole image) is a plain
            # cuMemcpyAsync, the ceiling's own call; and the driver refuses a batch on the legacy
            # default stream (CUDA_ERROR_INVALID_VALUE): there the copies go one by one, in order
            group = list(zip((int(p) for p in group[0]), (int(p) for p in group[1]), group[2]))
        copy = drv.cuMemcpyAsync
        for d, s, n in group:
            _cuda.check(copy(d, s, n, handle), f"cuMemcpyAsync(dst {d:#x}, src {s:#x}, {n:,} bytes, of a batch)")

    @_cuda.keeps_context
    def run(self, handle: int) -> None:
        _cuda.use_device(self.owner)
        if not self.side:
            for group in self.groups:
                self._issue(group, handle)
            return
        self.fork.record(handle)  # the side streams start after what the caller queued
        for group, side, join in zip(self.groups, self.side, self.joins):
            wait_event(side, self.fork)
            self._issue(group, side.ptr)
            join.record(side)
            wait_event(handle, join)  # and the caller's stream goes on after all of them


__all__ = ["CopyEngineMover", "engine_copies", "stream_groups", "MAX_BATCH_STREAMS"]
