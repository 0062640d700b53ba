"""What the preloader leaves in shared memory: where a rank is staged, its ``.ready`` file, the
preloader's pid file, and the validated source on disk.

Staging layout, under the shm root (``$FLASHBOOT_SHM`` or ``/dev/shm/flashboot``)::

    <name>-<sha of the image dir's real path>/
        rank-R.img          the staged image (rank-R.img.partial while copying)
        rank-R.ready        JSON: sizes, checksum summary, I/O mode, NUMA node, timings
        rank-R.lock         held (flock) by the process staging the rank, while it does
        rank-R.users        held shared (flock) by each engine loading a copy it stages itself
        rank-R.inline       present while the copy is one engines staged: the last to load it removes it
        preload.pid         the running preloader (JSON: pid, start time); removed on exit
        preload.log         output of a background preloader
        serve.sock          the served-load socket (SOCK_SEQPACKET)
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .._json import check_fields, finite_at_least, int_at_least, is_str, loads
from ..procfs import proc_start_time
from ..errors import (
    FlashBootError,
    LayoutError,
    WaitTimeoutError,
)

SHM_ENV = "FLASHBOOT_SHM"
DEFAULT_SHM_ROOT = "/dev/shm/flashboot"
READY_FORMAT = "flashboot-ready/1"
_POLL_S = 0.005
PRELOADER_UID_ENV = "FLASHBOOT_PRELOADER_UID"
"""Where engines of several users share one preloader (``--allow-group``): the uid it runs as."""


def trusted_uids() -> set[int]:
    """The users whose preloader, and whose staged copies, this process trusts: itself, root and
    ``$FLASHBOOT_PRELOADER_UID``."""
    trusted = {os.geteuid(), 0}
    extra = os.environ.get(PRELOADER_UID_ENV, "").strip()
    if extra.isdigit():
        trusted.add(int(extra))
    return trusted


def check_staging_owner(folder: Path, *files: Path) -> None:
    """Refuse (LayoutError) a staging folder, or a file in it, that another user could have
    planted: its owner not in :func:`trusted_uids`, or a folder any user may write (and so swap its
    files). The folder's name is the image path's hash, so anyone who can write to the shm root
    can make it first, and a load would take their bytes for the image's. A check by name only:
    what reads or writes the staged files opens the folder as a :class:`StagingFolder`."""
    with StagingFolder(folder) as opened:
        for path in files:
            fd = opened.open(path.name, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)


def _refuse_untrusted(path: Path, st: os.stat_result, folder: Path) -> None:
    """LayoutError unless ``st`` (of ``path``: ``folder`` or a file in it) is of a trusted user,
    and, for the folder, one no other user may write."""
    if st.st_uid not in trusted_uids():
        who = f"belongs to uid {st.st_uid}"
    elif path == folder and st.st_mode & 0o002:
        who = f"is mode {oct(st.st_mode & 0o7777)}: other users may write its files"
    else:
        return
    raise LayoutError(f"{path} {who}; a staged copy is taken only from a folder of this user (uid "
                      f"{os.geteuid()}), root or ${PRELOADER_UID_ENV}, that no other user may write: another user "
                      f"could have planted its bytes. Remove {folder}, or stage under a --shm-dir of your own "
                      f"(or ${SHM_ENV})")


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class StagingFolder:
    """A staging folder opened once, never through a symlink, and checked on that fd
    (:func:`_refuse_untrusted`); every file in it is then opened, renamed and removed relative to
    the fd (``dir_fd``, ``O_NOFOLLOW``). Checked by name and then used by name, a folder renamed
    away after the check and another put in its place (anyone who may write the shm root can: a
    folder there is renamed by the root's owner) was the one the bytes came from, or went to.
    ``check=False``: opened only, its owner and mode not checked.
    FileNotFoundError passes through (nothing staged); a symlink or a file in the folder's place
    is a LayoutError naming it."""

    def __init__(self, path: str | os.PathLike, *, check: bool = True):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        except (FileNotFoundError, PermissionError):
            raise
        except OSError as exc:
            _raise_out_of_fds(self.path, exc)
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            what = "a symlink" if os.path.islink(self.path) else "not a directory"
            raise LayoutError(f"{self.path} is {what}; a staging folder is taken only as a folder of its own, never "
                              f"through a link (another user could point it at their files). Remove it, or stage "
                              f"under a --shm-dir of your own (or ${SHM_ENV})") from None
        if check:
            try:
                _refuse_untrusted(self.path, os.fstat(self.fd), self.path)
            except BaseException:
                os.close(self.fd)
                raise

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "StagingFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self, name: str, flags: int, mode: int = 0o600, *, regular: bool = True) -> int:
        """``name`` in this folder opened with ``flags`` (never through a symlink); with
        ``regular``, LayoutError unless it is a regular file of a trusted user (a named pipe,
        a device or another user's file in its place is refused by name, not read or waited on)."""
        path = self.path / name
        try:
            fd = os.open(name, flags | _NOFOLLOW | (os.O_NONBLOCK if regular else 0), mode, dir_fd=self.fd)
        except OSError as exc:
            _raise_out_of_fds(path, exc)
            if exc.errno != errno.ELOOP:  # named by its whole path, not the bare name dir_fd was given
                raise type(exc)(exc.errno, exc.strerror, str(path)) from None
            raise LayoutError(f"{path}: a symlink where a staged file should be; a staged file is never read or "
                              f"written through a link. Remove {self.path}") from None
        if not regular:
            return fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                from ..fileio import _KINDS

                kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
                raise LayoutError(f"{path}: not a regular file ({kind})")
            _refuse_untrusted(path, st, self.path)
            if not flags & os.O_NONBLOCK:
                os.set_blocking(fd, True)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def stat(self, name: str) -> os.stat_result:
        """``name``'s lstat (FileNotFoundError where absent)."""
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def exists(self, name: str) -> bool:
        try:
            self.stat(name)
            return True
        except FileNotFoundError:
            return False

    def unlink(self, name: str) -> None:
        """Remove ``name`` (a link itself, never its target), quietly where absent."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def touch(self, name: str) -> None:
        os.close(self.open(name, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK, 0o644, regular=False))

    def same_file(self, name: str, fd: int) -> bool:
        """Whether ``name`` still names the file open as ``fd`` (see :func:`_same_file`)."""
        return _same_file(name, fd, self.stat)

    def read_ready(self, name: str) -> "ReadyInfo":
        """The ``.ready`` file ``name`` of this folder, parsed (see :func:`read_ready`)."""
        path = self.path / name
        fd = self.open(name, os.O_RDONLY)  # a regular file of a trusted user: a named pipe had blocked every wait
        try:
            text = _read_bounded(fd, path, MAX_READY_BYTES)
        except OSError as exc:
            raise LayoutError(f"{path}: unreadable .ready file ({exc})") from None
        finally:
            os.close(fd)
        return _parse_ready(path, text)


def _raise_out_of_fds(path: Path, exc: OSError) -> None:
    """FlashBootError naming the limit when ``exc`` says this process (or the system) has no fd left:
    a bare "Too many open files" named none, and another --shm-dir would not help."""
    from ..fileio import out_of_fds

    if (why := out_of_fds(exc)) is not None:
        raise FlashBootError(f"cannot open {path}: {why}") from None


def _read_bounded(fd: int, path: Path, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of ``fd`` (LayoutError past them: a file grown after its size was taken)."""
    ask = min(os.fstat(fd).st_size, max_bytes) + 1
    pieces, total = [], 0
    while total <= max_bytes:
        piece = os.read(fd, ask)
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
        ask = max_bytes + 1 - total
    if total > max_bytes:
        raise LayoutError(f"{path}: more than the {max_bytes:,} bytes a .ready file may hold")
    return b"".join(pieces)


def open_staged(paths: "StagedPaths", flags: int = os.O_RDONLY) -> tuple["ReadyInfo", int]:
    """The ``.ready`` of a staged rank and its image opened with ``flags``, both from one checked
    open of the staging folder (:class:`StagingFolder`): the image a reader maps is the one the
    ``.ready`` beside it vouches for, in the folder whose owner and mode were checked. Returns
    ``(info, fd)``; the caller closes the fd. FileNotFoundError where either is absent."""
    with StagingFolder(paths.dir) as folder:
        info = folder.read_ready(paths.ready.name)
        return info, folder.open(paths.image.name, flags)


# ============================================================================ paths and .ready
def shm_root(shm_dir: str | os.PathLike | None = None) -> Path:
    """Where staged images live: ``shm_dir``, else ``$FLASHBOOT_SHM``, else /dev/shm/flashboot."""
    return Path(shm_dir or os.environ.get(SHM_ENV) or DEFAULT_SHM_ROOT)


_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}
"""statfs ``f_type`` magics of filesystems whose files live in memory (linux/magic.h)."""


def filesystem_magic(path: str | os.PathLike) -> int:
    """The ``f_type`` of statfs(2) for ``path``, or of its nearest existing parent (Python's
    ``os.statvfs`` does not report it)."""
    import ctypes
    import errno as errno_mod

    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"statfs: {errno_mod.errorcode.get(err, err)}", str(path))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF  # f_type comes first, a long


