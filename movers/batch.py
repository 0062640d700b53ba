"""A validated list of chunk copies between two byte ranges: check once, then copy many times.

A pipeline (chain, ring, refit, streamed load) copies chunk by chunk. :class:`ChunkBatch` checks
the whole list once -- every entry inside both ranges, no two destinations overlapping, no
destination over a source another entry reads, the mover's alignment -- and refuses before any
launch, naming the entry. Afterwards :meth:`ChunkBatch.run` copies every entry at once (one
batched call or one launch, as the mover can) and :meth:`ChunkBatch.copy_chunk` one entry with
nothing but the launch.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from flashboot.errors import MoverError
from flashboot.memory import Span, check_backed, path_between

if TYPE_CHECKING:
    from .base import Mover


_INT64_MAX = np.iinfo(np.int64).max


def _is_int64(x: Any) -> bool:
    return (isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
            and -_INT64_MAX <= int(x) <= _INT64_MAX)


def _entries(chunks: Any) -> np.ndarray:
    """``chunks`` as an ``(n, 3)`` int64 array of ``(dst_offset, src_offset, nbytes)``: integers
    only (a float would be truncated to another chunk than the one asked for)."""
    if not isinstance(chunks, np.ndarray) and hasattr(chunks, "__array__"):  # a tensor: converted once, not walked
        try:
            chunks = np.asarray(chunks)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise MoverError(f"a chunk list must hold (dst_offset, src_offset, nbytes) integers: {exc}") from None
    if isinstance(chunks, Iterable) and not isinstance(chunks, np.ndarray):
        chunks = list(chunks)
    try:
        table = np.asarray(chunks)
    except (TypeError, ValueError) as exc:
        _refuse_short_entry(chunks)
        raise MoverError(f"a chunk list must hold (dst_offset, src_offset, nbytes) integers: {exc}") from None
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0:
        if isinstance(chunks, list):
            _refuse_short_entry(chunks)
        raise MoverError(f"a chunk list must be a non-empty list of (dst_offset, src_offset, nbytes); "
                         f"got an array of shape {table.shape}")
    # a bool among ints makes an int array (True read as 1): look at a list's own values
    kinds = None if isinstance(chunks, np.ndarray) else set(map(type, itertools.chain.from_iterable(chunks)))
    if table.dtype.kind not in "iu" or (kinds is not None and (bool in kinds or np.bool_ in kinds)):
        # floats, bools, ints past 64 bits (object)
        rows = table.tolist() if isinstance(chunks, np.ndarray) else chunks
        row = next((i for i, entry in enumerate(rows) if not all(map(_is_int64, entry))), None)
        if row is not None:
            raise MoverError(f"a chunk list must hold (dst_offset, src_offset, nbytes) 64-bit integers; entry {row} "
                             f"is {tuple(rows[row])!r}")
        # integers all: numpy made floats of np.uint64 beside signed ints ((np.uint64(8), 0, 8) had been
        # refused as no integers, naming entry 0 whatever it held)
        table = np.array([[int(v) for v in entry] for entry in rows], dtype=np.int64)
    if table.dtype.kind == "u" and table.size and int(table.max()) > _INT64_MAX:
        raise MoverError(f"a chunk list entry exceeds {_INT64_MAX:,} bytes")
    return table.astype(np.int64, copy=False)


def _refuse_short_entry(chunks: Any) -> None:
    """MoverError naming the first entry of a list that is not three values (numpy's "inhomogeneous
    shape after 1 dimensions", cut off, had named neither the entry nor what it held)."""
    if not isinstance(chunks, list):
        return
    for i, entry in enumerate(chunks):
        try:
            size = len(entry)
        except TypeError:
            size = None
        if size != 3:
            raise MoverError(f"a chunk list must be a non-empty list of (dst_offset, src_offset, nbytes); entry {i} is "
                             f"{entry!r}"
                             + ("" if size is None else f", {size} value(s)"))


def _first_overlap(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """Indices ``(i, j)`` of two intervals ``[start, end)`` that overlap, or None."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)  # furthest end among the intervals sorted before each
    bad = np.nonzero(s[1:] < reach[:-1])[0]
    if bad.size == 0:
        return None
    k = int(bad[0]) + 1
    j = int(order[k])
    i = int(order[int(np.argmax(e[:k] > s[k]))])  # an earlier interval reaching past j's start
    return i, j


def _first_hit(starts: np.ndarray, ends: np.ndarray, other_starts: np.ndarray, other_ends: np.ndarray) -> int | None:
    """The first index ``i`` whose interval ``[starts[i], ends[i])`` overlaps any interval of the
    others, or None: O(n log n)."""
    order = np.argsort(other_starts, kind="stable")
    reach = np.maximum.accumulate(other_ends[order])  # furthest end among the others starting at or before each
    k = np.searchsorted(other_starts[order], ends, side="left") - 1  # the last other starting before each end
    hit = np.nonzero((k >= 0) & (reach[np.maximum(k, 0)] > starts))[0]
    return int(hit[0]) if hit.size else None


def contiguous_runs(dst_offsets: np.ndarray, src_offsets: np.ndarray, nbytes: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries with each one that continues its predecessor in both ranges (destination and
    source each start where the previous entry's end) merged into it: ``(dst_offsets,
    src_offsets, nbytes)`` of the runs, in order. What NIXL and UCX do to a descriptor list before
    posting it: the copies are the same bytes, fewer of them. Entries in another order (or with a
    gap) stay apart, so a permuted chunk list still pays per entry."""
    if nbytes.size <= 1:
        return dst_offsets, src_offsets, nbytes
    continues = (dst_offsets[1:] == dst_offsets[:-1] + nbytes[:-1]) & (src_offsets[1:] == src_offsets[:-1] + nbytes[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~continues]))
    return dst_offsets[starts], src_offsets[starts], np.add.reduceat(nbytes, starts)


class ChunkBatch:
    """Chunk copies ``dst[d:d+n] <- src[s:s+n]`` for every ``(d, s, n)`` of ``chunks``, validated.

    Built by :meth:`Mover.batch`; raises MoverError naming the entry (index, offsets, bytes) for
    a chunk outside either range, a non-positive size, two overlapping destinations, a destination
    over another entry's source (the copies may run in any order), or a chunk the mover's
    alignment refuses. ``dst_offsets``, ``src_offsets`` and ``nbytes`` are int64 arrays.
    """

    def __init__(self, mover: "Mover", dst: Span, src: Span, chunks: Any) -> None:
        self.mover, self.dst, self.src = mover, dst, src
        table = _entries(chunks)
        self.dst_offsets, self.src_offsets, self.nbytes = (np.ascontiguousarray(table[:, i]) for i in range(3))
        self.path = path_between(src.device, dst.device)
        mover._check_path(self.path, src.device, dst.device)
        self._check(table)
        self.total_nbytes = int(self.nbytes.sum())
        self._chunks: list[tuple[Span, Span]] | None = None
        self.prepared = mover._prepare_batch(self)
        """What the mover built once for this batch (a device table, pointer lists), or None."""

    def __len__(self) -> int:
        return int(self.nbytes.size)

    def _entry(self, i: int) -> str:
        return (f"entry {i} (dst_offset {int(self.dst_offsets[i]):,}, src_offset {int(self.src_offsets[i]):,}, "
                f"nbytes {int(self.nbytes[i]):,})")

    def _check(self, table: np.ndarray) -> None:
        name = self.mover.name
        d, s, n = self.dst_offsets, self.src_offsets, self.nbytes
        for bad, why in ((n <= 0, "has no bytes"), (d < 0, "starts before the destination"),
                         (s < 0, "starts before the source"),
                         # n > size - offset, not offset + n > size: the sum of two int64 may wrap
                         (n > self.dst.nbytes - d, f"ends past the {self.dst.nbytes:,}-byte destination"),
                         (n > self.src.nbytes - s, f"ends past the {self.src.nbytes:,}-byte source")):
            hit = np.nonzero(bad)[0]
            if hit.size:
                raise MoverError(f"{name}: chunk {self._entry(int(hit[0]))} {why}; nothing was copied")
        pair = _first_overlap(d, d + n)
        if pair is not None:
            i, j = sorted(pair)
            raise MoverError(f"{name}: chunk {self._entry(j)} overlaps the destination of chunk {self._entry(i)}; "
                             "nothing was copied")
        dst_lo, src_lo = self.dst.ptr, self.src.ptr
        if self.dst.device == self.src.device and dst_lo < src_lo + self.src.nbytes and src_lo < dst_lo + self.dst.nbytes:
            # one address space: a destination must not cover bytes any entry reads. Sources may
            # overlap each other (both only read): each destination is looked up among the sources
            # sorted by start (dropping one overlapping source per pass was quadratic: 16,000
            # entries reading one block took 3 s)
            w = _first_hit(dst_lo + d, dst_lo + d + n, src_lo + s, src_lo + s + n)
            if w is not None:
                lo, hi = dst_lo + int(d[w]), dst_lo + int(d[w]) + int(n[w])
                r = int(np.argmax((src_lo + s < hi) & (src_lo + s + n > lo)))
                raise MoverError(f"{name}: chunk {self._entry(w)} writes over the source of chunk {self._entry(r)}; "
                                 "nothing was copied")
        a = self.mover.alignment
        if a > 1:
            bad = np.nonzero(((self.dst.ptr + d) % a) | ((self.src.ptr + s) % a) | (n % a))[0]
            if bad.size:
                raise MoverError(f"{name}: chunk {self._entry(int(bad[0]))} is not {a}-byte aligned "
                                 f"(pointers and size); nothing was copied")

    def runs(self, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Entries ``[lo, hi)`` as :func:`contiguous_runs` (validated already: merging changes no byte)."""
        sl = slice(lo, hi)
        return contiguous_runs(self.dst_offsets[sl], self.src_offsets[sl], self.nbytes[sl])

    def chunk_spans(self, i: int) -> tuple[Span, Span]:
        """``(dst, src)`` spans of entry ``i`` (built once for all entries)."""
        if self._chunks is None:
            dst, src = self.dst, self.src
            self._chunks = [(Span(dst.ptr + int(do), int(nb), dst.device, dst.pinned, dst.owner),
                             Span(src.ptr + int(so), int(nb), src.device, src.pinned, src.owner))
                            for do, so, nb in zip(self.dst_offsets, self.src_offsets, self.nbytes)]
        return self._chunks[i]

    def run(self, *, stream: Any) -> None:
        """Copy every entry, asynchronously on ``stream``: one batched call or launch where the
        mover has one (see its ``batched`` attribute)."""
        check_backed(self.dst, self.mover.name, "batch's destination")
        check_backed(self.src, self.mover.name, "batch's source")
        self.mover._check_stream(self.path, self.src.device, self.dst.device, stream)
        self.mover._copy_batch(self, stream)

    def _index(self, i: Any) -> int:
        """``i`` as an entry index, or MoverError (a float or a str raised a raw TypeError)."""
        if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) and 0 <= i < self.nbytes.size:
            return int(i)
        raise MoverError(f"{self.mover.name}: no chunk {i!r} in a batch of {self.nbytes.size} (an int in "
                         f"0..{self.nbytes.size - 1})")

    def copy_chunk(self, i: int, *, stream: Any) -> None:
        """Copy entry ``i`` alone, without validating the entry again (the per-chunk hot path)."""
        if type(i) is not int or not 0 <= i < self.nbytes.size:  # -1 would copy the last entry, not refuse
            i = self._index(i)
        # the ranges, not the entry: one closed or put to sleep since the batch was built segfaulted here
        check_backed(self.dst, self.mover.name, "batch's destination")
        check_backed(self.src, self.mover.name, "batch's source")
        dst, src = self.chunk_spans(i)
        self.mover._copy(dst, src, dst.nbytes, self.path, stream)


__all__ = ["ChunkBatch", "contiguous_runs"]
