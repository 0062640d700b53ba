"""Copy backends behind one registry. Importing this package registers every built-in mover."""

from .base import Mover
from .registry import best_mover, create_mover, list_movers, mover_class, movers_for, register_mover

# Built-in backends register themselves on import.
from . import copy_engine, host, triton_sm, triton_tma  # noqa: E402,F401

__all__ = ["Mover", "best_mover", "create_mover", "list_movers", "mover_class", "movers_for", "register_mover"]
