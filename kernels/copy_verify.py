"""A copy that checksums what it writes, in the same pass: one read of the source instead of two.

:func:`copy_with_checksums` runs the checksum kernel itself (``checksum_words_kernel`` with
``COPY=True``), so its digests are bit-identical to :func:`~flashboot.kernels.checksum.chunk_checksums`
of the destination. :func:`copy_verified` compares them with recorded digests and names the
first chunk that differs, as ``flashboot verify`` does. A verified load or clone calls it with
the manifest's chunk digests in place of a copy followed by a checksum pass.
"""

from __future__ import annotations

from typing import Any, Sequence

from flashboot.errors import ChecksumMismatchError, MoverError
from flashboot.memory import check_backed, count_of, span_of, writable

from .checksum_gpu import PendingDigests, _gpu_knobs, _start_chunk_sums
from .views import interpreting


def start_copy_with_checksums(dst: Any, src: Any, chunk_bytes: int, *, stream: Any = None,
                              **tuning: Any) -> PendingDigests:
    """Start copying all of ``src`` into the start of ``dst``, with the digests of its consecutive
    ``chunk_bytes`` chunks (the last may be short) computed from the words as they are written;
    ``.digests()`` of the result waits for them.

    CUDA memory (host memory under the interpreter): one kernel pass on ``stream``, and this
    returns once it is launched. Host memory otherwise: the host copy and checksum, done on
    return. Both pointers and ``chunk_bytes`` must be multiples of 4 and the ranges must not
    overlap (MoverError names the numbers). ``tuning`` overrides
    :data:`~flashboot.kernels.checksum.CHECKSUM_TUNING`.
    """
    d, s = span_of(writable(dst, "copy_with_checksums")), span_of(src)
    for span, role in ((d, "destination"), (s, "source")):  # a closed or asleep arena's span segfaulted
        check_backed(span, "copy_with_checksums", role)
    chunk_bytes = count_of(chunk_bytes)  # np.int64(4096) had been refused as no multiple of 4
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % 4:
        raise MoverError(f"copy_with_checksums: chunk_bytes must be a positive multiple of 4, got {chunk_bytes!r}")
    if s.nbytes > d.nbytes:
        raise MoverError(f"copy_with_checksums: a {s.nbytes:,}-byte source does not fit the {d.nbytes:,}-byte destination")
    if d.ptr % 4 or s.ptr % 4:
        raise MoverError(f"copy_with_checksums: needs 4-byte aligned pointers; got src {s.ptr:#x}, dst {d.ptr:#x}. "
                         "Copy with a mover, then flashboot.kernels.checksum.chunk_checksums")
    if d.device == s.device and d.ptr < s.ptr + s.nbytes and s.ptr < d.ptr + s.nbytes:
        raise MoverError(f"copy_with_checksums: source {s.ptr:#x} and destination {d.ptr:#x} overlap "
                         f"({s.nbytes:,} bytes)")
    d = d.sub(0, s.nbytes)
    if s.nbytes and (d.device.is_cuda or interpreting()):
        if d.device != s.device:
            raise MoverError(f"copy_with_checksums: runs on one device; got {s.device} -> {d.device}; "
                             "copy across devices with a mover, then checksum")
        return _start_chunk_sums(s, chunk_bytes, stream, _gpu_knobs(tuning), copy_to=d)
    if s.nbytes == 0:
        return PendingDigests.finished([])
    from flashboot.movers.host import host_copy

    from .checksum_host import chunk_checksums_host

    host_copy(d.ptr, s.ptr, s.nbytes)
    return PendingDigests.finished(chunk_checksums_host(d, chunk_bytes))


def copy_with_checksums(dst: Any, src: Any, chunk_bytes: int, *, stream: Any = None, **tuning: Any) -> list[int]:
    """:func:`start_copy_with_checksums`, waited for: the chunk digests of what was written."""
    return start_copy_with_checksums(dst, src, chunk_bytes, stream=stream, **tuning).digests()


def copy_verified(dst: Any, src: Any, expected: Sequence[int], chunk_bytes: int, *, stream: Any = None,
                  where: str = "copy", **tuning: Any) -> list[int]:
    """:func:`copy_with_checksums`, then ChecksumMismatchError naming the first chunk (index, byte
    range, both digests) whose digest differs from ``expected``; ``where`` prefixes the message
    (an image path, a clone's name). Returns the digests."""
    found = copy_with_checksums(dst, src, chunk_bytes, stream=stream, **tuning)
    if len(found) != len(expected):
        raise MoverError(f"{where}: {len(expected)} expected chunk digests for {len(found)} chunks of "
                         f"{chunk_bytes:,} bytes")
    nbytes = span_of(src).nbytes
    for c, (want, got) in enumerate(zip(expected, found)):
        if int(want) != got:
            offset = c * chunk_bytes
            raise ChecksumMismatchError(where, c, offset, min(chunk_bytes, nbytes - offset), int(want), got)
    return found


__all__ = ["start_copy_with_checksums", "copy_with_checksums", "copy_verified"]
