"""Lazy imports: a package lists ``name -> module`` and imports a name on first use, so importing
the package stays light and a missing optional piece fails only where it is used; and a long
import started early, in the background (:func:`import_early`)."""

from __future__ import annotations

import importlib
import threading
import time
from typing import Callable

EARLY_IMPORTS: dict[str, tuple[float, float]] = {}
"""When each finished :func:`import_early` began and ended (``time.perf_counter()``): a clone's
report names torch's where it ran into the clone."""


def lazy_getattr(package: str, table: dict[str, str], namespace: dict) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``package`` that resolves ``table`` and caches in ``namespace``."""

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


def import_early(name: str) -> threading.Thread:
    """Start importing the top-level module ``name`` in a daemon thread and return at once.

    A long import (torch: 1.2-1.5 s on a 2-core host, 3-4 s on the H200 VMs) then runs beside the
    caller's own imports and set-up, in the gaps they leave the GIL (file reads, driver calls), and
    the caller's own ``import`` of it later waits for this one (the import lock) and gets the
    module. A failed import is dropped here and leaves nothing in ``sys.modules``, so a later
    ``import`` runs it again and raises its error; one racing with the failure itself can get
    the half-run module (CPython checks ``_initializing`` after the failure cleared it), so this
    is for imports that do not fail in a working install.

    Top-level modules only, and every other thread must import ``name`` itself before any of its
    submodules: ``import torch.distributed`` while torch is half-imported does not wait for it (the
    import system only checks that the parent is in ``sys.modules``) and runs the submodule against
    the half-imported package (``torch._C._c10d_init`` then aborted the process), while ``import
    torch`` waits for the import in progress."""
    if "." in name:
        raise ValueError(f"import_early takes a top-level module, not {name!r}")

    def run() -> None:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
            EARLY_IMPORTS[name] = (t0, time.perf_counter())
        except BaseException:  # noqa: BLE001 - the caller's own import raises it where it is needed
            pass

    thread = threading.Thread(target=run, name=f"flashboot-import-{name}", daemon=True)
    thread.start()
    return thread
