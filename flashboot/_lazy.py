"""Lazy re-exports: a package lists ``name -> module`` and imports a name on first use, so
importing the package stays light and a missing optional piece fails only where it is used."""

from __future__ import annotations

import importlib
from typing import Callable


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
