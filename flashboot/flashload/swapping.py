"""Two images trade the device: :func:`swap` puts the outgoing one to sleep and wakes the
incoming one, by default with the outgoing image's segments handed to the incoming one (no
memory freed or allocated), else releasing them during, after or before the incoming copy. Each
side is :mod:`flashboot.flashload.lifecycle`'s sleep and wake, under both images' locks; a swap
that fails wakes the outgoing image again."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from ..errors import FlashBootError
from .lifecycle import (SleepReport, WakeReport, _backup_for, _check_wake_options, _closed, _copy, _refit_named, _sleep,
                        _state, _synchronize, wake)

SWAP_WAKE_OPTIONS = ("source", "keep_backup", "shm_dir", "served_timeout_s", "stream_config", "verify")
"""The options of :func:`wake` that :func:`swap` passes on to the incoming image's."""
SWAP_RELEASES = ("handover", "during", "after", "before")
"""How :func:`swap` gives the outgoing image's memory up: its segments handed to the incoming
image (no memory freed or allocated), or released during, after or before the incoming copy."""


@dataclass
class SwapReport:
    """One :func:`swap`: the outgoing image's ``sleep`` and the incoming one's ``wake`` reports;
    ``released``: how the outgoing memory was given up (one of :data:`SWAP_RELEASES`), and
    ``why`` when that is not what was asked; ``total_ms``."""

    sleep: SleepReport
    wake: WakeReport
    released: str
    why: str = ""
    total_ms: float = 0.0

    def to_dict(self) -> dict:
        return {"sleep": self.sleep.to_dict(), "wake": self.wake.to_dict(), "released": self.released,
                "why": self.why, "total_ms": self.total_ms}


def _why_no_handover(outgoing, incoming) -> str:
    """Why ``incoming`` cannot take ``outgoing``'s segments ("" when it can)."""
    a, b = outgoing.arena, incoming.arena
    if not (a.device.is_cuda and b.device.is_cuda):
        return "the host backend's segments are memfds named after their arena (importers check it)"
    if a.home_device != b.home_device or a.segment_bytes != b.segment_bytes:
        return (f"the outgoing arena has {a.segment_bytes:,}-byte segments on {a.home_device}, the incoming one "
                f"{b.segment_bytes:,}-byte segments on {b.home_device}")
    return ""


def _handover_sleep(outgoing, level: int) -> SleepReport:
    """The outgoing side of a handover before the incoming wake takes its segments: level 1's
    backup (one bulk D2H: the segments stay mapped until the incoming arena takes them)."""
    arena = outgoing.arena
    report = SleepReport(level=level, nbytes=outgoing.nbytes, device=str(arena.device))
    if level == 1:
        backup = _backup_for(outgoing, report)
        t0 = time.perf_counter()
        _copy(backup.span(outgoing.nbytes), arena.span(0, outgoing.nbytes), arena.device)
        report.backup_ms = (time.perf_counter() - t0) * 1e3
    else:
        _state(outgoing).drop_backup()
    outgoing.release_refit_sources()  # as a sleep does: the trainer's arena would keep its memory in use
    return report


def _check_can_sleep(arena) -> None:
    """ArenaError before anything moves where ``arena``'s sleep would be refused (an importer, or
    shared with a holder): release="after" had woken the incoming image first and then raised,
    leaving both awake."""
    if not arena.asleep:
        arena.check_can_sleep()


def _wake_outgoing_again(outgoing, exc: BaseException, wake_options: dict) -> None:
    """Wake ``outgoing`` after the incoming wake of a :func:`swap` failed; a note on ``exc`` says
    from where, or why it could not be."""
    options = {k: v for k, v in wake_options.items() if k in ("shm_dir", "served_timeout_s", "stream_config")}
    try:
        report = wake(outgoing, **options)
    except Exception as again:  # noqa: BLE001 - named on the error being raised
        exc.add_note(f"the outgoing image {outgoing!r} could not be woken again and stays asleep: "
                     f"{type(again).__name__}: {again}")
        return
    lost = report.details.get("refit_version_lost")
    exc.add_note(f"the outgoing image {outgoing!r} was woken again, from {report.source}"
                 + (f"; its {_refit_named(lost)} is lost (the image's weights are back): refit again" if lost else ""))


