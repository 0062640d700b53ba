"""Triton copy kernels: a vectorised persistent SM copy and a TMA copy through tensor descriptors.

Thin host wrappers :func:`sm_copy` and :func:`tma_copy` copy any byte count between spans,
tensors or arrays on the caller's stream: a bulk of whole elements goes through the fast
kernel, the few head/tail bytes around it through :func:`copy_bytes_kernel`.

Tuning knobs (the lead sweeps them on the GPU) are plain keyword arguments whose defaults live
in :data:`SM_TUNING` and :data:`TMA_TUNING`::

    sm_copy(dst, src, stream=s, block_bytes=32768, num_warps=4, programs_per_sm=1, num_stages=3,
            load_cache="", store_cache="")
    tma_copy(dst, src, stream=s, block_bytes=32768, num_warps=4, programs_per_sm=2, num_stages=3)

The tensor views and launch context live in :mod:`flashboot.kernels.views` (re-exported here).
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl
from triton.runtime import _allocation

from flashboot.errors import CapabilityError, FlashBootError, MoverError
from flashboot.memory import Span, check_backed, count_of, span_of, stream_handle, writable

from .knobs import check_launch_knobs
from .launch import LaunchConfig, current_device, launch
from .views import _NP_NAMES, interpreting, require_kernel_memory, sm_count, span_tensor

SM_TUNING: dict[str, Any] = {
    "block_bytes": 32768,  # bytes per program per loop step (4096 int64: the H200 probe's best)
    "num_warps": 4,
    "programs_per_sm": 1,  # persistent grid = #SMs x this
    "num_stages": 3,  # Triton's default (the probe's setting): lets the pipeliner prefetch the loop's loads
    "load_cache": "",  # "" or ".cg" (bypass L1)
    "store_cache": "",  # "" or ".cs" (streaming: evict first)
}
"""Defaults of :func:`sm_copy`'s knobs. Measured on H200 (probe): 4096 int64 per step, grid = #SMs: 91 % of d2d copy engine."""

TMA_TUNING: dict[str, Any] = {
    "block_bytes": 32768,  # bytes per TMA tile (4096 int64; split into <= 256-element boxes by Triton)
    "num_warps": 4,
    "programs_per_sm": 2,
    "num_stages": 3,
}
"""Defaults of :func:`tma_copy`'s knobs. Measured on H200 (probe): tile 4096 int64, grid = 2 x #SMs: 89 % of d2d copy engine."""

TMA_TABLE_TUNING: dict[str, Any] = {
    "block_bytes": 65536,
    "num_warps": 4,
    "programs_per_sm": 3,
    "num_stages": 3,
}
"""The ``triton_tma`` mover's batches (one launch over a descriptor table): 64 KiB tiles and 3
programs per SM. H200, 1 GiB in 4 MiB chunks (benchmarks/probes/tma_box.py, 2026-12-02): 0.90x the
copy engine against 0.88x with the single copy's knobs (32 KiB, 2 per SM) in the same process; 3
per SM led the sweep at every tile size. ``bench movers --chunked`` in another run measured 0.891x
(0.893x with the old knobs in an earlier one): no gain shown beyond the runs' noise.
A mover made with tuning overrides uses them for both."""

BULK_ALIGN = 16
"""The fast paths move 16-byte vectors; pointers congruent mod 16 get a 16-byte-aligned bulk."""

_TMA_MAX_ELEMS = 1 << 30
"""Descriptor shapes and coordinates are int32: one TMA launch covers at most 2**30 int64 (8 GiB)."""


