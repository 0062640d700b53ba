"""The preloader's copy: rank images disk -> shared memory ahead of the engine (paper section 3.5).

Many threads, ``O_DIRECT`` where the filesystem allows it, pages bound to the target GPU's NUMA
node; a ``.ready`` file, created atomically, says the copy is complete and verified against the
image's sizes (and checksums, ``verify=True``)."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import (
    CapabilityError,
    ChecksumMismatchError,
    FlashBootError,
    LayoutError,
    OutOfMemoryError,
    WaitTimeoutError,
)
from ..fileio import (
    DIRECT_ALIGNMENT,
    DirectReadRefused,
    lock_signer,
    open_for_reads,
    out_of_fds,
    sign_lock,
)
from ..memory import Device, cgroup_memory_room
from .shm import (
    SHM_ENV,
    RankSource,
    ReadyInfo,
    _exists,
    _pid_file_held,
    _same_file,
    _running_pid,
    _unlink_quietly,
    _write_atomic,
    check_ready,
    StagingFolder,
    checksum_fingerprint,
    log_file,
    make_dir,
    pid_file,
    rank_source,
    read_ready,
    remove_if_empty,
    socket_path,
    staged_paths,
    staging_dir,
)
from .stage_copy import StagedFileFull, copy_chunks, verify_staged, write_failed

DEFAULT_THREADS = 16
DEFAULT_CHUNK_BYTES = 64 << 20
"""Bytes per read: large enough for the disk's queue, small enough to spread over the threads."""
IO_MODES = ("auto", "direct", "buffered")

# Module-level so tests can simulate a full /dev/shm without mounting a tiny tmpfs.
_fallocate = os.posix_fallocate


