"""The Gluon kernel of :mod:`flashboot.kernels.tma_ring` (imported only where Gluon's Hopper TMA
exists: see :func:`~flashboot.kernels.tma_ring.ring_available`)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# Triton 3.7 renamed the TMA copies (the old names raise there); 3.6 has only the old ones
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _advance(table_ptr, col: gl.constexpr, t, entry, value, first, nxt, live):
    """Move a table cursor onto the chunk holding tile ``t`` (a program's tiles only increase and
    every chunk has a tile, so one step is enough); ``value`` is column ``col``."""
    if live & (t >= nxt):
        entry += 1
        value = gl.load(table_ptr + entry * 4 + col)
        first = nxt
        nxt = gl.load(table_ptr + entry * 4 + 7)  # the next row's first tile (the sentinel ends the table)
    return entry, value, first, nxt


@gluon.jit
def copy_ring_kernel(src_desc, dst_desc, table_ptr, starts_ptr, n_tiles, STAGES: gl.constexpr):
    """Copy every chunk of the table through a ring of ``STAGES`` shared-memory boxes per program."""
    ROWS: gl.constexpr = src_desc.block_type.shape[0]
    NBYTES: gl.constexpr = src_desc.block_type.nbytes
    LEAD: gl.constexpr = STAGES - 1  # loads in flight ahead of the store being issued
    pid = gl.program_id(0).to(gl.int64)
    nprog = gl.num_programs(0).to(gl.int64)
    t0 = pid * n_tiles // nprog
    n_mine = ((pid + 1) * n_tiles // nprog - t0).to(gl.int32)  # shared-memory indices are int32
    bufs = gl.allocate_shared_memory(src_desc.dtype, [STAGES, ROWS, src_desc.block_type.shape[1]], src_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):  # (a static_range's name must not be reused by a range() loop)
        mbarrier.init(bars.index(k), count=1)

    # two cursors over the table: the loads run LEAD tiles ahead of the stores
    e0 = gl.load(starts_ptr + pid)
    first0 = gl.load(table_ptr + e0 * 4 + 3)
    next0 = gl.load(table_ptr + e0 * 4 + 7)
    l_entry, l_src, l_first, l_next = e0, gl.load(table_ptr + e0 * 4 + 1), first0, next0
    s_entry, s_dst, s_first, s_next = e0, gl.load(table_ptr + e0 * 4), first0, next0

    for q in gl.static_range(LEAD):
        t = t0 + q
        live = q < n_mine
        l_entry, l_src, l_first, l_next = _advance(table_ptr, 1, t, l_entry, l_src, l_first, l_next, live)
        mbarrier.expect(bars.index(q), NBYTES, pred=live)
        tma_load(src_desc, [(l_src + (t - l_first) * ROWS).to(gl.int32), 0], bars.index(q), bufs.index(q), pred=live)

    for i in range(n_mine):
        t = t0 + i
        s = i % STAGES
        s_entry, s_dst, s_first, s_next = _advance(table_ptr, 0, t, s_entry, s_dst, s_first, s_next, True)
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        tma_store(dst_desc, [(s_dst + (t - s_first) * ROWS).to(gl.int32), 0], bufs.index(s))
        # the box of tile i + LEAD is the box of tile i - 1: free once all but the newest store have read it
        tma.store_wait(1)
        j = i + LEAD
        tj = t0 + j
        live = j < n_mine
        l_entry, l_src, l_first, l_next = _advance(table_ptr, 1, tj, l_entry, l_src, l_first, l_next, live)
        r = j % STAGES
        mbarrier.expect(bars.index(r), NBYTES, pred=live)
        tma_load(src_desc, [(l_src + (tj - l_first) * ROWS).to(gl.int32), 0], bars.index(r), bufs.index(r),
                 pred=live)

    tma.store_wait(0)  # the boxes must stay until the last store has read them
    for k in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(k))


__all__ = ["copy_ring_kernel"]
