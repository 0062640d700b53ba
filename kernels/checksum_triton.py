"""The checksum's Triton kernels (the definition is :mod:`flashboot.kernels.checksum_spec`).

Only this module of the GPU checksum imports Triton: :mod:`flashboot.kernels.checksum_gpu`
launches these kernels from a cubin compiled ahead of time where it can, and imports this module
to compile one or as the reference path. Its source's hash keys those cubins: any edit here
makes the cached ones stale.
"""

import triton
import triton.language as tl


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


def compile_words_kernel(arch: int, *, block: int, copy: bool, num_warps: int, num_stages: int,
                         divisible_by_16: tuple[str, ...]):
    """Triton's ``CompiledKernel`` of :func:`checksum_words_kernel` for CUDA arch ``arch`` (90:
    sm_90), told that the arguments ``divisible_by_16`` are (as Triton's JIT specialises such
    values) and nothing about the others. Compiles on the host (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = checksum_words_kernel
    names = fn.arg_names
    signature = {"words_ptr": "*i32", "sums_ptr": "*i64", "copy_ptr": "*i32", "n_words": "i64", "chunk_words": "i64",
                 "start_word": "i64", "tiles_per_chunk": "i64", "n_tiles": "i64", "BLOCK": "constexpr",
                 "COPY": "constexpr"}
    assert list(signature) == list(names), f"checksum_words_kernel's parameters changed: {names}"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    src = ASTSource(fn, signature, {(names.index("BLOCK"),): block, (names.index("COPY"),): copy}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


__all__ = ["checksum_bytes_kernel", "checksum_words_kernel", "compile_words_kernel"]