def not_shared_memory_warning(shm_dir: str | os.PathLike | None = None) -> str | None:
    """A warning when the staging root is not on a memory filesystem (tmpfs, ramfs, hugetlbfs):
    staging there writes the image to another disk, and a load reads it back at disk speed."""
    root = shm_root(shm_dir)
    magic = filesystem_magic(root)
    if magic in _MEMORY_FILESYSTEMS:
        return None
    via = "--shm-dir" if shm_dir else f"${SHM_ENV}" if os.environ.get(SHM_ENV) else "the default"
    return (f"warning: the staging root {root} (from {via}) is not shared memory (filesystem magic {magic:#x}, not "
            f"tmpfs, ramfs or hugetlbfs): staged images go to disk and loads read them at disk speed")


def remove_if_empty(directory: str | os.PathLike) -> bool:
    """Remove ``directory`` when it holds nothing (a staging directory whose last file went);
    returns whether it was removed."""
    try:
        os.rmdir(directory)
        return True
    except OSError:  # not empty, absent, or not ours
        return False


def staging_dir(image_dir: str | os.PathLike, shm_dir: str | os.PathLike | None = None) -> Path:
    """The directory under the shm root that holds ``image_dir``'s staged ranks.

    Keyed by the image directory's real path, so two images never share it and any process that
    names the same directory finds the same staged files."""
    real = os.path.realpath(image_dir)
    tag = hashlib.sha256(os.fsencode(real)).hexdigest()[:12]  # a non-UTF-8 name's surrogates: its bytes
    # the name is only a label (the tag is the key): cut to fit NAME_MAX with the tag, or an image
    # folder of more than 242 bytes could never be staged (ENAMETOOLONG)
    label = os.fsencode(os.path.basename(real.rstrip('/')))[:_NAME_MAX - 1 - len(tag)]
    return shm_root(shm_dir) / f"{label.decode(errors='ignore') or 'image'}-{tag}"


