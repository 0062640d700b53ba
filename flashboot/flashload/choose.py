"""Which source a load takes: the daemon when one serves the image, the staged copy pinned here
when a preloader staged (or will stage) it, the disk otherwise."""

from __future__ import annotations

from types import ModuleType

from .sources import disk, pinned, served

PREPARED_SOURCES: dict[str, ModuleType] = {"served": served, "staged": pinned, "stream": disk}
"""The source of each :func:`flashboot.prepare` mode."""


def choose_prepared(requested_mode: str, image_dir, rank: int, image, metadata_sha256: str,
                    shm_dir) -> tuple[str, str]:
    """(mode, why) for :func:`flashboot.prepare`: the one asked for, or (``"auto"``) served when a
    served-load daemon runs, streamed when nothing is or will be staged, pinned here otherwise."""
    if requested_mode != "auto":
        return requested_mode, "asked for"
    from .service import service_status
    from .shm import RankSource

    st = service_status(image_dir, shm_dir)
    if st.running and st.serve:
        return "served", f"a served-load daemon runs (pid {st.pid})"
    source = RankSource(image_dir, rank, image, metadata_sha256)
    why = disk.stream_reason(image_dir, rank, source, shm_dir=shm_dir)
    if why is not None:
        return "stream", why
    if st.running:
        return "staged", f"a preloader without --serve runs (pid {st.pid}): pinning its staged copy here"
    return "staged", "no served-load daemon runs: pinning the staged copy here"


__all__ = ["PREPARED_SOURCES", "choose_prepared"]
