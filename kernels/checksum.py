"""The 64-bit content checksum of a byte range, on the host (numba) and on the GPU (Triton).

The definition lives in :mod:`flashboot.kernels.checksum_spec`; both implementations here
agree with :func:`~flashboot.kernels.checksum_spec.checksum_reference` bit for bit.

Public entry points:

- :func:`checksum_host` / :func:`chunk_checksums_host`: numba, parallel, any buffer
  (:mod:`~flashboot.kernels.checksum_host`).
- :class:`ChunkDigests`: the chunk digests of a file summed from its writes (pre-pack, no read-back).
- :func:`checksum` / :func:`chunk_checksums`: dispatch on where the bytes live (host -> numba,
  CUDA -> :mod:`~flashboot.kernels.checksum_gpu`: the word kernel's cubin compiled ahead of time,
  else Triton), for spans, arenas, tensors and arrays.

This module imports neither numba nor Triton: each backend is imported by the first call that
needs it, so a process that checks only host memory never loads Triton, and one that checks only
CUDA memory never loads numba.
"""

from __future__ import annotations

import sys
from typing import Any

from flashboot._lazy import lazy_getattr
from flashboot.errors import FlashBootError

from .checksum_spec import word_term

_LAZY = {
    "ChunkDigests": "flashboot.kernels.checksum_host",
    "HOST_BLOCK_WORDS": "flashboot.kernels.checksum_host",
    "checksum_host": "flashboot.kernels.checksum_host",
    "chunk_checksums_host": "flashboot.kernels.checksum_host",
    "CHECKSUM_TUNING": "flashboot.kernels.checksum_gpu",
    "PendingDigests": "flashboot.kernels.checksum_gpu",
    "checksum_bytes_kernel": "flashboot.kernels.checksum_triton",
    "checksum_words_kernel": "flashboot.kernels.checksum_triton",
    "device_checksum": "flashboot.kernels.checksum_gpu",
    "device_chunk_checksums": "flashboot.kernels.checksum_gpu",
    "start_device_chunk_checksums": "flashboot.kernels.checksum_gpu",
    "warm_chunk_checksums": "flashboot.kernels.checksum_gpu",
}
__getattr__ = lazy_getattr("flashboot.kernels.checksum", _LAZY, globals())


def gpu_checksum_loaded(device_index: int) -> bool:
    """Whether this process has already run the GPU chunk checksum on CUDA device
    ``device_index``, so that another call costs ~1 ms rather than what a first call costs
    (loading the cubin, or ~1 s of Triton's import, launcher and cache without one). Imports nothing."""
    gpu = sys.modules.get("flashboot.kernels.checksum_gpu")
    return gpu is not None and device_index in gpu.LAUNCHED_ON


def _span_or_buffer(obj: Any):
    """A span of ``obj`` where :func:`span_of` knows it, else ``None`` for a plain host buffer."""
    from flashboot.memory import span_of

    if isinstance(obj, (bytes, bytearray, memoryview)):
        return None
    try:
        return span_of(obj)
    except FlashBootError as not_a_span:
        try:
            memoryview(obj)
        except TypeError:
            raise not_a_span from None  # neither a span nor a buffer: span_of's message says what was given
        return None


def checksum(obj: Any, *, stream: Any = None, **tuning: Any) -> int:
    """The 64-bit digest of a byte range wherever it lives: host memory through numba, CUDA memory
    through Triton (on ``stream``; the call waits for the result). ``obj`` is a Span, an arena, a
    tensor, a numpy or CuPy array, or any buffer. ``tuning`` overrides :data:`CHECKSUM_TUNING`."""
    span = _span_or_buffer(obj)
    if span is None or not span.device.is_cuda:
        from .checksum_host import checksum_host

        return checksum_host(obj if span is None else span)
    from .checksum_gpu import device_checksum

    return device_checksum(span, stream=stream, **tuning)


def chunk_checksums(obj: Any, chunk_bytes: int, *, stream: Any = None, **tuning: Any) -> list[int]:
    """Digests of consecutive ``chunk_bytes`` pieces of ``obj``, each its own range (the last may be
    short). On CUDA memory one launch covers all chunks: 16-byte loads when the range starts on a
    4-byte boundary and ``chunk_bytes`` is a multiple of 4 (best: of 64), byte loads otherwise."""
    from flashboot.memory import count_of

    # np.int64(4096) had been refused as no int, True taken as 1 (a digest per byte)
    chunk_bytes = count_of(chunk_bytes)
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise FlashBootError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    span = _span_or_buffer(obj)
    if span is None or not span.device.is_cuda:
        from .checksum_host import chunk_checksums_host

        return chunk_checksums_host(obj if span is None else span, chunk_bytes)
    from .checksum_gpu import device_chunk_checksums

    return device_chunk_checksums(span, chunk_bytes, stream=stream, **tuning)


__all__ = ["checksum", "chunk_checksums", "gpu_checksum_loaded", "word_term", *_LAZY]