_NAME_MAX = 255
"""The longest file name, in bytes, the filesystems of the shm root take."""


@dataclass(frozen=True)
class StagedPaths:
    """Files of one staged rank."""

    dir: Path
    image: Path
    partial: Path
    ready: Path
    lock: Path
    """Held (flock) by the process staging the rank; removed when it is done."""
    users: Path
    """Held shared (flock) by each engine that loads a copy staged inline (:func:`~flashboot.flashload.staging.stage_for_load`)."""
    inline: Path
    """Present while the staged copy is one an engine staged for its own load: the last engine to
    load it removes it (a copy ``flashboot preload`` staged stays)."""


def staged_paths(image_dir, rank: int, shm_dir=None) -> StagedPaths:
    d = staging_dir(image_dir, shm_dir)
    return StagedPaths(d, d / f"rank-{rank}.img", d / f"rank-{rank}.img.partial", d / f"rank-{rank}.ready",
                       d / f"rank-{rank}.lock", d / f"rank-{rank}.users", d / f"rank-{rank}.inline")


PID_FILE = "preload.pid"
"""The preloader's pid file, beside its socket in the image's staging folder."""


def pid_file(image_dir, shm_dir=None) -> Path:
    return staging_dir(image_dir, shm_dir) / PID_FILE


def log_file(image_dir, shm_dir=None) -> Path:
    return staging_dir(image_dir, shm_dir) / "preload.log"


