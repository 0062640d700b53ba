"""What a load hands back: :class:`LoadReport` (where the time went, by phase) and
:class:`LoadedImage` (the arena, its views, the metadata and the report).

Every source of :mod:`flashboot.flashload.pipeline` fills the same report, so ``bench boot`` and
the tests read one set of phases whatever the weights came from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..memory import Device


# ================================================================================ the report
@dataclass
class LoadReport:
    """Where the time of one load went, as the engine saw it (milliseconds).

    ``wait_ms``: waiting for the staged image (``.ready``, mapping, or what was left of an early
    pin; served: reading ``metadata.json``'s bytes and waiting for the ``.ready`` of them);
    ``metadata_ms``: the strict read and validation of ``metadata.json`` (pinned early: waiting
    for :func:`flashboot.stage`'s, done in the background); ``pin_ms``: pinning on the critical
    path; ``pinned_early_ms``: pinning paid before ``load`` was called (off the critical path, for
    reference); ``alloc_ms``: arena creation (and export, served); ``h2d_ms``: the bulk copy
    including its synchronisation; ``exchange_ms`` (served): descriptor exchange and the daemon's
    mapping of the arena; ``verify_ms``; ``bind_ms``: building the views; ``total_ms``: from the
    call to the return. ``overlapped`` names the phases that ran while the copy was in flight:
    their time is inside ``h2d_ms`` (or hidden by it), not added to it. ``details["source"]`` and
    ``details["source_why"]``: the source the bytes came from (``served``, ``disk``, ``pinned``)
    and why it was taken.
    """

    mode: str
    device: str
    rank: int
    nbytes: int
    tensors: int = 0
    wait_ms: float = 0.0
    metadata_ms: float = 0.0
    pin_ms: float = 0.0
    pinned_early_ms: float = 0.0
    alloc_ms: float = 0.0
    exchange_ms: float = 0.0
    h2d_ms: float = 0.0
    verify_ms: float = 0.0
    bind_ms: float = 0.0
    total_ms: float = 0.0
    chunks: int = 0
    overlapped: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    @property
    def h2d_gbps(self) -> float:
        """Bytes over the copy time alone."""
        return self.nbytes / (self.h2d_ms * 1e-3) / 1e9 if self.h2d_ms > 0 else float("inf")

    @property
    def gbps(self) -> float:
        """Bytes over the whole engine-visible time."""
        return self.nbytes / (self.total_ms * 1e-3) / 1e9 if self.total_ms > 0 else float("inf")

    @property
    def other_ms(self) -> float:
        """What the phases do not account for: the first use of modules this call imported, setting up
        the copy path, Python between the phases (the total minus the phases not marked overlapped)."""
        names = ("wait", "metadata", "pin", "alloc", "exchange", "h2d", "verify", "bind")
        timed = sum(getattr(self, f"{n}_ms") for n in names if n not in self.overlapped)
        return max(0.0, self.total_ms - timed)

    def phases(self) -> dict[str, float]:
        """The non-zero phases in order, in ms; ``other`` is :attr:`other_ms` (so the phases not
        marked overlapped add up to the total)."""
        names = ("wait", "metadata", "pin", "alloc", "exchange", "h2d", "verify", "bind")
        out = {n: getattr(self, f"{n}_ms") for n in names if getattr(self, f"{n}_ms") > 0}
        if self.other_ms >= 0.05:
            out["other"] = self.other_ms
        return out

    def verified_text(self) -> str:
        """"verified: N chunks match ..." or why nothing was checked."""
        if self.details.get("verified"):
            return f"verified: {self.details['verified']}"
        return "not verified: " + self.details.get("verify_skipped", "verify=False")

    def to_dict(self) -> dict:
        """The fields and the two rates; a rate with no time to divide by (a restart from a
        holder copies nothing: ``h2d_ms`` 0) is None, not ``inf``, which strict JSON cannot hold
        (``--json`` and the benchmarks' records had written ``Infinity``)."""
        rates = {"h2d_gbps": self.h2d_gbps, "gbps": self.gbps}
        return {**asdict(self), **{k: v if math.isfinite(v) else None for k, v in rates.items()}}

    def summary(self) -> str:
        from ..units import format_rate

        parts = ", ".join(f"{k} {v:.1f}{'*' if k in self.overlapped else ''}" for k, v in self.phases().items())
        during = f" (*: {OVERLAP_MEANING.get(self.mode.split(',')[-1].strip(), OVERLAP_MEANING[''])})" \
            if self.overlapped else ""
        early = f"; pinned early in {self.pinned_early_ms:.0f} ms" if self.pinned_early_ms else ""
        note = f"; {self.details['note']}" if self.details.get("note") else ""
        return (f"rank {self.rank} -> {self.device} ({self.mode}): {self.nbytes:,} bytes, {self.tensors} tensors in "
                f"{self.total_ms:.1f} ms ({format_rate(self.nbytes, self.total_ms)} end to end; H2D "
                f"{format_rate(self.nbytes, self.h2d_ms)}) [{parts} ms]{during}{early}; {self.verified_text()}{note}")


OVERLAP_MEANING = {"": "while the copy ran",
                   "prepared": "started by flashboot.prepare before the call; the call waited for what was left"}
"""What a ``*`` on a phase of :meth:`LoadReport.summary` means (by the last word of the mode)."""


# ============================================================================ the loaded image
class LoadedImage:
    """One rank's weights in an arena: ``arena``, ``tensors`` (name -> zero-copy view),
    ``metadata`` (:class:`~flashboot.layouts.ImageMetadata`), ``report`` (:class:`LoadReport`).

    The views are valid while the arena is open; :meth:`close` (or ``with``) releases it.
    :meth:`sleep` / :meth:`wake` release the memory and bring it back at the same addresses
    (:mod:`flashboot.flashload.lifecycle`).
    """

    def __init__(self, arena, tensors: dict, metadata, report: LoadReport, source, release_thread=None):
        self.arena, self.tensors, self.metadata, self.report = arena, tensors, metadata, report
        self.source = source
        self.release_thread = release_thread
        """The background unpin/unmap of a staged image that :func:`load` made itself (or None);
        benchmarks join it so one repeat's unpin does not overlap the next one's pin."""
        self.lifecycle = None  # what sleep() keeps for wake() (flashboot.flashload.lifecycle)
        self.version = 0
        """The weights' version: 0 as loaded from the image, then the one each :meth:`refit` made live;
        None after an in-place refit failed halfway (the bytes mix versions: see ``refit_torn``)."""
        self.refit_torn: dict | None = None
        """After a failed in-place refit: the versions its bytes mix, the last whole one and the error."""
        self.refit_sources: dict = {}
        """The trainer's arena as :meth:`refit` mapped it, kept for the next version (released by :meth:`close`
        and by a sleep: :meth:`release_refit_sources`)."""

    @property
    def device(self) -> Device:
        return self.arena.device

    @property
    def nbytes(self) -> int:
        return self.report.nbytes

    def sleep(self, level: int = 1):
        """Release the weights' memory, keeping every view's address; ``level=1`` keeps a host
        backup first. Returns a SleepReport (see :func:`flashboot.flashload.lifecycle.sleep`)."""
        from .lifecycle import sleep

        return sleep(self, level)

    def wake(self, **options):
        """Bring the weights back at the same addresses, from the backup, the daemon or the disk.
        Returns a WakeReport naming the source (see :func:`flashboot.flashload.lifecycle.wake`)."""
        from .lifecycle import wake

        return wake(self, **options)

    def refit(self, store: str, version: int, **options):
        """Take the weights a trainer published as ``version`` at ``store``, in place under the same
        views; atomic by default. Returns a RefitReport (see :func:`flashboot.weight_update.refit`)."""
        from flashboot.weight_update.engine import refit

        return refit(self, store, version, **options)

    def release_refit_sources(self) -> None:
        """Unmap the trainer's arena kept for the next refit (:attr:`refit_sources`)."""
        if self.refit_sources:  # only a refit holds any: importing FlashClone costs a first close 26-78 ms
            from flashboot.flashclone.sources import release_held_sources

            release_held_sources(self.refit_sources)

    def close(self, *, force: bool = False) -> None:
        """Release the arena; tensors of it still held elsewhere (a model's parameters) keep its
        memory until they are dropped, with a ResourceWarning. ``force``: release it at once all the
        same (a failed load's half-bound model, which nobody reads again). Idempotent."""
        from .lifecycle import close_lifecycle

        if isinstance(self.tensors, dict):  # emptied, not replaced: a prepare() handle holding the same dict
            self.tensors.clear()               # had kept every view into the freed memory
        else:
            self.tensors = {}
        self.release_refit_sources()
        close_lifecycle(self)
        if not self.arena.closed:
            self.arena.close(keep_viewed=not force)

    def __enter__(self) -> "LoadedImage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoadedImage(rank {self.report.rank}, {len(self.tensors)} tensors, {self.nbytes:,} bytes on {self.device})"


__all__ = ["LoadReport", "LoadedImage", "OVERLAP_MEANING"]
