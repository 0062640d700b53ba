"""``triton_sm``: a vectorised, persistent-grid Triton copy kernel (d2d; p2p over peer-mapped memory).

The kernel runs on the destination's GPU. For p2p it reads the peer's memory directly, so that
memory must be mapped for the destination GPU: peer access is enabled here for ordinary
(cudaMalloc) memory; a VMM arena must have been mapped with access for the destination GPU.
"""

from __future__ import annotations

from typing import Any

from flashboot import _cuda
from flashboot.errors import CapabilityError, CudaError
from flashboot.memory import Span, stream_handle

from .base import Mover
from .batch import ChunkBatch
from .registry import register_mover

_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
_peer_enabled: set[tuple[int, int]] = set()


def ensure_peer_access(reader: int, src: Span) -> None:
    """Make ``src`` (memory on another GPU) readable by kernels on GPU ``reader``.

    Enables peer access ``reader -> src.device`` once per pair, then asks the driver for the
    access flags ``reader`` has on ``src.ptr`` (VMM mappings carry their own access list).
    Raises CapabilityError naming the GPUs and the alternative when access is impossible or missing.
    """
    import cupy
    import torch

    owner = src.device.index
    rt = cupy.cuda.runtime
    if (reader, owner) not in _peer_enabled:
        if not rt.deviceCanAccessPeer(reader, owner):
            raise CapabilityError(
                f"cuda:{reader} cannot access memory of cuda:{owner} (no peer access between them); "
                "a kernel cannot pull across; use the 'copy_engine' mover for this p2p copy"
            )
        with cupy.cuda.Device(reader):
            try:
                rt.deviceEnablePeerAccess(owner)
            except rt.CUDARuntimeError as exc:
                if exc.status != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                    raise CudaError(f"cudaDeviceEnablePeerAccess(cuda:{reader} -> cuda:{owner})", exc.status,
                                    "cudaError", str(exc)) from exc
        _peer_enabled.add((reader, owner))
    from flashboot._cuda import driver

    drv = driver()
    with torch.cuda.device(reader):  # the query answers for the current context's device
        err, flags = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, src.ptr)
    # The driver reports access flags for VMM mappings; for other memory the query may not
    # apply (an error here is not a verdict), and peer access enabled above covers it.
    if int(err) == 0 and int(flags) == int(drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE):
        raise CapabilityError(
            f"the source at {src.ptr:#x} ({src.nbytes:,} bytes on cuda:{owner}) is not mapped for cuda:{reader}: "
            f"map the arena with access for cuda:{reader} (cuMemSetAccess), or use the 'copy_engine' mover"
        )


def cuda_mover_availability() -> tuple[bool, str]:
    """Common preflight of the Triton movers."""
    if not _cuda.cuda_available():
        return False, "no CUDA device (Triton movers copy GPU memory); use 'host' for host copies"
    try:
        import cupy  # noqa: F401
        import torch
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - dependencies
        return False, f"a dependency is not importable ({exc})"
    if not torch.cuda.is_available():
        return False, "torch was built without CUDA; the Triton movers launch through torch streams; use 'copy_engine'"
    return True, ""


@register_mover
class TritonSMMover(Mover):
    """Triton SM copy kernel: 16-byte loads/stores per thread, persistent grid (d2d, p2p)."""

    name = "triton_sm"
    paths = frozenset({"d2d", "p2p"})
    alignment = 1
    overlap = False
    batched = "one launch over a device-side descriptor table"

    def __init__(self, **tuning: Any) -> None:
        """``tuning`` overrides :data:`flashboot.kernels.copy.SM_TUNING` (block_bytes, num_warps, ...)."""
        super().__init__()
        from flashboot.kernels.copy import SM_TUNING, SMCopyLauncher, _knobs

        self.tuning = _knobs(SM_TUNING, tuning)
        self._launch = SMCopyLauncher(self.tuning)  # built once: an aligned call is the kept runner's launch

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return cuda_mover_availability()

    def _copy(self, dst: Span, src: Span, nbytes: int, path: str, stream: Any) -> None:
        if path == "p2p":
            ensure_peer_access(dst.device.index, src)
        self._launch(dst, src, nbytes, stream if type(stream) is int else stream_handle(stream))

    def _prepare_batch(self, batch: ChunkBatch) -> Any:
        return prepare_table(batch, "sm", self.tuning)

    def _copy_batch(self, batch: ChunkBatch, stream: Any) -> None:
        batch.prepared.launch(stream_handle(stream))


def prepare_table(batch: ChunkBatch, kind: str, knobs: dict[str, Any], entries=None):
    """The device table of a Triton mover's batch (or of ``entries``, pieces of its chunks: see
    :func:`~flashboot.kernels.copy_table.table_for`); peer access checked once for a p2p batch."""
    from flashboot.kernels.copy_table import table_for

    if batch.path == "p2p":
        ensure_peer_access(batch.dst.device.index, batch.src)
    return table_for(batch, kind=kind, knobs=knobs, entries=entries)


__all__ = ["TritonSMMover", "ensure_peer_access", "prepare_table"]