def _fs_free_bytes(path: str | int) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _no_inode(directory) -> str | None:
    """Why a file could not be made in ``directory`` with ENOSPC while bytes were free: its
    filesystem has no inode left (a tmpfs's ``nr_inodes``, /dev/shm full of small files), in
    words with the numbers; None where it has some."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    if st.f_files == 0 or st.f_favail > 0:  # 0 files: a filesystem that keeps no count
        return None
    return (f"{directory} has no free inode: its filesystem holds all the {st.f_files:,} files it may (a tmpfs's "
            f"nr_inodes), with {st.f_bavail * st.f_frsize:,} bytes free")



# =================================================================================== staging
class StagingBusy(FlashBootError):
    """Another process stages the rank now (it holds the rank's lock); the message names its pid."""


@dataclass
class StageResult:
    """What staging one rank did: bytes, I/O mode (and why), NUMA placement, time."""

    rank: int
    nbytes: int
    staged: str
    io_mode: str
    io_reason: str
    numa_node: int | None
    numa_reason: str
    threads: int
    read_s: float
    verified: bool
    skipped: bool = False
    restaged_because: str = ""
    """Why a copy already staged was staged again (it failed ``verify``); empty otherwise."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s > 0 else float("inf")





def stage_rank(image_dir, rank: int, *, shm_dir=None, threads: int = DEFAULT_THREADS, io: str = "auto",
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: Any = "cpu", numa_policy: str = "preferred",
               verify: bool = False, force: bool = False, progress: Callable[[int, int], None] | None = None,
               stop: threading.Event | None = None, inline: bool = False) -> StageResult:
    """Copy rank ``rank`` of ``image_dir`` into shared memory and mark it ready.

    Refuses before any I/O when the shm filesystem lacks the space (OutOfMemoryError with the
    bytes needed and free). A filesystem that fills up during the copy removes the partial file
    and raises OutOfMemoryError too. ``io``: ``auto`` (O_DIRECT, buffered where refused; the
    result says which), ``direct`` or ``buffered``. ``device``: the GPU the rank will load onto;
    the staged pages are bound to its NUMA node where the machine has more than one.
    ``verify`` recomputes the chunk checksums of the staged bytes (ChecksumMismatchError naming
    the chunk). A rank already staged from the same pre-pack is left alone unless ``force``; with
    ``verify`` its staged bytes are checked first, and a copy that fails is staged again.
    ``inline``: an engine stages the copy for its own load (see :func:`stage_for_load`). A rank
    another process stages now is refused with :class:`StagingBusy`.
    """
    if io not in IO_MODES:
        raise FlashBootError(f"io must be one of {', '.join(IO_MODES)}, got {io!r}")
    if threads < 1 or chunk_bytes < DIRECT_ALIGNMENT or chunk_bytes % DIRECT_ALIGNMENT:
        raise FlashBootError(f"need threads >= 1 and chunk_bytes a positive multiple of {DIRECT_ALIGNMENT} "
                             f"(got {threads}, {chunk_bytes})")
    paths = staged_paths(image_dir, rank, shm_dir)
    made = not _exists(paths.dir)
    # the lock before the metadata: a stager refused as busy (polled by the engines and preloaders
    # waiting for another) reads none of it
    for _ in range(FOLDER_RETRIES):
        make_dir(paths.dir)
        folder = None
        try:
            # opened once and checked on the fd (another user's folder: nothing staged there is ours to
            # vouch for); every file below is relative to it, never to a folder swapped in at its name
            folder = StagingFolder(paths.dir)
            lock = _lock_rank(paths, rank, image_dir, folder)
            break
        except FileNotFoundError:  # the folder, emptied and removed meanwhile (the last engine out, an
            made = True            # unstage): made again, as an engine's stage_for_load does
        except BaseException:
            if folder is not None:
                folder.close()
            raise
        if folder is not None:
            folder.close()
    else:
        raise FlashBootError(f"{paths.dir} was removed {FOLDER_RETRIES} times as rank {rank} of {image_dir} was to be "
                             "staged into it; is something else removing it?")
    try:
        try:
            src = rank_source(image_dir, rank)
        except BaseException:
            _unlock_rank(paths, lock, folder)
            lock = None
            if made:  # an image refused before anything was staged leaves no folder behind
                remove_if_empty(paths.dir)
            raise
        return _stage_locked(image_dir, rank, src, paths, folder, threads=threads, io=io, chunk_bytes=chunk_bytes,
                             device=device, numa_policy=numa_policy, verify=verify, force=force, progress=progress,
                             stop=stop, inline=inline)
    finally:
        try:
            if lock is not None:
                _unlock_rank(paths, lock, folder)
        finally:
            folder.close()


FOLDER_RETRIES = 20
"""How many times a stager makes the staging folder again when it is removed before the lock is in it."""


def _flock_current(path: Path, op: int, folder: StagingFolder | None = None) -> int | None:
    """``path`` opened (created where absent) and locked with ``op`` (``LOCK_EX``/``LOCK_SH``,
    never blocking): its fd, or None while another process holds a conflicting lock. A file its
    last holder removed between our open and our lock is not the one others see: opened again.
    Relative to ``folder`` (``path``'s, opened and checked) where given; never through a symlink
    (a lock is signed: its file is truncated)."""
    while True:
        try:
            if folder is not None:
                fd = folder.open(path.name, os.O_RDWR | os.O_CREAT, 0o600, regular=False)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # its folder removed meanwhile: the caller's to say (or make it again)
            raise
        except OSError as exc:  # a read-only or another user's staging folder: it had been a bare OSError
            if (why := out_of_fds(exc)) is not None:  # not the folder's fault: another --shm-dir would not help
                raise FlashBootError(f"cannot open the lock file {path}: {why}") from None
            why = (_no_inode(path.parent) if exc.errno == errno.ENOSPC else None) or exc.strerror
            raise FlashBootError(f"cannot open the lock file {path}: {why}; this process cannot stage or "
                                 f"load a staged copy there: use another --shm-dir (or ${SHM_ENV})") from None
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if folder.same_file(path.name, fd) if folder is not None else _same_file(path, fd):
            return fd
        os.close(fd)


def _lock_rank(paths, rank: int, image_dir, folder: StagingFolder | None = None) -> int:
    """An exclusive lock on the rank's ``rank-R.lock`` (flock), held while it is staged: two
    stagers of one rank (two engines staging inline, a preloader beside a bare ``stage_rank``)
    each withdrew the other's ``.partial`` by name, and the first to finish renamed the other's
    half-written file into place under its ``.ready``. A second stager is refused by name
    (FlashBootError with the holder's pid). Returns the lock's fd."""
    fd = _flock_current(paths.lock, fcntl.LOCK_EX, folder)
    if fd is None:
        raise StagingBusy(f"rank {rank} of {image_dir} is being staged already (by pid {lock_signer(paths.lock)}, "
                          f"which holds {paths.lock}); wait for its {paths.ready}, or stop it first")
    sign_lock(fd)
    return fd


def _unlock_rank(paths, fd: int, folder: StagingFolder | None = None) -> None:
    """Remove the rank's lock file while still holding it (a process that opened it meanwhile
    finds it gone and retries), unless it is no longer this one (removed by ``unstage`` and made
    again by the next stager), then release it."""
    try:
        if folder is not None:
            if folder.same_file(paths.lock.name, fd):
                folder.unlink(paths.lock.name)
        elif _same_file(paths.lock, fd):
            _unlink_quietly(paths.lock)
    finally:
        os.close(fd)


def _stage_locked(image_dir, rank: int, src: RankSource, paths, folder: StagingFolder, *, threads: int, io: str, chunk_bytes: int,
                  device: Any, numa_policy: str, verify: bool, force: bool,
                  progress: Callable[[int, int], None] | None, stop: threading.Event | None,
                  inline: bool = False) -> StageResult:
    """:func:`stage_rank` once the rank's lock is held. Every file of the rank is opened, renamed
    and removed relative to ``folder`` (the staging folder, opened and checked once)."""
    from ..pinning import MappedFile, bind_to_node, fs_type, gpu_numa_node

    nbytes = src.nbytes
    restaged_because = ""
    if not force and folder.exists(paths.image.name):
        try:
            info = folder.read_ready(paths.ready.name)
            check_ready(info, src)
            fd = folder.open(paths.image.name, os.O_RDONLY)  # a regular file of ours: a link or a pipe is restaged
            try:
                size = os.fstat(fd).st_size
                # skipped unchecked, a corrupted staged copy was kept and served; checked on every start, a
                # 140 GB rank took ~70 s each time: a verification is recorded in .ready (of this metadata)
                if size == nbytes and verify and not info.verified:
                    verify_staged(fd, nbytes, src, paths.image, stop)
            finally:
                os.close(fd)
            if size == nbytes:
                how = "already staged"
                if verify and not info.verified:
                    try:
                        _write_atomic(paths.ready, json.dumps({**info.to_dict(), "verified": True}, indent=1),
                                      folder)
                    except OSError as exc:  # staged copies filled it to the last page: the copy is good all the same
                        if exc.errno != errno.ENOSPC:
                            raise
                        how += f"; its verification not recorded ({paths.dir} is full): checked again next time"
                if not inline:  # `flashboot preload` keeps the copy an engine staged: the last engine out left it gone
                    folder.unlink(paths.inline.name)
                return StageResult(rank, nbytes, str(paths.image), info.io_mode, how, info.numa_node,
                                   info.numa_reason, info.threads, 0.0, info.verified or verify, skipped=True)
        except ChecksumMismatchError as exc:
            restaged_because = f"its staged copy failed verification: {exc}"
        except (FileNotFoundError, LayoutError):
            pass
    # Withdraw an older copy first: nobody may see .ready beside a half-replaced image.
    for p in (paths.ready, paths.image, paths.partial, paths.inline):
        folder.unlink(p.name)
    free = _fs_free_bytes(folder.fd)
    if nbytes > free:
        raise OutOfMemoryError(f"staging rank {rank} of {image_dir} into {paths.dir}", nbytes, free)
    room = cgroup_memory_room() if fs_type(str(paths.dir)) in ("tmpfs", "ramfs") else None
    if room is not None and nbytes > room[0]:  # a container's /dev/shm: OOM-killed halfway, not refused
        raise OutOfMemoryError(f"staging rank {rank} of {image_dir} into {paths.dir} (its pages are charged to this "
                               f"process's memory cgroup: {room[1]})", nbytes, room[0])
    dev = Device.parse(device)
    node, numa_reason = gpu_numa_node(dev)
    try:
        fd = folder.open(paths.partial.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, regular=False)
    except OSError as exc:  # a bare "[Errno 28] No space left on device" with the bytes free named no inode
        why = _no_inode(paths.dir) if exc.errno == errno.ENOSPC else out_of_fds(exc)
        if why is None:
            raise
        raise FlashBootError(f"staging rank {rank} of {image_dir}: cannot create {paths.partial}: {why}") from None
    mapping = None
    try:
        try:
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            raise write_failed(str(paths.partial), f"sizing it to {nbytes:,} bytes", exc) from None
        if node is not None:
            # The policy of a shared tmpfs mapping is the file's: pages written by pwrite land there.
            mapping = MappedFile(str(paths.partial), nbytes, fd=fd)
            bind_to_node(mapping.ptr, nbytes, node, numa_policy)
            numa_reason += f" ({numa_policy})"
        try:
            _fallocate(fd, 0, nbytes)  # reserve the pages now, so a full tmpfs fails here, not at byte N
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise StagedFileFull(0) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        t0 = time.perf_counter()
        src_fd, mode, reason = open_for_reads(src.path, io)
        # the file the metadata was validated against, before and after the copy (as a streamed load
        # checks): one rewritten in place while it was staged had its mix of bytes staged under a
        # .ready, and every load that did not verify served them
        identity = src.image.file_identity
        try:
            if identity is not None:
                identity.check(os.fstat(src_fd), "since its metadata was read (the rank is not staged)")
            try:
                copy_chunks(src_fd, fd, nbytes, direct=mode == "o_direct", threads=threads, chunk_bytes=chunk_bytes,
                             progress=progress, stop=stop, numa_node=node, src_name=str(src.path),
                             dst_name=str(paths.partial))
            except DirectReadRefused as exc:
                if io == "direct":
                    raise CapabilityError(f"{src.path}: reads under O_DIRECT fail ({exc}) and io='direct' was asked") from None
                os.close(src_fd)
                src_fd = os.open(src.path, os.O_RDONLY)
                mode, reason = "buffered", f"filesystem refuses O_DIRECT reads ({exc})"
                if identity is not None:
                    identity.check(os.fstat(src_fd), "since its metadata was read (the rank is not staged)")
                copy_chunks(src_fd, fd, nbytes, direct=False, threads=threads, chunk_bytes=chunk_bytes,
                             progress=progress, stop=stop, numa_node=node, src_name=str(src.path),
                             dst_name=str(paths.partial))
            if identity is not None:
                identity.check(os.fstat(src_fd), "while it was staged (the rank is not staged)")
        finally:
            os.close(src_fd)
        read_s = time.perf_counter() - t0
        if verify:
            verify_staged(fd, nbytes, src, paths.partial, stop)
        folder.rename(paths.partial.name, paths.image.name)
        cs = src.metadata.checksums
        info = ReadyInfo(
            path=paths.ready, rank=rank, nbytes=nbytes, staged=str(paths.image), source=str(src.path),
            metadata_sha256=src.metadata_sha256, job_id=src.metadata.job_id, key_digest=src.metadata.key.digest,
            checksum={"algorithm": cs.algorithm, "chunk_bytes": cs.chunk_bytes, "chunks": len(cs.digests),
                      "fingerprint": checksum_fingerprint(cs.digests)},
            verified=verify, io_mode=mode, io_reason=reason, numa_node=node, numa_reason=numa_reason, threads=threads,
            read_s=read_s, staged_at=time.time(), pid=os.getpid())
        text = json.dumps(info.to_dict(), indent=1)
        try:
            if inline:  # before .ready: an engine that loads the copy once it is ready finds it marked
                folder.touch(paths.inline.name)
            _write_atomic(paths.ready, text, folder)
        except BaseException as exc:
            folder.unlink(paths.image.name)  # never loaded without its .ready: it would only hold the memory
            folder.unlink(paths.inline.name)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and (why := _no_inode(paths.dir)):
                raise FlashBootError(f"staging rank {rank} of {image_dir}: cannot write {paths.ready}: {why} "
                                     "(staged copy removed)") from None
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # the copy took the last page
                raise OutOfMemoryError(f"staging rank {rank} of {image_dir}: {paths.dir} filled up after the "
                                       f"{nbytes:,} bytes were copied, writing {paths.ready} (staged copy removed)",
                                       len(text), _fs_free_bytes(str(paths.dir))) from None
            raise
        return StageResult(rank, nbytes, str(paths.image), mode, reason, node, numa_reason, threads, read_s, verify,
                           restaged_because=restaged_because)
    except StagedFileFull as full:
        folder.unlink(paths.partial.name)
        now_free = _fs_free_bytes(folder.fd)
        raise OutOfMemoryError(
            f"staging rank {rank} of {image_dir}: {paths.dir} filled up after {full.written:,} of {nbytes:,} bytes "
            f"(partial file removed)", nbytes, now_free) from None
    except BaseException:
        folder.unlink(paths.partial.name)
        raise
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)



BUSY_POLL_S = 0.05
"""How often an engine waiting for another process's staging of its rank asks again."""


class InlineCopy:
    """One engine's use of a rank staged in shared memory for engines' own loads (see
    :func:`stage_for_load`): it holds ``rank-R.users`` shared until :meth:`release`."""

    def __init__(self, paths, fd: int, staged_here: bool, folder: StagingFolder | None = None):
        self.paths, self._fd, self.staged_here = paths, fd, staged_here
        self._folder = folder
        """The staging folder ``rank-R.users`` was opened in (closed by :meth:`release`): the copy is
        removed from it, not from whatever folder has its name by then."""

    def release(self) -> bool:
        """Let go of the copy; returns True when this engine was the last to load it and removed it
        (only a copy an engine staged: one ``flashboot preload`` staged stays). The last engine out
        also removes ``rank-R.users``, and the staging folder once nothing is left in it (as the
        unstage engines ran before them did): they had stayed, the folder listed as a leftover
        by ``preload --status``, or hidden from it by the ``.users`` file. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return False
        p, folder, self._folder = self.paths, self._folder, None
        if folder is None:  # made by hand (tests): the folder as it is now, never through a link
            try:
                folder = StagingFolder(p.dir, check=False)
            except (OSError, LayoutError):
                os.close(fd)
                return False
        removed = False
        try:
            try:  # the last user: no other engine holds it shared (a conversion: ours is dropped first)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # another engine still loads it: the last one out removes it
            if not folder.same_file(p.users.name, fd):
                return False  # removed and made again since
            try:  # the rank's lock while removing: a stager cannot restage or keep the copy meanwhile
                lock = _lock_rank(p, p.image.name, p.dir, folder)
            except (FlashBootError, OSError):  # StagingBusy, or a lock file that cannot be opened
                lock = None  # being restaged (or its folder gone meanwhile): the copy is not this engine's to remove
            try:
                if lock is not None and folder.exists(p.inline.name):  # not staged, or kept since, by `flashboot preload`
                    for path in (p.ready, p.image, p.partial, p.inline):
                        folder.unlink(path.name)
                    removed = True
                folder.unlink(p.users.name)  # last: an engine that makes it anew finds no .ready of a copy going
            finally:
                if lock is not None:
                    _unlock_rank(p, lock, folder)
        finally:
            os.close(fd)
            folder.close()
        remove_if_empty(p.dir)  # an engine that makes it again meanwhile retries (stage_for_load)
        return removed


def stage_for_load(image_dir, rank: int, *, timeout_s: float, shm_dir=None, device: Any = "cpu",
                   log: Callable[[str], None] | None = None, check_staged: bool = True) -> InlineCopy:
    """Stage rank ``rank`` in shared memory for this engine's load, beside other engines that may
    do the same (data-parallel replicas of one image on one node): one stages it, the others wait
    for it (at most ``timeout_s``; WaitTimeoutError naming the stager) and load the same copy, and
    one that finds it staged already loads it as it is. Each holds ``rank-R.users`` shared until
    :meth:`InlineCopy.release`, which the last of them turns into the copy's removal when an
    engine staged it. ``log`` is told when this process staged the rank itself (on the engine's
    critical path). ``check_staged=False`` takes a rank with a ``.ready`` as it is, without
    reading its metadata here (the load checks the copy against it, once)."""
    paths = staged_paths(image_dir, rank, shm_dir)
    started = time.monotonic()
    while True:  # shared on users: waits only while the last engine out removes the copy (EX)
        folder = fd = None
        try:
            make_dir(paths.dir)
            # checked, and never through a link: a symlink at its name had its .users made, and the copy
            # staged, in whatever folder it named
            folder = StagingFolder(paths.dir)
            fd = _flock_current(paths.users, fcntl.LOCK_SH, folder)
        except FileNotFoundError:  # the folder, removed by the last engine out after make_dir: made again
            pass
        except BaseException:
            if folder is not None:
                folder.close()
            raise
        if fd is not None:
            break
        if folder is not None:
            folder.close()
        if time.monotonic() >= started + timeout_s:
            raise WaitTimeoutError(f"rank {rank} of {image_dir}: {paths.users} stayed locked by the engine removing "
                                   f"its copy for {timeout_s:g} s")
        time.sleep(BUSY_POLL_S)
    try:
        if not check_staged and folder.exists(paths.ready.name):  # staged: the load reads the metadata, not us too
            return InlineCopy(paths, fd, staged_here=False, folder=folder)
        # another engine staging it: its .ready comes, or it failed and this process stages the rank
        result = stage_rank_when_free(image_dir, rank, wait_s=timeout_s, started=started, poll_s=BUSY_POLL_S,
                                      shm_dir=shm_dir, device=device, inline=True)
        if log is not None and not result.skipped:
            log(f"staged rank {rank} of {image_dir} in this process ({result.nbytes / 1e9:.2f} GB from disk "
                f"in {result.read_s:.2f} s, on the engine's critical path); run `flashboot preload "
                f"{image_dir}` before starting the engine to take it off")
        return InlineCopy(paths, fd, staged_here=not result.skipped, folder=folder)
    except BaseException:
        InlineCopy(paths, fd, staged_here=False, folder=folder).release()  # the last out: its .users (and folder) had stayed
        raise


def unstage(image_dir, ranks: list[int] | None = None, *, shm_dir=None) -> list[Path]:
    """Remove staged ranks (all by default) and return the paths removed. Once no rank is left,
    the preloader's log, a dead preloader's pid file and socket, and the staging directory itself
    go too. Refuses while a preloader for the directory runs."""
    path = pid_file(image_dir, shm_dir)
    running = _running_pid(path)
    if running:
        raise FlashBootError(f"a preloader for {image_dir} is running (pid {running}); stop it first (--stop)")
    if _pid_file_held(path):  # starting (its pid not written yet) or exiting: its files are not ours to remove
        raise FlashBootError(f"a preloader for {image_dir} is starting or exiting (its pid file {path} is locked); "
                             "stop it first (--stop) or try again once it has exited")
    d = staging_dir(image_dir, shm_dir)
    removed: list[Path] = []
    wanted = None if ranks is None else {f"rank-{r}" for r in ranks}
    try:  # opened once, never through a link: by name, a symlink at its name had the rank-* files of the
        folder = StagingFolder(d, check=False)  # folder it named removed (any folder, for root)
    except FileNotFoundError:
        return removed
    except LayoutError:
        if os.path.islink(d):
            raise
        return removed  # a file in its place: nothing staged
    with folder:
        return _unstage_in(image_dir, shm_dir, d, folder, wanted, removed)


def _unstage_in(image_dir, shm_dir, d: Path, folder: StagingFolder, wanted, removed: list[Path]) -> list[Path]:
    """:func:`unstage` in the staging folder ``d``, opened as ``folder``."""
    names = os.listdir(folder.fd)
    stems = sorted(stem for stem in {n.split(".")[0] for n in names if n.startswith("rank-")}
                   if wanted is None or stem in wanted)
    # Each rank's lock and its .users exclusively while its files go: checked and then removed, a
    # stager or an engine that came in between had its .partial, or the copy it was loading,
    # removed under it (and a second stager made a new lock beside the first's).
    held: list[tuple[Any, int, int]] = []
    ours = set()  # the ranks whose files go: locked here (a rank staged since the listing is not)
    try:
        for stem in stems:
            ours.add(stem)
            try:
                rank = int(stem[len("rank-"):])
            except ValueError:
                continue  # not a rank's file: nobody stages or loads it
            paths = staged_paths(image_dir, rank, shm_dir)
            try:
                lock = _lock_rank(paths, rank, image_dir, folder)
            except StagingBusy:  # a bare stage_rank has no pid file: its lock says it runs
                raise FlashBootError(f"{stem} of {image_dir} is being staged (its lock {paths.lock} is held); let it "
                                     "finish or stop it, then unstage") from None
            except FileNotFoundError:  # the folder, removed meanwhile by the last engine out: nothing left
                return removed
            try:
                users = _flock_current(paths.users, fcntl.LOCK_EX, folder)  # engines loading the copy hold it shared
            except BaseException:  # it cannot be opened: the rank's lock is not held by the list below yet
                _unlock_rank(paths, lock, folder)
                raise
            if users is None:
                _unlock_rank(paths, lock, folder)
                # a copy `flashboot preload` staged stays after the engines: it had said they would remove it
                after = "the last engine to load it removes it" if folder.exists(paths.inline.name) else \
                    "unstage it once they have loaded"
                raise FlashBootError(f"{stem} of {image_dir} is being loaded by an engine (it holds {paths.users}); "
                                     f"{after}")
            held.append((paths, lock, users))
        for name in sorted(os.listdir(folder.fd)) if held else names:  # no lock held: the folder may go
            if name.split(".")[0] in ours and _not_a_folder(folder, name):
                folder.unlink(name)
                if name in names:  # not the lock files made here to hold
                    removed.append(d / name)
    finally:
        for paths, lock, users in held:
            os.close(users)  # its file went above: an engine waiting on it opens a new one
            _unlock_rank(paths, lock, folder)
    try:
        left = any(n.startswith("rank-") for n in os.listdir(folder.fd))
    except FileNotFoundError:  # the folder, removed meanwhile by the last engine out
        return removed
    if not left:
        for p in (log_file(image_dir, shm_dir), pid_file(image_dir, shm_dir), socket_path(image_dir, shm_dir)):
            if folder.exists(p.name):
                folder.unlink(p.name)
                removed.append(p)
        if remove_if_empty(d):
            removed.append(d)
    return removed


def _not_a_folder(folder: StagingFolder, name: str) -> bool:
    try:
        return not stat.S_ISDIR(folder.stat(name).st_mode)
    except FileNotFoundError:
        return False


# ============================================================================ configuration
@dataclass
class PreloadConfig:
    """What a preloader does. Validates itself; the CLI and YAML only fill it."""

    image_dir: str
    ranks: list[int] | None = None
    shm_dir: str | None = None
    threads: int = DEFAULT_THREADS
    io: str = "auto"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    devices: dict[int, str] = field(default_factory=dict)
    """Rank -> the device it loads onto (NUMA placement); default ``cuda:<rank mod #GPUs>`` or cpu."""
    numa_policy: str = "preferred"
    verify: bool = False
    force: bool = False
    serve: bool = False
    pin: bool = True
    """Served mode: register (pin) each staged image once (CUDA only)."""
    allow_group: str | int | None = None
    """Served mode: a group (name or gid) whose members may ask for loads besides the daemon's own
    user; the socket is then mode 0660 and of that group. Default: the daemon's user only."""

    def __post_init__(self):
        from ..pinning import NUMA_POLICIES

        from flashboot.layouts.image import require_image_dir

        self.image_dir = str(require_image_dir(self.image_dir))
        if self.io not in IO_MODES:
            raise FlashBootError(f"io must be one of {', '.join(IO_MODES)}, got {self.io!r}")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise FlashBootError(f"threads must be an int >= 1, got {self.threads!r}")
        if self.chunk_bytes < DIRECT_ALIGNMENT or self.chunk_bytes % DIRECT_ALIGNMENT:
            raise FlashBootError(f"chunk_bytes must be a positive multiple of {DIRECT_ALIGNMENT}, got {self.chunk_bytes}")
        if self.numa_policy not in NUMA_POLICIES:
            raise FlashBootError(f"numa_policy must be one of {', '.join(NUMA_POLICIES)}, got {self.numa_policy!r}")
        self.devices = {int(k): str(v) for k, v in (self.devices or {}).items()}
        self.allow_gid()  # an unknown group is refused now, not when the socket is made
        # Both act only on the served-load daemon: without serve they had been dropped without a word
        # (a user who asked for --allow-group believed the group could load)
        if not self.serve:
            if self.pin is not True:
                raise FlashBootError(f"pin={self.pin!r} (--no-pin) applies only to a serving preloader "
                                     "(serve=True, --serve); this one only stages")
            if self.allow_group is not None:
                raise FlashBootError(f"allow_group={self.allow_group!r} (--allow-group) applies only to a serving "
                                     "preloader (serve=True, --serve): without it nobody connects")

    def allow_gid(self) -> int | None:
        """The gid of :attr:`allow_group` (None when not set); FlashBootError naming an unknown group."""
        import grp

        g = self.allow_group
        if g is None:
            return None
        if isinstance(g, bool) or not isinstance(g, (str, int)):
            raise FlashBootError(f"allow_group must be a group name or gid, got {g!r}")
        try:
            if isinstance(g, int) or g.isdigit():
                return grp.getgrgid(int(g)).gr_gid
            return grp.getgrnam(g).gr_gid
        except (KeyError, OverflowError):
            raise FlashBootError(f"allow_group {g!r}: no such group on this host") from None

    @classmethod
    def from_dict(cls, d: dict) -> "PreloadConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise FlashBootError(f"unknown preload options {sorted(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def resolved_ranks(self) -> list[int]:
        from flashboot.layouts import image_ranks

        have = image_ranks(self.image_dir)
        if self.ranks is None:
            return have
        missing = sorted(set(self.ranks) - set(have))
        if missing:
            raise LayoutError(f"{self.image_dir}: ranks {missing} requested; the image has ranks {have}")
        return sorted(set(self.ranks))

    def device_for(self, rank: int) -> Device:
        from .._cuda import device_count

        if rank in self.devices:
            return Device.parse(self.devices[rank])
        n = device_count()
        return Device("cuda", rank % n) if n else Device("cpu")


STAGER_WAIT_S = 600.0
STAGER_POLL_S = 0.2
"""How long a preloader waits for another process (an engine staging its own copy) to finish
staging a rank it is to stage, and how often it asks (the rank's lock)."""


def stage_rank_when_free(image_dir, rank: int, *, stop: threading.Event | None = None,
                         log: Callable[[str], None] | None = None, wait_s: float = STAGER_WAIT_S,
                         started: float | None = None, poll_s: float = STAGER_POLL_S, **options) -> StageResult:
    """:func:`stage_rank` (``options`` are its own); while another process stages the rank (an
    engine staging its own copy), wait for it, at most ``wait_s`` from ``started`` (a
    ``time.monotonic()``, default now; WaitTimeoutError), asking every ``poll_s``, and take its
    copy over (a preloader started beside such an engine had failed the rank, a second engine
    too). ``log`` is told once that it waits; ``stop`` ends the wait (FlashBootError saying so)."""
    deadline, said = (time.monotonic() if started is None else started) + wait_s, False
    while True:
        try:
            return stage_rank(image_dir, rank, stop=stop, **options)
        except StagingBusy as busy:
            if stop is not None and stop.is_set():
                raise FlashBootError(f"the preloader (pid {os.getpid()}) is stopping; rank {rank} was not staged "
                                     f"while waiting for another stager: {busy}") from None
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"{busy}: still staging after {wait_s:g} s") from None
            if log is not None and not said:
                log(f"rank {rank}: {busy}; waiting for it")
                said = True
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)


def preload(config: PreloadConfig | dict, *, progress: Callable[[int, int, int], None] | None = None,
            stop: threading.Event | None = None, log: Callable[[str], None] | None = None) -> list[StageResult]:
    """Stage every rank of ``config`` (one after the other, each with many threads).

    ``progress(rank, done_bytes, total_bytes)`` is called as bytes land.
    """
    if isinstance(config, dict):
        config = PreloadConfig.from_dict(config)
    results = []
    for rank in config.resolved_ranks():
        cb = (lambda done, total, r=rank: progress(r, done, total)) if progress else None
        results.append(stage_rank_when_free(config.image_dir, rank, shm_dir=config.shm_dir, threads=config.threads,
                                            io=config.io, chunk_bytes=config.chunk_bytes,
                                            device=config.device_for(rank), numa_policy=config.numa_policy,
                                            verify=config.verify, force=config.force, progress=cb, stop=stop, log=log))
    return results