def socket_path(image_dir, shm_dir=None) -> Path:
    return staging_dir(image_dir, shm_dir) / "serve.sock"


def make_dir(path: Path) -> Path:
    """``path`` created with its parents where absent; FlashBootError naming what is in the way
    (a file given as --shm-dir, a filesystem like /proc that takes no folders) instead of the
    bare OSError. A folder removed by another process as it is made (the last engine out, an
    unstage) is made again: ``mkdir(exist_ok=True)`` raises "File exists" when the folder it
    found is gone by the time it looks again."""
    for attempt in range(3):
        try:
            path.mkdir(mode=0o755, parents=True, exist_ok=True)  # not 0777 under umask 0: others could swap its files
            return path
        except FileExistsError as error:
            exc = error
            if attempt < 2 and not _exists(path):
                continue
        except OSError as error:
            exc = error
        break
    blocker = next((p for p in (path, *path.parents) if _exists(p)), None)
    why = (f"{blocker} is not a directory" if blocker is not None and not blocker.is_dir() else
           f"{blocker} takes no new folder {exc.filename} ({exc.strerror})")
    raise FlashBootError(f"cannot create the staging folder {path}: {why}; use another --shm-dir (or "
                         f"${SHM_ENV})") from None


def _same_file(path: Path | str, fd: int, stat=os.stat) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a lock file its last holder removed,
    and maybe another made since, is not the one others lock); ``stat``: how ``path`` is looked up."""
    try:
        st = stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _exists(path: Path) -> bool:
    """``path.exists()``, False where even the stat fails (a name longer than NAME_MAX)."""
    try:
        return path.exists()
    except OSError:
        return False


SUN_PATH_MAX = 107
"""Longest Unix socket path (sun_path holds 108 bytes with the terminating NUL)."""


def check_socket_path(path: Path) -> Path:
    """``path``, or FlashBootError when it is too long to bind or connect to (the kernel's own
    refusal is a bare "AF_UNIX path too long")."""
    n = len(os.fsencode(path))
    if n > SUN_PATH_MAX:
        raise FlashBootError(f"socket path {path} is {n} bytes; Unix sockets allow {SUN_PATH_MAX}: use a shorter "
                             "--shm-dir (or $FLASHBOOT_SHM)")
    return path


@dataclass(frozen=True)
class RankSource:
    """One rank's image on disk, validated by the strict reader (sizes checked, no byte read)."""

    image_dir: str
    rank: int
    image: Any  # flashboot.layouts.Image
    metadata_sha256: str

    @property
    def metadata(self):
        return self.image.metadata

    @property
    def nbytes(self) -> int:
        return self.image.nbytes

    @property
    def path(self) -> Path:
        return self.image.path


def rank_source(image_dir, rank: int, *, tp: int | None = None, ep: int | None = None,
                expected_key=None) -> RankSource:
    """Read and validate rank ``rank`` of the pre-packed image in ``image_dir``.

    Raises LayoutError for a missing or malformed image, a rank the image does not have, a
    tp/ep/key that disagrees with the caller's, or an image file whose size is not the recorded one.
    """
    return begin_rank_source(image_dir, rank, tp=tp, ep=ep, expected_key=expected_key)()


def begin_rank_source(image_dir, rank: int, *, tp: int | None = None, ep: int | None = None,
                      expected_key=None) -> Callable[[], RankSource]:
    """:func:`rank_source` started: the metadata files are read (and hashed) in threads
    (:func:`~flashboot.layouts.image.begin_metadata_read`) while the caller does work that
    releases the GIL too; the call returned decodes, validates and returns the source."""
    from flashboot.layouts.image import begin_metadata_read, open_image

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise LayoutError(f"rank must be a non-negative int, got {rank!r}")
    pending = begin_metadata_read(image_dir, rank)

    def finish() -> RankSource:
        image = open_image(pending.finish(), rank, tp=tp, ep=ep, expected_key=expected_key)
        return RankSource(str(image_dir), rank, image, image.metadata_sha256)  # of the very bytes validated

    return finish


