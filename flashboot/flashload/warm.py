"""The loader's imports, paid as the engine starts rather than inside its first load."""

from __future__ import annotations

import importlib
import time
from typing import Any

LOADER_MODULES = (
    "flashboot.flashload.pipeline", "flashboot.flashload.client", "flashboot.flashload.stream",
    "flashboot.flashload.stage", "flashboot.flashload.views",
    "flashboot.arena", "flashboot.layouts.image", "flashboot.layouts.table", "flashboot.fdshare",
    "flashboot.fileio", "flashboot.pinning",
)
"""What :func:`flashboot.prepare` and :func:`flashboot.load` import on their first call. Measured on
the 2-core host backend: a first served load of 3,170 tensors took 86 ms in a fresh process, 68 ms
of it these imports, against 12.5 ms once they were imported (11 ms for a second load)."""


def import_loader(device: Any = None) -> float:
    """Import :data:`LOADER_MODULES` and, for a CUDA ``device``, the driver bindings an arena uses
    (``cuda.bindings``, which torch does not load), and grow the fd table for an arena's segment
    fds (:func:`~flashboot.fdshare.grow_fd_table`); returns the milliseconds spent. The engine
    plugins run this in a thread at engine start; import errors propagate (the load would raise
    the same)."""
    from ..memory import Device

    t0 = time.perf_counter()
    for name in LOADER_MODULES:
        # each package before its modules: a package another thread is still initialising is
        # waited for, where importing its module straight away races that thread's __init__
        # (which can end in Python's _DeadlockError: seen in CI for a clone's warm-up thread)
        parts = name.split(".")
        for i in range(2, len(parts) + 1):
            importlib.import_module(".".join(parts[:i]))
    from ..fdshare import grow_fd_table

    grow_fd_table()
    if device is not None and Device.parse(device).is_cuda:
        from .. import _cuda

        _cuda.driver()
    return (time.perf_counter() - t0) * 1e3


__all__ = ["LOADER_MODULES", "import_loader"]
