"""Refit inside an engine: a trainer's published weights into the arena the engine's model serves from.

The loaders bind every tensor of the engine's model to a view of one arena
(:func:`~.engine_bind.bind_engine_model`), so an update is :meth:`LoadedImage.refit
<flashboot.flashload.report.LoadedImage.refit>` of that arena (atomic by default: a remap under
the same addresses; the views, and any CUDA graph captured over them, stay valid), then the
post-load step the integration runs at load (vLLM: ``process_weights_after_loading`` under
``weights_already_processed``; SGLang: its repair of views taken at construction), passed in as
``reprocess``. The engine adapters route their weight-update entry points here
(:mod:`flashboot.integrations.vllm_weight_transfer`, :func:`flashboot.integrations.sglang.refit_weights`).

An engine image holds the engine's own post-processed tensors, so the trainer publishes them by
the engine's names (:func:`~flashboot.weight_update.plan.plan_engine_pack`); every rank of an
engine publishes under its own store namespace (:func:`refit_name`), so the ranks of a
tensor-parallel engine refit at once. Nothing here imports an engine.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from flashboot.errors import CapabilityError, LayoutError
from flashboot.weight_update import RefitError, RefitReport
from flashboot.weight_update.engine import check_refit_values
from flashboot.weight_update.publish import DEFAULT_NAME

from .engine_key import EngineKey
from .engine_sleep import check_awake

logger = logging.getLogger("flashboot.integrations")

REFIT_OPTIONS = ("atomic", "timeout_s", "schedule", "clones", "transport", "token_file", "chunk_bytes")
"""What an engine's update request may pass on to :func:`flashboot.weight_update.refit`."""


def refit_name(name: str, rank: int) -> str:
    """The publish name of one engine rank (each rank's version N is its own store namespace)."""
    return f"{name}-rank{rank}"


def engine_publisher(image: Any, rank: int = 0, *, store: str, name: str = DEFAULT_NAME, **options: Any):
    """The trainer's :class:`~flashboot.weight_update.Publisher` for rank ``rank`` of an engine
    image, publishing where the engine's update route looks (:func:`refit_name`). Its
    ``publish(tensors, version)`` takes the engine's tensors by the engine's names: every
    parameter, buffer and tensor attribute of the image (:func:`engine_tensors_to_publish`)."""
    from flashboot.weight_update import Publisher

    return Publisher(image, rank, store=store, name=refit_name(name, rank), **options)


def engine_tensors_to_publish(model, device: Any) -> Iterable[tuple[str, Any]]:
    """``(name, tensor)`` of every parameter and buffer of ``model`` (a model in the engine's
    layout: the engine's model class, or a trainer's copy of it) as the pre-pack dump names them;
    another name of the same tensor (tied weights) is given once. Tensor attributes (MLA's
    ``w_kc``) are left to the engine, which derives them after the copy."""
    from .engine_dump import collect_engine_tensors

    return [(name, t.tensor) for name, t in collect_engine_tensors(model, device, extras=False).tensors.items()]


def check_refit_options(options: Mapping[str, Any], what: str) -> dict:
    """``options`` as a dict after checking their names (:data:`REFIT_OPTIONS`) and values
    (:func:`~flashboot.weight_update.engine.check_refit_values`: an engine's update request is
    JSON, where ``"false"``, ``null`` or ``NaN`` would otherwise pass); RefitError otherwise."""
    unknown = sorted(set(options) - set(REFIT_OPTIONS))
    if unknown:
        raise RefitError(f"{what}: unknown refit option(s) {unknown}; known: {list(REFIT_OPTIONS)}")
    check_refit_values(what, **options)
    return dict(options)


def served_weights(model, what: str):
    """The :class:`~.engine_bind.EngineWeights` ``model`` serves from, refusing a model the
    flashboot loader did not load (CapabilityError), one whose weights were closed (RefitError)
    and one cloned from a seed (no image to refit under)."""
    weights = getattr(model, "_flashboot_weights", None)
    if weights is not None and weights.arena.closed:  # it was: "not loaded by the flashboot loader"
        raise RefitError(f"{what}: the weights of {type(model).__name__} were released (their arena is closed: "
                         "the engine shut down or closed them); nothing was copied")
    if weights is None:
        raise CapabilityError(f"{what}: {type(model).__name__} was not loaded by the flashboot loader (start the "
                              "engine with --load-format flashboot); its weights are not in a FlashBoot arena")
    if not hasattr(weights.handle, "refit"):
        raise CapabilityError(f"{what}: the weights were cloned from a seed ({weights.how}); a refit needs an image "
                              "load (its manifest is what the trainer publishes against)")
    return weights


def _tensor_attribute(model, name: str):
    module, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module), leaf)


