"""Compile ahead of time: the word checksum kernel's cubins into FlashBoot's kernel cache
(:mod:`flashboot.kernels.cubin`, launched without Triton), and each checksum path run once on a
small buffer of ``device`` so its compiled form lands in the on-disk caches (Triton's for the
byte path, numba's ``cache=True`` for the host). ``flashboot warm`` calls it at install, after
writing FlashBoot's bytecode (:mod:`flashboot.bytecode`); the caches are keyed by GPU
architecture, Triton version and kernel source, so one run per machine and version is enough."""

from __future__ import annotations

import time
from typing import Any

from flashboot.memory import Device


def warm_checksum(device: Any = None) -> dict[str, float]:
    """On CUDA, the word kernel's cubins (:func:`~flashboot.kernels.checksum_gpu.prepare_checksum_kernels`:
    a fresh process then launches them without Triton); then both checksum paths (word loads,
    byte loads) once on ``device``. Returns ms per step."""
    import torch

    from .checksum import chunk_checksums

    dev = Device.parse(device)
    out = {}
    if dev.is_cuda:
        from .checksum_gpu import prepare_checksum_kernels

        out.update({f"words cubin, {variant}": ms for variant, ms in prepare_checksum_kernels(dev.index).items()})
    buf = torch.ones(1 << 20, dtype=torch.uint8, device=str(dev))
    for name, (start, chunk) in {"words": (0, 1 << 16), "bytes": (1, (1 << 16) + 1)}.items():
        t0 = time.perf_counter()
        chunk_checksums(buf[start:], chunk)
        if dev.is_cuda:
            torch.cuda.synchronize(dev.index)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


__all__ = ["warm_checksum"]
