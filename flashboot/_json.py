"""JSON from outside: parsed, or refused with a FlashBoot error naming where it came from."""

from __future__ import annotations

import json
from typing import Any

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
