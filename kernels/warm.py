"""Compile ahead of time: the word checksum kernel's cubins into FlashBoot's kernel cache
(:mod:`flashboot.kernels.cubin`, launched without Triton), and each checksum path run once on a
small buffer of ``device`` so its compiled form lands in the on-disk caches (Triton's for the
byte path, numba's ``cache=True`` for the host), and on CUDA the bytecode of the modules a
fresh process's first GPU checksum imports. ``flashboot warm`` calls it at install; the caches
are keyed by GPU architecture, Triton version and kernel source, so one run per machine and
version is enough."""

from __future__ import annotations

import time
import warnings
from typing import Any

from flashboot.memory import Device

FIRST_CALL_MODULES = ("flashboot.kernels", "flashboot.kernels.checksum", "flashboot.kernels.checksum_spec",
                      "flashboot.kernels.checksum_gpu", "flashboot.kernels.cubin", "flashboot.kernels.knobs",
                      "flashboot.kernels.launch_ctypes", "flashboot.kernels.views")
"""The modules a fresh process's first checksum of CUDA memory imports beyond ``flashboot``."""


def compile_first_call_bytecode() -> list[str]:
    """Write the bytecode of :data:`FIRST_CALL_MODULES` where Python reads it (``__pycache__``,
    or ``sys.pycache_prefix``), as a wheel's install does: an editable install run under
    ``PYTHONDONTWRITEBYTECODE`` never writes it, and compiling these modules in every fresh
    process cost about half of the first call's 20 ms budget on an H200 host. Returns the files
    written; one that cannot be written is a RuntimeWarning naming it and why."""
    import importlib.util
    import py_compile

    written = []
    for name in FIRST_CALL_MODULES:
        source = importlib.util.find_spec(name).origin
        target = importlib.util.cache_from_source(source)
        try:
            written.append(py_compile.compile(source, cfile=target, doraise=True))
        except (py_compile.PyCompileError, OSError) as exc:
            warnings.warn(f"flashboot warm: cannot write {target} ({type(exc).__name__}: {exc}); a fresh process "
                          f"compiles {name} at its first checksum", RuntimeWarning, stacklevel=2)
    return written


def warm_checksum(device: Any = None) -> dict[str, float]:
    """On CUDA, the bytecode of the first call's modules (:func:`compile_first_call_bytecode`)
    and the word kernel's cubins (:func:`~flashboot.kernels.checksum_gpu.prepare_checksum_kernels`:
    a fresh process then launches them without Triton); then both checksum paths (word loads,
    byte loads) once on ``device``. Returns ms per step."""
    import torch

    from .checksum import chunk_checksums

    dev = Device.parse(device)
    out = {}
    if dev.is_cuda:
        from .checksum_gpu import prepare_checksum_kernels

        t0 = time.perf_counter()
        compile_first_call_bytecode()
        out["first call's bytecode"] = (time.perf_counter() - t0) * 1e3
        out.update({f"words cubin, {variant}": ms for variant, ms in prepare_checksum_kernels(dev.index).items()})
    buf = torch.ones(1 << 20, dtype=torch.uint8, device=str(dev))
    for name, (start, chunk) in {"words": (0, 1 << 16), "bytes": (1, (1 << 16) + 1)}.items():
        t0 = time.perf_counter()
        chunk_checksums(buf[start:], chunk)
        if dev.is_cuda:
            torch.cuda.synchronize(dev.index)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


__all__ = ["FIRST_CALL_MODULES", "compile_first_call_bytecode", "warm_checksum"]
