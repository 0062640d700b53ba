"""The loaders FlashLoad is compared with, behind one small interface.

Each :class:`PeerLoader` turns a list of safetensors files into ``{name: tensor on device}``.
``prepare`` runs untimed (building a pinned host copy, for the two pinned baselines); ``load`` is
what the benchmark times; ``release`` drops what ``load`` returned. Adapters for packages that
are not installed say so through :meth:`availability` instead of failing (the GPU machines get
InstantTensor and fastsafetensors from wheels carried in ``.whl``, see ../shared/hardware.md).

On the host backend (``device="cpu"``) the same loaders read into host memory, so the whole
benchmark runs in CI; there "pinned" means plain host memory.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar


class PeerLoader:
    """One way of loading a checkpoint: ``name``, ``availability()``, ``prepare``, ``load``, ``release``."""

    name: ClassVar[str] = ""
    module: ClassVar[str] = "safetensors.torch"
    """The library :meth:`load` calls: an engine that loads with it imported it at start, as it
    imports FlashBoot's loader, so a first-call benchmark imports it before the clock."""
    per_tensor: ClassVar[bool] = True
    """True when the result is a name -> tensor dict (verified tensor by tensor)."""

    def __init__(self, files: list[str], device: str):
        self.files, self.device = list(files), device

    @classmethod
    def availability(cls, device: str) -> tuple[bool, str]:
        return True, ""

    def prepare(self) -> None:
        """Untimed set-up."""

    def load(self) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Free what the loader holds beyond the result of :meth:`load`."""


class SafetensorsLoader(PeerLoader):
    """``safetensors.torch.load_file(file, device=...)`` for each file."""

    name = "safetensors"

    def load(self) -> dict:
        from safetensors.torch import load_file

        out: dict = {}
        for f in self.files:
            out.update(load_file(f, device=self.device))
        return out


class InstantTensorLoader(PeerLoader):
    """InstantTensor ``safe_open(files, framework="pt", device=N)``; direct-I/O into a GPU ring buffer."""

    name = "instanttensor"
    module = "instanttensor"

    @classmethod
    def availability(cls, device: str) -> tuple[bool, str]:
        if importlib.util.find_spec("instanttensor") is None:
            return False, "instanttensor is not installed (pip install instanttensor==0.2.2)"
        if not device.startswith("cuda"):
            return False, "InstantTensor loads to CUDA devices only"
        return True, ""

    def load(self) -> dict:
        from instanttensor import safe_open

        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        out: dict = {}
        with safe_open(self.files, framework="pt", device=index) as f:
            for name, t in f.tensors():
                out[name] = t
        return out


class FastSafetensorsLoader(PeerLoader):
    """fastsafetensors ``fastsafe_open(nogds=True)``; tensors cloned out before its buffers close."""

    name = "fastsafetensors"
    module = "fastsafetensors"

    @classmethod
    def availability(cls, device: str) -> tuple[bool, str]:
        if importlib.util.find_spec("fastsafetensors") is None:
            return False, "fastsafetensors is not installed (pip install fastsafetensors==0.5.0)"
        if not device.startswith("cuda"):
            return False, "benchmarked on CUDA devices only"
        return True, ""

    def load(self) -> dict:
        from fastsafetensors import fastsafe_open

        out: dict = {}
        with fastsafe_open(filenames=self.files, nogds=True, device=self.device) as f:
            for k in f.keys():
                out[k] = f.get_tensor(k).clone()
        return out


class _PinnedSource(PeerLoader):
    """Holds every tensor in one pinned host buffer (untimed), as a loader that already paid the
    read and the pin would."""

    module = "torch"

    def prepare(self) -> None:
        import torch
        from safetensors.torch import load_file

        cpu: dict = {}
        for f in self.files:
            cpu.update(load_file(f))
        self.nbytes = sum(t.numel() * t.element_size() for t in cpu.values())
        pin = self.device.startswith("cuda")
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.pinned: dict = {}
        off = 0
        for name, t in cpu.items():
            n = t.numel() * t.element_size()
            self.flat[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            self.pinned[name] = self.flat[off:off + n].view(t.dtype).view(t.shape)
            off += n

    def release(self) -> None:
        self.flat = None
        self.pinned = {}


class PerTensorPinnedLoader(_PinnedSource):
    """``t.to(device, non_blocking=True)`` for every tensor of the pinned copy, then one sync."""

    name = "per-tensor pinned"

    def load(self) -> dict:
        import torch

        if not self.device.startswith("cuda"):
            return {n: t.clone() for n, t in self.pinned.items()}
        out = {n: t.to(self.device, non_blocking=True) for n, t in self.pinned.items()}
        torch.cuda.synchronize(self.device)
        return out


class BulkPinnedLoader(_PinnedSource):
    """One copy of the whole pinned buffer into one device buffer: the limit every loader is held to.

    Its result is the device buffer with the same per-tensor views as the source."""

    name = "bulk pinned H2D (limit)"

    def prepare(self) -> None:
        import torch

        super().prepare()
        self.dst = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views = {}
        for name, t in self.pinned.items():
            off = t.data_ptr() - self.flat.data_ptr()
            n = t.numel() * t.element_size()
            self.views[name] = self.dst[off:off + n].view(t.dtype).view(t.shape)

    def load(self) -> dict:
        import torch

        self.dst.copy_(self.flat, non_blocking=True)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        return self.views

    def release(self) -> None:
        super().release()
        self.dst = None
        self.views = {}


PEERS: list[type[PeerLoader]] = [
    SafetensorsLoader, InstantTensorLoader, FastSafetensorsLoader, PerTensorPinnedLoader, BulkPinnedLoader,
]

__all__ = ["PeerLoader", "PEERS", "SafetensorsLoader", "InstantTensorLoader", "FastSafetensorsLoader",
           "PerTensorPinnedLoader", "BulkPinnedLoader"]
