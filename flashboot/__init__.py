"""FlashBoot: weights serving-ready on GPUs in a fraction of a second.

One contiguous VMM arena per GPU (:class:`Arena`), pre-packed per-rank images laid out exactly
like it, a bulk host->GPU load (FlashLoad) and NCCL-free GPU->GPU replication (FlashClone).
Without CUDA, the same API runs on the host backend (shareable host memory).
"""

from __future__ import annotations

from ._lazy import lazy_getattr
from .errors import (
    ArenaError,
    CapabilityError,
    ChecksumMismatchError,
    CudaError,
    FlashBootError,
    ImageReadError,
    LayoutError,
    MoverError,
    OutOfMemoryError,
    RendezvousError,
    UnknownNameError,
    WaitTimeoutError,
)
from .memory import CPU, Device, Span, span_of

__version__ = "0.1.0"

# Public names re-exported lazily from their modules, so `import flashboot` stays light
# and a missing optional piece fails only where it is used.
_LAZY = {
    "prepack": "flashboot.flashload.prepack",
    "PrepackReport": "flashboot.flashload.prepack",
    "Arena": "flashboot.arena",
    "ArenaDescriptor": "flashboot.arena",
    "load": "flashboot.flashload.pipeline",
    "bind": "flashboot.flashload.bind",
    "LoadedImage": "flashboot.flashload.report",
    "LoadReport": "flashboot.flashload.report",
    "stage": "flashboot.flashload.stage",
    "prepare": "flashboot.flashload.prepared",
    "PreparedLoad": "flashboot.flashload.prepared",
    "StagedImage": "flashboot.flashload.stage",
    "StreamConfig": "flashboot.flashload.stream",
    "build_plan": "flashboot.schedulers",
    "Plan": "flashboot.schedulers",
    "simulate": "flashboot.sim",
    "load_topology": "flashboot.sim",
    "clone": "flashboot.flashclone",
    "seed": "flashboot.flashclone",
    "prepare_clone": "flashboot.flashclone",
    "CloneResult": "flashboot.flashclone",
    "CloneReport": "flashboot.flashclone",
    "hand_over": "flashboot.flashclone.holder",
    "open_held": "flashboot.flashclone.holder",
    "publish": "flashboot.weight_update",
    "Publisher": "flashboot.weight_update",
    "refit": "flashboot.weight_update",
    "checksum": "flashboot.kernels.checksum",
    "chunk_checksums": "flashboot.kernels.checksum",
}


__getattr__ = lazy_getattr('flashboot', _LAZY, globals())


def __dir__() -> list[str]:
    """The lazy names too: ``dir(flashboot)`` and a notebook's completion of ``flashboot.`` had
    shown neither ``load`` nor ``prepare`` until first used."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArenaError", "CapabilityError", "ChecksumMismatchError", "CudaError", "FlashBootError",
    "ImageReadError", "LayoutError", "MoverError", "OutOfMemoryError", "RendezvousError", "UnknownNameError",
    "WaitTimeoutError", "CPU", "Device", "Span", "span_of", "__version__", *_LAZY,
]