def swap(outgoing, incoming, *, level: int = 2, release: str = "handover", **wake_options) -> SwapReport:
    """Put ``outgoing`` to sleep (``level``) and wake ``incoming`` (``wake_options`` as :func:`wake`).

    The outgoing model's work on the device is waited for first. ``release``: how the outgoing
    memory goes. ``"handover"`` (the default): the incoming arena takes the outgoing one's
    segments as it wakes (:meth:`Arena.wake`'s ``donor``), so nothing is freed or allocated and
    the driver's work on freed memory (~25 ms of the copy engine per 14 GB on an H200) does not
    slow the incoming copy; on the host backend, or between arenas of other devices or segment
    sizes, it is ``"before"`` and the report says why. Where the device has room for
    ``incoming``'s arena beside the outgoing one: ``"during"`` the incoming copy (:func:`wake`'s
    ``meanwhile``), ``"after"`` it, or ``"before"`` the wake (the plain sleep-then-wake); without
    that room it is ``"before"``, and the report says why. Errors as :func:`sleep` and
    :func:`wake`, the wake options checked before anything moves; when the wake fails,
    ``incoming`` stays asleep and ``outgoing``, if its sleep had run or its segments were handed
    over, is woken again (from its backup at level 1, else the daemon or the disk; ``shm_dir``,
    ``served_timeout_s`` and ``stream_config`` as given): a note on the error says from where, or
    why it could not be and stays asleep (:attr:`Arena.asleep` tells).
    """
    if release not in SWAP_RELEASES:
        raise FlashBootError(f"unknown swap release {release!r}; known: {', '.join(SWAP_RELEASES)}")
    if type(level) is not int or level not in (1, 2):  # True == 1, but is no level
        raise FlashBootError(f"sleep level must be 1 (keep a host backup) or 2 (keep nothing), got {level!r}")
    if outgoing is incoming:
        raise FlashBootError(f"swap needs two images; {outgoing!r} was given as both")
    with contextlib.ExitStack() as held:
        for state in sorted((_state(outgoing), _state(incoming)), key=id):  # one order: two swaps cannot deadlock
            held.enter_context(state.lock)
        return _swap(outgoing, incoming, level, release, wake_options)


def _swap(outgoing, incoming, level: int, release: str, wake_options: dict) -> SwapReport:
    """:func:`swap`, under both images' lifecycle locks."""
    from ..pinning import device_free_bytes

    for what, loaded in (("outgoing", outgoing), ("incoming", incoming)):
        if _closed(loaded):
            raise FlashBootError(f"{what} {loaded!r} is closed; there is nothing to swap")
    # before anything moves: a misspelt or bad wake option had been refused by the incoming wake,
    # after the outgoing image had gone to sleep (release="before")
    unknown = sorted(set(wake_options) - set(SWAP_WAKE_OPTIONS))
    if unknown:
        raise FlashBootError(f"unknown swap option(s) {unknown}; known: level, release, {', '.join(SWAP_WAKE_OPTIONS)}")
    _check_wake_options(**wake_options)
    _check_can_sleep(outgoing.arena)
    t0 = time.perf_counter()
    _synchronize(outgoing.arena.device)  # the outgoing model's kernels end before its memory goes
    slept: list[SleepReport] = []

    def release_outgoing() -> None:
        slept.append(_sleep(outgoing, level, synchronize=False))

    incoming_arena = incoming.arena
    need = incoming_arena.nbytes if incoming_arena.asleep else 0
    asleep_already = ("the outgoing image is asleep already" if outgoing.arena.asleep else
                      "the incoming image is awake already" if not need else "")
    if release == "handover":
        why = asleep_already or _why_no_handover(outgoing, incoming)
    else:
        free = device_free_bytes(incoming_arena.device)
        why = "" if release == "before" else asleep_already or (
            f"{incoming_arena.device} has {free:,} bytes free; the incoming arena needs {need:,} beside the outgoing "
            "one's" if need > free else "")
    released = "before" if why else release
    serving = not outgoing.arena.asleep
    try:
        if released == "handover":
            kept = _state(outgoing).backup
            handing = _handover_sleep(outgoing, level)
            try:
                woke = wake(incoming, _donor=outgoing.arena, **wake_options)
            except BaseException:
                if not outgoing.arena.asleep and _state(outgoing).backup is not kept:
                    # the wake failed before it took the segments: the outgoing image serves on, and
                    # had kept the backup of its whole size (pinned) taken for a sleep that never came
                    _state(outgoing).drop_backup()
                raise
            _state(outgoing).level = level
            parts = woke.details.get("wake", {})
            handing.release_ms = parts.get("donor_ms", 0.0)
            handing.release_parts = {"donor_ms": handing.release_ms}
            handing.total_ms = handing.backup_ms + handing.release_ms
            slept.append(handing)
        else:
            if released == "before":
                release_outgoing()
            woke = wake(incoming, meanwhile=release_outgoing if released == "during" else None, **wake_options)
            if released == "after":
                release_outgoing()
    except Exception as exc:
        if serving and outgoing.arena.asleep and incoming.arena.asleep:
            _wake_outgoing_again(outgoing, exc, wake_options)  # the failed swap had left neither image awake
        raise
    return SwapReport(sleep=slept[0], wake=woke, released=released, why=why, total_ms=(time.perf_counter() - t0) * 1e3)


__all__ = ["SWAP_RELEASES", "SWAP_WAKE_OPTIONS", "SwapReport", "swap"]
