"""Which source a load takes: every registered source is asked in its order
(:func:`~flashboot.flashload.sources.base.registered_sources`), the first that fits is taken, and
the others' reasons are kept: the daemon when one serves the image, the disk when nothing is or
will be staged, the staged copy pinned here otherwise."""

from __future__ import annotations

from ..errors import FlashBootError
from .sources import Source, registered_sources, source_for_mode
from .want import Want


def choose(want: Want) -> tuple[Source, str, dict[str, str]]:
    """(the first registered source whose offer fits ``want``, why, why not each one before it)."""
    why_not: dict[str, str] = {}
    for source in registered_sources():
        offer = source.offer(want)
        if offer.fits:
            return source, offer.why, why_not
        why_not[source.name] = offer.why
    raise FlashBootError(f"no load source fits rank {want.rank} of {want.image_dir}: "
                         + "; ".join(f"{name}: {why}" for name, why in why_not.items()))


def choose_prepared(requested_mode: str, rank_source, shm_dir, daemon=None) -> tuple[Source, str]:
    """(source, why) for :func:`flashboot.prepare` of ``rank_source`` (a validated
    :class:`~flashboot.flashload.shm.RankSource`): the one whose mode was asked for, or
    (``"auto"``) :func:`choose`'s answer knowing whether a preloader (daemon) runs (``daemon``:
    its :func:`~flashboot.flashload.shm.service_status` when the caller already read it)."""
    if requested_mode != "auto":
        return source_for_mode(requested_mode), "asked for"
    from .shm import service_status

    image_dir = rank_source.image_dir
    if daemon is None:
        daemon = service_status(image_dir, shm_dir)
    want = Want(image_dir, rank_source.rank, rank_source, shm_dir=shm_dir, daemon=daemon)
    source, why, _ = choose(want)
    return source, why


def choose_copy_first(requested_mode: str, image_dir, rank: int, shm_dir, daemon=None) -> tuple[Source, str] | None:
    """(source, why) when :func:`flashboot.prepare` takes a source whose copy starts before this
    process parses the metadata (:attr:`Source.copies_before_metadata`): the one asked for, or
    (``"auto"``) the first registered one that fits, asked before any source that needs the
    parsed metadata to decide; None otherwise (the metadata is parsed first). ``daemon`` as for
    :func:`choose_prepared`."""
    if requested_mode != "auto":
        source = source_for_mode(requested_mode)
        return (source, "asked for") if source.copies_before_metadata else None
    from .shm import service_status

    if daemon is None:
        daemon = service_status(image_dir, shm_dir)
    want = Want(image_dir, rank, None, shm_dir=shm_dir, daemon=daemon)
    for source in registered_sources():
        if not source.copies_before_metadata:
            return None
        offer = source.offer(want)  # such a source decides without the metadata (rank_source None)
        if offer.fits:
            return source, offer.why
    return None


__all__ = ["choose", "choose_copy_first", "choose_prepared"]