def _post_process(model, weights, version: int, what: str, reprocess, derive, derived: list[str]) -> None:
    """Run the engine's post-processing of refitted bytes; a failure is a RefitError that says the
    bytes are live and how to finish (weights.post_refit_pending stays set)."""
    for step, run in (("reprocess", reprocess), ("derive", derive)):
        if run is None:
            continue
        views = {n: weights.tensors[n] for n in derived} if step == "derive" else {}
        try:
            run()
        except Exception as exc:
            raise RefitError(f"{what}: version {version}'s bytes are live but the engine's post-processing failed "
                             f"at {step} ({type(exc).__name__}: {exc}); the weights are not servable until it "
                             f"succeeds: refit to version {version} again to re-run it without copying, or reload "
                             "the engine") from exc
        moved = [n for n, view in views.items() if _tensor_attribute(model, n).data_ptr() != view.data_ptr()]
        if moved:  # served from outside the arena from now on: a sleep or the next refit would miss them
            weights.post_refit_pending = None  # a retry would replace them again: only a reload helps
            raise RefitError(f"{what}: version {version}'s post-processing replaced tensor attribute(s) {moved[:3]} "
                             "instead of writing into their arena views; the weights are version "
                             f"{version} but those tensors live outside the arena: reload the engine")


def refit_engine_model(model, store: str, version: int, *, what: str, name: str = DEFAULT_NAME,
                       reprocess: Callable[[], None] | None = None, derive: Callable[[], None] | None = None,
                       **options: Any) -> RefitReport:
    """Refit ``model`` (bound by a flashboot loader) to ``version`` as published at ``store`` for
    its image rank, then run ``reprocess`` (the integration's post-load step) and, when the
    trainer left tensor attributes to the engine (the record's ``refit_derived``: MLA's
    ``w_kc``/``w_vc``), ``derive``: the engine's own post-processing, which must write them into
    their arena views in place (SGLang's ``post_load_weights`` does: ``bind_or_assign``); a version
    that needs it is refused before a byte moves where there is none. ``options``: see
    :data:`REFIT_OPTIONS`.

    Raises CapabilityError (a model not served from an image load), RefitError (weights asleep:
    named, with the engine's wake call; an older version; a record for another image key, engine
    key (another engine version, GPU architecture, kernel backend) or rank; all before a byte
    moves; or, after the copy, a failed ``reprocess``/``derive``: the version's bytes are live,
    the weights are not servable until a call for the same version re-runs the post-processing
    without copying) and whatever :func:`flashboot.weight_update.refit` raises."""
    weights = served_weights(model, what)
    options = check_refit_options(options, what)
    check_refit_values(what, name=name)
    check_awake(model, f"{what}: refused, nothing was copied", RefitError)
    rank = weights.handle.metadata.parallel.rank

    def same_engine_key(record: dict) -> None:
        # the layouts key names model, layout and dtypes; the engine key also its version, GPU and kernels
        ours = weights.section.key
        try:
            theirs = EngineKey.from_dict(record.get("refit_engine_key"), f"{what}: version {version}'s record")
        except LayoutError as exc:
            raise RefitError(f"{exc}: not published from an engine image (engine_publisher); nothing was "
                             "copied, the old weights are serving") from None
        diffs = ours.mismatches(theirs)
        if diffs:
            detail = "; ".join(f"{k}: engine {want!r}, published {have!r}" for k, want, have in diffs)
            raise RefitError(f"{what}: version {version} was published for {theirs.describe()}, this engine is "
                             f"{ours.describe()} ({detail}); nothing was copied, the old weights are serving")
        derived[:] = record.get("refit_derived", [])
        if derived and derive is None:
            raise RefitError(f"{what}: version {version} leaves {len(derived)} tensor attribute(s) to the engine "
                             f"({', '.join(derived[:3])}), which this engine's integration cannot derive; publish "
                             "them too. Nothing was copied, the old weights are serving")

    pending = weights.post_refit_pending
    if pending is not None and version == pending["version"] == weights.handle.version:
        # its bytes are live already: only the post-processing that failed is run again
        derived = list(pending["derived"])
        if derived and derive is None:
            raise RefitError(f"{what}: version {version}'s bytes are live but {len(derived)} tensor attribute(s) "
                             f"({', '.join(derived[:3])}) still need the engine's derive step, which this call "
                             "does not pass; the weights are not servable until it runs")
        report = RefitReport(version, version, bool(options.get("atomic", True)), 0,
                             details={"post_processing_only": True})
    else:
        derived = []
        try:
            report = weights.handle.refit(store, version, name=refit_name(name, rank), check_record=same_engine_key,
                                          **options)
        except BaseException:
            if pending is not None and weights.handle.version != pending["version"]:
                # torn by an in-place copy: the bytes are a mix now, not the pending version's (one
                # that failed before writing a byte left them, and the retry, as they were)
                weights.post_refit_pending = None
            raise
        # version N is live from here on: a failure below must say so and leave a way to finish it
        weights.post_refit_pending = {"version": version, "derived": list(derived)}
    _post_process(model, weights, version, what, reprocess, derive if derived else None, derived)
    weights.post_refit_pending = None
    if derived:
        report.details["derived"] = derived
    logger.info("flashboot: %s", report.summary())
    return report


__all__ = ["REFIT_OPTIONS", "check_refit_options", "engine_publisher", "engine_tensors_to_publish",
           "refit_engine_model", "refit_name", "served_weights"]
