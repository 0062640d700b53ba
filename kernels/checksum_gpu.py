"""The 64-bit content checksum on the GPU: Triton kernels over a span (see
:mod:`flashboot.kernels.checksum`, which dispatches here for CUDA memory)."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl

from flashboot.errors import FlashBootError

from .checksum_spec import LENGTH_MUL, M64, word_term


# ------------------------------------------------------------------------------------------ GPU
CHECKSUM_TUNING: dict[str, Any] = {
    "block_words": 1024,  # 32-bit words per program per loop step (a power of two): 8 per thread
    "num_warps": 4,
    "programs_per_sm": 6,  # persistent grid = #SMs x this, one wave (~70 registers a thread, sm_90, ptxas 13):
    # copy + checksum of 1 GiB on the H200 ran 0.87x a plain copy at 4, 0.99x at 6, 0.63x at 2 (RESULTS.md)
    "num_stages": 3,  # Triton's default software pipelining of the loop's loads
}
"""Defaults of the GPU checksum's knobs; :func:`checksum` and :func:`chunk_checksums` take overrides."""

LAUNCHED_ON: set[int] = set()
"""Devices this process has launched the word checksum kernel on (a verify's kernel): its first
launch in a process costs ~1 s of Triton, later ones ~1 ms (see :func:`~flashboot.kernels.checksum.gpu_checksum_loaded`)."""


