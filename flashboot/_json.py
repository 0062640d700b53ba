"""JSON from outside: parsed, or refused with a FlashBoot error naming where it came from."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from .errors import FlashBootError


def loads(raw: bytes | str, where: str, error: type[FlashBootError] = FlashBootError) -> Any:
    """``json.loads(raw)``; ``error`` naming ``where`` for text that is not JSON, not UTF-8, or
    nested too deeply to parse (``json`` recurses once per level: ~10^5 ``[`` exhaust the stack
    limit and raise RecursionError, which is no ValueError)."""
    try:
        return json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error(f"{where}: not JSON ({exc})") from None
    except RecursionError:
        raise error(f"{where}: not JSON (nested deeper than this reader accepts)") from None


# ---------------------------------------------------------------- typed fields of outside JSON
# JSON allows any value anywhere; a reader states what each field must be as (words, test) and
# :func:`check_fields` refuses the first that is not, naming it. ``bool`` is no int here.
def int_at_least(minimum: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= minimum


def is_str(v: Any) -> bool:
    return type(v) is str


def finite_at_least(minimum: float) -> Callable[[Any], bool]:
    return lambda v: type(v) in (int, float) and math.isfinite(v) and v >= minimum


def check_fields(obj: dict, spec: dict[str, tuple[str, Callable[[Any], bool]]], error: type[FlashBootError],
                 prefix: str) -> None:
    """``error(f"{prefix}{name} must be {words}, found ...")`` for the first field of ``obj`` that
    ``spec`` names and whose test fails (absent fields are the caller's to require)."""
    for name, (what, ok) in spec.items():
        if name in obj and not ok(obj[name]):
            raise error(f"{prefix}{name} must be {what}, found {_shown(obj[name])}")


def _shown(value: Any) -> str:
    """``value`` for a message: at most 200 characters, and a few levels deep. str() of the whole
    value first had recursed through every level of a nested list that loads() accepted
    (RecursionError) and built all of a large one only to cut it."""
    if type(value) is str:
        return value[:200]
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 4, 200, 200, 200
    return r.repr(value)[:200]
