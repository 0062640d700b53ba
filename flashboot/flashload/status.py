"""What a load of each rank would find now: one state per rank, from the staged files, the image on
disk and (when one serves) the daemon's own account. ``flashboot preload DIR --status`` prints it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import FlashBootError, LayoutError
from ..fileio import lock_signer
from .shm import (
    StagingFolder,
    _pid_file_held,
    _running_pid,
    rank_source,
    read_ready,
    shm_root,
    staged_paths,
    staging_dir,
)

STATES = ("not staged", "staging", "staged", "served", "stale", "truncated", "failed", "unreadable")
"""Every state :func:`rank_states` reports. ``staged``: a load maps the staged copy; ``served``: the
daemon holds it and copies it on request; ``stale``: staged (or held) from another pre-pack than
the image now on disk; ``truncated``: the staged file is not the size its ``.ready`` records;
``failed``: the daemon could not stage it; ``unreadable``: the image or the ``.ready`` is refused."""


@dataclass(frozen=True)
class RankState:
    """One rank: its state (one of :data:`STATES`) and what it rests on, with the numbers."""

    rank: int
    state: str
    detail: str

    def line(self) -> str:
        return f"rank {self.rank}: {self.state}" + (f": {self.detail}" if self.detail else "")


def status_ranks(image_dir, shm_dir=None, daemon: dict | None = None) -> tuple[list[int], str]:
    """The ranks ``preload --status`` reports: the image's own, and every rank with a file in the
    staging folder or held by the daemon (an image moved away, deleted or re-packed with fewer
    ranks leaves copies that still take their memory); and why the image's own ranks could not
    be read ('' when they could)."""
    from flashboot.layouts import image_ranks

    ranks, why = set(), ""
    try:
        ranks.update(image_ranks(image_dir))
    except FlashBootError as exc:
        why = str(exc)
    ranks.update(int(r) for r in ((daemon or {}).get("ranks") or {}) if str(r).isdigit())
    try:
        names = os.listdir(staging_dir(image_dir, shm_dir))
    except OSError:
        names = []
    ranks.update(int(m.group(1)) for m in map(re.compile(r"rank-(\d+)\.(img|img\.partial|ready)$").match, names) if m)
    return sorted(ranks), why


def rank_states(image_dir, ranks: list[int], shm_dir=None, *, daemon: dict | None = None,
                preloader_pid: int | None = None) -> list[RankState]:
    """The state of each rank in ``ranks``. ``daemon``: a serving daemon's status reply (its
    account wins for the ranks it holds); ``preloader_pid``: a running preloader (a rank without
    ``.ready`` is then staging, not absent)."""
    held = (daemon or {}).get("ranks") or {}
    return [_rank_state(image_dir, rank, shm_dir, held.get(str(rank)), daemon, preloader_pid) for rank in ranks]


def _rank_state(image_dir, rank: int, shm_dir, held: dict | None, daemon: dict | None,
                preloader_pid: int | None) -> RankState:
    paths = staged_paths(image_dir, rank, shm_dir)
    try:
        source = rank_source(image_dir, rank)
    except FlashBootError as exc:
        return RankState(rank, "unreadable", f"the image on disk is refused: {exc}"
                                             + _copy_left(image_dir, paths, held, daemon))
    if held is not None:
        return _held_state(image_dir, rank, source, held, daemon, paths.ready)
    try:
        info = read_ready(paths.ready)
    except FileNotFoundError:
        if preloader_pid is None and _pid_file_held(paths.lock):  # an engine staging its own copy (stage_for_load)
            so_far = _staging_progress(paths.partial, source.nbytes)
            return RankState(rank, "staging", f"by pid {lock_signer(paths.lock)} (no preloader: an engine staging "
                                              f"its own copy, which the last engine to load it removes){so_far}")
        if preloader_pid is None:
            left = _size(paths.partial)  # a stager killed mid-copy: its file, reserved whole, still takes memory
            return RankState(rank, "not staged", f"{paths.ready} absent" + (
                "" if left is None else f"; {paths.partial} ({left:,} bytes), left by a stager that died, still takes "
                                        f"its memory: `flashboot preload {image_dir} --unstage` removes it (a stage "
                                        "of the rank replaces it)"))
        so_far = _staging_progress(paths.partial, source.nbytes)
        return RankState(rank, "staging", f"by preloader pid {preloader_pid}{so_far}")
    except LayoutError as exc:
        return RankState(rank, "unreadable", str(exc))
    if info.metadata_sha256 != source.metadata_sha256 or info.nbytes != source.nbytes:
        return RankState(rank, "stale", f"{paths.image} was staged from another pre-pack ({info.nbytes:,} bytes, "
                                        f"metadata sha256 {info.metadata_sha256[:12]}) than {source.path} now holds "
                                        f"({source.nbytes:,} bytes, {source.metadata_sha256[:12]}); re-stage it: "
                                        f"`flashboot preload {image_dir}`")
    try:  # as a load opens it: in the checked folder, never through a link, a regular file
        with StagingFolder(paths.dir) as folder:
            fd = folder.open(paths.image.name, os.O_RDONLY)
            size = os.fstat(fd).st_size
            os.close(fd)
    except FileNotFoundError:
        size = None
    except LayoutError as exc:  # a link, a pipe or a device in its place: "staged" had been said, and loads refused it
        return RankState(rank, "unreadable", str(exc))
    if size != info.nbytes:
        found = "absent" if size is None else f"{size:,} bytes"
        return RankState(rank, "truncated", f"{paths.image} is {found}, its .ready records {info.nbytes:,} bytes; "
                                            f"re-stage it: `flashboot preload {image_dir}`")
    numa = info.numa_node if info.numa_node is not None else "-"
    engines = ""
    if _size(paths.inline) is not None:
        held = _flock_held(paths.users)
        engines = (f"; staged by an engine for its own load (pid {info.pid}), and no engine holds it now (they "
                   f"were killed before they let it go): `flashboot preload {image_dir} --unstage` removes it, "
                   f"`flashboot preload {image_dir}` keeps it" if held is False else
                   f"; staged by an engine for its own load (pid {info.pid}): the last engine to load it removes it "
                   f"(`flashboot preload {image_dir}` keeps it)")
    return RankState(rank, "staged", f"{info.nbytes:,} bytes at {paths.image} ({info.io_mode}, {info.gbps:.2f} GB/s, "
                                     f"NUMA {numa}){engines}")


def _copy_left(image_dir, paths, held: dict | None, daemon: dict | None) -> str:
    """What a rank whose image is refused still takes in memory: the daemon's copy, or the files
    staged; '' when nothing is left."""
    if held is not None and held.get("state") in ("pinned", "mapped"):
        nbytes = held.get("nbytes")
        size = f"{nbytes:,} bytes" if isinstance(nbytes, int) else "its bytes"
        return (f"; the daemon (pid {(daemon or {}).get('pid')}) still holds its copy ({size}, {held['state']}): "
                f"`flashboot preload {image_dir} --stop`, then `--unstage`, frees it")
    left = [f"{p} ({size:,} bytes)" for p in (paths.image, paths.partial) if (size := _size(p)) is not None]
    if not left:
        return ""
    return (f"; {' and '.join(left)} {'is' if len(left) == 1 else 'are'} still staged and take{'s' if len(left) == 1 else ''} "
            f"its memory: `flashboot preload {image_dir} --unstage` removes it")


def _held_state(image_dir, rank: int, source, held: dict, daemon: dict, ready) -> RankState:
    pid = daemon.get("pid")
    state = held.get("state")
    if state == "failed":
        return RankState(rank, "failed", f"the daemon (pid {pid}) could not stage it: {held.get('error')}")
    if state == "staging":
        return RankState(rank, "staging", f"by the serving daemon (pid {pid})")
    sha, nbytes, said = held.get("metadata_sha256"), held.get("nbytes"), ""
    if sha is None:  # an older FlashBoot's daemon does not say which pre-pack: the .ready it wrote does
        try:
            info = read_ready(ready)
            sha, nbytes = info.metadata_sha256, info.nbytes
            said = f" (by its {ready.name}: an older daemon's status does not say)"
        except (OSError, LayoutError):
            sha = ""  # told as "stale": nothing says it holds this pre-pack
    if sha != source.metadata_sha256 or nbytes != source.nbytes:
        nbytes = f"{nbytes:,}" if isinstance(nbytes, int) else repr(nbytes)
        return RankState(rank, "stale", f"the daemon (pid {pid}) holds another pre-pack{said} ({nbytes} bytes, "
                                        f"metadata sha256 {sha[:12]}) than {source.path} now holds "
                                        f"({source.nbytes:,} bytes, {source.metadata_sha256[:12]}); restart it: "
                                        f"`flashboot preload {image_dir} --stop`, then `--serve` again")
    pin = f", pinned in {held['pin_ms']:.0f} ms" if held.get("pin_ms") else ""
    return RankState(rank, "served", f"{source.nbytes:,} bytes {state} by the daemon (pid {pid}){pin}")


def _staging_progress(partial, nbytes: int) -> str:
    """What the ``.partial`` of a rank being staged says of its progress: its size is not it (the
    stager sizes and reserves it whole before the first byte, fallocate'd blocks included, so its
    size and its blocks had read "N of N bytes so far" from the start), and nothing on disk counts
    the bytes copied, so how far it is goes unsaid rather than a wrong number."""
    if _size(partial) is None:
        return f", {nbytes:,} bytes to stage"
    return f", {nbytes:,} bytes to stage into {partial} (bytes copied so far unknown: the file is reserved whole)"


def _flock_held(path) -> bool | None:
    """Whether any process holds a flock on ``path``, from ``/proc/locks`` (read, not tried: a
    status's own try-lock of ``.users`` would race the last engine's check that no other holds it);
    False where the file is gone, None where the locks cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # "1: FLOCK  ADVISORY  READ  1234 00:2c:5678 0 EOF"; a waiter's line reads "1: -> FLOCK ..."
    return any(len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == inode for parts in map(str.split, lines))


def _size(path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def leftover_staging_dirs(shm_dir=None) -> list:
    """Folders under the staging root that hold no staged rank and belong to no running preloader
    (a preload of any image that failed, or was interrupted, before this version cleaned up after
    itself): what ``preload --status`` lists so that they can be removed."""
    root = shm_root(shm_dir)
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except (FileNotFoundError, NotADirectoryError):  # a file as the root: nothing was staged there
        return []
    left = []
    for d in entries:
        try:
            names = [p.name for p in d.iterdir()]
        except OSError:  # not ours to read
            continue
        if not any(n.startswith("rank-") for n in names) and not _running_pid(d / "preload.pid") \
                and not _pid_file_held(d / "preload.pid"):
            left.append(d)
    return left
