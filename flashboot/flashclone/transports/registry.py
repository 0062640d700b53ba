"""Choosing the transport a clone reads its source by."""

from __future__ import annotations

from ...errors import FlashBootError, RendezvousError
from ...memory import Device
from ..common import _same_host


TRANSPORTS = ("auto", "posix_fd", "fabric", "nccl")


def _choose_transport(desc, dev: Device, requested: str) -> tuple[str, str]:
    """``(transport, note)`` for reading the arena ``desc`` describes from ``dev``."""
    if requested not in TRANSPORTS:
        raise FlashBootError(f"transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested != "auto":
        if requested == "posix_fd" and not _same_host(desc):
            raise RendezvousError(f"transport posix_fd needs the seed on this host; it runs on {desc.hostname!r}")
        if requested == "fabric" and desc.fabric_handles is None:
            raise RendezvousError(f"transport fabric asked for, but the seed's arena has no fabric handles "
                                  f"({desc.handle_type})")
        return requested, "asked for"
    if (desc.backend == "host") != (not dev.is_cuda):
        raise RendezvousError(f"the seed's arena is a {desc.backend} arena; a clone on {dev} cannot map it "
                              f"(use device {'cpu' if desc.backend == 'host' else 'cuda:N'})")
    if _same_host(desc):
        return "posix_fd", ""
    if desc.fabric_handles is not None and dev.is_cuda:
        from ...arena import fabric_preflight

        pre = fabric_preflight(dev.index)
        if pre.supported:
            return "fabric", f"seed on {desc.hostname!r}, mapped by fabric handle"
        return "nccl", f"seed on {desc.hostname!r}; no fabric here ({pre.reason}): NCCL broadcast"
    return "nccl", (f"seed on {desc.hostname!r} with no fabric handle ({desc.handle_type}): "
                    f"{'NCCL' if dev.is_cuda else 'gloo'} broadcast")
