"""The checks every kernel wrapper makes of its launch knobs, in a module of their own: the
checksum's first call in a fresh process checks its knobs and must not pay for importing
:mod:`flashboot.kernels.launch` (a dataclass definition: milliseconds) to do it."""

from __future__ import annotations

from typing import Any

from flashboot.errors import FlashBootError


def check_launch_knobs(knobs: dict[str, Any]) -> None:
    """num_warps a power of two, programs_per_sm and num_stages positive ints."""
    w = knobs["num_warps"]
    if not isinstance(w, int) or w < 1 or w & (w - 1) or w > 32:
        raise FlashBootError(f"num_warps must be a power of two in 1..32, got {w!r}")
    for name in ("programs_per_sm", "num_stages"):
        v = knobs[name]
        if not isinstance(v, int) or v < 1:
            raise FlashBootError(f"{name} must be a positive int, got {v!r}")


__all__ = ["check_launch_knobs"]
