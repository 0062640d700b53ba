"""The 64-bit content checksum of a byte range, on the host (numba) and on the GPU (Triton).

The definition lives in :mod:`flashboot.kernels.checksum_spec`; both implementations here
agree with :func:`~flashboot.kernels.checksum_spec.checksum_reference` bit for bit.

Public entry points:

- :func:`checksum_host` / :func:`chunk_checksums_host`: numba, parallel, any buffer.
- :class:`ChunkDigests`: the chunk digests of a file summed from its writes (pre-pack, no read-back).
- :func:`checksum` / :func:`chunk_checksums`: dispatch on where the bytes live (host -> numba,
  CUDA -> Triton), for spans, arenas, tensors and arrays.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import triton
import triton.language as tl
from numba import njit, prange

from flashboot.errors import FlashBootError

from .checksum_spec import GOLDEN32, LENGTH_MUL, M32, M64, MIX_Y, SALT_Y

# numba types integer literals as int64 and uint64 (op) int64 as float64: keep every constant uint64.
_U16, _U13, _U32 = np.uint64(16), np.uint64(13), np.uint64(32)
_MASK32 = np.uint64(M32)
_FMIX_C1, _FMIX_C2 = np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)
_GOLDEN32, _MIX_Y, _SALT_Y = np.uint64(GOLDEN32), np.uint64(MIX_Y), np.uint64(SALT_Y)

HOST_BLOCK_WORDS = 1 << 16
"""Words per parallel work item of the numba loop (256 KB: enough to amortise scheduling)."""


# ----------------------------------------------------------------------------------------- host
@njit(inline="always")
def _fmix32(h):
    h ^= h >> _U16
    h = (h * _FMIX_C1) & _MASK32
    h ^= h >> _U13
    h = (h * _FMIX_C2) & _MASK32
    return h ^ (h >> _U16)


@njit(inline="always")
def _word_xy(w, i):
    """The two 32-bit halves ``(x_i, y_i)`` of word ``w``'s term at word index ``i``."""
    lo = i & _MASK32
    hi = i >> _U32
    return _fmix32(w ^ ((lo * _GOLDEN32) & _MASK32)), _fmix32(((w + lo * _MIX_Y + hi) & _MASK32) ^ _SALT_Y)


@njit(parallel=True, cache=True)
def _chunk_term_sums(words, chunk_words, start_word):
    """Per chunk of ``chunk_words`` words: the sum mod 2**64 of the word terms, indices
    restarting at ``start_word`` in every chunk. The last chunk may be short."""
    n = words.size
    n_chunks = (n + chunk_words - 1) // chunk_words
    blocks_per_chunk = (chunk_words + HOST_BLOCK_WORDS - 1) // HOST_BLOCK_WORDS
    n_blocks = n_chunks * blocks_per_chunk
    partial = np.zeros(n_blocks, np.uint64)
    for b in prange(n_blocks):
        c = b // blocks_per_chunk
        chunk_start = c * chunk_words
        chunk_end = min(n, chunk_start + chunk_words)
        j0 = chunk_start + (b - c * blocks_per_chunk) * HOST_BLOCK_WORDS
        j1 = min(chunk_end, j0 + HOST_BLOCK_WORDS)
        # sum(x << 32 | y) = (sum(x) << 32) + sum(y) mod 2**64: sum x and y apart, shift once.
        sum_x = np.uint64(0)
        sum_y = np.uint64(0)
        for j in range(j0, j1):
            x, y = _word_xy(np.uint64(words[j]), start_word + np.uint64(j - chunk_start))
            sum_x += x
            sum_y += y
        partial[b] = (sum_x << _U32) + sum_y
    out = np.zeros(n_chunks, np.uint64)
    for c in range(n_chunks):
        s = np.uint64(0)
        for k in range(blocks_per_chunk):
            s += partial[c * blocks_per_chunk + k]
        out[c] = s
    return out


@njit(nogil=True, cache=True)
def _run_term_sum(words, start_word):
    """The sum of the terms of ``words`` at indices ``start_word, start_word + 1, ...``; serial
    and without the GIL, so several writer threads hash at once."""
    sum_x = np.uint64(0)
    sum_y = np.uint64(0)
    for j in range(words.size):
        x, y = _word_xy(np.uint64(words[j]), start_word + np.uint64(j))
        sum_x += x
        sum_y += y
    return (sum_x << _U32) + sum_y


