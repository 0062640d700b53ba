"""Packing a trainer's tensors into an arena laid out as an image: one table, one launch.

:class:`PackTable` turns a :class:`~flashboot.weight_update.plan.PackPlan` and the tensors themselves
(their addresses and strides) into rows ``(dst, src, nbytes, run_bytes, src_run_stride)``. On a
GPU the rows become the movers' device-side descriptor table
(:class:`~flashboot.kernels.copy_table.CopyTable` with strided runs) and every tensor of the
rank is packed by one launch of ``copy_table_kernel``; under ``TRITON_INTERPRET=1`` the same
kernel runs on host memory (tests). The host backend packs the same rows with numpy (strided
views of the addresses, one assignment per row). :func:`pack_per_tensor` is the baseline the benchmark
compares with: a ``copy_`` per piece into the arena's views.
"""

from __future__ import annotations

import ctypes
from typing import Any, Mapping

import numpy as np

from .plan import PackPlan, PublishError, box_runs, dtype_name


def _check_tensors(plan: PackPlan, tensors: Mapping[str, Any], device) -> None:
    """Every tensor the plan reads is given, on ``device``, with the planned dtype and shape."""
    for name, (dtype, shape) in plan.sources.items():
        t = tensors.get(name)
        if t is None:
            raise PublishError(f"publish: tensor {name!r} was planned but is no longer given")
        if dtype_name(t) != dtype or tuple(t.shape) != tuple(shape):
            raise PublishError(f"publish: tensor {name!r} is {dtype_name(t)} {list(t.shape)}, planned as {dtype} "
                               f"{list(shape)}")
        if t.device.type == "meta":  # its data_ptr() is 0: the pack would read whatever is there
            raise PublishError(f"publish: tensor {name!r} is a meta tensor (no data; materialize it first); nothing "
                               "was written")
        if t.numel() and _data_ptr(t) == 0:  # so is a DTensor's (FSDP2), with the global shape and dtype
            hint = "pass t.full_tensor()" if hasattr(t, "full_tensor") else "pass a plain strided tensor"
            raise PublishError(f"publish: tensor {name!r} is a {type(t).__name__} of layout {t.layout} with no "
                               f"data of its own at an address (data_ptr() 0); {hint}; nothing was written")
        if t.is_neg() or t.is_conj():  # a lazy neg()/conj() view (a complex's .conj().imag): bytes not values
            raise PublishError(f"publish: tensor {name!r} is a lazy {'negative' if t.is_neg() else 'conjugate'} view "
                               "(its bytes in memory are not its values); pass t.resolve_neg() / t.resolve_conj(); "
                               "nothing was written")
        on = f"cuda:{t.device.index}" if t.device.type == "cuda" else str(t.device)
        if on != str(device):
            raise PublishError(f"publish: tensor {name!r} is on {on}, the arena on {device}; pack needs them on one "
                               "device")


def _data_ptr(t) -> int:
    """``t.data_ptr()``, 0 for a tensor without storage (sparse, fake), which raises instead."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return 0


PACK_TUNING: dict[str, Any] = {
    "block_bytes": 16384,  # bytes per tile (2048 int64): 0.91x the D2D copy on H200 vs 0.87x at 32 KiB
    "num_warps": 4,
    "num_stages": 3,
    "programs_per_sm": 2,  # the movers' table grid (0.91x batched on H200); see below
}
"""The pack's table-kernel launch. Each tile reads its row (tile -> row map, then the row) before
its data, a chain of dependent loads the pipeliner cannot overlap across tiles; with one program
per SM (the single-copy kernel's setting, which pipelines) the pack ran at 0.72-0.75x the D2D
copy on H200, so it takes the table kernel's grid of two programs per SM. The sweep of the
13:20 UTC H200 run (checkpoint A, x D2D; programs per SM / warps / tile KiB): 1/4/32 0.75,
2/4/32 0.87, 4/4/32 0.88, 2/8/32 0.76, 2/4/16 0.91, 4/4/16 0.82 (benchmarks/RESULTS.md)."""


class PackTable:
    """The rows that pack ``tensors`` into an arena by ``plan`` (checked: every tensor present,
    with its planned dtype and shape, on the arena's device). ``rows``: int64 ``(n, 5)``.
    ``tuning`` overrides :data:`PACK_TUNING` (the benchmark sweeps it)."""

    def __init__(self, plan: PackPlan, tensors: Mapping[str, Any], arena, tuning: Mapping[str, Any] | None = None):
        _check_tensors(plan, tensors, arena.device)
        unknown = set(tuning or {}) - set(PACK_TUNING)
        if unknown:
            raise PublishError(f"pack tuning: unknown knob(s) {sorted(unknown)}; known: {sorted(PACK_TUNING)}")
        self.tuning = {**PACK_TUNING, **(tuning or {})}
        self.plan, self.arena, self.tensors = plan, arena, tensors  # the tensors stay alive while the table is used
        base = arena.span(0, plan.metadata.image_nbytes).ptr
        rows: list[tuple[int, int, int, int, int]] = []
        for p in plan.pieces:
            t = tensors[p.source]
            for d, s, n, run, stride in box_runs(tuple(t.shape), tuple(t.stride()), p.itemsize, p.box, t.data_ptr(),
                                                 p.dst_offset, f"tensor {p.source!r}"):
                rows.append((base + d, s, n, run, stride))
        self.rows = np.array(rows, dtype=np.int64).reshape(-1, 5)
        self.nbytes = int(self.rows[:, 2].sum()) if len(rows) else 0
        self._device_table = None

    def launch(self, *, stream: Any = None) -> None:
        """Pack: one kernel launch on a GPU (asynchronous on ``stream``); numpy on the host
        backend (synchronous; the kernel itself runs on host memory under the Triton
        interpreter, which is for tests, see tests/test_weight_update.py)."""
        dev = self.arena.device
        if not len(self.rows):
            return
        if dev.is_cuda:
            from flashboot.memory import stream_handle

            if self._device_table is None:
                from flashboot.kernels.copy_table import CopyTable

                k = self.tuning
                self._device_table = CopyTable(self.rows[:, :3], runs=self.rows[:, 3:], device=dev, kind="sm",
                                               block_bytes=k["block_bytes"], num_warps=k["num_warps"],
                                               num_stages=k["num_stages"], programs_per_sm=k["programs_per_sm"])
            self._device_table.launch(stream_handle(stream))
            return
        pack_rows_host(self.rows)


def pack_rows_host(rows: np.ndarray) -> None:
    """The host backend's pack: each row's strided runs assigned through numpy views of the addresses."""
    for dst, src, nbytes, run, stride in rows.tolist():
        n_runs = nbytes // run
        extent = (n_runs - 1) * stride + run
        s = np.ctypeslib.as_array((ctypes.c_uint8 * extent).from_address(src))
        d = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(dst))
        d.reshape(n_runs, run)[...] = np.lib.stride_tricks.as_strided(s, (n_runs, run), (stride, 1))


def pack_per_tensor(plan: PackPlan, tensors: Mapping[str, Any], arena) -> None:
    """The baseline: one ``copy_`` per piece into a view of the arena (what an engine does per
    parameter today). Asynchronous on the current stream on a GPU."""
    flat = arena.bytes()
    for p in plan.pieces:
        src = tensors[p.source][tuple(slice(a, b) for a, b in p.box)]
        n = src.numel() * p.itemsize
        flat[p.dst_offset:p.dst_offset + n].view(src.dtype).view(src.shape).copy_(src)


__all__ = ["PACK_TUNING", "PackTable", "pack_per_tensor", "pack_rows_host"]
