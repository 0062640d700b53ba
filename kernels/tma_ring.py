"""The TMA mover's batches: a Gluon kernel that copies through shared memory with TMA alone.

Plain Triton's descriptor copy (:mod:`flashboot.kernels.copy_table`) takes each box from shared
memory into registers and back before its TMA store, and waits on that store before the buffer
is reused: batched at 4 MiB it reached 0.889-0.894x the copy engine in five H200 runs (target
0.90). Here (Gluon, ``triton.experimental.gluon``) each program keeps a ring of ``stages``
shared-memory boxes: a TMA load fills a box (its mbarrier counts the bytes in), a TMA store
writes the same box out, and the only other wait is ``store_wait(1)`` before a box is refilled,
so ``stages - 1`` loads stay in flight. H200, 1 GiB, same run (2026-12-02,
``benchmarks/probes/tma_gluon.py``): 0.912x the copy engine in 4 MiB chunks, 0.910x in 1 MiB
chunks, 0.921x as one copy (256-row boxes, 4 stages, 1 program per SM, 4 warps), all byte-exact.

Descriptors are made on the host once per batch, one over the whole destination range and one
over the whole source range, as rows of 128 B (16 int64: the widest swizzle); a chunk is only
coordinates. A device table holds ``[dst_row, src_row, n_rows, first_tile]`` per chunk (128-B
row units; ``first_tile`` the tiles' prefix sum) and a sentinel ``[0, 0, 0, n_tiles]``; program
``p`` of ``P`` copies tiles ``[p*T//P, (p+1)*T//P)`` from the row the host found for it.

Only whole boxes go through the ring: :func:`split_for_ring` gives it each chunk's box-aligned
body (offsets on 128-byte rows) and leaves the rest (a chunk's last partial box, a chunk off the
128-byte grid) to the descriptor table in the same stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashboot.errors import MoverError

ROW_BYTES = 128
"""Bytes per descriptor row: 16 int64, the 128-byte swizzle span."""
COLS = ROW_BYTES // 8

RING_TUNING: dict[str, int] = {"rows": 256, "stages": 4, "programs_per_sm": 1, "num_warps": 4}
"""Boxes of 256 rows (32 KiB), 4 per program, one program per SM, 4 warps: the probe's best at
4 MiB (0.912x) and within 0.001 of its best at 1 MiB; 2 stages fell to 0.84x, 2 programs per SM
of 3 stages to 0.90x."""

def ring_available() -> tuple[bool, str]:
    """Whether this Triton has Gluon's Hopper TMA (Triton >= 3.6): the batches' kernel."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as exc:
        import triton

        return False, f"Triton {triton.__version__} has no Gluon Hopper TMA ({exc})"
    return True, ""


def _kernel():
    """The Gluon kernel, imported on first use (importing Gluon costs, and a Triton without it
    keeps the descriptor table)."""
    from .tma_ring_kernel import copy_ring_kernel

    return copy_ring_kernel


