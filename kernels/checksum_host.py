"""The 64-bit content checksum on the host: numba, parallel, any buffer (see
:mod:`flashboot.kernels.checksum`, which dispatches here for host memory)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from flashboot.errors import FlashBootError
from flashboot.memory import count_of

from ._numba import cached_njit, numba_or_error, parallel_call
from .checksum_spec import GOLDEN32, LENGTH_MUL, M32, M64, MIX_Y, SALT_Y, word_term

_numba = numba_or_error("the host checksum (verify on the host backend, a staged copy's check)")
njit, prange = _numba.njit, _numba.prange

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


@cached_njit(parallel=True)
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


@cached_njit(nogil=True)
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


@cached_njit(nogil=True)
def _scattered_term_sum(values, indices):
    """The sum of the terms of words ``values[k]`` at word indices ``indices[k]``."""
    sum_x = np.uint64(0)
    sum_y = np.uint64(0)
    for k in range(values.size):
        x, y = _word_xy(np.uint64(values[k]), np.uint64(indices[k]))
        sum_x += x
        sum_y += y
    return (sum_x << _U32) + sum_y


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
    return parallel_call(_chunk_term_sums, words, np.int64(chunk_words), np.uint64(start_word))


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
    chunk_bytes = count_of(chunk_bytes)  # np.int64(4096) had been refused, True taken as 1
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise FlashBootError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    raw = _as_bytes(buf)
    n = raw.size
    if n == 0:
        return []
    # one chunk covers a smaller buffer whole: the kernel sizes its scratch by chunk_bytes, and
    # chunk_bytes 1<<60 on 8 bytes asked for exabytes (MemoryError; 1<<70: OverflowError)
    chunk_bytes = min(chunk_bytes, n)
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


__all__ = ["ChunkDigests", "HOST_BLOCK_WORDS", "checksum_host", "chunk_checksums_host"]