@njit(nogil=True, cache=True)
def _scattered_term_sum(values, indices):
    """The sum of the terms of words ``values[k]`` at word indices ``indices[k]``."""
    sum_x = np.uint64(0)
    sum_y = np.uint64(0)
    for k in range(values.size):
        x, y = _word_xy(np.uint64(values[k]), np.uint64(indices[k]))
        sum_x += x
        sum_y += y
    return (sum_x << _U32) + sum_y


def word_term(word: int, index: int) -> int:
    """The digest term ``x_i << 32 | y_i`` of one 32-bit ``word`` at word ``index`` (pure Python)."""

    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)

    lo, hi = index & M32, index >> 32
    x = fmix(word ^ ((lo * GOLDEN32) & M32))
    y = fmix(((word + lo * MIX_Y + hi) & M32) ^ SALT_Y)
    return (x << 32) | y


def _as_bytes(buf: Any) -> np.ndarray:
    """A flat uint8 numpy view of a buffer-protocol object or a host span (no copy)."""
    from flashboot.memory import Span

    if isinstance(buf, Span):
        if buf.device.is_cuda:
            raise FlashBootError(f"checksum_host needs host memory; the span is on {buf.device}")
        if buf.nbytes == 0:
            return np.zeros(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * buf.nbytes).from_address(buf.ptr))
    if isinstance(buf, np.ndarray):
        if not buf.flags["C_CONTIGUOUS"]:
            raise FlashBootError("checksum_host needs a C-contiguous array")
        return buf.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        if hasattr(buf, "data_ptr") or hasattr(buf, "span"):  # torch tensors, arenas: no buffer protocol
            from flashboot.memory import span_of

            return _as_bytes(span_of(buf))
        raise FlashBootError(f"cannot checksum {type(buf).__name__}: not a contiguous buffer ({exc})") from exc


def _host_terms(raw: np.ndarray, chunk_words: int, start_word: int = 0) -> np.ndarray:
    """Per-chunk term sums over the whole words of ``raw`` (trailing 1-3 bytes excluded)."""
    n_words = raw.size // 4
    if n_words == 0:
        return np.zeros(0, np.uint64)
    words = raw[: n_words * 4].view("<u4")  # may be unaligned; numba handles that
    return _chunk_term_sums(words, np.int64(chunk_words), np.uint64(start_word))