def checksum_fingerprint(digests) -> str:
    """One 64-bit hex fingerprint of a chunk checksum table (each digest weighted by its position)."""
    total = 0
    for i, d in enumerate(digests):
        total = (total + int(d) * (2 * i + 1)) & ((1 << 64) - 1)
    return f"{total:016x}"


@dataclass(frozen=True)
class ReadyInfo:
    """What a ``.ready`` file says about a staged rank."""

    path: Path
    rank: int
    nbytes: int
    staged: str
    source: str
    metadata_sha256: str
    job_id: str
    key_digest: str
    checksum: dict
    verified: bool
    io_mode: str
    io_reason: str
    numa_node: int | None
    numa_reason: str
    threads: int
    read_s: float
    staged_at: float
    pid: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s > 0 else float("inf")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("path")
        return {"format": READY_FORMAT, **d}


MAX_READY_BYTES = 1 << 20
"""A ``.ready`` file is about a KB of JSON; anything past this is not one."""


def read_ready(path: str | os.PathLike) -> ReadyInfo:
    """Parse a ``.ready`` file; LayoutError naming the file when it is malformed, or when its
    staging folder or the file is not of a trusted user (:class:`StagingFolder`)."""
    path = Path(path)
    try:  # the copy it vouches for: every reader of a staged copy comes here
        folder = StagingFolder(path.parent)
    except FileNotFoundError:
        raise
    except OSError as exc:  # NotADirectory and the like: as the file's own open said before
        raise LayoutError(f"{path}: unreadable .ready file ({exc})") from None
    with folder:
        return folder.read_ready(path.name)


def _parse_ready(path: Path, text: bytes) -> ReadyInfo:
    raw = loads(text, f"{path}: unreadable .ready file", LayoutError)
    if not isinstance(raw, dict) or raw.get("format") != READY_FORMAT:
        raise LayoutError(f"{path}: not a {READY_FORMAT} file")
    names = [f.name for f in dataclasses.fields(ReadyInfo) if f.name != "path"]
    missing = [n for n in names if n not in raw]
    if missing:
        raise LayoutError(f"{path}: .ready file lacks {missing}")
    check_fields(raw, _READY_FIELDS, LayoutError, f"{path}: .ready field ")
    return ReadyInfo(path=path, **{n: raw[n] for n in names})


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # compiled at import, not in a first load
_READY_FIELDS = {
    **{n: ("an int >= 0", int_at_least(0)) for n in ("rank", "nbytes")},
    **{n: ("an int >= 1", int_at_least(1)) for n in ("threads", "pid")},
    **{n: ("a string", is_str) for n in ("staged", "source", "job_id", "key_digest", "io_mode", "io_reason",
                                         "numa_reason")},
    "metadata_sha256": ("64 hex digits", lambda v: is_str(v) and _SHA256_HEX.fullmatch(v) is not None),
    "checksum": ("an object", lambda v: type(v) is dict),
    "verified": ("true or false", lambda v: type(v) is bool),
    "numa_node": ("null or an int >= 0", lambda v: v is None or int_at_least(0)(v)),
    **{n: ("a finite number >= 0", finite_at_least(0)) for n in ("read_s", "staged_at")},
}
"""Field -> (what it must be, in words; its test): every field of a ``.ready`` is checked (the
file is outside bytes)."""


