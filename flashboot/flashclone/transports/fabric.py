"""Same NVLink domain: map the source's arena through CUDA fabric handles (needs an IMEX channel)."""

from __future__ import annotations

from ...memory import Device
from .posix_fd import _open_arena
from .registry import Seen, Transport, register_transport


@register_transport
class Fabric(Transport):
    """The source's arena mapped by its segments' fabric handles (IMEX); the clone copies with a mover."""

    name = "fabric"
    order = 10
    reach = "nvlink_domain"
    memory = ("device",)
    setup = "cuMemImportFromShareableHandle(FABRIC) + map per segment, like posix_fd; needs an IMEX channel"
    maps = True

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        from ... import _cuda

        if not _cuda.cuda_available():
            return False, "no CUDA device"
        from ...arena import fabric_preflight

        pre = fabric_preflight(0)
        return pre.supported, pre.reason

    @classmethod
    def usable(cls, seen: Seen, dev: Device) -> tuple[bool, str]:
        desc = seen.desc
        if desc.fabric_handles is None:
            return False, f"the seed's arena has no fabric handle ({desc.handle_type})"
        if not dev.is_cuda:
            return False, f"fabric handles map device memory; this clone is on {dev}"
        from ...arena import fabric_preflight

        pre = fabric_preflight(dev.index)
        if not pre.supported:
            return False, f"no fabric on {dev} ({pre.reason})"
        return True, f"seed on {desc.hostname!r}, mapped by fabric handle"

    @classmethod
    def open_arena(cls, desc, dev: Device, detail: dict | None = None, prefix: str = ""):
        return _open_arena(desc, dev, cls.name, detail, prefix)
