"""The mover registry: one table, one decorator. Backends register themselves on import."""

from __future__ import annotations

from dataclasses import dataclass

from flashboot.errors import FlashBootError, UnknownNameError

from .base import Mover

_MOVERS: dict[str, type[Mover]] = {}


def register_mover(cls: type[Mover]) -> type[Mover]:
    """Class decorator: add ``cls`` to the registry under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Mover)):
        raise FlashBootError(f"{cls!r} is not a Mover subclass")
    if not cls.name or not cls.paths:
        raise FlashBootError(f"{cls.__name__} must set `name` and `paths`")
    if cls.name in _MOVERS and _MOVERS[cls.name] is not cls:
        raise FlashBootError(f"mover {cls.name!r} is already registered by {_MOVERS[cls.name].__name__}")
    _MOVERS[cls.name] = cls
    return cls


def mover_class(name: str) -> type[Mover]:
    """The registered class for ``name``; UnknownNameError lists the known names."""
    try:
        return _MOVERS[name]
    except KeyError:
        raise UnknownNameError("mover", name, _MOVERS) from None


def create_mover(name: str, **options) -> Mover:
    """Construct the mover registered as ``name``. Raises CapabilityError where it cannot run here."""
    return mover_class(name)(**options)


@dataclass(frozen=True)
class MoverInfo:
    """What a mover can copy and whether it runs on this machine (without constructing it)."""

    name: str
    paths: tuple[str, ...]
    available: bool
    reason: str
    summary: str
    batched: str = ""
    """How ``copy_batch`` copies a chunk list (one batched call, one launch, or one call per chunk)."""


def list_movers() -> list[MoverInfo]:
    """Every registered mover, sorted by name."""
    infos = []
    for name in sorted(_MOVERS):
        cls = _MOVERS[name]
        ok, reason = cls.availability()
        infos.append(MoverInfo(name, tuple(p for p in ("h2d", "d2h", "d2d", "p2p", "host") if p in cls.paths),
                               ok, reason, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "",
                               cls.batched))
    return infos


def movers_for(path: str) -> list[str]:
    """Names of registered movers that declare ``path``."""
    return sorted(n for n, c in _MOVERS.items() if path in c.paths)
