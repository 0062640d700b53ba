"""The mover registry: one table, one decorator. Backends register themselves on import."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from flashboot.errors import CapabilityError, FlashBootError, MoverError, UnknownNameError
from flashboot.memory import PATHS

from .base import Mover, availability_of

_MOVERS: dict[str, type[Mover]] = {}


def register_mover(cls: type[Mover]) -> type[Mover]:
    """Class decorator: add ``cls`` to the registry under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Mover)):
        raise FlashBootError(f"{cls!r} is not a Mover subclass")
    if not cls.name or not cls.paths:
        raise FlashBootError(f"{cls.__name__} must set `name` and `paths`")
    # a name that is not a plain string broke list_movers() and best_mover() (sorted() of mixed
    # types) for every caller; a str of paths was read letter by letter ('h', 'o', 's', 't')
    if not isinstance(cls.name, str) or cls.name != cls.name.strip():
        raise FlashBootError(f"{cls.__name__}: a mover name must be a string without surrounding spaces, got {cls.name!r}")
    if isinstance(cls.paths, str):
        raise FlashBootError(f"{cls.__name__}: `paths` must be a set of path names, got the string {cls.paths!r}; "
                             f"e.g. frozenset({{{cls.paths!r}}})")
    unknown = sorted(set(cls.paths) - set(PATHS))  # a typo ("H2D") registered a mover no copy could pick
    if unknown:
        raise FlashBootError(f"{cls.__name__} declares unknown path(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(PATHS)}")
    # every copy and batch compares against it: "16" raised TypeError there, 4.5 a numpy ufunc error
    if type(cls.alignment) is not int or cls.alignment < 1:
        raise FlashBootError(f"{cls.__name__}: `alignment` must be an int >= 1 (bytes), got {cls.alignment!r}")
    _check_copy(cls)
    held = _MOVERS.get(cls.name)
    # the same class defined again (a notebook cell run twice) replaces it; another class is refused
    if held is not None and held is not cls and _where(held) != _where(cls):
        raise FlashBootError(f"mover {cls.name!r} is already registered by {_where(held)}; {_where(cls)} needs "
                             "another name")
    _MOVERS[cls.name] = cls
    return cls


def _where(obj) -> str:
    """``module.QualifiedName`` of a class or function: what tells a redefinition from another one."""
    return f"{obj.__module__}.{obj.__qualname__}"


def _check_copy(cls: type[Mover]) -> None:
    """FlashBootError unless ``cls`` implements ``_copy(self, dst, src, nbytes, path, stream)``:
    a mover without one registered, and its first copy raised a bare NotImplementedError; one of
    another signature a TypeError from inside Mover.copy, neither naming what to write."""
    want = "_copy(self, dst, src, nbytes, path, stream)"
    if cls._copy is Mover._copy:
        raise FlashBootError(f"{cls.__name__} must implement {want}: Mover.copy, batches and the executor call it")
    try:
        sig = inspect.signature(cls._copy)
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing to hold it against
        return
    try:
        sig.bind(None, None, None, 0, "", None)
    except TypeError as exc:
        raise FlashBootError(f"{cls.__name__}.{cls._copy.__name__}{sig} does not take the arguments of {want}: "
                             f"{exc}") from None


def mover_class(name: str) -> type[Mover]:
    """The registered class for ``name``; UnknownNameError lists the known names."""
    try:
        return _MOVERS[name]
    except (KeyError, TypeError):  # TypeError: a list or dict for a name (unhashable)
        raise UnknownNameError("mover", name, _MOVERS) from None


def create_mover(name: str, **options) -> Mover:
    """Construct the mover registered as ``name``. Raises CapabilityError where it cannot run here,
    MoverError naming an option it does not take."""
    cls = mover_class(name)
    takes = _options(cls)
    if options and takes is not None and not options.keys() <= set(takes):  # a raw TypeError named Mover.__init__
        unknown = sorted(set(options) - set(takes))
        raise MoverError(f"mover {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(takes) or 'none'}")
    return cls(**options)


@functools.cache
def _options(cls: type[Mover]) -> tuple[str, ...] | None:
    """The keyword options ``cls`` takes, or None when it takes any (``**tuning``)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


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
        ok, reason = availability_of(cls)
        infos.append(MoverInfo(name, tuple(p for p in ("h2d", "d2h", "d2d", "p2p", "host") if p in cls.paths),
                               # a blank docstring had raised IndexError here, for every listing
                               ok, reason, next(iter((cls.__doc__ or "").strip().splitlines()), ""),
                               cls.batched))
    return infos


def movers_for(path: str) -> list[str]:
    """Names of registered movers that declare ``path``."""
    return sorted(n for n, c in _MOVERS.items() if path in c.paths)


PREFERENCE = ("copy_engine", "triton_sm", "triton_tma", "host")
"""Fastest first, as measured on an H200 (shared/hardware.md: the copy engine leads the Triton
copies on every path); a mover not listed comes after these, by name."""


def best_mover(src, dst=None, **options) -> Mover:
    """Construct the fastest mover that runs on this machine and copies from device ``src`` to
    device ``dst`` (default: ``src``): ``copy_engine`` on a GPU, ``host`` on the host backend.

    ``src`` and ``dst`` are anything :meth:`flashboot.Device.parse` takes. Raises
    CapabilityError naming each mover of that path and why it cannot run here."""
    from flashboot.memory import Device, path_between

    src_dev = Device.parse(src)
    path = path_between(src_dev, src_dev if dst is None else Device.parse(dst))
    ranked = sorted(movers_for(path), key=lambda n: (PREFERENCE.index(n) if n in PREFERENCE else len(PREFERENCE), n))
    why = {}
    for name in ranked:
        ok, why[name] = availability_of(_MOVERS[name])
        if ok:
            return create_mover(name, **options)
    raise CapabilityError(f"no mover copies {path} on this machine: "
                          + ("; ".join(f"{n}: {w}" for n, w in why.items()) or "none is registered for it"))
