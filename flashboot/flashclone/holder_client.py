"""The engine side of the holder (:mod:`flashboot.flashclone.holder`): hand an arena over, find,
map and release what is held."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import Any

from ..errors import ArenaError, FlashBootError, WaitTimeoutError
from ..fileio import lock_signer
from ..procfs import STOPPED, process_state
from .holder_refit import HeldAs, link, made_of, write_refit
from .holder_registry import (DEFAULT_TIMEOUT_S, HOLDER_PROTOCOL, REQUESTS, _check_name, _DirKV, _kv, holder_gone,
                              protocol_refused)


def hand_over(arena, name: str, *, registry=None, store=None, timeout_s: float = DEFAULT_TIMEOUT_S,
              image: dict | None = None, **store_options):
    """Ask the holder to keep ``arena`` under ``name``; returns the holder's descriptor once it has
    mapped it (after which this process may exit). From then on ``arena.sleep()`` is refused,
    naming the holder. WaitTimeoutError when no holder answers within ``timeout_s``; ArenaError
    when the holder could not adopt it. ``image``: what the weights are (a JSON-ready dict,
    :func:`flashboot.flashload.restart.image_identity`), published with the held arena."""
    from ..arena import ArenaDescriptor
    from ..units import check_timeout

    _check_name(name)
    check_timeout(timeout_s, "hand_over timeout_s")  # NaN: no deadline is ever reached, a wait for no holder never ended
    image = _json_image(image)
    # a store that does not answer is bounded by the same timeout, not the store's 30 s default
    kv = _kv(registry, store, **({"timeout_s": timeout_s, **store_options} if store is not None else store_options))
    try:
        request = secrets.token_hex(8)
        deadline = time.monotonic() + timeout_s
        _ask(kv, name, {"descriptor": arena.export().to_dict(), "request": request, "pid": os.getpid(),
                        "image": image, "protocol": HOLDER_PROTOCOL}, deadline, timeout_s)
        delay = 0.001
        while True:
            held = kv.get("held", name)
            if held is not None and held.get("request") == request:
                if "error" in held:
                    raise ArenaError(f"the holder ({kv.where()}) could not adopt {name!r}: {held['error']}")
                arena.share(f"holder {name!r} ({kv.where()})")  # its sleep would free nothing the holder maps
                # an in-place refit writes the holder's memory from now on: it records what it made of it
                where = {"registry": os.fspath(registry)} if registry is not None else \
                    {"store": store, **{k: v for k, v in store_options.items() if k != "timeout_s"}}
                held_as = HeldAs(name, where, request)
                link(arena, held_as)
                made = made_of(arena)
                if made is not None:  # refit before this hand-over: a restart must not take it for the image
                    try:
                        write_refit(held_as, made, timeout_s)
                    except FlashBootError as exc:
                        raise ArenaError(f"the holder ({kv.where()}) holds {name!r} now, but what refits made of "
                                         f"its bytes ({_made_text(made)}) could not be recorded beside it: {exc}; "
                                         f"a restart would take them for the image's: release it (`flashboot hold "
                                         f"--release {name}`) and hand it over again") from exc
                return ArenaDescriptor.from_dict(held["descriptor"])
            failed = held.get("failed") if held is not None else None
            if isinstance(failed, dict) and failed.get("request") == request:  # the arena held before stays
                raise ArenaError(f"the holder ({kv.where()}) could not adopt {name!r}: {failed.get('error')} (it keeps "
                                 f"the arena it held as {name!r} before)")
            if held is not None and held.get("replaces") == request:  # answered, then that answer replaced
                raise ArenaError(f"the holder ({kv.where()}) took {name!r} and then, before this engine looked, "
                                 f"another engine's (pid {held.get('engine_pid', '?')}) hand-over under that name in "
                                 f"its place: two engines hand over as {name!r} (give each its own name)")
            if time.monotonic() > deadline:
                _withdraw(kv, name, request)
                raise WaitTimeoutError(f"no holder adopted {name!r} within {timeout_s:g} s ({kv.where()}); "
                                       + (_holder_fate(kv) or "is `flashboot hold` running there?"))
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        kv.close()


def _made_text(state: dict) -> str:
    torn = state.get("torn")
    return (f"torn, versions {', '.join(map(str, torn['versions']))} mixed" if torn else f"version {state['version']}")


def _json_image(image):
    """``image`` as the request carries it (paths as strings); FlashBootError naming what is not a
    JSON-ready dict: a Path had been a raw TypeError from the request's JSON."""
    import json

    if image is None:
        return None
    if not isinstance(image, dict):
        raise FlashBootError(f"hand_over image= takes a dict of what the weights are (see "
                             f"flashboot.flashload.restart.image_identity) or None, got {type(image).__name__} "
                             f"{str(image)[:200]!r}")
    image = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in image.items()}
    try:
        json.dumps(image, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FlashBootError(f"hand_over image= must hold JSON values (str, int, float, bool, None, lists, dicts): "
                             f"{exc}") from None
    return image


def _ask(kv, name: str, body: dict, deadline: float, timeout_s: float) -> None:
    """Ask the holder once no other request under ``name`` is pending (one at a time: two engines
    handing over under one name at once had replaced each other's request, and the one replaced
    waited out its whole timeout, asked whether a holder ran at all). WaitTimeoutError naming the
    pending request's engine when it is not taken by ``deadline``."""
    delay, announce = 0.001, True
    while True:
        pending = kv.put_request(name, body, announce)
        if pending is None:
            return
        announce = False
        if time.monotonic() > deadline:
            what = "a release" if pending.get("op") == "release" else "a hand-over"
            raise WaitTimeoutError(
                f"could not ask the holder ({kv.where()}) about {name!r} within {timeout_s:g} s: {what} of that name "
                f"by pid {pending.get('pid', '?')} stayed pending, not taken; "
                + (_holder_fate(kv) or "is `flashboot hold` running there?"))
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _withdraw(kv, name: str, request: str) -> None:
    """Remove this engine's request ``name`` if it is still pending (not another's made since)."""
    with contextlib.suppress(FlashBootError):  # the wait's timeout is what the engine is told
        pending = kv.get(REQUESTS, name)
        if pending is not None and pending.get("request") == request:
            kv.delete(REQUESTS, name)


def _holder_fate(kv) -> str:
    """What became of a registry's holder, for a wait that ran out (its lock file names its pid):
    exited (killed: the engine had been asked whether one runs at all), stopped, or '' (running,
    or not known). A store's: none of this protocol when no holder holds its lease."""
    if not isinstance(kv, _DirKV):
        with contextlib.suppress(FlashBootError):  # the wait's timeout is what the engine is told
            gen = kv.rdv.add("hold/holder/gen", 0)
            if gen == 0 or kv.rdv.has(f"hold/holder/{gen}/free"):
                return (f"no holder of holder protocol {HOLDER_PROTOCOL} serves it (none holds its lease; a holder of an "
                        "older FlashBoot takes none, and does not see this FlashBoot's requests): start this "
                        "FlashBoot's `flashboot hold --store`")
        return ""
    pid = lock_signer(kv.path / kv.LOCK)
    state = process_state(pid) if pid.isdigit() else None
    if state in STOPPED:
        return f"its holder (pid {pid}) is stopped (process state {state}): resume it (kill -CONT) or restart it"
    older = _older_holder(kv)
    if older:
        return older
    if state == "X":
        return f"its holder (pid {pid}) has exited: start `flashboot hold --registry {kv.path}` again"
    return ""


def _older_holder(kv) -> str:
    """The running holder of another protocol whose records a registry holds (it does not look where
    this FlashBoot's engines ask), or ''."""
    for name in kv.names("held"):
        try:
            record = kv.get("held", name)
        except FlashBootError:  # one bad file: the others still tell
            continue
        if record and "descriptor" in record and holder_gone(record) is None and protocol_refused(record):
            return (f"pid {record.get('holder_pid')}, a holder of holder protocol {record.get('protocol', 1)!r}, keeps "
                    f"{name!r} here and does not see this FlashBoot's requests (holder protocol {HOLDER_PROTOCOL}): "
                    f"stop it and start this FlashBoot's `flashboot hold --registry {kv.path}`")
    return ""



def held_record(name: str, *, registry=None, store=None, **store_options) -> dict | None:
    """The holder's whole record for ``name`` (descriptor, image, since, holder_pid; or the error
    of a failed adoption), None when nothing is held under it."""
    _check_name(name)
    kv = _kv(registry, store, create=False, **store_options)
    try:
        return kv.get("held", name)
    finally:
        kv.close()


def held_descriptor(name: str, *, registry=None, store=None, **store_options):
    """The descriptor the holder publishes for ``name``; ArenaError when nothing is held under it."""
    from ..arena import ArenaDescriptor

    _check_name(name)
    kv = _kv(registry, store, create=False, **store_options)
    try:
        held = kv.get("held", name)
        if held is None or "descriptor" not in held:
            raise ArenaError(f"no arena is held as {name!r} in {kv.where()}"
                             + (f" (last adoption failed: {held['error']})" if held and "error" in held else ""))
        gone = holder_gone(held)
        if gone is not None:  # its fds, taken by pid, would be nothing, or another process's
            raise ArenaError(f"the arena held as {name!r} in {kv.where()} is gone: {gone}")
        refused = protocol_refused(held)
        if refused is not None:  # an older holder's record: served beside this FlashBoot's, it had been used unsaid
            raise ArenaError(f"the arena held as {name!r} in {kv.where()} is refused: {refused}")
        return ArenaDescriptor.from_dict(held["descriptor"])
    finally:
        kv.close()


def open_held(name: str, device: Any = None, *, registry=None, store=None, **store_options):
    """Map the arena held as ``name`` (the same memory, no copy). ``device`` as for
    :meth:`flashboot.Arena.open` (default: where it lives). ArenaError when it is not held or the
    holder has exited."""
    from ..arena import Arena

    desc = held_descriptor(name, registry=registry, store=store, **store_options)
    if desc.backend == "host":
        return Arena.open(desc)
    return Arena.open(desc, device)


def release(name: str, *, registry=None, store=None, timeout_s: float = DEFAULT_TIMEOUT_S, **store_options) -> None:
    """Ask the holder to drop ``name`` and wait until it has. WaitTimeoutError if it does not;
    ArenaError when nothing holds ``name`` (or its holder has exited)."""
    from ..units import check_timeout

    _check_name(name)
    check_timeout(timeout_s, "release timeout_s")  # NaN had waited forever for a holder that is not there
    # the store's connect is bounded by the same timeout, not the store's 30 s default
    kv = _kv(registry, store, create=False,
             **({"timeout_s": timeout_s, **store_options} if store is not None else store_options))
    try:
        # a name nothing holds had returned at once, as if released: a typo went unnoticed
        held = kv.get("held", name)
        if held is None:
            raise ArenaError(f"nothing is held as {name!r} in {kv.where()}")
        gone = holder_gone(held) if "descriptor" in held else None
        if gone is not None:  # no holder will answer the request: the wait had run out blaming it
            raise ArenaError(f"{name!r} is held no more in {kv.where()}: {gone}, and its memory went with it")
        refused = protocol_refused(held) if "descriptor" in held else None
        if refused is not None:  # that holder does not look where this FlashBoot asks: the wait had run out
            raise ArenaError(f"{name!r} in {kv.where()} is not released: {refused} (release it with that "
                             "FlashBoot's `flashboot hold --release`)")
        deadline = time.monotonic() + timeout_s
        _ask(kv, name, {"op": "release", "request": secrets.token_hex(8), "pid": os.getpid(),
                        "protocol": HOLDER_PROTOCOL}, deadline, timeout_s)
        while kv.get("held", name) is not None:
            if time.monotonic() > deadline:
                fate = _holder_fate(kv)
                raise WaitTimeoutError(f"the holder did not release {name!r} within {timeout_s:g} s ({kv.where()})"
                                       + (f"; {fate}" if fate else ""))
            time.sleep(0.01)
    finally:
        kv.close()


def list_held(registry) -> dict[str, dict]:
    """``name -> record`` of everything held in a registry directory."""
    kv = _DirKV(registry, create=False)
    return {n: kv.get("held", n) for n in kv.names("held")}


__all__ = ["hand_over", "held_descriptor", "held_record", "list_held", "open_held", "release"]
