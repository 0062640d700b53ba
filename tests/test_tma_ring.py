"""The TMA mover's Gluon ring (flashboot.kernels.tma_ring): which bytes it takes, the table its
programs walk, that the kernel lowers to TMA alone for Hopper, and byte-exact batches on a GPU."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from _python import run_compiling
from flashboot.kernels.tma_ring import ROW_BYTES, ring_available, ring_table, split_for_ring

BOX = 256 * ROW_BYTES


def _chunks(seed: int, n: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks of every kind: whole boxes, a partial last box, off the 128-byte grid, tiny."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 4, n)
    sizes = np.where(kinds == 0, BOX * rng.integers(1, 5, n),
                     np.where(kinds == 1, BOX * rng.integers(0, 3, n) + 16 * rng.integers(1, BOX // 16, n),
                              np.where(kinds == 2, 16 * rng.integers(1, 4000, n), 16)))
    starts = np.cumsum(np.concatenate([[0], sizes[:-1] + 16 * (kinds[:-1] == 2)]))
    starts = starts + np.where(kinds == 2, 16, 0)  # off the grid (16-byte aligned: TMA's rule still holds)
    order = rng.permutation(n)
    return starts[order], starts[order][::-1].copy(), sizes[order]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_ring_takes_each_chunks_whole_boxes_and_the_rest_what_is_left(seed):
    d, _, n = _chunks(seed)
    ring, rest = split_for_ring(1 << 40, 2 << 40, d, d + BOX, n, BOX)  # sources a box further on
    assert (ring[:, 2] % BOX == 0).all() and (ring[:, :2] % ROW_BYTES == 0).all() and (ring[:, 2] > 0).all()
    pieces = np.concatenate([ring, rest])
    assert (pieces[:, 1] == pieces[:, 0] + BOX).all()  # each piece reads where its bytes come from
    got = sorted((int(do), int(nb)) for do, _, nb in pieces)
    # every chunk's bytes exactly once: the pieces tile the chunks
    pieces = iter(got)
    for do, nb in sorted(zip(d.tolist(), n.tolist())):
        end, at = do + nb, do
        while at < end:
            p_do, p_nb = next(pieces)
            assert p_do == at, (do, nb, p_do)
            at += p_nb
        assert at == end
    assert next(pieces, None) is None
    # a chunk on the grid goes to the ring but for its last partial box; off it, all to the rest
    on = (d % ROW_BYTES == 0)
    assert int(ring[:, 2].sum()) == int((n - n % BOX)[on].sum())


def test_an_unaligned_range_sends_everything_to_the_rest():
    d, s, n = _chunks(3, 40)
    ring, rest = split_for_ring((1 << 40) + 8, 2 << 40, d, d, n, BOX)
    assert ring.size == 0 and int(rest[:, 2].sum()) == int(n.sum())


def _walk(table: np.ndarray, starts: np.ndarray, rows: int) -> list[tuple[int, int]]:
    """The kernel's cursor walk in Python: (dst_row, src_row) of every tile each program copies."""
    n_tiles, programs = int(table[-1, 3]), len(starts)
    flat = table.ravel()
    out = []
    for p in range(programs):
        t0, t1 = p * n_tiles // programs, (p + 1) * n_tiles // programs
        entry = int(starts[p])
        first, nxt = int(flat[entry * 4 + 3]), int(flat[entry * 4 + 7])
        for t in range(t0, t1):
            if t >= nxt:  # one step is enough: every row has a tile
                entry += 1
                first, nxt = nxt, int(flat[entry * 4 + 7])
            out.append((int(flat[entry * 4]) + (t - first) * rows, int(flat[entry * 4 + 1]) + (t - first) * rows))
    return out


@pytest.mark.parametrize("programs", [1, 7, 132, 5000])
def test_every_program_starts_at_its_row_and_every_box_is_copied_once(programs):
    d, s, n = _chunks(programs, 200)
    ring, _ = split_for_ring(0, 0, d, d, n, BOX)
    ring[:, 1] = ring[::-1, 0]  # sources elsewhere than their destinations
    rows = BOX // ROW_BYTES
    table, starts = ring_table(ring, rows=rows, programs=programs)
    assert len(starts) == min(programs, int(table[-1, 3]))
    expect = sorted((int(do) // ROW_BYTES + k * rows, int(so) // ROW_BYTES + k * rows)
                    for do, so, nb in ring for k in range(int(nb) // BOX))
    assert sorted(_walk(table, starts, rows)) == expect


RING_PTX = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from flashboot.kernels.tma_ring_kernel import copy_ring_kernel

layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=64, rank=2)
desc = f"tensordesc<i64[256, 16],{layout!r}>"
sig = {"src_desc": desc, "dst_desc": desc, "table_ptr": "*i64", "starts_ptr": "*i64", "n_tiles": "i64",
       "STAGES": "constexpr"}
k = triton.compile(GluonASTSource(copy_ring_kernel, sig, {"STAGES": 4}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4})
print(json.dumps({"ptx": k.asm["ptx"], "shared": k.metadata.shared}))
"""


@pytest.mark.skipif(not ring_available()[0], reason="this Triton has no Gluon Hopper TMA")
def test_the_ring_kernel_lowers_to_tma_loads_and_stores_without_registers_for_hopper():
    """Compiled for sm_90a in a child process (Triton ships ptxas; no GPU needed): bulk tensor
    copies both ways, and no ld.shared / st.shared (the data never passes through registers)."""
    out = json.loads(run_compiling(RING_PTX).strip().splitlines()[-1])
    ptx = out["ptx"]
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)  # TMA stores from shared memory
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)  # TMA loads into it
    assert not re.search(r"\b(?:ld|st)\.shared\.", ptx)
    assert out["shared"] >= 4 * BOX  # the ring: 4 boxes of 32 KiB


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 4 << 20])
def test_gpu_tma_batches_through_the_ring_are_exact(chunk):
    """Chunks of every kind in shuffled order (or 4 MiB chunks, all whole boxes): the ring and
    the table each copy their part, byte-exact, nothing else written; the table kernel alone too."""
    import torch

    from flashboot import MoverError
    from flashboot.memory import span_of
    from flashboot.movers import create_mover

    if chunk is None:
        d, s, n = _chunks(11, 120)
    else:
        d = np.arange(0, 64 << 20, chunk)[::-1].copy()
        s, n = d.copy(), np.full(d.size, chunk)
    total = int(max((d + n).max(), (s + n).max())) + 4096
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((total,), 0x5A, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    chunks = list(zip(d.tolist(), s.tolist(), n.tolist()))
    expect = torch.full_like(dst, 0x5A)
    for do, so, nb in chunks:
        expect[do:do + nb] = src[so:so + nb]
    for kernel in ("ring", "table"):
        dst.fill_(0x5A)
        torch.cuda.synchronize()
        batch = create_mover("triton_tma", batch_kernel=kernel).batch(span_of(dst), span_of(src), chunks)
        want = {"ring": "Gluon TMA ring" if chunk else "Gluon TMA ring + descriptor table",
                "table": "descriptor table (batch_kernel='table')"}[kernel]
        assert batch.prepared.kernel == want
        stream = torch.cuda.Stream(device=0)
        batch.run(stream=stream)
        stream.synchronize()
        assert torch.equal(dst, expect), kernel
    with pytest.raises(MoverError, match="batch_kernel must be 'ring' or 'table', got 'fast'"):
        create_mover("triton_tma", batch_kernel="fast")
