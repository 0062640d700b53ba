"""Same host: map the source's arena through a POSIX fd taken with ``pidfd_getfd``."""

from __future__ import annotations

import socket
import time

from ...memory import Device
from ..common import _same_host
from .registry import Seen, Transport, register_transport


def _open_arena(desc, dev: Device, transport: str, detail: dict | None = None, prefix: str = ""):
    """Map an exported arena on ``dev`` by ``transport`` ("posix_fd" or "fabric"). ``detail``
    (optional) accumulates :meth:`Arena.open`'s timings, keys prefixed with ``prefix``."""
    from ...arena import Arena

    timings: dict = {}
    t0 = time.perf_counter()
    if desc.backend == "host":
        arena = Arena.open(desc, timings=timings)
    else:
        arena = Arena.open(desc, dev, via="fabric" if transport == "fabric" else "pidfd", timings=timings)
    if detail is not None:
        timings["open_ms"] = (time.perf_counter() - t0) * 1e3
        for k, v in timings.items():
            detail[prefix + k] = detail.get(prefix + k, 0.0) + v
    return arena


@register_transport
class PosixFd(Transport):
    """The source's arena mapped by its segments' POSIX fds (pidfd_getfd); the clone copies with a mover."""

    name = "posix_fd"
    order = 0
    reach = "same_host"
    memory = ("host", "device")
    setup = "pidfd_getfd + map: ~1 ms for the first 256 MiB segment, ~0.05 ms per further one"
    maps = True

    @classmethod
    def usable(cls, seen: Seen, dev: Device) -> tuple[bool, str]:
        if _same_host(seen.desc):
            return True, ""
        return False, (f"the seed's arena lives on host {seen.desc.hostname!r}, this clone runs on "
                       f"{socket.gethostname()!r}; a POSIX fd does not cross hosts")

    @classmethod
    def open_arena(cls, desc, dev: Device, detail: dict | None = None, prefix: str = ""):
        return _open_arena(desc, dev, cls.name, detail, prefix)
