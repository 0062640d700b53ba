"""Same host: map the source's arena through a POSIX fd taken with ``pidfd_getfd``."""

from __future__ import annotations

import time

from ...memory import Device


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
