"""The checksum's definition, written plainly in numpy: the reference the fast kernels must match.

A byte range of ``n`` bytes is read as little-endian uint32 words ``w_i`` (the last word
zero-padded), ``i = 0 .. ceil(n/4) - 1``, ``lo = i mod 2**32``, ``hi = i >> 32``::

    fmix32(h)  = murmur3's finaliser on 32 bits
    x_i        = fmix32(w_i ^ (lo * 0x9E3779B1 mod 2**32))
    y_i        = fmix32(((w_i + lo * 0x7FEB352D + hi) mod 2**32) ^ 0x27D4EB2F)
    digest     = (n * 0x9E3779B97F4A7C15 + sum_i (x_i << 32 | y_i)) mod 2**64

The sum is order-independent, so a GPU tree reduction, a parallel CPU loop and this
sequential numpy code agree bit for bit. Each word's term depends on its position, so
swapped words change the digest; the length term separates ranges that differ only in
trailing zero bytes.
"""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B1
MIX_Y = 0x7FEB352D
SALT_Y = 0x27D4EB2F
LENGTH_MUL = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1


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


def fmix32_np(h: np.ndarray) -> np.ndarray:
    """murmur3 fmix32 on a uint64 array holding 32-bit values."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & np.uint64(M32)
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & np.uint64(M32)
    return h ^ (h >> np.uint64(16))


def words_of(buf) -> np.ndarray:
    """The range as uint32 words, zero-padded to a multiple of 4 bytes."""
    raw = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    pad = (-raw.size) % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    return raw.view("<u4")


def checksum_reference(buf, block_words: int = 1 << 22) -> int:
    """The 64-bit digest of ``buf`` (any buffer-protocol object), computed in numpy blocks."""
    n = memoryview(buf).nbytes
    words = words_of(buf)
    total = (n * LENGTH_MUL) & M64
    with np.errstate(over="ignore"):
        for start in range(0, words.size, block_words):
            w = words[start:start + block_words].astype(np.uint64)
            i = np.arange(start, start + w.size, dtype=np.uint64)
            lo, hi = i & np.uint64(M32), i >> np.uint64(32)
            x = fmix32_np(w ^ ((lo * np.uint64(GOLDEN32)) & np.uint64(M32)))
            y = fmix32_np(((w + lo * np.uint64(MIX_Y) + hi) & np.uint64(M32)) ^ np.uint64(SALT_Y))
            total = (total + int(((x << np.uint64(32)) | y).sum(dtype=np.uint64))) & M64
    return total