# -------------------------------------------------------------------------------------- kernels
@triton.jit
def copy_sm_kernel(
    dst_ptr,
    src_ptr,
    n_elems: tl.int64,
    BLOCK: tl.constexpr,  # elements per program per loop step
    LOAD_CACHE: tl.constexpr,  # cache modifier of the loads ("" or ".cg")
    STORE_CACHE: tl.constexpr,  # cache modifier of the stores ("" or ".cs")
):
    """Persistent grid-stride copy of ``n_elems`` elements: full tiles unmasked, the last one masked."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    n_full = n_elems // BLOCK
    for tile in range(pid, n_full, nprog):
        base = tile * BLOCK
        x = tl.load(src_ptr + base + offs, cache_modifier=LOAD_CACHE)
        tl.store(dst_ptr + base + offs, x, cache_modifier=STORE_CACHE)
    # The partial last tile goes to the program that would have had it next.
    base = n_full * BLOCK
    limit = tl.where(pid == n_full % nprog, n_elems, 0)
    mask = base + offs < limit
    x = tl.load(src_ptr + base + offs, mask=mask, other=0)
    tl.store(dst_ptr + base + offs, x, mask=mask)


@triton.jit
def copy_tma_kernel(
    dst_ptr,
    src_ptr,
    n_elems,
    BLOCK: tl.constexpr,  # elements per TMA tile
):
    """Persistent copy through 1-D tensor descriptors: TMA load of a tile, TMA store of it.

    Out-of-range elements of the last tile are zero-padded on load and clipped on store.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    src_desc = tl.make_tensor_descriptor(src_ptr, shape=[n_elems], strides=[1], block_shape=[BLOCK])
    dst_desc = tl.make_tensor_descriptor(dst_ptr, shape=[n_elems], strides=[1], block_shape=[BLOCK])
    n_tiles = tl.cdiv(n_elems, BLOCK)
    for tile in range(pid, n_tiles, nprog):
        x = src_desc.load([tile * BLOCK])
        dst_desc.store([tile * BLOCK], x)


@triton.jit
def copy_bytes_kernel(
    dst_ptr,
    src_ptr,
    head_nbytes,
    tail_offset,
    tail_nbytes,
):
    """One program copies bytes ``[0, head_nbytes)`` and ``[tail_offset, tail_offset + tail_nbytes)``
    (each < 16): the unaligned ends around a vectorised bulk."""
    i = tl.arange(0, 32)
    is_head = i < 16
    pos = tl.where(is_head, i, tail_offset + (i - 16))
    mask = tl.where(is_head, i < head_nbytes, (i - 16) < tail_nbytes)
    x = tl.load(src_ptr + pos, mask=mask, other=0)
    tl.store(dst_ptr + pos, x, mask=mask)


# ----------------------------------------------------------------------------------- wrappers
def _split(dst: Span, src: Span, nbytes: int) -> tuple[int, int, int, int]:
    """``(head, align, itemsize, body)``: bytes before the bulk, the alignment both pointers share
    (a power of two <= 16), the bulk's element size (<= 8) and the bulk's bytes (a multiple of align)."""
    rel = (dst.ptr - src.ptr) % BULK_ALIGN
    align = BULK_ALIGN
    while rel % align:  # largest power of two both pointers are congruent modulo
        align //= 2
    head = min((-src.ptr) % align, nbytes)
    body = (nbytes - head) // align * align
    return head, align, min(align, 8), body


def _prepare(dst: Any, src: Any, nbytes: int | None) -> tuple[Span, Span, int]:
    d, s = span_of(writable(dst, "copy")), span_of(src)
    for span, role in ((d, "destination"), (s, "source")):  # a closed or asleep arena's span segfaulted
        check_backed(span, "copy", role)
    # a size from numpy (np.int64(50)) had been refused as "cannot copy 50 bytes from a 100-byte source"
    nbytes = s.nbytes if nbytes is None else count_of(nbytes)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or nbytes > s.nbytes or nbytes > d.nbytes:
        raise FlashBootError(f"cannot copy {nbytes!r} bytes from a {s.nbytes:,}-byte source to a {d.nbytes:,}-byte destination")
    if d.device == s.device and d.ptr < s.ptr + nbytes and s.ptr < d.ptr + nbytes:
        # the programs copy tiles in any order: a forward overlap read tiles already overwritten
        raise MoverError(f"cannot copy {nbytes:,} bytes from {s.ptr:#x} to {d.ptr:#x} on {d.device}: the ranges overlap; "
                         "copy through a separate buffer")
    return d, s, nbytes


_BYTES_CONFIG = LaunchConfig((), ("uint8", "uint8", None, None, None), num_warps=1, num_stages=1)


