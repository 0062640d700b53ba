"""Family rules, one module per model family, registered by config.json ``model_type``.

``family_for(model_type)`` returns the rule for a model type; a type with no rule gets the
:class:`~flashboot.layouts.families.generic.GenericFamily` (tensors verbatim) and a warning
saying so. Each module registers itself with :func:`register_family` on import.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashboot.errors import FlashBootError, UnknownNameError

from .base import Family, Piece, PlanContext, PlannedTensor, RankPlan, TransformerFamily, check_plan

_FAMILIES: dict[str, type[Family]] = {}
_BY_MODEL_TYPE: dict[str, str] = {}


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: register ``cls`` under ``cls.name`` and each of ``cls.model_types``."""
    if not (isinstance(cls, type) and issubclass(cls, Family)) or not cls.name or not isinstance(cls.name, str):
        raise FlashBootError(f"{cls!r} is not a Family subclass with a name")
    # ("llama2") is a string, not a tuple: it would claim model types 'l', 'a', 'm', ... and the
    # model it was written for would fall back to generic with only a warning
    if not isinstance(cls.model_types, tuple) or not all(isinstance(mt, str) and mt for mt in cls.model_types):
        raise FlashBootError(f"family {cls.name!r}: model_types must be a tuple of non-empty strings, got "
                             f"{cls.model_types!r}")
    if cls.name in _FAMILIES and _FAMILIES[cls.name] is not cls:
        raise FlashBootError(f"family {cls.name!r} is already registered by {_FAMILIES[cls.name].__name__}")
    for mt in cls.model_types:
        owner = _BY_MODEL_TYPE.get(mt)
        if owner not in (None, cls.name):
            raise FlashBootError(f"model_type {mt!r} is already claimed by family {owner!r}")
    _FAMILIES[cls.name] = cls
    for mt in cls.model_types:
        _BY_MODEL_TYPE[mt] = cls.name
    return cls


def get_family(name: str) -> Family:
    """The family registered as ``name``; UnknownNameError lists the known ones."""
    try:
        cls = _FAMILIES[name]
    except KeyError:
        raise UnknownNameError("family", name, _FAMILIES) from None
    return cls()  # outside the try: a KeyError of the family's own constructor is not "unknown family"


@dataclass(frozen=True)
class FamilyChoice:
    """The family picked for a model type, and whether that was the generic fallback."""

    family: Family
    model_type: str | None
    fallback: bool
    warning: str | None


def family_for(model_type: str | None) -> FamilyChoice:
    """The family registered for ``model_type``, else generic with a warning that says so."""
    name = _BY_MODEL_TYPE.get(model_type or "")
    if name is not None:
        return FamilyChoice(get_family(name), model_type, False, None)
    what = f"model_type {model_type!r}" if model_type else "a checkpoint without config.json model_type"
    warning = (f"no family rules for {what}: falling back to generic (tensors written verbatim, no "
               f"expert region, tp/ep > 1 refused); known model types: {', '.join(sorted(_BY_MODEL_TYPE))}")
    return FamilyChoice(get_family("generic"), model_type, True, warning)


def list_families() -> dict[str, tuple[str, ...]]:
    """Family name -> the model types it is registered for."""
    return {name: cls.model_types for name, cls in sorted(_FAMILIES.items())}


# Importing a module registers its families.
from . import deepseek_v3, generic, llama, mixtral, qwen3_moe  # noqa: E402,F401

__all__ = ["Family", "FamilyChoice", "Piece", "PlanContext", "PlannedTensor", "RankPlan", "TransformerFamily",
           "check_plan", "family_for", "get_family", "list_families", "register_family"]
