"""Compile ahead of time: run each checksum path once on a small buffer of ``device`` so its
compiled form lands in the on-disk caches (Triton's for CUDA, numba's ``cache=True`` for the
host), and a fresh process's first verified load loads it instead of compiling it (0.5-0.6 s on
an H200 host). ``flashboot warm`` calls it at install; the cache is keyed by GPU architecture,
Triton version and kernel source, so one run per machine and version is enough."""

from __future__ import annotations

import time
from typing import Any

from flashboot.memory import Device


def warm_checksum(device: Any = None) -> dict[str, float]:
    """Both checksum paths (word loads, byte loads) on ``device``; returns ms per path."""
    import torch

    from .checksum import chunk_checksums

    dev = Device.parse(device)
    buf = torch.ones(1 << 20, dtype=torch.uint8, device=str(dev))
    out = {}
    for name, (start, chunk) in {"words": (0, 1 << 16), "bytes": (1, (1 << 16) + 1)}.items():
        t0 = time.perf_counter()
        chunk_checksums(buf[start:], chunk)
        if dev.is_cuda:
            torch.cuda.synchronize(dev.index)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


__all__ = ["warm_checksum"]