def _write_atomic(path: Path, text: str, folder: "StagingFolder | None" = None) -> None:
    """Write ``text`` to a temporary name and rename it into place: readers see all or nothing.
    With ``folder`` (``path``'s, opened), both relative to it: never into a folder swapped in
    since, nor through a symlink planted at the temporary's name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    own = folder is None
    if own:
        folder = StagingFolder(path.parent, check=False)
    try:
        try:
            folder.unlink(tmp.name)  # made anew: a file (or a pipe) planted at its name is not written through
            fd = folder.open(tmp.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, regular=False)
            with open(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            folder.rename(tmp.name, path.name)
        except BaseException:  # a full tmpfs (ENOSPC at the flush): no half-written temporary left behind
            folder.unlink(tmp.name)
            raise
    finally:
        if own:
            folder.close()


def check_ready(info: ReadyInfo, source: RankSource) -> None:
    """Refuse a staged copy that is not of ``source`` (another pre-pack of the same directory)."""
    if info.metadata_sha256 != source.metadata_sha256 or info.nbytes != source.nbytes:
        raise LayoutError(
            f"{info.path}: staged rank {info.rank} is of another pre-pack ({info.nbytes:,} bytes, metadata sha256 "
            f"{info.metadata_sha256[:12]}) than {source.path} ({source.nbytes:,} bytes, {source.metadata_sha256[:12]}); "
            f"re-run flashboot preload {source.image_dir}"
        )


class PreloaderExitedError(WaitTimeoutError):
    """The preloader that was to stage a rank exited before its ``.ready`` appeared: the wait
    ends then, not at its timeout."""


_PID_CHECK_S = 0.25
"""How often a wait checks that the preloader it waits for still runs."""


def wait_ready(image_dir, rank: int, *, timeout_s: float, shm_dir=None,
               stop: threading.Event | None = None) -> ReadyInfo:
    """Block until rank ``rank`` of ``image_dir`` is staged; returns its :class:`ReadyInfo`.

    Raises WaitTimeoutError naming the ``.ready`` path after ``timeout_s`` seconds, or
    PreloaderExitedError as soon as the preloader that ran when the wait began has exited
    without writing it and none runs now (a preloader started later, or in its place, is waited
    for as before), LayoutError at once when the one running stages other ranks only (its pid
    file's), or FlashBootError once ``stop`` is set (the waiter was closed).
    """
    paths = staged_paths(image_dir, rank, shm_dir)
    deadline = time.monotonic() + timeout_s
    delay = _POLL_S
    running = _running_pid(pid_file(image_dir, shm_dir))
    checked, first = time.monotonic(), True
    while True:
        try:
            return read_ready(paths.ready)
        except FileNotFoundError:
            pass
        if running and first:  # a preloader of other ranks never writes this one
            first = False
            ranks = (_read_pid_file(pid_file(image_dir, shm_dir)) or {}).get("ranks")
            if isinstance(ranks, list) and all(type(r) is int for r in ranks) and rank not in ranks:
                raise LayoutError(f"the preloader (pid {running}) for {image_dir} stages ranks {ranks}, not rank {rank}: "
                                  f"{paths.ready} never comes; restart it with that rank too (`flashboot preload "
                                  f"{image_dir} --stop`, then `--ranks {' '.join(map(str, sorted({*ranks, rank})))}`)")
        if running and time.monotonic() - checked >= _PID_CHECK_S:
            checked = time.monotonic()
            now = _running_pid(pid_file(image_dir, shm_dir))
            if now and now != running:  # restarted meanwhile: the new one is waited for, as one started later
                running, first = now, True  # its ranks are asked again
            elif now != running:
                try:
                    return read_ready(paths.ready)  # written just before it exited
                except FileNotFoundError:
                    pass
                raise PreloaderExitedError(
                    f"the preloader (pid {running}) exited before {paths.ready} appeared (rank {rank} of {image_dir} "
                    f"not staged); its log: {log_file(image_dir, shm_dir)}. Restart it, or load with no preloader "
                    "running: the load then streams the image from disk")
        if stop is not None and stop.is_set():
            raise FlashBootError(f"the wait for {paths.ready} (rank {rank} of {image_dir} staged) was stopped after "
                                 f"{timeout_s - max(0.0, deadline - time.monotonic()):.1f} of {timeout_s:g} s")
        if time.monotonic() >= deadline:
            running = _running_pid(pid_file(image_dir, shm_dir))
            dead = None if running else dead_pid(pid_file(image_dir, shm_dir))
            who = (f"a preloader is running (pid {running})" if running else
                   ("no preloader is running" + (f" (the one its pid file names, pid {dead}, was killed: its log "
                                                 f"{log_file(image_dir, shm_dir)})" if dead else "")
                    + f": start one with `flashboot preload {image_dir} --ranks {rank}`"))
            raise WaitTimeoutError(f"waited {timeout_s:g} s for {paths.ready} (rank {rank} of {image_dir} staged); {who}")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)



# ============================================================================ the pid file
def _read_pid_file(path: Path) -> dict | None:
    from ..fileio import read_regular

    try:  # a regular file of a bounded size: a named pipe in its place blocked every load's status check
        d = loads(read_regular(path, MAX_READY_BYTES), str(path), LayoutError)
        return d if isinstance(d, dict) and isinstance(d.get("pid"), int) else {"pid": -1}
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: the staging root is a file
        return None
    except (OSError, ValueError, LayoutError):
        return {"pid": -1}


def _pid_file_held(path: Path) -> bool:
    """Whether a preloader holds the lock on ``path`` (flock, from before it writes the file until
    after it removes it): an empty or half-written pid file whose lock is held is a preloader
    starting, not a stale file (taken for one, it was replaced and two preloaders ran)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a named pipe: no wait for a writer
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: two readers do not see each other as holders
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _running_pid(path: Path) -> int | None:
    """The pid recorded in ``path`` if that process is still the one that wrote it."""
    d = _read_pid_file(path)
    if not d or d["pid"] <= 0:
        return None
    start = proc_start_time(d["pid"])
    return d["pid"] if start is not None and start == d.get("start_time") else None


def dead_pid(path: Path) -> int | None:
    """The pid a stale pid file ``path`` names: its preloader was killed (a clean stop removes the
    file), for a wait that runs out to name it; None where none is named or it still runs."""
    d = _read_pid_file(path)
    return d["pid"] if d and d["pid"] > 0 and not _running_pid(path) else None


@dataclass(frozen=True)
class ServiceStatus:
    """A preloader's pid file, read: running, stale (its process is gone) or absent."""

    path: Path
    pid: int | None
    """-1 (running) while a starting preloader holds the file's lock but has not written it yet."""
    running: bool
    stale: bool
    serve: bool = False


def service_status(image_dir, shm_dir=None, *, path: Path | None = None) -> ServiceStatus:
    """The preloader of ``image_dir``'s pid file (or the one at ``path``), read. Here, not beside
    the service that writes it: a load asks this before its copy, and importing the service (its
    server and staging) cost ~4 ms of a first early call on the 2-core host, before the daemon's
    request."""
    path = pid_file(image_dir, shm_dir) if path is None else path
    d = _read_pid_file(path)
    if d is None:
        return ServiceStatus(path, None, False, False)
    # a pid not written yet under a held lock: starting. A written pid that is gone is not running, even
    # while its lock is held: a killed process keeps its files until its memory is torn down
    running = _running_pid(path) is not None or (d["pid"] <= 0 and _pid_file_held(path))
    return ServiceStatus(path, d["pid"], running, not running, bool(d.get("serve")))


def started_elsewhere(image_dir, shm_dir=None) -> list[tuple[ServiceStatus, str]]:
    """Running preloaders started for ``image_dir`` (the path as given, made absolute) while it
    named another folder than now (a symlink to a model's current version, re-pointed since):
    their staging folders are keyed by the real path they found, so `--status` and `--stop` of
    ``image_dir`` looked only where it leads now. Each: its status and that real path."""
    want, here = os.path.abspath(image_dir), pid_file(image_dir, shm_dir)
    try:
        folders = sorted(shm_root(shm_dir).iterdir())
    except OSError:
        return []
    found = []
    for folder in folders:
        path = folder / PID_FILE
        d = _read_pid_file(path) if path != here else None
        if d and d.get("image_dir") == want and isinstance(d.get("real_image_dir"), str) and _running_pid(path):
            found.append((service_status(image_dir, shm_dir, path=path), d["real_image_dir"]))
    return found


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


