"""The transport registry: one table, one decorator; each transport module registers itself.

A transport says what it can do as data, so callers, ``flashboot info`` and tests can ask without
constructing it: how far it reaches (``REACH``), which memory it moves (``memory``), and what it
costs to set up (``setup``). ``auto`` walks the registry in ``order`` and takes the first transport
that is usable between this clone and the seed; the note it returns says why, naming each one it
passed over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ...errors import FlashBootError, RendezvousError, UnknownNameError
from ...memory import Device

REACH = ("same_host", "nvlink_domain", "any_host")
"""How far a transport reaches: the same host, hosts of one NVLink domain (IMEX), any host."""
MEMORY = ("host", "device")

_TRANSPORTS: dict[str, type["Transport"]] = {}


@dataclass(frozen=True)
class Seen:
    """What a clone knows about its source before choosing: the source's arena descriptor and what
    the seed offers beyond mapping (``offers``: e.g. ``{"nixl": {...}, "nccl": True}``)."""

    desc: Any
    offers: Mapping[str, Any]


class Transport:
    """Base class. Subclasses set the class attributes and implement :meth:`usable`; a transport
    whose clone maps the source's arena (``maps = True``) implements :meth:`open_arena`, the others
    :meth:`run` (the whole clone, see :mod:`flashboot.flashclone.cloning`)."""

    name: str = ""
    order: int = 100
    """Position in ``auto``'s preference (lower first)."""
    reach: str = ""
    memory: tuple[str, ...] = ()
    setup: str = ""
    """What it costs to set up, in words and measured figures (shown by ``flashboot info``)."""
    maps: bool = False

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """``(works on this machine, why not)``: a cheap check, nothing is created."""
        return True, ""

    @classmethod
    def usable(cls, seen: Seen, dev: Device) -> tuple[bool, str]:
        """``(usable between this clone on dev and the source, reason)``: the reason says why it is
        chosen when usable, why not otherwise."""
        raise NotImplementedError

    @classmethod
    def open_arena(cls, desc, dev: Device, detail: dict | None = None, prefix: str = ""):
        raise FlashBootError(f"transport {cls.name!r} does not map the source's arena")

    @classmethod
    def run(cls, ctx) -> Any:
        raise FlashBootError(f"transport {cls.name!r} maps the source's arena; it has no run()")


def register_transport(cls: type[Transport]) -> type[Transport]:
    """Class decorator: add ``cls`` to the registry under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise FlashBootError(f"{cls!r} is not a Transport subclass")
    if not cls.name or cls.reach not in REACH or not cls.memory or not set(cls.memory) <= set(MEMORY) or not cls.setup:
        raise FlashBootError(f"{cls.__name__} must set name, reach (one of {REACH}), memory (of {MEMORY}) and setup")
    if cls.name in _TRANSPORTS and _TRANSPORTS[cls.name] is not cls:
        raise FlashBootError(f"transport {cls.name!r} is already registered by {_TRANSPORTS[cls.name].__name__}")
    _TRANSPORTS[cls.name] = cls
    return cls


def _load_all() -> None:
    from . import fabric, nccl, nixl, posix_fd  # noqa: F401 - each registers itself


def transport_class(name: str) -> type[Transport]:
    """The registered class for ``name``; UnknownNameError lists the known names (and ``auto``)."""
    _load_all()
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise UnknownNameError("transport", name, [*_TRANSPORTS, "auto"]) from None


def transport_names() -> list[str]:
    """Registered names in ``auto``'s order of preference."""
    _load_all()
    return sorted(_TRANSPORTS, key=lambda n: (_TRANSPORTS[n].order, n))


@dataclass(frozen=True)
class TransportInfo:
    """What a transport can do and whether it works on this machine (without constructing it)."""

    name: str
    reach: str
    memory: tuple[str, ...]
    setup: str
    available: bool
    reason: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def list_transports() -> list[TransportInfo]:
    """Every registered transport, in ``auto``'s order."""
    out = []
    for name in transport_names():
        cls = _TRANSPORTS[name]
        ok, reason = cls.availability()
        out.append(TransportInfo(name, cls.reach, tuple(cls.memory), cls.setup, ok, reason))
    return out


def choose_transport(seen: Seen, dev: Device, requested: str) -> tuple[type[Transport], str]:
    """``(transport class, note)`` for reading the source ``seen`` describes from ``dev``.

    ``requested``: ``"auto"`` or a registered name. An explicit name that cannot serve this source
    raises RendezvousError saying why; ``auto`` takes the first usable one in order and its note
    names why each earlier one was passed over."""
    if requested != "auto":
        cls = transport_class(requested)
        ok, why = cls.usable(seen, dev)
        if not ok:
            raise RendezvousError(f"transport {requested} cannot serve this clone: {why}")
        return cls, "asked for"
    desc = seen.desc
    if (desc.backend == "host") != (not dev.is_cuda):
        raise RendezvousError(f"the seed's arena is a {desc.backend} arena; a clone on {dev} cannot map it "
                              f"(use device {'cpu' if desc.backend == 'host' else 'cuda:N'})")
    passed = []
    for name in transport_names():
        cls = _TRANSPORTS[name]
        ok, why = cls.usable(seen, dev)
        if ok:
            return cls, "; ".join(passed + ([why] if why else []))
        passed.append(f"not {name}: {why}")
    raise RendezvousError(f"no transport can reach the seed on {desc.hostname!r} from {dev}: {'; '.join(passed)}")
