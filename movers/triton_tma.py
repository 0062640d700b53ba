"""``triton_tma``: a Triton copy kernel through tensor descriptors (TMA, compute capability >= 9.0).

Runs on the destination's GPU like ``triton_sm``. TMA addresses 16-byte aligned tiles, so the
source and destination must be congruent mod 16 (a MoverError names ``triton_sm`` otherwise).
A batch sends its chunks' whole 32 KiB boxes through the Gluon ring of
:mod:`flashboot.kernels.tma_ring` (TMA loads and stores straight through shared memory) and the
rest through the descriptor table of :mod:`flashboot.kernels.copy_table`; ``batch.prepared.kernel``
says which ran.
"""

from __future__ import annotations

from typing import Any

from flashboot.errors import MoverError
from flashboot.memory import Span, stream_handle

from .base import Mover
from .batch import ChunkBatch
from .registry import register_mover
from .triton_sm import cuda_mover_availability, ensure_peer_access, prepare_table

_ALTERNATIVES = "use 'triton_sm' or 'copy_engine' instead"


@register_mover
class TritonTMAMover(Mover):
    """Triton TMA copy kernel via ``tl.make_tensor_descriptor`` (d2d, p2p; Hopper and later)."""

    name = "triton_tma"
    paths = frozenset({"d2d", "p2p"})
    alignment = 1
    overlap = False
    batched = ("one launch of a Gluon TMA ring over the chunks' whole 32 KiB boxes (shared memory straight "
               "to global), the rest through a device-side descriptor table; 16-byte aligned chunks")

    def __init__(self, *, batch_kernel: str = "ring", **tuning: Any) -> None:
        """``tuning`` overrides :data:`flashboot.kernels.copy.TMA_TUNING` (block_bytes, num_warps, ...)
        for single copies and the descriptor table alike; without it, the table uses
        :data:`~flashboot.kernels.copy.TMA_TABLE_TUNING`. ``batch_kernel``: ``"ring"`` (batches'
        whole boxes through :mod:`flashboot.kernels.tma_ring`, where this Triton has Gluon) or
        ``"table"`` (every chunk through the descriptor table: the kernel to compare with)."""
        super().__init__()
        from flashboot.kernels.copy import TMA_TABLE_TUNING, TMA_TUNING, TMACopyLauncher, _knobs

        if batch_kernel not in ("ring", "table"):
            raise MoverError(f"triton_tma: batch_kernel must be 'ring' or 'table', got {batch_kernel!r}")
        self.batch_kernel = batch_kernel
        self.tuning = _knobs(TMA_TUNING, tuning)
        self.table_tuning = self.tuning if tuning else dict(TMA_TABLE_TUNING)
        self._launch = TMACopyLauncher(self.tuning)  # built once: an aligned call is the kept runner's launch

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        from flashboot._cuda import cuda_available

        if not cuda_available():
            return False, f"no CUDA device; TMA needs a GPU of compute capability >= 9.0; {_ALTERNATIVES} on a GPU machine"
        from flashboot.kernels.copy import tma_available

        ok, why = tma_available()
        if not ok:
            return False, f"{why}; {_ALTERNATIVES}"
        ok, why = cuda_mover_availability()
        if not ok:
            return False, f"{why}; {_ALTERNATIVES}"
        from flashboot._cuda import check, device_count, driver

        drv = driver()
        major_attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        minor_attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
        for i in range(device_count()):
            dev = check(drv.cuDeviceGet(i), f"cuDeviceGet({i})")
            major = check(drv.cuDeviceGetAttribute(major_attr, dev), "cuDeviceGetAttribute(CC major)")
            if major < 9:
                minor = check(drv.cuDeviceGetAttribute(minor_attr, dev), "cuDeviceGetAttribute(CC minor)")
                return False, f"cuda:{i} has compute capability {major}.{minor}; TMA needs >= 9.0; {_ALTERNATIVES}"
        return True, ""

    def _copy(self, dst: Span, src: Span, nbytes: int, path: str, stream: Any) -> None:
        if path == "p2p":
            ensure_peer_access(dst.device.index, src)
        self._launch(dst, src, nbytes, stream if type(stream) is int else stream_handle(stream))

    def _prepare_batch(self, batch: ChunkBatch) -> Any:
        from flashboot.kernels.tma_ring import (RING_TUNING, ROW_BYTES, RingAndTable, RingCopy, ring_available,
                                                split_for_ring)

        if self.batch_kernel == "table":
            why = "batch_kernel='table'"
        elif not batch.dst.device.is_cuda:
            why = "host memory (Triton's interpreter)"
        else:
            why = ring_available()[1]
        if why:
            return RingAndTable(None, prepare_table(batch, "tma", self.table_tuning), why)
        if batch.path == "p2p":
            ensure_peer_access(batch.dst.device.index, batch.src)  # the ring reads the peer's memory too
        ring, rest = split_for_ring(batch.dst.ptr, batch.src.ptr, batch.dst_offsets, batch.src_offsets, batch.nbytes,
                                    RING_TUNING["rows"] * ROW_BYTES)
        ring_copy = RingCopy(batch.dst, batch.src, ring, device_index=batch.dst.device.index) if len(ring) else None
        # the rest: a chunk's last partial box, or a chunk off the 128-byte grid
        rest_table = prepare_table(batch, "tma", self.table_tuning, entries=rest) if len(rest) else None
        return RingAndTable(ring_copy, rest_table)

    def _copy_batch(self, batch: ChunkBatch, stream: Any) -> None:
        batch.prepared.launch(stream_handle(stream))


__all__ = ["TritonTMAMover"]