def _copy_ends(d: Span, s: Span, nbytes: int, head: int, body: int, handle: int) -> None:
    tail = nbytes - head - body
    if head or tail:
        launch(copy_bytes_kernel, _BYTES_CONFIG, (1,), (d.ptr, s.ptr, head, head + body, tail),
               device=d.device.index, stream=handle,
               views=lambda: (span_tensor(d, 1, 0, nbytes), span_tensor(s, 1, 0, nbytes), head, head + body, tail))


def _knobs(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise FlashBootError(f"unknown tuning knob(s) {sorted(unknown)}; known: {sorted(defaults)}")
    knobs = {**defaults, **overrides}
    bb = knobs["block_bytes"]
    if not isinstance(bb, int) or bb < 16 or bb & (bb - 1):
        raise FlashBootError(f"block_bytes must be a power of two >= 16, got {bb!r}")
    check_launch_knobs(knobs)
    return knobs


def sm_copy(dst: Any, src: Any, nbytes: int | None = None, *, stream: Any, **tuning: Any) -> None:
    """Copy ``nbytes`` (default: all of ``src``) with the persistent SM kernel on ``stream``.

    Runs on ``dst``'s device (for p2p the source must be mapped there). Exact for any size and
    alignment: pointers congruent mod 16 get a 16-byte vector bulk, others the widest element
    both share. ``tuning`` overrides :data:`SM_TUNING`.
    """
    k = _knobs(SM_TUNING, tuning)
    d, s, nbytes = _prepare(dst, src, nbytes)
    if nbytes:
        sm_copy_spans(d, s, nbytes, stream_handle(stream), k)


@functools.cache
def _sm_config(itemsize: int, block: int, load_cache: str, store_cache: str, num_warps: int,
               num_stages: int) -> LaunchConfig:
    dtype = _NP_NAMES[itemsize]
    return LaunchConfig((("BLOCK", block), ("LOAD_CACHE", load_cache), ("STORE_CACHE", store_cache)),
                        (dtype, dtype, None), num_warps, num_stages)


def sm_copy_spans(d: Span, s: Span, nbytes: int, handle: int, k: dict[str, Any]) -> None:
    """:func:`sm_copy` after validation: ``nbytes > 0`` fits both spans, ``k`` are checked knobs,
    ``handle`` a raw stream. A mover holds an :class:`SMCopyLauncher` instead (the same, with
    the per-knob work done once)."""
    SMCopyLauncher(k)(d, s, nbytes, handle)


_I32_MAX = (1 << 31) - 1


class SMCopyLauncher:
    """:func:`sm_copy_spans` for fixed knobs, with everything that depends only on them (the
    launch configuration per element width, the tile size, the programs per SM) computed once.

    Per call: a copy whose pointers and size are 16-byte aligned (every chunk of an arena) calls
    the compiled kernel's runner kept for its grid and specialisation, with plain ints (the
    movers' hot path); any other copy, and the first of each grid, goes through :func:`launch`
    (the split into a vector bulk and byte ends, the cache key)."""

    def __init__(self, k: dict[str, Any]):
        self.programs_per_sm = k["programs_per_sm"]
        self.by_itemsize = {}
        for itemsize in _NP_NAMES:
            block = max(1, k["block_bytes"] // itemsize)
            self.by_itemsize[itemsize] = (block, _sm_config(itemsize, block, k["load_cache"], k["store_cache"],
                                                            k["num_warps"], k["num_stages"]))
        self._block8, config8 = self.by_itemsize[8]
        self._consts8 = config8.constexpr_values
        self._grid_cap: dict[int, int] = {}
        self._runners: dict[tuple, Any] = {}
        """(device, grid, n % 16 == 0, n in int32) -> the runner of a 16-byte aligned copy of n int64."""

    def __call__(self, d: Span, s: Span, nbytes: int, handle: int) -> None:
        dptr, sptr = d.ptr, s.ptr
        if not (dptr | sptr | nbytes) & 15 and d.device.is_cuda:
            index = d.device.index
            n = nbytes >> 3
            cap = self._grid_cap.get(index)
            if cap is None:
                cap = self._grid_cap[index] = sm_count(index) * self.programs_per_sm
            grid = min(cap, -(-n // self._block8))
            key = (index, grid, not n & 15, n <= _I32_MAX)
            runner = self._runners.get(key)
            if runner is not None and current_device() == index:
                runner(dptr, sptr, n, *self._consts8, stream=handle)
                return
            runner = self._launch(d, s, nbytes, handle)
            if runner is not None:
                self._runners[key] = runner
            return
        self._launch(d, s, nbytes, handle)

    def _launch(self, d: Span, s: Span, nbytes: int, handle: int):
        """Any copy: the split, then the bulk's launch (returns its runner) and the ends'."""
        require_kernel_memory(d)
        head, _, itemsize, body = _split(d, s, nbytes)
        runner = None
        if body:
            block, config = self.by_itemsize[itemsize]
            n_elems = body // itemsize
            index = d.device.index
            grid = (max(1, min(sm_count(index) * self.programs_per_sm, -(-n_elems // block))),)
            runner = launch(copy_sm_kernel, config, grid, (d.ptr + head, s.ptr + head, n_elems), device=index,
                            stream=handle, views=lambda: (span_tensor(d, itemsize, head, body),
                                                          span_tensor(s, itemsize, head, body), n_elems))
        if nbytes != body:
            _copy_ends(d, s, nbytes, head, body, handle)
        return runner


_TMA_SCRATCH: dict[tuple[int, int], tuple[Any, int, int]] = {}
"""(device, stream handle) -> (tensor, bytes, address): the scratch of the last TMA launch on that stream."""
_TMA_SCRATCH_STREAMS = 64
"""Streams whose scratch is kept (the oldest is dropped beyond: a pipeline uses a handful)."""


def _tma_allocator(size: int, alignment: int, stream: Any):
    """Global scratch for device-side tensor descriptors (Triton asks for it at every launch).

    One buffer per stream, reused by the next launch on the same stream: launches on one stream
    run one after the other, so the next kernel writes its descriptors only once the previous
    one is done with them (a fresh allocation per launch cost ~20 us of the 78 us per TMA copy).
    Allocated on the launch's own ``stream``: torch's caching allocator hands a freed block out
    again without waiting only for work on the stream it was allocated on, so a buffer dropped
    here is never given to another stream while a kernel may still read it.
    """
    handle = stream if type(stream) is int else stream_handle(stream)
    key = (current_device(), handle)  # the launch's device is current (Triton launches in its context)
    kept = _TMA_SCRATCH.get(key)
    if kept is not None and kept[1] >= size and kept[2] % alignment == 0:
        return kept[0]
    import torch

    on = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream()
    with torch.cuda.stream(on):
        buf = torch.empty(max(size, 2 * (kept[1] if kept is not None else 0)), dtype=torch.int8, device="cuda")
    _TMA_SCRATCH.pop(key, None)
    _TMA_SCRATCH[key] = (buf, buf.numel(), buf.data_ptr())
    while len(_TMA_SCRATCH) > _TMA_SCRATCH_STREAMS:
        _TMA_SCRATCH.pop(next(iter(_TMA_SCRATCH)))
    return buf


def _ensure_tma_allocator() -> None:
    # triton.set_allocator is per context (a ContextVar): set it in every thread that launches,
    # but leave an allocator the application installed alone.
    current = _allocation._allocator.get() if hasattr(_allocation._allocator, "get") else None
    if current is None or isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_tma_allocator)


def tma_available() -> tuple[bool, str]:
    """Whether this Triton has device-side tensor descriptors (``tl.make_tensor_descriptor``)."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return False, f"Triton {triton.__version__} lacks tl.make_tensor_descriptor (needs >= 3.4)"
    return True, ""


def tma_copy(dst: Any, src: Any, nbytes: int | None = None, *, stream: Any, **tuning: Any) -> None:
    """Copy ``nbytes`` (default: all of ``src``) through TMA tensor descriptors on ``stream``.

    Runs on ``dst``'s device. TMA needs 16-byte aligned bases, so ``src`` and ``dst`` must be
    congruent mod 16 (MoverError otherwise, naming ``sm_copy``); the head and tail bytes
    around the aligned bulk are copied separately. ``tuning`` overrides :data:`TMA_TUNING`.
    """
    k = _knobs(TMA_TUNING, tuning)
    d, s, nbytes = _prepare(dst, src, nbytes)
    if nbytes == 0:
        return
    ok, why = tma_available()
    if not ok:
        raise CapabilityError(f"tma_copy: {why}; use sm_copy (mover 'triton_sm') or the 'copy_engine' mover")
    tma_copy_spans(d, s, nbytes, stream_handle(stream), k)


@functools.cache
def _tma_config(block: int, num_warps: int, num_stages: int) -> LaunchConfig:
    return LaunchConfig((("BLOCK", block),), ("int64", "int64", None), num_warps, num_stages)


def tma_copy_spans(d: Span, s: Span, nbytes: int, handle: int, k: dict[str, Any]) -> None:
    """:func:`tma_copy` after validation (as :func:`sm_copy_spans`); MoverError when the pointers
    are not congruent mod 16."""
    TMACopyLauncher(k)(d, s, nbytes, handle)


class TMACopyLauncher:
    """:func:`tma_copy_spans` for fixed knobs (as :class:`SMCopyLauncher`): a 16-byte aligned copy
    of at most one descriptor's reach calls the runner kept for its grid and specialisation."""

    def __init__(self, k: dict[str, Any]):
        self.programs_per_sm = k["programs_per_sm"]
        self.block = max(2, k["block_bytes"] // 8)
        self.config = _tma_config(self.block, k["num_warps"], k["num_stages"])
        self._consts = self.config.constexpr_values
        self._piece = _TMA_MAX_ELEMS // self.block * self.block  # whole tiles addressable by int32 coordinates
        self._grid_cap: dict[int, int] = {}
        self._runners: dict[tuple, Any] = {}
        """(device, grid, n % 16 == 0, n == 1) -> the runner of a 16-byte aligned copy of n int64."""

    def __call__(self, d: Span, s: Span, nbytes: int, handle: int) -> None:
        dptr, sptr = d.ptr, s.ptr
        n = nbytes >> 3
        if not (dptr | sptr | nbytes) & 15 and n <= self._piece and d.device.is_cuda:
            index = d.device.index
            cap = self._grid_cap.get(index)
            if cap is None:
                cap = self._grid_cap[index] = sm_count(index) * self.programs_per_sm
            grid = min(cap, -(-n // self.block))
            key = (index, grid, not n & 15, n == 1)
            runner = self._runners.get(key)
            if runner is not None and current_device() == index:
                _ensure_tma_allocator()
                runner(dptr, sptr, n, *self._consts, stream=handle)
                return
            runner = self._launch(d, s, nbytes, handle)
            if runner is not None:
                self._runners[key] = runner
            return
        self._launch(d, s, nbytes, handle)

    def _launch(self, d: Span, s: Span, nbytes: int, handle: int):
        """Any copy: the split, the bulk in pieces (returns the runner when there is one piece), the ends."""
        require_kernel_memory(d)
        head, align, _, body = _split(d, s, nbytes)
        if align != BULK_ALIGN and body:
            raise MoverError(
                f"tma_copy: source {s.ptr:#x} and destination {d.ptr:#x} differ by {(d.ptr - s.ptr) % 16} mod 16 bytes; "
                "TMA needs both 16-byte aligned. Use sm_copy (mover 'triton_sm') or 'copy_engine' for this pair"
            )
        runners = []
        if body:
            if d.device.is_cuda:
                _ensure_tma_allocator()
            block, n_elems = self.block, body // 8
            for first in range(0, n_elems, self._piece):
                count = min(self._piece, n_elems - first)
                grid = (max(1, min(sm_count(d.device.index) * self.programs_per_sm, -(-count // block))),)
                off = head + first * 8
                runners.append(launch(copy_tma_kernel, self.config, grid, (d.ptr + off, s.ptr + off, count),
                                      device=d.device.index, stream=handle,
                                      views=lambda off=off, count=count: (span_tensor(d, 8, off, count * 8),
                                                                         span_tensor(s, 8, off, count * 8), count)))
        _copy_ends(d, s, nbytes, head, body, handle)
        return runners[0] if len(runners) == 1 else None


__all__ = [
    "SM_TUNING", "TMA_TUNING", "copy_sm_kernel", "copy_tma_kernel", "copy_bytes_kernel",
    "sm_copy", "tma_copy", "sm_copy_spans", "tma_copy_spans", "SMCopyLauncher", "TMACopyLauncher", "span_tensor", "sm_count", "tma_available", "interpreting",
]