def _tail_term(raw: np.ndarray, start_word: int = 0) -> int:
    """The term of the zero-padded last word when ``raw.size`` is not a multiple of 4."""
    r = raw.size % 4
    if not r:
        return 0
    word = int.from_bytes(bytes(raw[raw.size - r:]) + b"\0" * (4 - r), "little")
    return word_term(word, start_word + raw.size // 4)


def _checksum_host_bytes(raw: np.ndarray, start_word: int = 0) -> int:
    sums = _host_terms(raw, max(1, raw.size // 4), start_word)
    total = (raw.size * LENGTH_MUL + (int(sums[0]) if sums.size else 0) + _tail_term(raw, start_word)) & M64
    return total


def checksum_host(buf: Any) -> int:
    """The 64-bit digest of a host buffer (any buffer-protocol object, numpy array or host span).

    Parallel over the CPU cores through numba; bit-exact with ``checksum_reference``.
    """
    return _checksum_host_bytes(_as_bytes(buf))


def chunk_checksums_host(buf: Any, chunk_bytes: int) -> list[int]:
    """Digests of consecutive ``chunk_bytes`` pieces of ``buf``, each hashed as its own range
    (word indices restart at 0); the last chunk may be short. An empty buffer has no chunks."""
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise FlashBootError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    raw = _as_bytes(buf)
    n = raw.size
    if n == 0:
        return []
    if chunk_bytes % 4:
        # Chunks that start mid-word: each chunk reads its own word grid.
        return [_checksum_host_bytes(raw[s:s + chunk_bytes]) for s in range(0, n, chunk_bytes)]
    sums = _host_terms(raw, chunk_bytes // 4)
    out = []
    for k, s in enumerate(range(0, n, chunk_bytes)):
        nb = min(chunk_bytes, n - s)
        term = int(sums[k]) if k < sums.size else 0
        if k == (n - 1) // chunk_bytes:
            term += _tail_term(raw[s:s + nb])
        out.append((nb * LENGTH_MUL + term) & M64)
    return out


class ChunkDigests:
    """The chunk digests of a ``nbytes`` file (padding: zero bytes) computed from the writes that
    fill it, in any order and from several threads, with no read-back.

    The digest is a sum of per-word terms that depend only on the word and its index in its
    chunk, so each write adds the terms of the whole words it holds (:meth:`add`); the bytes of
    words a write only partly holds are kept, and :meth:`digests` adds, once everything is
    written, the terms of those words and of the never-written (zero) ones. Equal, bit for bit,
    to :func:`chunk_checksums_host` of the finished file. Writes must not overlap (LayoutError
    from :meth:`digests` otherwise).
    """

    def __init__(self, nbytes: int, chunk_bytes: int):
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % 4:
            raise FlashBootError(f"chunk_bytes must be a positive multiple of 4, got {chunk_bytes!r}")
        self.nbytes, self.chunk_bytes = nbytes, chunk_bytes
        self._sums = [0] * (-(-nbytes // chunk_bytes))
        self._runs: list[tuple[int, int]] = []  # word ranges [w0, w1) whose terms are summed
        self._edges: dict[int, int] = {}  # byte offset -> value, of words only partly written by one write
        import threading

        self._lock = threading.Lock()

    def add(self, offset: int, data: Any) -> None:
        """Account for ``data`` (bytes-like or uint8 array) written at byte ``offset``."""
        raw = _as_bytes(data)
        n = raw.size
        if n == 0:
            return
        if offset < 0 or offset + n > self.nbytes:
            raise FlashBootError(f"write of {n:,} bytes at {offset:,} outside the {self.nbytes:,}-byte file")
        w0, w1 = -(-offset // 4), (offset + n) // 4  # whole words inside the write
        sums, runs = [], []
        if w1 > w0:
            cw = self.chunk_bytes // 4
            w = w0
            while w < w1:  # per chunk: word indices restart at 0 in every chunk
                c = w // cw
                end = min(w1, (c + 1) * cw)
                part = raw[w * 4 - offset:end * 4 - offset].view("<u4")
                sums.append((c, int(_run_term_sum(part, np.uint64(w - c * cw)))))
                w = end
            runs.append((w0, w1))
        edges = {b: int(raw[b - offset]) for b in range(offset, min(w0 * 4, offset + n))}
        edges.update({b: int(raw[b - offset]) for b in range(max(w1 * 4, offset), offset + n)} if w1 >= w0 else {})
        with self._lock:
            if not self._edges.keys().isdisjoint(edges):
                from flashboot.errors import LayoutError

                raise LayoutError(f"two writes of byte {min(self._edges.keys() & edges.keys()):,} in a "
                                  f"{self.nbytes:,}-byte file: its chunk digests cannot be summed from its writes")
            for c, t in sums:
                self._sums[c] = (self._sums[c] + t) & M64
            self._runs.extend(runs)
            self._edges.update(edges)

    def digests(self) -> list[int]:
        """The chunk digests of the file as written (zeros where nothing was)."""
        from flashboot.errors import LayoutError

        n_words = -(-self.nbytes // 4)
        cw = self.chunk_bytes // 4
        sums = list(self._sums)
        gaps, prev = [], 0  # word ranges no write covered whole: zeros, plus the split words
        for a, b in sorted(self._runs):
            if a < prev:
                raise LayoutError(f"two writes overlap at word {a:,} of a {self.nbytes:,}-byte file: its chunk digests "
                                  "cannot be summed from its writes")
            if a > prev:
                gaps.append((prev, a))
            prev = b
        if prev < n_words:
            gaps.append((prev, n_words))
        for a, b in gaps:
            while a < b:
                c = a // cw
                end = min(b, (c + 1) * cw)
                zeros = np.zeros(end - a, np.uint32)  # padding: small beside the tensors
                sums[c] = (sums[c] + int(_run_term_sum(zeros, np.uint64(a - c * cw)))) & M64
                a = end
        if self._edges:
            # Words only partly written: their bytes, zero elsewhere; counted as zero words above.
            by_word: dict[int, int] = {}
            for b, v in self._edges.items():
                by_word[b // 4] = by_word.get(b // 4, 0) | (v << (8 * (b % 4)))
            words = np.array(sorted(by_word), np.int64)
            starts = np.array([a for a, _ in gaps], np.int64)
            ends = np.array([b for _, b in gaps], np.int64)
            k = np.searchsorted(starts, words, side="right") - 1
            if (k < 0).any() or (words >= ends[np.maximum(k, 0)]).any():
                raise LayoutError(f"a write overlaps another's partly written word in a {self.nbytes:,}-byte file")
            values = np.array([by_word[int(w)] for w in words], np.uint32)
            chunk = words // cw
            idx = (words - chunk * cw).astype(np.uint64)
            zeros = np.zeros_like(values)
            for c in np.unique(chunk).tolist():
                m = chunk == c
                fix = int(_scattered_term_sum(values[m], idx[m])) - int(_scattered_term_sum(zeros[m], idx[m]))
                sums[c] = (sums[c] + fix) & M64
        return [(min(self.chunk_bytes, self.nbytes - c * self.chunk_bytes) * LENGTH_MUL + t) & M64
                for c, t in enumerate(sums)]


# ------------------------------------------------------------------------------------------ GPU
CHECKSUM_TUNING: dict[str, Any] = {
    "block_words": 1024,  # 32-bit words per program per loop step (a power of two): 8 per thread
    "num_warps": 4,
    "programs_per_sm": 4,  # persistent grid = #SMs x this, one wave: 16 warps per SM as 2048 x 8 warps x 2 had,
    # but ~70 registers a thread where that took ~120 (sm_90, ptxas 13), so all four stay resident
    "num_stages": 3,  # Triton's default software pipelining of the loop's loads
}
"""Defaults of the GPU checksum's knobs; :func:`checksum` and :func:`chunk_checksums` take overrides."""


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


def _start_chunk_sums(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0,
                      copy_to=None) -> PendingDigests:
    """Launch the digests of ``chunk_bytes`` chunks of a word-aligned span (``span.ptr % 4 == 0``
    and ``chunk_bytes % 4 == 0``) in one kernel on ``stream``; the last chunk's 1-3 trailing bytes
    are read back by :meth:`PendingDigests.digests`. ``copy_to``: a span the bytes are copied into
    in the same pass (same size, word-aligned)."""
    import torch

    from .views import launch_on, sm_count, span_tensor

    n = span.nbytes
    block = knobs["block_words"]
    if start_word % block:
        raise FlashBootError(f"start_word {start_word} must be a multiple of block_words {block}")
    n_chunks = -(-n // chunk_bytes)
    n_words = n // 4
    chunk_words = chunk_bytes // 4
    tiles_per_chunk = -(-chunk_words // block)
    n_tiles = (n_chunks - 1) * tiles_per_chunk + -(-(n_words - (n_chunks - 1) * chunk_words) // block)
    # One wave of a few programs per SM, each a contiguous share of all chunks' tiles: a grid of
    # (chunks x programs per chunk) left a second, nearly empty wave behind.
    n_prog = max(1, min(n_tiles, sm_count(span.device.index) * knobs["programs_per_sm"]))
    r = n % 4
    with launch_on(span, stream):
        sums = torch.zeros(n_chunks, dtype=torch.int64, device="cuda" if span.device.is_cuda else "cpu")
        if n_words:
            words = span_tensor(span, 4, 0, n_words * 4)
            checksum_words_kernel[(n_prog,)](
                words, sums, words if copy_to is None else span_tensor(copy_to, 4, 0, n_words * 4),
                n_words, chunk_words, start_word, tiles_per_chunk, n_tiles, BLOCK=block, COPY=copy_to is not None,
                num_warps=knobs["num_warps"], num_stages=knobs["num_stages"],
            )
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
        return checksum_host(obj if span is None else span)
    return device_checksum(span, stream=stream, **tuning)


def chunk_checksums(obj: Any, chunk_bytes: int, *, stream: Any = None, **tuning: Any) -> list[int]:
    """Digests of consecutive ``chunk_bytes`` pieces of ``obj``, each its own range (the last may be
    short). On CUDA memory one launch covers all chunks: 16-byte loads when the range starts on a
    4-byte boundary and ``chunk_bytes`` is a multiple of 4 (best: of 64), byte loads otherwise."""
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise FlashBootError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    span = _span_or_buffer(obj)
    if span is None or not span.device.is_cuda:
        return chunk_checksums_host(obj if span is None else span, chunk_bytes)
    return device_chunk_checksums(span, chunk_bytes, stream=stream, **tuning)


def device_chunk_checksums(span, chunk_bytes: int, *, stream: Any = None, **tuning: Any) -> list[int]:
    """:func:`chunk_checksums` with the Triton kernels (CUDA spans; host spans under the interpreter)."""
    knobs = _gpu_knobs(tuning)
    if span.nbytes == 0:
        return []
    if span.ptr % 4 == 0 and chunk_bytes % 4 == 0:
        return _device_chunk_sums(span, chunk_bytes, stream, knobs)
    return _device_chunk_sums_bytes(span, chunk_bytes, stream, knobs)


__all__ = [
    "checksum", "chunk_checksums", "checksum_host", "chunk_checksums_host", "device_checksum",
    "device_chunk_checksums", "word_term", "CHECKSUM_TUNING", "checksum_words_kernel", "checksum_bytes_kernel",
    "PendingDigests",
]