@triton.jit
def _fmix32_tl(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _word_terms(w, lo, hi):
    """``x, y`` of the spec for uint32 words ``w`` at indices ``hi << 32 | lo`` (all uint32; wraps mod 2**32)."""
    x = _fmix32_tl(w ^ (lo * 0x9E3779B1))
    y = _fmix32_tl((w + lo * 0x7FEB352D + hi) ^ 0x27D4EB2F)
    return x, y


@triton.jit
def _tile_terms(raw, offs, idx, acc_x, acc_y, mask, MASKED: tl.constexpr):
    """``acc_x, acc_y`` plus the terms of the tile of words ``raw`` whose first word has index
    ``idx`` (int64; a multiple of the tile's size, so the tile's ``hi`` is one scalar)."""
    w = raw.to(tl.uint32, bitcast=True)
    lo0 = idx.to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    offs = offs.to(tl.uint32)
    # (lo0 + offs) * K = offs * K + lo0 * K mod 2**32: the per-word products are loop-invariant
    # and the per-tile ones scalars, so a word costs an add where it cost an add and a multiply.
    x = _fmix32_tl(w ^ (offs * 0x9E3779B1 + lo0 * 0x9E3779B1))
    y = _fmix32_tl((w + offs * 0x7FEB352D + (lo0 * 0x7FEB352D + hi)) ^ 0x27D4EB2F)
    if MASKED:
        x = tl.where(mask, x, 0)
        y = tl.where(mask, y, 0)
    return acc_x + x, acc_y + y.to(tl.uint64)


@triton.jit
def checksum_words_kernel(
    words_ptr,
    sums_ptr,
    copy_ptr,
    n_words: tl.int64,
    chunk_words: tl.int64,
    start_word: tl.int64,
    tiles_per_chunk: tl.int64,
    n_tiles: tl.int64,
    BLOCK: tl.constexpr,  # words per tile; a power of two, so no tile straddles a 2**32 index boundary
    COPY: tl.constexpr,  # also store every word read to copy_ptr: a copy that checksums what it writes
):
    """Per chunk: the sum mod 2**64 of its word terms, added atomically to ``sums[c]`` (zeroed).

    Chunk ``c`` covers words ``[c * chunk_words, ...)`` (the last may be short) with indices
    restarting at ``start_word``; it has ``tiles_per_chunk`` tiles of ``BLOCK`` words (the last
    of them partial when ``BLOCK`` does not divide the chunk), ``n_tiles`` in all. The grid is
    persistent (a few programs per SM, one wave): program ``p`` of ``P`` takes the contiguous
    tiles ``[p * n_tiles // P, (p + 1) * n_tiles // P)``, so every program gets the same work
    whatever the chunk size, and flushes its sum once per chunk it touches. Full tiles are
    loaded unmasked (16-byte vectors), the next one while the current one is hashed. With
    ``COPY`` the words go to ``copy_ptr`` at the same positions: the digests are of the bytes written.
    """
    p = tl.program_id(0).to(tl.int64)
    n_prog = tl.num_programs(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    t = p * n_tiles // n_prog
    t_end = (p + 1) * n_tiles // n_prog
    while t < t_end:
        c = t // tiles_per_chunk
        chunk_begin = c * chunk_words
        chunk_len = tl.minimum(n_words - chunk_begin, chunk_words)
        n_full = chunk_len // BLOCK
        j0 = t - c * tiles_per_chunk
        j1 = tl.minimum(t_end - c * tiles_per_chunk, tiles_per_chunk)  # this program's tiles of chunk c: [j0, j1)
        j_full = tl.minimum(j1, n_full)
        acc_x = tl.zeros([BLOCK], dtype=tl.uint32)  # x only matters mod 2**32: (sum x) << 32
        acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
        # Prefetch: the first full tile (predicated off, whole, when there is none), then in the
        # loop the next one (the last one again at the end: in range, and never used).
        raw = tl.load(words_ptr + chunk_begin + j0 * BLOCK + offs, mask=offs < tl.where(j0 < j_full, BLOCK, 0), other=0)
        for j in range(j0, j_full):
            nxt = tl.load(words_ptr + chunk_begin + tl.minimum(j + 1, j_full - 1) * BLOCK + offs)
            if COPY:
                tl.store(copy_ptr + chunk_begin + j * BLOCK + offs, raw)
            acc_x, acc_y = _tile_terms(raw, offs, start_word + j * BLOCK, acc_x, acc_y, offs, False)
            raw = nxt
        # The chunk's partial last tile, masked, when it is among this program's tiles.
        first = n_full * BLOCK
        limit = tl.where((j0 <= n_full) & (n_full < j1), chunk_len - first, 0)
        mask = offs < limit
        raw = tl.load(words_ptr + chunk_begin + first + offs, mask=mask, other=0)
        if COPY:
            tl.store(copy_ptr + chunk_begin + first + offs, raw, mask=mask)
        acc_x, acc_y = _tile_terms(raw, offs, start_word + first, acc_x, acc_y, mask, True)
        total = (tl.sum(acc_x, axis=0).to(tl.uint64) << 32) + tl.sum(acc_y, axis=0)
        tl.atomic_add(sums_ptr + c, total.to(tl.int64, bitcast=True), sem="relaxed")
        t = c * tiles_per_chunk + j1


@triton.jit
def checksum_bytes_kernel(
    bytes_ptr,
    partial_ptr,
    n_bytes: tl.int64,
    chunk_bytes: tl.int64,
    start_word: tl.int64,
    BLOCK: tl.constexpr,  # words per loop step (a power of two)
):
    """Slow path for ranges or chunks that do not start on a 4-byte boundary: words assembled
    from byte loads, each chunk's last word zero-padded. Grid ``(n_chunks, P)`` like
    :func:`checksum_words_kernel`; writes ``partial[c * P + p]``."""
    chunk = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    n_prog = tl.num_programs(1).to(tl.int64)
    chunk_begin = chunk * chunk_bytes
    chunk_len = tl.minimum(n_bytes - chunk_begin, chunk_bytes)
    n_words = (chunk_len + 3) // 4
    n_tiles = (n_words + BLOCK - 1) // BLOCK
    offs = tl.arange(0, BLOCK)
    acc_x = tl.zeros([BLOCK], dtype=tl.uint32)
    acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
    for tile in range(p, n_tiles, n_prog):
        first = tile * BLOCK
        byte0 = (first + offs) * 4
        w = tl.zeros([BLOCK], dtype=tl.uint32)
        for k in tl.static_range(4):
            b = tl.load(bytes_ptr + chunk_begin + byte0 + k, mask=byte0 + k < chunk_len, other=0)
            w |= b.to(tl.uint32) << (8 * k)
        idx = start_word + first
        lo = idx.to(tl.uint32) + offs
        hi = (idx >> 32).to(tl.uint32)
        x, y = _word_terms(w, lo, hi)
        valid = first + offs < n_words
        acc_x += tl.where(valid, x, 0)
        acc_y += tl.where(valid, y, 0).to(tl.uint64)
    total = (tl.sum(acc_x, axis=0).to(tl.uint64) << 32) + tl.sum(acc_y, axis=0)
    tl.store(partial_ptr + chunk * n_prog + p, total.to(tl.int64, bitcast=True))


def _gpu_knobs(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(CHECKSUM_TUNING)
    if unknown:
        raise FlashBootError(f"unknown checksum knob(s) {sorted(unknown)}; known: {sorted(CHECKSUM_TUNING)}")
    k = {**CHECKSUM_TUNING, **overrides}
    bw = k["block_words"]
    if not isinstance(bw, int) or bw < 16 or bw & (bw - 1):
        raise FlashBootError(f"block_words must be a power of two >= 16, got {bw!r}")
    from .copy import _check_launch_knobs

    _check_launch_knobs(k)
    return k


def _sum_partials(partials, n_chunks: int) -> list[int]:
    """Wrap-around uint64 sums of the ``(n_chunks, P)`` partials, fetched to the host."""
    host = partials.cpu().numpy().view(np.uint64).reshape(n_chunks, -1)
    return [int(v) for v in host.sum(axis=1, dtype=np.uint64)]


class PendingDigests:
    """Chunk digests the device is still computing: :meth:`digests` waits for them (a launch
    returns at once, so a caller or a benchmark can stop the clock, or queue more work, first)."""

    def __init__(self, span, stream: Any, sums, chunk_bytes: int, start_word: int):
        self._span, self._stream, self._sums = span, stream, sums
        self._chunk_bytes, self._start_word = chunk_bytes, start_word
        self._done: list[int] | None = None

    @classmethod
    def finished(cls, digests: list[int]) -> "PendingDigests":
        """Digests already known (a host copy computes them before it returns)."""
        done = cls(None, None, None, 0, 0)
        done._done = digests
        return done

    def digests(self) -> list[int]:
        """The digests, one per chunk (waits for the launch's stream once)."""
        if self._done is not None:
            return self._done
        from .views import launch_on, span_tensor

        span, n, chunk_bytes = self._span, self._span.nbytes, self._chunk_bytes
        r = n % 4
        with launch_on(span, self._stream):  # the read-back is ordered after the kernel on its stream
            sums = [int(v) for v in self._sums.cpu().numpy().view(np.uint64)]
            tail = span_tensor(span, 1, n - r, r).cpu().numpy() if r else None
        out = []
        for c, term in enumerate(sums):
            nb = min(chunk_bytes, n - c * chunk_bytes)
            if tail is not None and c == len(sums) - 1:
                word = int.from_bytes(tail.tobytes() + b"\0" * (4 - r), "little")
                term += word_term(word, self._start_word + (nb // 4))
            out.append((nb * LENGTH_MUL + term) & M64)
        self._done, self._sums = out, None
        return out


def _words_launch(nbytes: int, chunk_bytes: int, block: int, programs_per_sm: int,
                  device_index: int) -> tuple[tuple[int], tuple[int, int, int, int]]:
    """The word kernel's grid and sizes (``n_words, chunk_words, tiles_per_chunk, n_tiles``) for
    ``chunk_bytes`` chunks of ``nbytes``: what a launch passes, and what Triton specialises on
    (an int that is 1 or a multiple of 16 compiles another kernel), so a warm-up can match it."""
    from .views import sm_count

    n_chunks = -(-nbytes // chunk_bytes)
    n_words = nbytes // 4
    chunk_words = chunk_bytes // 4
    tiles_per_chunk = -(-chunk_words // block)
    n_tiles = (n_chunks - 1) * tiles_per_chunk + -(-(n_words - (n_chunks - 1) * chunk_words) // block)
    # One wave of a few programs per SM, each a contiguous share of all chunks' tiles: a grid of
    # (chunks x programs per chunk) left a second, nearly empty wave behind.
    n_prog = max(1, min(n_tiles, sm_count(device_index) * programs_per_sm))
    return (n_prog,), (n_words, chunk_words, tiles_per_chunk, n_tiles)


def _words_sizes_args(sizes: tuple[int, int, int, int], start_word: int) -> tuple[int, ...]:
    """The word kernel's int arguments in its parameter order."""
    n_words, chunk_words, tiles_per_chunk, n_tiles = sizes
    return n_words, chunk_words, start_word, tiles_per_chunk, n_tiles


def _start_chunk_sums(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0,
                      copy_to=None) -> PendingDigests:
    """Launch the digests of ``chunk_bytes`` chunks of a word-aligned span (``span.ptr % 4 == 0``
    and ``chunk_bytes % 4 == 0``) in one kernel on ``stream``; the last chunk's 1-3 trailing bytes
    are read back by :meth:`PendingDigests.digests`. ``copy_to``: a span the bytes are copied into
    in the same pass (same size, word-aligned)."""
    import torch

    from .views import launch_on, span_tensor

    n = span.nbytes
    block = knobs["block_words"]
    if start_word % block:
        raise FlashBootError(f"start_word {start_word} must be a multiple of block_words {block}")
    n_chunks = -(-n // chunk_bytes)
    grid, sizes = _words_launch(n, chunk_bytes, block, knobs["programs_per_sm"], span.device.index)
    n_words = sizes[0]
    r = n % 4
    with launch_on(span, stream):
        sums = torch.zeros(n_chunks, dtype=torch.int64, device="cuda" if span.device.is_cuda else "cpu")
        if n_words:
            words = span_tensor(span, 4, 0, n_words * 4)
            checksum_words_kernel[grid](
                words, sums, words if copy_to is None else span_tensor(copy_to, 4, 0, n_words * 4),
                *_words_sizes_args(sizes, start_word), BLOCK=block, COPY=copy_to is not None,
                num_warps=knobs["num_warps"], num_stages=knobs["num_stages"],
            )
            if copy_to is None and span.device.is_cuda:
                LAUNCHED_ON.add(span.device.index)
        if copy_to is not None and r:
            from .copy import copy_bytes_kernel

            copy_bytes_kernel[(1,)](span_tensor(copy_to, 1), span_tensor(span, 1), 0, n - r, r)
    return PendingDigests(span, stream, sums, chunk_bytes, start_word)


def _device_chunk_sums(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0) -> list[int]:
    """:func:`_start_chunk_sums`, waited for."""
    return _start_chunk_sums(span, chunk_bytes, stream, knobs, start_word).digests()


def _device_chunk_sums_bytes(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0) -> list[int]:
    """The byte-load slow path (any start address, any ``chunk_bytes``), all chunks in one launch."""
    import torch

    from .views import launch_on, sm_count, span_tensor

    block = knobs["block_words"]
    if start_word % block:
        raise FlashBootError(f"start_word {start_word} must be a multiple of block_words {block}")
    n = span.nbytes
    n_chunks = -(-n // chunk_bytes)
    tiles_per_chunk = -(-(-(-min(chunk_bytes, n) // 4)) // block)
    target = sm_count(span.device.index) * knobs["programs_per_sm"]
    n_prog = max(1, min(tiles_per_chunk, -(-target // n_chunks), 65535))
    with launch_on(span, stream):
        partials = torch.empty(n_chunks * n_prog, dtype=torch.int64, device="cuda" if span.device.is_cuda else "cpu")
        checksum_bytes_kernel[(n_chunks, n_prog)](span_tensor(span, 1), partials, n, chunk_bytes, start_word,
                                                  BLOCK=block, num_warps=knobs["num_warps"], num_stages=knobs["num_stages"])
        sums = _sum_partials(partials, n_chunks)
    return [(min(chunk_bytes, n - c * chunk_bytes) * LENGTH_MUL + sums[c]) & M64 for c in range(n_chunks)]


def device_checksum(span, *, stream: Any = None, start_word: int = 0, **tuning: Any) -> int:
    """The digest of a span with the Triton kernels (CUDA spans; host spans under the interpreter).

    ``start_word`` shifts the word indices (tests use it to reach indices past 2**32 without
    allocating 16 GB); it must be a multiple of ``block_words``.
    """
    knobs = _gpu_knobs(tuning)
    if span.nbytes == 0:
        return 0
    if span.ptr % 4:
        return _device_chunk_sums_bytes(span, span.nbytes, stream, knobs, start_word)[0]
    # One chunk spanning the range; its stride rounded to whole tiles keeps 16-byte alignment visible.
    block = knobs["block_words"]
    stride_bytes = -(-span.nbytes // (4 * block)) * 4 * block
    return _device_chunk_sums(span, stride_bytes, stream, knobs, start_word)[0]


def device_chunk_checksums(span, chunk_bytes: int, *, stream: Any = None, **tuning: Any) -> list[int]:
    """:func:`chunk_checksums` with the Triton kernels (CUDA spans; host spans under the interpreter)."""
    knobs = _gpu_knobs(tuning)
    if span.nbytes == 0:
        return []
    if span.ptr % 4 == 0 and chunk_bytes % 4 == 0:
        return _device_chunk_sums(span, chunk_bytes, stream, knobs)
    return _device_chunk_sums_bytes(span, chunk_bytes, stream, knobs)


def start_device_chunk_checksums(span, chunk_bytes: int, *, stream: Any, **tuning: Any) -> PendingDigests:
    """:func:`device_chunk_checksums` launched on ``stream`` and not waited for: the digests of a
    word-aligned span (``span.ptr`` and ``chunk_bytes`` multiples of 4), read by
    :meth:`PendingDigests.digests`. A caller checksums a piece while the next one is copied."""
    if span.ptr % 4 or chunk_bytes % 4 or span.nbytes == 0:
        raise FlashBootError(f"start_device_chunk_checksums needs a non-empty span at a 4-byte aligned address "
                             f"and chunks of a multiple of 4 bytes; got {span.nbytes:,} bytes at {span.ptr:#x} in "
                             f"chunks of {chunk_bytes:,}")
    return _start_chunk_sums(span, chunk_bytes, stream, _gpu_knobs(tuning))


def warm_chunk_checksums(device_index: int, nbytes: int, chunk_bytes: int, **tuning: Any) -> None:
    """Compile and load the kernel that :func:`chunk_checksums` of ``nbytes`` at a 16-byte aligned
    address (an arena, a piece of one) in ``chunk_bytes`` chunks on CUDA device ``device_index``
    launches, without launching it: Triton specialises on its sizes (1, multiples of 16), so a
    probe of another shape leaves a first call of this one to compile (~290 ms in a served load
    of 40,250 tensors, hardware.md). Touches a few bytes of scratch memory, not ``nbytes``."""
    import contextlib

    import torch

    from .views import interpreting

    knobs = _gpu_knobs(tuning)
    if nbytes <= 0 or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise FlashBootError(f"warm_chunk_checksums needs nbytes > 0 and chunk_bytes > 0, got {nbytes!r}, "
                             f"{chunk_bytes!r}")
    block = knobs["block_words"]
    n_chunks = -(-nbytes // chunk_bytes)
    on_host = interpreting()  # the interpreter compiles nothing; its launches are what tests compare
    with contextlib.nullcontext() if on_host else torch.cuda.device(device_index):
        # 16-byte aligned, as an arena: pointers specialise on it too
        scratch = torch.zeros(16, dtype=torch.int64, device="cpu" if on_host else f"cuda:{device_index}")
        if chunk_bytes % 4 == 0 and nbytes >= 4:
            grid, sizes = _words_launch(nbytes, chunk_bytes, block, knobs["programs_per_sm"], device_index)
            compiled = checksum_words_kernel.warmup(
                scratch.view(torch.int32), scratch, scratch.view(torch.int32), *_words_sizes_args(sizes, 0),
                BLOCK=block, COPY=False, num_warps=knobs["num_warps"], num_stages=knobs["num_stages"], grid=grid)
        else:
            compiled = checksum_bytes_kernel.warmup(
                scratch.view(torch.uint8), scratch, nbytes, chunk_bytes, 0, BLOCK=block,
                num_warps=knobs["num_warps"], num_stages=knobs["num_stages"], grid=(n_chunks, 1))
    # the module load and launcher a first launch would make lazily (Triton's CompiledKernel)
    init_handles = getattr(compiled, "_init_handles", None)
    if init_handles is not None:
        init_handles()


__all__ = ["CHECKSUM_TUNING", "PendingDigests", "checksum_bytes_kernel", "checksum_words_kernel", "device_checksum",
           "device_chunk_checksums", "start_device_chunk_checksums", "warm_chunk_checksums"]
