"""Bind: point a meta-initialised torch module's parameters and buffers at a loaded image's views,
so the arena holds the only copy of the weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import FlashBootError, LayoutError
from ..memory import Device
from .report import LoadedImage


# ===================================================================================== bind
@dataclass
class BindReport:
    """What :func:`bind` did: names bound, tied names that share a binding, recomputed buffers,
    and (non-strict) what did not match."""

    bound: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    recomputed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    """Names copied to the module's dtype (``cast=True``): the only ones not zero-copy."""


@dataclass
class _Slot:
    module: Any
    local: str
    kind: str  # "param" | "buffer"
    persistent: bool


def _slots(module) -> tuple[dict[str, _Slot], dict[str, Any]]:
    """Every parameter and buffer of ``module`` by full name (tied ones under each of their names)."""
    slots, tensors = {}, {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for local, p in mod._parameters.items():
            if p is not None:
                slots[prefix + local] = _Slot(mod, local, "param", True)
                tensors[prefix + local] = p
        for local, b in mod._buffers.items():
            if b is not None:
                slots[prefix + local] = _Slot(mod, local, "buffer", local not in mod._non_persistent_buffers_set)
                tensors[prefix + local] = b
    return slots, tensors


def _listing(title: str, items: list[str], limit: int = 8) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{len(items)} {title}: {', '.join(items[:limit])}{more}"


def bind(module, loaded: LoadedImage, strict: bool = True, *, buffers: dict | None = None,
         cast: bool = False) -> BindReport:
    """Point the parameters and buffers of ``module`` (built on the meta device) at ``loaded``'s views.

    Each parameter becomes ``torch.nn.Parameter(view, requires_grad=False)`` on its owning module
    (no per-parameter storage: the arena is the only copy). Parameters tied to one another (the
    same Parameter under several names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``)
    share one binding. Non-persistent buffers (not in any checkpoint, e.g. rotary ``inv_freq``)
    are taken from ``buffers`` (name -> tensor) or recomputed on the device: for a transformers
    model by its own ``_init_weights`` of the buffer's module, as ``from_pretrained`` does.

    ``strict``: raise LayoutError listing missing, unexpected and shape/dtype-mismatched names
    (nothing is rebound then); otherwise bind what matches and report the rest. ``cast``: a tensor
    whose shape matches but dtype does not (a router the model keeps in float32 while the image
    holds bfloat16) is copied to the module's dtype on the device instead of refused; those names
    are listed in ``report.cast`` and are the only ones outside the arena.
    """
    import torch

    _check_loaded(module, loaded)
    slots, current = _slots(module)
    views = loaded.tensors
    buffers = dict(buffers or {})
    _check_buffers(module, buffers, slots, current)  # before anything is rebound: a refusal leaves the module as it was
    groups: dict[int, list[str]] = {}
    for name, t in current.items():
        groups.setdefault(id(t), []).append(name)

    report = BindReport()
    plan: list[tuple[list[str], Any]] = []  # (names sharing one binding, view)
    used: set[str] = set()
    for names in groups.values():
        slot0 = slots[names[0]]
        if slot0.kind == "buffer" and not slot0.persistent:
            continue
        present = [n for n in names if n in views]
        if not present:
            if not any(n in buffers for n in names):
                report.missing.extend(names)
            continue
        view = views[present[0]]
        used.update(present)
        target = current[names[0]]
        bad = False
        for n in present:
            v = views[n]
            if tuple(v.shape) != tuple(target.shape) or (v.dtype != target.dtype and not cast):
                report.mismatched.append(f"{n} (image {list(v.shape)} {v.dtype}, module {list(target.shape)} {target.dtype})")
                bad = True
        if not bad and view.dtype != target.dtype:
            view = view.to(target.dtype)
            report.cast.append(names[0])
        if not bad:
            plan.append((names, view))
            for n in names[1:]:
                report.tied[n] = names[0]
    report.unexpected = sorted(set(views) - used)
    if strict and (report.missing or report.unexpected or report.mismatched):
        problems = [_listing(t, l) for t, l in (("missing from the image", report.missing),
                                                 ("in the image but not in the module", report.unexpected),
                                                 ("mismatched", report.mismatched)) if l]
        raise LayoutError(f"cannot bind {type(module).__name__} to {loaded!r}: " + "; ".join(problems))

    for names, view in plan:
        slot0 = slots[names[0]]
        value = torch.nn.Parameter(view, requires_grad=False) if slot0.kind == "param" else view
        for n in names:
            s = slots[n]
            (s.module._parameters if s.kind == "param" else s.module._buffers)[s.local] = value
        report.bound.append(names[0])
    for name, value in buffers.items():
        s = slots[name]
        s.module._buffers[s.local] = value.to(str(loaded.device))
        report.recomputed.append(name)
    _recompute_buffers(module, slots, loaded.device, set(buffers), report, strict)
    return report


def _check_loaded(module, loaded) -> None:
    """FlashBootError unless ``loaded`` is an open :class:`LoadedImage`: a :func:`flashboot.prepare`
    handle passed by mistake had failed on its ``tensors`` (None) with a bare TypeError, and a
    closed image (no views left) was refused as if the module's every weight were missing from it."""
    from .prepared import PreparedLoad

    what = type(module).__name__
    if not isinstance(loaded, LoadedImage):
        hint = " (a flashboot.prepare() handle: bind what flashboot.load(..., prepared=handle) returns)" \
            if isinstance(loaded, PreparedLoad) else ""
        raise FlashBootError(f"bind takes the LoadedImage flashboot.load() returns, got {type(loaded).__name__}"
                             f"{hint}; {what} was not changed")
    if loaded.arena.closed:
        raise FlashBootError(f"cannot bind {what} to {loaded!r}: it is closed (its arena and views are released); "
                             "load the image again")


def _check_buffers(module, buffers: dict, slots: dict[str, _Slot], current: dict) -> None:
    """LayoutError naming the entry where ``buffers=`` names no buffer of ``module``, or gives
    something other than a tensor of the buffer's shape (checked before anything is rebound)."""
    import torch

    what = type(module).__name__
    for name, value in buffers.items():
        s = slots.get(name)
        if s is None or s.kind != "buffer":
            raise LayoutError(f"buffers= names {name!r}, which is not a buffer of {what}; {what} was not changed")
        if not isinstance(value, torch.Tensor):
            raise LayoutError(f"buffers={{{name!r}: ...}} must be a torch.Tensor, got {type(value).__name__}; "
                              f"{what} was not changed")
        want = tuple(current[name].shape)
        if tuple(value.shape) != want:
            raise LayoutError(f"buffers={{{name!r}: ...}} has shape {list(value.shape)}, the buffer of {what} has "
                              f"{list(want)}; {what} was not changed")


def _recompute_buffers(module, slots: dict[str, _Slot], device: Device, given: set[str], report: BindReport,
                       strict: bool) -> None:
    """Materialise non-persistent buffers still on the meta device, the way transformers does after
    ``from_pretrained``: an empty tensor on the device, then the model's ``_init_weights`` of the
    owning module (it recomputes rotary ``inv_freq`` from the config). Only modules without
    parameters of their own are re-initialised, so no bound weight is ever overwritten."""
    import torch

    pending: dict[int, tuple[Any, list[str]]] = {}
    for name, s in slots.items():
        if s.kind != "buffer" or s.persistent or name in given:
            continue
        buf = s.module._buffers[s.local]
        if buf is None or not buf.is_meta:
            continue
        pending.setdefault(id(s.module), (s.module, []))[1].append(name)
    init = getattr(module, "_init_weights", None)
    failed = []
    for mod, names in pending.values():
        if init is None or any(p is not None for p in mod._parameters.values()):
            failed.extend(names)
            continue

        def initialised_from(fill: int) -> None:
            for n in names:
                s = slots[n]
                b = s.module._buffers[s.local]
                fresh = torch.empty(b.shape, dtype=b.dtype, device=str(device))
                fresh.fill_(float("nan") if fresh.is_floating_point() else fill)  # an init that skips it shows
                s.module._buffers[s.local] = fresh
            with torch.no_grad():
                init(mod)

        def buffer(n: str):
            return slots[n].module._buffers[slots[n].local]

        initialised_from(0)
        # an int or bool buffer (position_ids) has no value free for a marker: the init runs from two
        # fills and must give the same (one that skipped it had been reported recomputed, holding
        # whatever torch.empty found)
        first = {n: buffer(n).clone() for n in names if not buffer(n).is_floating_point()}
        if first:
            initialised_from(1)
        for n in names:
            b = buffer(n)
            if bool(torch.isnan(b).any()) if b.is_floating_point() else not torch.equal(b, first[n]):
                failed.append(n)
            else:
                report.recomputed.append(n)
    if failed and strict:
        raise LayoutError(
            f"cannot recompute non-persistent buffer(s) {', '.join(failed)} of {type(module).__name__} on {device}: "
            "they are in no checkpoint and the model's _init_weights does not set them; pass buffers={name: tensor}")
    report.missing.extend(failed)


__all__ = ["BindReport", "bind"]
