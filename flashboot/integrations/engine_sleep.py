"""Engine weights that stay: an engine's sleep of its weights handed to FlashBoot's sleep and wake.

SGLang's memory saver (``torch_memory_saver``) and vLLM's sleep mode (``CuMemAllocator``) release
what torch allocated through their hooked allocators. FlashBoot's weights are one VMM arena made
through the driver, which neither sees. So the loader, after binding, hands its weights over here
(:func:`stay`), and each engine's own per-tag dispatch calls in for its ``weights`` tag:

* SGLang: ``release_memory_occupation`` / ``resume_memory_occupation`` pause and resume the tag
  through the scheduler's memory-saver adapter; :mod:`flashboot.integrations.sglang` wraps the
  adapters' ``pause``/``resume`` for the ``weights`` tag.
* vLLM: ``sleep(level)`` / ``wake_up(tags)`` reach the worker's sleep-mode backend;
  :mod:`flashboot.integrations.vllm` registers the ``flashboot`` backend.

:func:`sleep_engine_weights` is :meth:`LoadedImage.sleep <flashboot.flashload.report.LoadedImage.sleep>`
(level 1: a pinned backup in this process; level 2: nothing kept) of every arena handed over in
this process, and :func:`wake_engine_weights` is its wake (from the backup, the preloader daemon
or the disk, the report naming which): every view keeps its address, so the model's parameters
and any CUDA graph captured over them stay valid, and a level-2 wake brings the image's bytes
back without the engine reloading anything. The KV cache and everything else the engines
allocate stay with their own mechanism. Nothing here imports an engine.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from flashboot.errors import CapabilityError, FlashBootError

from .engine_key import LoaderOptions

logger = logging.getLogger("flashboot.integrations")

SLEEP_LEVELS = (1, 2)
WEIGHTS_TAG = "weights"
"""The memory tag both engines give their weights."""


@dataclass
class _Staying:
    """One arena handed over: the weights (weakly: the engine's model owns them) and where the
    preloader stages (for a wake from its pinned copy)."""

    weights: weakref.ref
    shm_dir: str | None

    def alive(self):
        weights = self.weights()
        return weights if weights is not None and not weights.arena.closed else None


_lock = threading.Lock()
_staying: list[_Staying] = []


def memory_saver_policy(enabled: bool, flag: str, options: LoaderOptions) -> bool:
    """Before loading: whether the weights will be handed to FlashBoot's sleep (:func:`stay`).

    ``memory_saver="sleep"`` (default): yes, for an image load; a clone (``seed_store``: no image
    to wake from), a published seed (``publish_store``: clones map the arena) or an arena kept by a
    holder (``holder``: the holder maps it) cannot, which is
    a CapabilityError naming ``flag`` when the engine's memory saver / sleep mode is on (and
    False otherwise). ``"resident"``: no; the arena stays resident when the engine pauses its
    weights (a warning when ``flag`` is on). ``"refuse"``: CapabilityError naming ``flag`` when it
    is on.
    """
    if options.memory_saver == "refuse":
        if enabled:
            raise CapabilityError(f"{flag} is on and the flashboot option memory_saver is 'refuse'; pass "
                                  "'\"memory_saver\": \"sleep\"' (FlashBoot puts the weights to sleep) or \"resident\"")
        return False
    if options.memory_saver == "resident":
        if enabled:
            logger.warning("flashboot: %s is on; the weight arena stays resident when the engine pauses its weights "
                           "(memory_saver=resident)", flag)
        return False
    why_not = ("the weights are cloned from a seed (seed_store): there is no image to wake them from"
               if options.seed_store is not None else
               "the arena is published as a FlashClone seed (publish_store): clones map it"
               if options.publish_store is not None else
               "the arena is kept by a holder across restarts (holder): the holder maps it"
               if options.holder is not None else None)
    if why_not is None:
        return True
    if enabled:
        raise CapabilityError(f"{flag} is on, but FlashBoot cannot put these weights to sleep: {why_not}. Start the "
                              f"engine without {flag}, or pass '\"memory_saver\": \"resident\"' in "
                              "--model-loader-extra-config to keep them resident across pauses.")
    return False


def stay(weights, *, shm_dir: str | None = None) -> None:
    """Hand ``weights`` (an image load's :class:`~.engine_bind.EngineWeights`) to the engine's
    sleep and wake in this process, for as long as they are open. ``shm_dir``: the preloader's
    staging root, for a wake from its pinned copy. A clone's weights are refused
    (CapabilityError: nothing to wake them from)."""
    if not hasattr(weights.handle, "sleep"):
        raise CapabilityError(f"{weights.how} weights cannot sleep: only an image load has a source to wake from")
    with _lock:
        _staying[:] = [s for s in _staying if s.alive() is not None]
        _staying.append(_Staying(weakref.ref(weights), shm_dir))


def _alive() -> list[tuple[Any, _Staying]]:
    with _lock:
        return [(w, s) for s in _staying for w in (s.alive(),) if w is not None]


def staying_weights() -> list:
    """The open weights handed over in this process, in the order they were."""
    return [w for w, _ in _alive()]


def sleep_engine_weights(level: int) -> list:
    """Put every arena handed over in this process to sleep: ``level`` 1 (pinned backup first) or 2
    (nothing kept). Returns their SleepReports (level 0 for one already asleep, except 2 for one a level-2 sleep freed the
    level-1 backup of). All or none: if
    one arena's sleep raises, the arenas this call put to sleep (that one too, where its copy out
    failed after its release had begun) are woken again before the error is raised, so the engine
    that is told the pause failed runs on whole weights; a note on the error says so, or names the
    arenas a wake could not bring back."""
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise FlashBootError(f"sleep level must be 1 (keep a host backup) or 2 (keep nothing), got {level!r}")
    reports, slept = [], []
    for weights, staying in _alive():
        was_asleep = weights.arena.asleep
        try:
            report = weights.handle.sleep(level)
        except BaseException as exc:
            if not was_asleep and weights.arena.asleep:  # a copy out failed part-way: it slept without its bytes
                slept.append((weights, staying))
            _wake_again(slept, exc)
            raise
        logger.info("flashboot: %s", report.summary())
        reports.append(report)
        if not was_asleep:  # one asleep before this call stays asleep (level 2 may have freed its backup)
            slept.append((weights, staying))
    return reports


def _wake_again(slept: list, exc: BaseException) -> None:
    """Wake the arenas an engine-wide sleep had put to sleep when a later one failed; notes on
    ``exc`` say what happened to them."""
    stuck, reverted = [], []
    for weights, staying in slept:
        try:
            report = weights.handle.wake(shm_dir=staying.shm_dir)
        except BaseException as again:  # noqa: BLE001 - named on the error being raised
            stuck.append(f"{weights.arena.nbytes:,}-byte arena {weights.arena.arena_id} ({type(again).__name__}: "
                         f"{again})")
            continue
        lost = report.details.get("refit_version_lost")
        if lost is not None:  # woken from the image: a refit's bytes were not kept (level 2)
            reverted.append(f"arena {weights.arena.arena_id} is back at the image's version, not refit version {lost}")
    if stuck:
        exc.add_note(f"the sleep failed after {len(slept)} arena(s) had gone to sleep; woken again: "
                     f"{len(slept) - len(stuck)}; still asleep: {'; '.join(stuck)}")
    elif slept:
        exc.add_note(f"the {len(slept)} arena(s) this sleep had put to sleep before it failed were woken again")
    if reverted:
        exc.add_note(f"refit again: {'; '.join(reverted)}")


def wake_engine_weights() -> list:
    """Wake every arena handed over in this process at its addresses, from the first source that
    has its bytes (backup, served, disk). Returns their WakeReports (source ``awake`` for one
    already awake). Raises OutOfMemoryError / FlashBootError as :meth:`LoadedImage.wake` does:
    that arena and those after it stay asleep and a later wake retries them (the ones woken
    before it stay awake); a note on the error counts both."""
    reports = []
    alive = _alive()
    for k, (weights, staying) in enumerate(alive):
        try:
            report = weights.handle.wake(shm_dir=staying.shm_dir)
        except BaseException as exc:
            exc.add_note(f"{k} of the {len(alive)} arena(s) are awake; arena {weights.arena.arena_id} and the "
                         f"{len(alive) - k - 1} after it stay asleep until a wake succeeds")
            raise
        logger.info("flashboot: %s", report.summary())
        reports.append(report)
    return reports


def check_awake(model: Any, what: str, error: type[FlashBootError] = FlashBootError) -> None:
    """Refuse ``what`` (raising ``error``) on a model whose FlashBoot weights are asleep (its views
    are unmapped)."""
    weights = getattr(model, "_flashboot_weights", None)
    if weights is not None and not weights.arena.closed and weights.arena.asleep:
        raise error(f"{what}: the model's {weights.arena.nbytes:,}-byte weight arena is asleep; wake its "
                             f"weights first (SGLang: resume_memory_occupation(tags=['{WEIGHTS_TAG}']); vLLM: "
                             f"wake_up(tags=['{WEIGHTS_TAG}']))")


__all__ = ["SLEEP_LEVELS", "WEIGHTS_TAG", "check_awake", "memory_saver_policy", "sleep_engine_weights", "stay",
           "staying_weights", "wake_engine_weights"]
