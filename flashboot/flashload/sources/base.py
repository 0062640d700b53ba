"""A source of a load's bytes, and the one registry of them.

A source is one module that defines a :class:`Source` subclass and decorates it with
:func:`register_source`: :mod:`flashboot.flashload.choose` asks every registered source's
:meth:`Source.offer` in :attr:`Source.order` and takes the first that fits, and
:func:`flashboot.prepare` hands the arena to the chosen source's :meth:`Source.start_prepared`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import FlashBootError
from ...memory import Device
from ..landing import verify_loaded
from ..want import LoadRequest, Want


@dataclass(frozen=True)
class Offer:
    """A source's answer to a :class:`Want`: whether it fits, and why (or why not)."""

    fits: bool
    why: str


class Source:
    """One place a load's bytes come from. Subclasses set :attr:`name`, :attr:`mode` and
    :attr:`order` and fill in :meth:`offer`, :meth:`load`, :meth:`start_prepared` and
    :meth:`report_prepared`;
    :meth:`verify_prepared` recomputes the checksums in this process unless overridden."""

    name = ""
    """The registry's key."""
    mode = ""
    """:func:`flashboot.prepare`'s name for it (``mode=``, :attr:`PreparedLoad.mode`)."""
    order = 0
    """Where :mod:`~flashboot.flashload.choose` asks it: lower first."""
    verified_by_daemon = False
    """Whether the chunk digests come from the process that copies (cheap to check here: a load
    then verifies by default; see :func:`~flashboot.flashload.want.verify_default`)."""

    copies_staged = False
    """Whether the bytes it copies are the staged copy in shared memory, not the image file
    (:meth:`bytes_from` names that copy)."""

    copies_before_metadata = False
    """Whether its copy may start before this process parses the metadata (the daemon's
    ``.ready`` vouches for the bytes): :func:`flashboot.prepare` then calls :meth:`start_prepared`
    with no arena and no parsed metadata, and the source creates the arena
    (``handle.create_arena``) and parses them (``handle.open_metadata``) beside its copy; its
    :meth:`offer` decides from ``want.daemon`` alone."""

    def offer(self, want: Want) -> Offer:
        """Whether this source can fill the arena for ``want``, and why (or why not)."""
        raise NotImplementedError

    def load(self, request: LoadRequest, rank_source, report, why: str):
        """The plain load (no :func:`flashboot.prepare`): create the arena, fill it while the views
        are built, verify; a LoadedImage, or the arena released and the error raised. ``rank_source``
        (the validated :class:`~flashboot.flashload.shm.RankSource`) and ``report`` (with its
        metadata time) come from the pipeline's metadata read and admission; a source that reads
        the metadata beside its copy (served) gets None for both. ``why``: why it was chosen."""
        raise NotImplementedError

    def start_prepared(self, handle, t: float):
        """:func:`flashboot.prepare`'s copy into ``handle.arena`` (the load makes the views, while
        it runs: :meth:`~flashboot.flashload.prepared.PreparedLoad.wait_viewable`); fills
        ``handle.copy``. A generator, started on the caller's thread: each ``yield`` hands what
        follows to the handle's background thread (before anything that may block: a wait for
        the preloader, a pin, the copy's end); it returns (``StopIteration.value``) the time the
        copy started, having called ``handle.copy_issued()`` once it runs. A step that next
        blocks on a file alone (the daemon's reply) may yield that file (``fileno()`` and a
        ``deadline`` in ``time.monotonic()``): the rest then runs on the load's thread if the
        load already waits (:meth:`~flashboot.flashload.prepared.PreparedLoad.wait_in_load`)."""
        raise NotImplementedError
        yield  # noqa: unreachable: makes this a generator, as every source's is

    def bytes_from(self, image_path, image_dir, rank: int, shm_dir) -> str:
        """What the bytes it copied were read from, as a checksum mismatch names it: the image
        file, or the staged copy of it (a byte flipped there had been named as in the image file
        on disk, which then checked clean)."""
        if not self.copies_staged:
            return str(image_path)
        from ..shm import staged_paths

        return f"the staged copy {staged_paths(image_dir, rank, shm_dir).image} of {image_path}"

    def verify_prepared(self, handle, where: str, checked) -> None:
        """Check the early copy's bytes against the pre-pack's chunk checksums (fills ``checked``)."""
        verify_loaded(handle.arena, handle.metadata, where, checked)

    def report_prepared(self, report, prepared, dev: Device) -> None:
        """What a load of ``prepared`` reports about the early copy (mode, chunks, pin, details)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<source {self.name!r}>"


_SOURCES: dict[str, Source] = {}


def register_source(cls: type[Source]) -> type[Source]:
    """Class decorator: registers one instance of ``cls`` under ``cls.name`` (and its ``mode``)."""
    for key, kind in ((cls.name, "name"), (cls.mode, "mode")):
        if not key:
            raise FlashBootError(f"source {cls.__name__} has no {kind}")
    taken = [s for s in _SOURCES.values() if s.name == cls.name or s.mode == cls.mode]
    if taken:
        raise FlashBootError(f"source {cls.__name__} ({cls.name!r}, mode {cls.mode!r}) clashes with {taken[0]!r}")
    _SOURCES[cls.name] = cls()
    return cls


def registered_sources() -> list[Source]:
    """Every registered source, in the order :mod:`~flashboot.flashload.choose` asks them."""
    return sorted(_SOURCES.values(), key=lambda s: s.order)


def source_for_mode(mode: str) -> Source:
    """The source :func:`flashboot.prepare` calls ``mode``; FlashBootError naming the known ones."""
    for source in _SOURCES.values():
        if source.mode == mode:
            return source
    known = ", ".join(sorted(s.mode for s in _SOURCES.values()))
    raise FlashBootError(f"no load source has the mode {mode!r}; known: {known}")


__all__ = ["Offer", "Source", "register_source", "registered_sources", "source_for_mode"]