def split_for_ring(dst_ptr: int, src_ptr: int, dst_offsets: np.ndarray, src_offsets: np.ndarray,
                   nbytes: np.ndarray, box: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ring, rest)``: each an ``(n, 3)`` int64 array of ``(dst_offset, src_offset, nbytes)``.

    The ring takes each chunk's whole boxes from its start, where both its addresses lie on the
    128-byte grid of its range's descriptor; the rest takes what is left of each chunk (its last
    partial box, or all of a chunk off that grid). Both ranges' bases must be 16-byte aligned
    (TMA's rule); otherwise everything is rest."""
    d, s, n = (np.asarray(a, dtype=np.int64) for a in (dst_offsets, src_offsets, nbytes))
    on_grid = (d % ROW_BYTES == 0) & (s % ROW_BYTES == 0) & ((dst_ptr % 16 == 0) and (src_ptr % 16 == 0))
    body = np.where(on_grid, n - n % box, 0)
    ring = np.stack([d, s, body], axis=1)[body > 0]
    left = n - body
    rest = np.stack([d + body, s + body, left], axis=1)[left > 0]
    return ring, rest


def ring_table(ring: np.ndarray, *, rows: int, programs: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's table and each program's first row (numpy int64), for ``ring``'s chunks
    (whole boxes of ``rows`` x 128 B): see the module docstring."""
    table = np.zeros((len(ring) + 1, 4), dtype=np.int64)
    table[:-1, :3] = ring // ROW_BYTES
    table[1:, 3] = np.cumsum(table[:-1, 2] // rows)
    n_tiles = int(table[-1, 3])
    p = np.arange(max(1, min(programs, n_tiles)), dtype=np.int64)
    starts = (np.searchsorted(table[:-1, 3], p * n_tiles // len(p), side="right") - 1).astype(np.int64)
    return table, starts


class RingCopy:
    """The box-aligned chunks of a batch, copied by one launch of the ring kernel.

    ``dst``/``src``: the batch's ranges (CUDA spans on one GPU's address space); ``ring``: the
    chunks from :func:`split_for_ring`. Built once (table and descriptors); :meth:`launch` costs
    Triton's launcher, which encodes the two descriptors."""

    def __init__(self, dst, src, ring: np.ndarray, *, device_index: int, knobs: dict[str, int] | None = None):
        import torch
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from .views import sm_count, span_tensor

        knobs = dict(RING_TUNING, **(knobs or {}))
        self.rows, self.stages, self.num_warps = knobs["rows"], knobs["stages"], knobs["num_warps"]
        self.device_index = device_index
        views = []
        for span, what in ((src, "source"), (dst, "destination")):
            n_rows = span.nbytes // ROW_BYTES
            if span.ptr % 16 or not 0 < n_rows < 1 << 31:
                raise MoverError(f"triton_tma ring: the {what} range ({span.nbytes:,} B at {span.ptr:#x}) is not "
                                 "16-byte aligned or not 128 B to 256 GiB long")
            views.append(span_tensor(span, 8, 0, n_rows * ROW_BYTES).view(-1, COLS))
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=64, rank=2)
        self.src_desc, self.dst_desc = (TensorDescriptor(v, list(v.shape), [COLS, 1], [self.rows, COLS], layout)
                                        for v in views)
        table, starts = ring_table(ring, rows=self.rows,
                                   programs=sm_count(device_index) * knobs["programs_per_sm"])
        self.n_tiles, self.programs = int(table[-1, 3]), len(starts)
        where = f"cuda:{device_index}"
        self.table = torch.from_numpy(table.ravel().copy()).to(where)
        self.starts = torch.from_numpy(starts).to(where)

    def launch(self, handle: int) -> None:
        """Copy every chunk, asynchronously on the raw stream ``handle``."""
        import torch

        from .views import launch_on_index

        with launch_on_index(self.device_index, handle):
            stream = torch.cuda.current_stream(self.device_index)
            # the batch may be dropped before the kernel has read its table: keep the caching
            # allocator from handing the blocks out again until this stream is past them
            self.table.record_stream(stream)
            self.starts.record_stream(stream)
            _kernel()[(self.programs,)](self.src_desc, self.dst_desc, self.table, self.starts, self.n_tiles,
                                        STAGES=self.stages, num_warps=self.num_warps)


class RingAndTable:
    """A TMA batch: the ring kernel for the chunks' whole boxes, the descriptor table
    (:class:`~flashboot.kernels.copy_table.CopyTable`) for what is left; either may be None.
    ``kernel`` names what runs (``bench movers`` prints it)."""

    def __init__(self, ring: RingCopy | None, rest: Any, why_no_ring: str = ""):
        self.ring, self.rest = ring, rest
        parts = (["Gluon TMA ring"] if ring is not None else []) + (["descriptor table"] if rest is not None else [])
        self.kernel = " + ".join(parts) + (f" ({why_no_ring})" if why_no_ring else "")

    def launch(self, handle: int) -> None:
        if self.ring is not None:
            self.ring.launch(handle)
        if self.rest is not None:
            self.rest.launch(handle)


__all__ = ["RING_TUNING", "ROW_BYTES", "RingAndTable", "RingCopy", "ring_available", "ring_table", "split_for_ring"]
