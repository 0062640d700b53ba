"""What an in-place refit made of a held arena's bytes: the weights' version, beside the holder's
record of the arena (:mod:`flashboot.flashclone.holder`).

An arena handed to the holder, or opened from it, is the holder's memory: an in-place refit
(:func:`flashboot.weight_update.refit` with ``atomic=False``; an atomic one cannot remap a shared
arena) writes the bytes a restarted engine binds. The held record names the image they were
loaded from; this record says what refits made of them since. Without it a restart bound a refit
version's bytes, or a failed refit's mix, as the image's (``loaded.version`` 0, mode ``held``).
Its body mirrors the engine's ``loaded.version`` / ``loaded.refit_torn``:

* ``{"version": N, "manifest": {...}}``: refit version N, whole; ``manifest``: its publish's
  (:class:`~flashboot.flashclone.manifest.Manifest`, with its chunk checksums), for a restart
  that verifies;
* ``{"torn": {"last_whole": X, "versions": [X, ..., N], "error": ...}}``: a refit to N began to
  write and did not finish. The engine writes it before the refit's first write, so one that
  stays so is an engine killed mid-copy.

It lives beside the held record (a registry's ``refit/NAME.json``, a store's ``hold/refit/NAME``,
signed with the token like the others) and names the adoption it is about (the held record's
``request``): one left from an arena held under the name before is not this arena's. The engine
writes it itself, at once: through the holder's request queue the torn mark could not be known
to be down before the first write. The holder removes it with the arena.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass

from ..errors import FlashBootError
from .holder_registry import DEFAULT_TIMEOUT_S, HOLDER_PROTOCOL, REFIT, _check_name, _kv


@dataclass
class HeldAs:
    """An arena this process maps is held as ``name`` (``where``: ``registry=`` or ``store=`` and
    the store's options), by the adoption that answered ``request``."""

    name: str
    where: dict
    request: str
    state: dict | None = None
    """What the refit record says (as this process last wrote or read it); None: the image's bytes."""
    gone: bool = False
    """The holder keeps the arena under ``name`` no more (released, or another arena in its place)."""

    def describe(self) -> str:
        return f"held as {self.name!r} ({_describe(self.where)})"


_LINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def link(arena, held: HeldAs) -> None:
    """Note that ``arena``'s memory is held as ``held`` (one held under the same name and place
    before is replaced)."""
    with _GUARD:
        others = [h for h in _LINKS.get(arena, []) if (h.name, h.where) != (held.name, held.where)]
        _LINKS[arena] = [*others, held]


_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def remember(arena, state: dict | None) -> None:
    """Note what refits made of ``arena``'s bytes in this process (a state as :func:`write_refit`
    takes; None: the image's), so that a later hand-over records it (:func:`made_of`)."""
    with _GUARD:
        if state is None:
            _MADE.pop(arena, None)
        else:
            _MADE[arena] = state


def made_of(arena) -> dict | None:
    """What refits made of ``arena``'s bytes (:func:`remember`); None: the image's bytes."""
    with _GUARD:
        return _MADE.get(arena)


def links(arena) -> list[HeldAs]:
    """Where ``arena``'s memory is held (empty: nowhere this process knows of)."""
    with _GUARD:
        return [h for h in _LINKS.get(arena, []) if not h.gone]


def read_refit(name: str, request, **where) -> dict | None:
    """The refit record of the arena held as ``name`` by the adoption of ``request``, checked
    (:func:`check_state`); None when no refit wrote into it. FlashBootError when it cannot be
    read or is malformed."""
    _check_name(name)
    kv = _kv(**where, create=False)
    try:
        record = kv.get(REFIT, name)
    finally:
        kv.close()
    if record is None or record.get("request") != request:  # another adoption's: not this arena's bytes
        return None
    return check_state({k: record[k] for k in ("version", "manifest", "torn") if k in record},
                       f"{REFIT}/{name} in {_describe(where)}")


def write_refit(held: HeldAs, state: dict | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Record ``state`` for the arena ``held`` (None: the image's bytes again, the record removed);
    FlashBootError when it cannot be written. Nothing is written once the holder keeps another
    arena under the name, or none (``held.gone``): the record of the one it keeps now is not this
    one's to replace."""
    where = dict(held.where)
    if "store" in where:  # bounded by the caller's timeout, not the store's default
        where.setdefault("timeout_s", timeout_s)
    kv = _kv(**where)
    try:
        record = kv.get("held", held.name)
        if record is None or "descriptor" not in record or record.get("request") != held.request:
            held.gone = True
            return
        if state is None:
            kv.delete(REFIT, held.name)
        else:
            kv.put(REFIT, held.name, {**state, "request": held.request, "engine_pid": os.getpid(), "at": time.time(),
                                      "protocol": HOLDER_PROTOCOL})
    finally:
        kv.close()
    held.state = state


def check_state(state: dict, where: str) -> dict:
    """``state`` (a refit record's ``version``/``manifest`` or ``torn``) when well-formed, else
    FlashBootError naming the field: a restart must not guess what the bytes are."""
    def bad(what: str) -> FlashBootError:
        return FlashBootError(f"{where}: malformed refit record ({what}): what the held bytes are is not known")

    def version(v) -> bool:
        return type(v) is int and v >= 0

    if "torn" in state:
        torn = state["torn"]
        if not (isinstance(torn, dict) and version(torn.get("last_whole")) and isinstance(torn.get("versions"), list)
                and torn["versions"] and all(map(version, torn["versions"])) and isinstance(torn.get("error"), str)):
            raise bad(f"torn: {str(torn)[:200]}")
        return {"torn": {k: torn[k] for k in ("last_whole", "versions", "error")}}
    if not version(state.get("version")):
        raise bad(f"version: {state.get('version')!r}")
    manifest = state.get("manifest")
    if manifest is not None:
        from .manifest import Manifest

        try:
            Manifest.from_dict(manifest)
        except FlashBootError as exc:
            raise bad(f"manifest: {exc}") from None
    return {"version": state["version"], "manifest": manifest}


def _describe(where: dict) -> str:
    return f"registry {where['registry']!r}" if where.get("registry") is not None else f"store {where.get('store')}"


__all__ = ["HeldAs", "REFIT", "check_state", "link", "links", "made_of", "read_refit", "remember", "write_refit"]
