"""Byte sizes as people write them: ``4096``, ``217e9``, ``217GB``, ``256MiB``, ``1.5 GB``; and
timeouts checked once where a caller gives them."""

from __future__ import annotations

import math
import re

from .errors import FlashBootError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


MAX_BYTES = 2**63 - 1
"""The largest byte count taken: what a signed 64-bit size (a file offset, a tensor's numel) holds."""


def parse_bytes(text) -> int:
    """Parse a byte count. Decimal units (KB, MB, GB, TB) are powers of 10, binary ones (KiB,
    MiB, GiB, TiB, and bare K/M/G/T) powers of 2. Raises FlashBootError on anything else or a
    non-positive, fractional or larger than :data:`MAX_BYTES` byte count."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        import decimal  # ~1 ms: not in every process that imports this module (the load path does)

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise FlashBootError(f"cannot parse byte size {_short(text)}: use e.g. 4096, 217e9, 217GB, 256MiB")
        # Decimal, not float: a float overflowed on 1e400 and rounded 9007199254740993 to ...992
        try:
            number = decimal.Decimal(m.group(1))
        except decimal.InvalidOperation:  # an exponent beyond what Decimal holds (1e99999999999999999999)
            raise FlashBootError(f"byte size {_short(text)} is out of range (at most {MAX_BYTES:,} bytes)") from None
        if number > MAX_BYTES:  # exact comparison, before any arithmetic that could overflow
            raise FlashBootError(f"byte size {_short(text)} is larger than {MAX_BYTES:,} bytes")
        with decimal.localcontext() as ctx:
            ctx.prec = len(m.group(1)) + 20  # enough digits that the product is exact
            number *= _UNITS[m.group(2).lower()]
        if number != number.to_integral_value():
            raise FlashBootError(f"byte size {_short(text)} is not a whole number of bytes ({number})")
        value = int(number)
    if value <= 0:
        raise FlashBootError(f"byte size must be positive, got {_short(text)}")
    if value > MAX_BYTES:
        raise FlashBootError(f"byte size {_short(text)} is larger than {MAX_BYTES:,} bytes")
    return value


def _short(text) -> str:
    r = repr(text) if not isinstance(text, int) else str(text) if text.bit_length() < 256 else f"a {text.bit_length()}-bit int"
    return r if len(r) <= 80 else r[:60] + f"... ({len(r)} characters)"


def format_bytes(nbytes: int) -> str:
    """Human-readable size in binary units, as the options take them: ``64 MiB``, ``12.82 GiB``.

    Every size the CLI prints goes through here, so one unit system is shown everywhere (rates stay
    decimal GB/s, as link speeds are quoted)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def format_rate(nbytes: int, ms: float) -> str:
    """``nbytes`` moved in ``ms`` milliseconds as a readable rate (``54.1 GB/s``, ``17.2 MB/s``)."""
    if ms <= 0:
        return "- B/s"
    return format_bytes(int(nbytes / (ms * 1e-3))) + "/s"


MAX_TIMEOUT_S = 1e6
"""The longest wait a caller may ask for (~11.6 days): past it, thread and lock waits overflow
(inf raised OverflowError mid-load) and a wait that long is a mistake."""


def is_finite_number(value) -> bool:
    """An int or a float, finite (a bool is no number here: True had passed for 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def limit_text(limit: int) -> str:
    """A resource limit (``resource.getrlimit``'s) as an error names it: ``unlimited`` or ``1,024``."""
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,}"


def check_timeout(value, what: str, error: type[FlashBootError] = FlashBootError, *, zero_ok: bool = False) -> float:
    """``value`` as a float of seconds in (0, :data:`MAX_TIMEOUT_S`] (``[0, ...]`` with ``zero_ok``:
    a wait that may also not wait), or ``error`` naming ``what``: NaN had spun a thread forever (no
    deadline is ever reached), inf raised OverflowError."""
    if not is_finite_number(value) or not (0 <= value if zero_ok else 0 < value) or value > MAX_TIMEOUT_S:
        raise error(f"{what} must be a finite number of seconds in {'[' if zero_ok else '('}0, {MAX_TIMEOUT_S:g}], "
                    f"got {value!r}")
    return float(value)


def timeout_arg(text: str) -> float:
    """argparse type of a ``--timeout``: :func:`check_timeout` of the number given (NaN and inf had
    been taken, 1e12 overflowed the store's timers)."""
    import argparse

    try:
        return check_timeout(float(text), "--timeout")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    except FlashBootError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
