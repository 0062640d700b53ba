"""The schedule registry: one module per schedule registers its planner by name."""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Mapping

from flashboot.errors import UnknownNameError

from .plan import Plan, PlanError, default_chunk_bytes

Planner = Callable[..., Plan]
_SCHEDULES: dict[str, Planner] = {}


def register_schedule(name: str) -> Callable[[Planner], Planner]:
    """Decorator: register ``planner(n, total_bytes, chunk_bytes, **options) -> Plan`` as ``name``."""

    # a name that is not a plain string would break list_schedules() and every unknown-name
    # message (sorted() of mixed types), for every caller, not just this one
    if not isinstance(name, str) or not name or name != name.strip():
        raise PlanError(f"a schedule name must be a non-empty string without surrounding spaces, got {name!r}")

    def deco(planner: Planner) -> Planner:
        try:  # a planner of another signature had registered, and build_plan raised its TypeError
            inspect.signature(planner).bind(1, 1, 1)
        except TypeError as exc:
            raise PlanError(f"schedule {name!r}: its planner must take (n, total_bytes, chunk_bytes, **options): "
                            f"{exc}") from None
        except ValueError:  # no signature to read (a builtin): nothing to hold it against
            pass
        held, where = _SCHEDULES.get(name), _where(planner)
        # the same planner defined again (a notebook cell run twice) replaces it; another (or any
        # lambda: they all share one name) is refused
        if held is not None and held is not planner and (_where(held) != where or "<lambda>" in where):
            raise PlanError(f"schedule {name!r} is already registered by {_where(held)}; {where} needs "
                            "another name")
        _SCHEDULES[name] = planner
        return planner

    return deco


def _where(obj: Any) -> str:
    """``module.qualified_name`` of a planner: what tells a redefinition from another planner."""
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def list_schedules() -> list[str]:
    """Names of the registered schedules, sorted."""
    return sorted(_SCHEDULES)


def build_plan(name: str, n: int, total_bytes: int, chunk_bytes: int | None = None,
               options: Mapping[str, Any] | None = None, **kwargs: Any) -> Plan:
    """Build the plan of schedule ``name``.

    ``n`` is the number of clones (star, chain: plus one seed) or of ring members (ring).
    ``chunk_bytes`` defaults to :func:`~flashboot.schedulers.plan.default_chunk_bytes`. Planner options come as keywords
    or as a plain dict ``options`` (e.g. ``{"align_bytes": 4096}`` for ring).
    Raises UnknownNameError for an unknown schedule, PlanError for a bad request.
    """
    planner = _SCHEDULES.get(name) if isinstance(name, str) else None  # a list for a name: unhashable, a TypeError
    if planner is None:
        raise UnknownNameError("schedule", name, _SCHEDULES)
    if options is not None and not isinstance(options, Mapping):
        raise PlanError(f"schedule {name!r}: options must be a dict of option name to value, got {options!r}")
    merged = {**(options or {}), **kwargs}
    if merged:
        _check_options(name, planner, merged)
    # counts computed with numpy (a sweep over 2 ** np.arange(20, 31)) are the ints they hold: they
    # had been refused as "chunk_bytes must be a positive int, got np.int64(1048576)"
    n, total_bytes, chunk_bytes = (_index(v) for v in (n, total_bytes, chunk_bytes))
    chunk = default_chunk_bytes(name, n) if chunk_bytes is None else chunk_bytes
    plan = planner(n, total_bytes, chunk, **merged)
    # a registered planner's answer is checked as the built-in ones are made: a planner returning
    # None had come back as the "plan", one of another image size as a plan of the bytes asked for
    if not isinstance(plan, Plan):
        raise PlanError(f"schedule {name!r}: its planner returned {type(plan).__name__}, not a Plan")
    if plan.total_bytes != total_bytes:
        raise PlanError(f"schedule {name!r}: its planner made a plan of {plan.total_bytes:,} bytes; "
                        f"{total_bytes:,} were asked for")
    return plan


def _index(value: Any) -> Any:
    """``value`` as a plain int where it is an integer of another type (numpy's), else unchanged
    for the planner to judge (a bool stays a bool: True is no count)."""
    if type(value) is int or isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return value
    return operator.index(value)


def _check_options(name: str, planner: Planner, options: Mapping[str, Any]) -> None:
    """PlanError naming the options ``planner`` does not take (an option of one schedule passed to
    another, e.g. ring's ``align_bytes`` to chain, had surfaced as the planner's TypeError)."""
    params = list(inspect.signature(planner).parameters.values())[3:]  # after n, total_bytes, chunk_bytes
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise PlanError(f"schedule {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
                        f"{', '.join(known) or '(none)'}")


__all__ = ["build_plan", "list_schedules", "register_schedule"]
