"""The host mover's parallel copy loop (numba), at module level so that numba can cache it on disk:
compiling it costs a fresh process ~0.6 s at its first copy of 1 MiB or more (a clone's whole
transfer of a small arena), loading it from the cache a fraction of that."""

from __future__ import annotations

from ._numba import cached_njit, numba_or_error

numba = numba_or_error("the host mover's parallel copy")


@cached_njit(parallel=True, nogil=True)
def copy_chunks(dst, src, chunk_bytes):
    """``dst[:] = src`` (uint8 arrays of one length), ``chunk_bytes`` per parallel work item."""
    n = src.shape[0]
    nchunks = (n + chunk_bytes - 1) // chunk_bytes
    for c in numba.prange(nchunks):
        lo = c * chunk_bytes
        hi = min(lo + chunk_bytes, n)
        dst[lo:hi] = src[lo:hi]


__all__ = ["copy_chunks"]
