"""The preloader: rank images disk -> shared memory ahead of the engine, and the served-load daemon.

Paper section 3.5. A separate process reads each rank's pre-packed image from disk into
/dev/shm (many threads, ``O_DIRECT``, pages bound to the target GPU's NUMA node) while the
engine starts; a ``.ready`` file, created atomically, tells the engine the copy is complete. The
engine then only pins and copies (:func:`flashboot.stage`, :func:`flashboot.load`).

Pinning runs at a third of the H2D rate, so a long-lived daemon (``serve=True``) keeps each
staged image registered once per residency, listens on a Unix socket, and on request opens the
engine's exported arena and copies the image into it: the engine pays only the descriptor
exchange and the copy (:func:`served_load`, used by ``load(..., served=True)``).

Staging layout, under the shm root (``$FLASHBOOT_SHM`` or ``/dev/shm/flashboot``)::

    <name>-<sha of the image dir's real path>/
        rank-R.img          the staged image (rank-R.img.partial while copying)
        rank-R.ready        JSON: sizes, checksum summary, I/O mode, NUMA node, timings
        preload.pid         the running preloader (JSON: pid, start time); removed on exit
        preload.log         output of a background preloader
        serve.sock          the served-load socket (SOCK_SEQPACKET)
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import errors as _errors
from .errors import (
    CapabilityError, ChecksumMismatchError, FlashBootError, LayoutError, OutOfMemoryError, RendezvousError,
    WaitTimeoutError,
)
from .fdshare import SCM_MAX_FD, recv_more_fds
from .memory import Device

SHM_ENV = "FLASHBOOT_SHM"
DEFAULT_SHM_ROOT = "/dev/shm/flashboot"
READY_FORMAT = "flashboot-ready/1"
DEFAULT_THREADS = 16
DEFAULT_CHUNK_BYTES = 64 << 20
"""Bytes per read: large enough for the disk's queue, small enough to spread over the threads."""
DIRECT_ALIGNMENT = 4096
"""O_DIRECT wants offsets, lengths and buffers aligned to the logical block size (<= 4096)."""
SERVE_CHUNK_BYTES = 1 << 30
"""The daemon's H2D goes in 1 GB chunks (hardware.md: streams and smaller chunks do not help)."""
IO_MODES = ("auto", "direct", "buffered")
_POLL_S = 0.005

# Module-level so tests can simulate a full /dev/shm without mounting a tiny tmpfs.
_pwrite = os.pwrite
_fallocate = os.posix_fallocate


def _fs_free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ============================================================================ paths and .ready
def shm_root(shm_dir: str | os.PathLike | None = None) -> Path:
    """Where staged images live: ``shm_dir``, else ``$FLASHBOOT_SHM``, else /dev/shm/flashboot."""
    return Path(shm_dir or os.environ.get(SHM_ENV) or DEFAULT_SHM_ROOT)


def staging_dir(image_dir: str | os.PathLike, shm_dir: str | os.PathLike | None = None) -> Path:
    """The directory under the shm root that holds ``image_dir``'s staged ranks.

    Keyed by the image directory's real path, so two images never share it and any process that
    names the same directory finds the same staged files."""
    real = os.path.realpath(image_dir)
    tag = hashlib.sha256(real.encode()).hexdigest()[:12]
    return shm_root(shm_dir) / f"{os.path.basename(real.rstrip('/')) or 'image'}-{tag}"


@dataclass(frozen=True)
class StagedPaths:
    """Files of one staged rank."""

    dir: Path
    image: Path
    partial: Path
    ready: Path


def staged_paths(image_dir, rank: int, shm_dir=None) -> StagedPaths:
    d = staging_dir(image_dir, shm_dir)
    return StagedPaths(d, d / f"rank-{rank}.img", d / f"rank-{rank}.img.partial", d / f"rank-{rank}.ready")


def pid_file(image_dir, shm_dir=None) -> Path:
    return staging_dir(image_dir, shm_dir) / "preload.pid"


def log_file(image_dir, shm_dir=None) -> Path:
    return staging_dir(image_dir, shm_dir) / "preload.log"


def socket_path(image_dir, shm_dir=None) -> Path:
    return staging_dir(image_dir, shm_dir) / "serve.sock"


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
    from flashboot.layouts import read_image

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise LayoutError(f"rank must be a non-negative int, got {rank!r}")
    image = read_image(image_dir, rank, tp=tp, ep=ep, expected_key=expected_key)
    return RankSource(str(image_dir), rank, image, image.metadata_sha256)  # of the very bytes validated


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


def read_ready(path: str | os.PathLike) -> ReadyInfo:
    """Parse a ``.ready`` file; LayoutError naming the file when it is malformed."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{path}: unreadable .ready file ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != READY_FORMAT:
        raise LayoutError(f"{path}: not a {READY_FORMAT} file")
    names = [f.name for f in dataclasses.fields(ReadyInfo) if f.name != "path"]
    missing = [n for n in names if n not in raw]
    if missing:
        raise LayoutError(f"{path}: .ready file lacks {missing}")
    return ReadyInfo(path=path, **{n: raw[n] for n in names})


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name and rename it into place: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_ready(info: ReadyInfo, source: RankSource) -> None:
    """Refuse a staged copy that is not of ``source`` (another pre-pack of the same directory)."""
    if info.metadata_sha256 != source.metadata_sha256 or info.nbytes != source.nbytes:
        raise LayoutError(
            f"{info.path}: staged rank {info.rank} is of another pre-pack ({info.nbytes:,} bytes, metadata sha256 "
            f"{info.metadata_sha256[:12]}) than {source.path} ({source.nbytes:,} bytes, {source.metadata_sha256[:12]}); "
            f"re-run flashboot preload {source.image_dir}"
        )


def wait_ready(image_dir, rank: int, *, timeout_s: float, shm_dir=None) -> ReadyInfo:
    """Block until rank ``rank`` of ``image_dir`` is staged; returns its :class:`ReadyInfo`.

    Raises WaitTimeoutError naming the ``.ready`` path after ``timeout_s`` seconds.
    """
    paths = staged_paths(image_dir, rank, shm_dir)
    deadline = time.monotonic() + timeout_s
    delay = _POLL_S
    while True:
        try:
            return read_ready(paths.ready)
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            running = _running_pid(pid_file(image_dir, shm_dir))
            who = (f"a preloader is running (pid {running})" if running else
                   f"no preloader is running: start one with `flashboot preload {image_dir} --ranks {rank}`")
            raise WaitTimeoutError(f"waited {timeout_s:g} s for {paths.ready} (rank {rank} of {image_dir} staged); {who}")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)


# =================================================================================== staging
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

    @property
    def gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s > 0 else float("inf")


class _DirectRefused(Exception):
    """A read under O_DIRECT failed with EINVAL: the filesystem accepts the flag but not the I/O."""


class _Full(Exception):
    def __init__(self, written: int):
        self.written = written


def _open_source(path: Path, io: str) -> tuple[int, str, str]:
    """Open ``path`` for reading: ``(fd, mode, reason)``. O_DIRECT unless ``io`` says buffered or
    the filesystem refuses it (tmpfs does); ``io="direct"`` makes a refusal an error."""
    if io == "buffered":
        return os.open(path, os.O_RDONLY), "buffered", "asked for buffered reads"
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), "o_direct", ""
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if io == "direct":
            raise CapabilityError(f"{path}: the filesystem refuses O_DIRECT (open: EINVAL) and io='direct' was asked") from None
        return os.open(path, os.O_RDONLY), "buffered", "filesystem refuses O_DIRECT (open: EINVAL)"


def _copy_chunks(src_fd: int, dst_fd: int, nbytes: int, *, direct: bool, threads: int, chunk_bytes: int,
                 progress: Callable[[int, int], None] | None, stop: threading.Event | None,
                 numa_node: int | None, src_name: str) -> None:
    """Copy ``nbytes`` from ``src_fd`` to ``dst_fd`` with ``threads`` workers, one chunk at a time each."""
    from .pinning import bind_to_node

    n_chunks = -(-nbytes // chunk_bytes)
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "error": None}

    def take() -> int | None:
        with lock:
            if state["error"] is not None or state["next"] >= n_chunks:
                return None
            i = state["next"]
            state["next"] += 1
            return i

    def worker() -> None:
        buf = mmap.mmap(-1, chunk_bytes)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        try:
            if numa_node is not None:  # the bounce buffer too: it is read right after the disk writes it
                bind_to_node(ctypes.addressof(ctypes.c_char.from_buffer(buf)), chunk_bytes, numa_node)
            while (i := take()) is not None:
                if stop is not None and stop.is_set():
                    raise FlashBootError(f"staging of {src_name} was interrupted")
                off = i * chunk_bytes
                want = min(chunk_bytes, nbytes - off)
                ask = -(-want // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT if direct else want
                got = 0
                while got < want:
                    try:
                        n = os.preadv(src_fd, [view[got:ask]], off + got)
                    except OSError as exc:
                        if direct and exc.errno == errno.EINVAL:
                            raise _DirectRefused(str(exc)) from None
                        raise
                    if n == 0:
                        raise LayoutError(f"{src_name}: ends at byte {off + got:,}; {nbytes:,} bytes were expected "
                                          "(the image file shrank while it was staged)")
                    got += n
                done = 0
                while done < want:
                    try:
                        done += _pwrite(dst_fd, view[done:want], off + done)
                    except OSError as exc:
                        if exc.errno == errno.ENOSPC:
                            raise _Full(off + done) from None
                        raise
                with lock:
                    state["done"] += want
                    total = state["done"]
                if progress is not None:
                    progress(total, nbytes)
        except BaseException as exc:
            with lock:
                if state["error"] is None:
                    state["error"] = exc
        finally:
            try:
                view.release()
                buf.close()
            except BufferError:
                pass  # the stored error's traceback still holds a slice; the buffer goes with it

    pool = [threading.Thread(target=worker, name=f"flashboot-preload-{k}", daemon=True)
            for k in range(max(1, min(threads, n_chunks)))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if state["error"] is not None:
        raise state["error"]


def stage_rank(image_dir, rank: int, *, shm_dir=None, threads: int = DEFAULT_THREADS, io: str = "auto",
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: Any = "cpu", numa_policy: str = "preferred",
               verify: bool = False, force: bool = False, progress: Callable[[int, int], None] | None = None,
               stop: threading.Event | None = None) -> StageResult:
    """Copy rank ``rank`` of ``image_dir`` into shared memory and mark it ready.

    Refuses before any I/O when the shm filesystem lacks the space (OutOfMemoryError with the
    bytes needed and free). A filesystem that fills up during the copy removes the partial file
    and raises OutOfMemoryError too. ``io``: ``auto`` (O_DIRECT, buffered where refused; the
    result says which), ``direct`` or ``buffered``. ``device``: the GPU the rank will load onto;
    the staged pages are bound to its NUMA node where the machine has more than one.
    ``verify`` recomputes the chunk checksums of the staged bytes (ChecksumMismatchError naming
    the chunk). A rank already staged from the same pre-pack is left alone unless ``force``.
    """
    if io not in IO_MODES:
        raise FlashBootError(f"io must be one of {', '.join(IO_MODES)}, got {io!r}")
    if threads < 1 or chunk_bytes < DIRECT_ALIGNMENT or chunk_bytes % DIRECT_ALIGNMENT:
        raise FlashBootError(f"need threads >= 1 and chunk_bytes a positive multiple of {DIRECT_ALIGNMENT} "
                             f"(got {threads}, {chunk_bytes})")
    from .pinning import MappedFile, bind_to_node, gpu_numa_node

    src = rank_source(image_dir, rank)
    paths = staged_paths(image_dir, rank, shm_dir)
    paths.dir.mkdir(parents=True, exist_ok=True)
    nbytes = src.nbytes
    if not force and paths.image.exists():
        try:
            info = read_ready(paths.ready)
            check_ready(info, src)
            if paths.image.stat().st_size == nbytes:
                return StageResult(rank, nbytes, str(paths.image), info.io_mode, "already staged", info.numa_node,
                                   info.numa_reason, info.threads, 0.0, info.verified, skipped=True)
        except (FileNotFoundError, LayoutError):
            pass
    # Withdraw an older copy first: nobody may see .ready beside a half-replaced image.
    for p in (paths.ready, paths.image, paths.partial):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    free = _fs_free_bytes(str(paths.dir))
    if nbytes > free:
        raise OutOfMemoryError(f"staging rank {rank} of {image_dir} into {paths.dir}", nbytes, free)
    dev = Device.parse(device)
    node, numa_reason = gpu_numa_node(dev)
    fd = os.open(paths.partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    mapping = None
    try:
        os.ftruncate(fd, nbytes)
        if node is not None:
            # The policy of a shared tmpfs mapping is the file's: pages written by pwrite land there.
            mapping = MappedFile(str(paths.partial), nbytes, fd=fd)
            bind_to_node(mapping.ptr, nbytes, node, numa_policy)
            numa_reason += f" ({numa_policy})"
        try:
            _fallocate(fd, 0, nbytes)  # reserve the pages now, so a full tmpfs fails here, not at byte N
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise _Full(0) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        t0 = time.perf_counter()
        src_fd, mode, reason = _open_source(src.path, io)
        try:
            try:
                _copy_chunks(src_fd, fd, nbytes, direct=mode == "o_direct", threads=threads, chunk_bytes=chunk_bytes,
                             progress=progress, stop=stop, numa_node=node, src_name=str(src.path))
            except _DirectRefused as exc:
                if io == "direct":
                    raise CapabilityError(f"{src.path}: reads under O_DIRECT fail ({exc}) and io='direct' was asked") from None
                os.close(src_fd)
                src_fd = os.open(src.path, os.O_RDONLY)
                mode, reason = "buffered", f"filesystem refuses O_DIRECT reads ({exc})"
                _copy_chunks(src_fd, fd, nbytes, direct=False, threads=threads, chunk_bytes=chunk_bytes,
                             progress=progress, stop=stop, numa_node=node, src_name=str(src.path))
        finally:
            os.close(src_fd)
        read_s = time.perf_counter() - t0
        if verify:
            _verify_staged(fd, nbytes, src, paths.partial)
        os.rename(paths.partial, paths.image)
        cs = src.metadata.checksums
        info = ReadyInfo(
            path=paths.ready, rank=rank, nbytes=nbytes, staged=str(paths.image), source=str(src.path),
            metadata_sha256=src.metadata_sha256, job_id=src.metadata.job_id, key_digest=src.metadata.key.digest,
            checksum={"algorithm": cs.algorithm, "chunk_bytes": cs.chunk_bytes, "chunks": len(cs.digests),
                      "fingerprint": checksum_fingerprint(cs.digests)},
            verified=verify, io_mode=mode, io_reason=reason, numa_node=node, numa_reason=numa_reason, threads=threads,
            read_s=read_s, staged_at=time.time(), pid=os.getpid())
        _write_atomic(paths.ready, json.dumps(info.to_dict(), indent=1))
        return StageResult(rank, nbytes, str(paths.image), mode, reason, node, numa_reason, threads, read_s, verify)
    except _Full as full:
        _unlink_quietly(paths.partial)
        now_free = _fs_free_bytes(str(paths.dir))
        raise OutOfMemoryError(
            f"staging rank {rank} of {image_dir}: {paths.dir} filled up after {full.written:,} of {nbytes:,} bytes "
            f"(partial file removed)", nbytes, now_free) from None
    except BaseException:
        _unlink_quietly(paths.partial)
        raise
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _verify_staged(fd: int, nbytes: int, src: RankSource, where: Path) -> None:
    from flashboot.kernels.checksum import chunk_checksums_host

    from .pinning import MappedFile

    cs = src.metadata.checksums
    with MappedFile(str(where), nbytes, fd=fd) as m:
        found = chunk_checksums_host(m.array(), cs.chunk_bytes)
    for k, (want, got) in enumerate(zip(cs.digests, found)):
        if want != got:
            start, n = cs.chunk_range(k, nbytes)
            raise ChecksumMismatchError(f"{where} (staged from {src.path}, rank {src.rank})", k, start, n, want, got)


def unstage(image_dir, ranks: list[int] | None = None, *, shm_dir=None) -> list[Path]:
    """Remove staged ranks (all by default) and return the files removed. Refuses while a
    preloader for the directory runs."""
    running = _running_pid(pid_file(image_dir, shm_dir))
    if running:
        raise FlashBootError(f"a preloader for {image_dir} is running (pid {running}); stop it first (--stop)")
    d = staging_dir(image_dir, shm_dir)
    removed = []
    if not d.is_dir():
        return removed
    for p in sorted(d.iterdir()):
        rank_of = p.name.split(".")[0]
        if ranks is None or rank_of in {f"rank-{r}" for r in ranks}:
            if p.is_file() and p.name.startswith("rank-"):
                p.unlink()
                removed.append(p)
    return removed


def read_rate(path: str | os.PathLike, *, io: str = "direct", nbytes: int | None = None,
              block_bytes: int = 16 << 20) -> tuple[float, str]:
    """Sequential single-stream read rate of ``path`` in GB/s, like ``dd bs=16M iflag=direct``.

    Returns ``(gbps, mode)``; falls back to buffered reads where O_DIRECT is refused (mode says).
    """
    fd, mode, _ = _open_source(Path(path), "auto" if io == "direct" else "buffered")
    size = os.fstat(fd).st_size if nbytes is None else nbytes
    buf = mmap.mmap(-1, block_bytes)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < size:
            n = os.preadv(fd, [view], off)
            if n == 0:
                break
            off += n
        dt = time.perf_counter() - t0
    finally:
        view.release()
        buf.close()
        os.close(fd)
    return (off / dt / 1e9 if dt > 0 else float("inf")), mode


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

    def __post_init__(self):
        from .pinning import NUMA_POLICIES

        self.image_dir = str(self.image_dir)
        if not os.path.isdir(self.image_dir):
            raise LayoutError(f"{self.image_dir}: no such image directory")
        if self.io not in IO_MODES:
            raise FlashBootError(f"io must be one of {', '.join(IO_MODES)}, got {self.io!r}")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise FlashBootError(f"threads must be an int >= 1, got {self.threads!r}")
        if self.chunk_bytes < DIRECT_ALIGNMENT or self.chunk_bytes % DIRECT_ALIGNMENT:
            raise FlashBootError(f"chunk_bytes must be a positive multiple of {DIRECT_ALIGNMENT}, got {self.chunk_bytes}")
        if self.numa_policy not in NUMA_POLICIES:
            raise FlashBootError(f"numa_policy must be one of {', '.join(NUMA_POLICIES)}, got {self.numa_policy!r}")
        self.devices = {int(k): str(v) for k, v in (self.devices or {}).items()}

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
        from ._cuda import device_count

        if rank in self.devices:
            return Device.parse(self.devices[rank])
        n = device_count()
        return Device("cuda", rank % n) if n else Device("cpu")


def preload(config: PreloadConfig | dict, *, progress: Callable[[int, int, int], None] | None = None,
            stop: threading.Event | None = None) -> list[StageResult]:
    """Stage every rank of ``config`` (one after the other, each with many threads).

    ``progress(rank, done_bytes, total_bytes)`` is called as bytes land.
    """
    if isinstance(config, dict):
        config = PreloadConfig.from_dict(config)
    results = []
    for rank in config.resolved_ranks():
        cb = (lambda done, total, r=rank: progress(r, done, total)) if progress else None
        results.append(stage_rank(config.image_dir, rank, shm_dir=config.shm_dir, threads=config.threads, io=config.io,
                                  chunk_bytes=config.chunk_bytes, device=config.device_for(rank),
                                  numa_policy=config.numa_policy, verify=config.verify, force=config.force,
                                  progress=cb, stop=stop))
    return results


# ============================================================================ the pid file
def _proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _read_pid_file(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) and isinstance(d.get("pid"), int) else {"pid": -1}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"pid": -1}


def _running_pid(path: Path) -> int | None:
    """The pid recorded in ``path`` if that process is still the one that wrote it."""
    d = _read_pid_file(path)
    if not d or d["pid"] <= 0:
        return None
    start = _proc_start_time(d["pid"])
    return d["pid"] if start is not None and start == d.get("start_time") else None


@dataclass(frozen=True)
class ServiceStatus:
    """A preloader's pid file, read: running, stale (its process is gone) or absent."""

    path: Path
    pid: int | None
    running: bool
    stale: bool
    serve: bool = False


def service_status(image_dir, shm_dir=None) -> ServiceStatus:
    path = pid_file(image_dir, shm_dir)
    d = _read_pid_file(path)
    if d is None:
        return ServiceStatus(path, None, False, False)
    running = _running_pid(path) is not None
    return ServiceStatus(path, d["pid"], running, not running, bool(d.get("serve")))


def _claim_pid_file(path: Path, serve: bool) -> str:
    """Write this process's pid file; returns a note about a stale one it replaced.

    Raises FlashBootError when a live preloader holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    note = ""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            running = _running_pid(path)
            if running and running != os.getpid():
                raise FlashBootError(f"a preloader already runs for this image (pid {running}, pid file {path}); "
                                     "stop it with --stop") from None
            d = _read_pid_file(path) or {}
            note = f"removed stale pid file {path} (pid {d.get('pid')} is gone)"
            _unlink_quietly(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "start_time": _proc_start_time(os.getpid()), "serve": serve,
                       "argv": sys.argv}, f)
        return note
    raise FlashBootError(f"could not claim pid file {path}")


def _release_pid_file(path: Path) -> None:
    d = _read_pid_file(path)
    if d and d.get("pid") == os.getpid():
        _unlink_quietly(path)


def start_background(config: PreloadConfig, *, timeout_s: float = 30.0, extra_argv: list[str] | None = None) -> int:
    """Start ``flashboot preload`` for ``config`` as a detached service; returns its pid.

    Waits (up to ``timeout_s``) until the service has claimed its pid file; its output goes to
    the ``preload.log`` beside it. Raises FlashBootError when one already runs, or with the log's
    tail when the service dies at start.
    """
    status = service_status(config.image_dir, config.shm_dir)
    if status.running:
        raise FlashBootError(f"a preloader already runs for {config.image_dir} (pid {status.pid}); stop it with --stop")
    if status.stale:
        _unlink_quietly(status.path)
    log = log_file(config.image_dir, config.shm_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    # The preload command's own entry point: the service needs no other command to import.
    argv = [sys.executable, "-m", "flashboot.commands.preload", config.image_dir, *config_argv(config),
            *(extra_argv or [])]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _running_pid(status.path) == proc.pid:
            return proc.pid
        code = proc.poll()
        if code is not None:
            if code == 0:
                return proc.pid  # it staged everything and exited already
            raise FlashBootError(f"background preloader exited with status {code} at start; {log}:\n{_tail(log)}")
        time.sleep(0.02)
    raise WaitTimeoutError(f"background preloader (pid {proc.pid}) did not claim {status.path} within {timeout_s:g} s; "
                           f"see {log}")


def _tail(path: Path, nbytes: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-nbytes:].decode(errors="replace")


def config_argv(config: PreloadConfig) -> list[str]:
    """Command-line options that rebuild ``config`` (for the background service)."""
    argv = ["--threads", str(config.threads), "--io", config.io, "--chunk-bytes", str(config.chunk_bytes),
            "--numa-policy", config.numa_policy]
    if config.ranks is not None:
        argv += ["--ranks", *map(str, config.ranks)]
    if config.shm_dir:
        argv += ["--shm-dir", str(config.shm_dir)]
    for rank, dev in sorted(config.devices.items()):
        argv += ["--device", f"{rank}={dev}"]
    if config.verify:
        argv.append("--verify")
    if config.force:
        argv.append("--force")
    if config.serve:
        argv.append("--serve")
    if not config.pin:
        argv.append("--no-pin")
    return argv


def stop_service(image_dir, shm_dir=None, *, timeout_s: float = 30.0) -> str:
    """Stop the preloader of ``image_dir`` (SIGTERM, then wait); returns what happened.

    A stale pid file (its process gone) is removed and reported. Raises WaitTimeoutError when the
    process does not exit within ``timeout_s``.
    """
    status = service_status(image_dir, shm_dir)
    if status.pid is None:
        return f"no preloader runs for {image_dir} (no pid file {status.path})"
    if status.stale:
        _unlink_quietly(status.path)
        return f"no preloader runs for {image_dir}: removed stale pid file {status.path} (pid {status.pid} is gone)"
    pid = status.pid
    start = _proc_start_time(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        raise FlashBootError(f"not permitted to stop preloader pid {pid} (pid file {status.path}): another user's") from None
    except ProcessLookupError:
        return f"preloader pid {pid} exited on its own"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _proc_start_time(pid) != start:
            if status.path.exists() and _running_pid(status.path) is None:
                _unlink_quietly(status.path)  # it died without cleaning up
            return f"stopped preloader pid {pid}"
        try:  # reap it if it is our child (tests start it from this process)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.02)
    raise WaitTimeoutError(f"preloader pid {pid} did not exit within {timeout_s:g} s of SIGTERM")


def run_service(config: PreloadConfig, *, log: Callable[[str], None] = print,
                progress: Callable[[int, int, int], None] | None = None) -> list[StageResult] | None:
    """Run a preloader in this process: claim the pid file, stage (and with ``config.serve``,
    serve until SIGTERM), release the pid file. SIGTERM stops it cleanly: a copy in flight is
    abandoned and its partial file removed. Returns the staging results (None when serving)."""
    path = pid_file(config.image_dir, config.shm_dir)
    note = _claim_pid_file(path, config.serve)
    if note:
        log(note)
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if config.serve:
            PreloadServer(config, stop=stop, log=log).run(progress)
            return None
        results = preload(config, progress=progress, stop=stop)
        for r in results:
            log(_describe_stage(r))
        return results
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _release_pid_file(path)


# ====================================================================== the served-load daemon
@dataclass
class _Resident:
    """One staged rank held by the daemon: mapped and (CUDA) pinned once."""

    rank: int
    event: threading.Event = field(default_factory=threading.Event)
    mapping: Any = None
    pinned: Any = None
    nbytes: int = 0
    metadata_sha256: str = ""
    pin_ms: float = 0.0
    error: BaseException | None = None
    state: str = "staging"


def _error_payload(exc: BaseException) -> dict:
    attrs = {k: v for k, v in vars(exc).items() if isinstance(v, (int, float, str, bool, type(None)))}
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "attrs": attrs}


def _raise_remote(reply: dict, who: str) -> None:
    cls = getattr(_errors, reply.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, FlashBootError)):
        cls = FlashBootError
    exc = cls.__new__(cls)
    Exception.__init__(exc, f"{who}: {reply.get('message', 'failed')}")
    exc.__dict__.update(reply.get("attrs") or {})
    raise exc


class PreloadServer:
    """Stages ranks, keeps them mapped and pinned, and copies them into engines' arenas on request.

    Protocol (``SOCK_SEQPACKET``, one JSON message each way): the engine sends
    ``{"op": "load", "rank", "descriptor", "pci_bus_id", "nbytes", "metadata_sha256",
    "timeout_s"}`` with its arena's fd attached (SCM_RIGHTS); the daemon opens the arena, copies,
    synchronises, closes its mapping and answers ``{"ok": true, "map_ms", "h2d_ms", ...}`` or
    ``{"ok": false, "error", "message"}``. ``{"op": "status"}`` answers what it holds.
    """

    def __init__(self, config: PreloadConfig, *, stop: threading.Event | None = None, log: Callable[[str], None] = print):
        self.config = config
        self.stop = stop or threading.Event()
        self.log = log
        self.ranks = config.resolved_ranks()
        self.residents = {r: _Resident(r) for r in self.ranks}
        self.sock_path = socket_path(config.image_dir, config.shm_dir)
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._copy_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # ---- residency ---------------------------------------------------------------------------
    def _make_resident(self, rank: int) -> None:
        from .pinning import MappedFile, register_host

        res = self.residents[rank]
        src = rank_source(self.config.image_dir, rank)
        paths = staged_paths(self.config.image_dir, rank, self.config.shm_dir)
        check_ready(read_ready(paths.ready), src)
        res.mapping = MappedFile(str(paths.image), src.nbytes)
        res.nbytes, res.metadata_sha256 = src.nbytes, src.metadata_sha256
        dev = self.config.device_for(rank)
        if dev.is_cuda and self.config.pin:
            res.pinned = register_host(res.mapping.ptr, src.nbytes, dev, path=str(paths.image))
            res.pin_ms = res.pinned.pin_ms
        res.state = "pinned" if res.pinned is not None else "mapped"

    def _warm_up(self) -> None:
        """Import and construct what a request needs, so the first engine does not pay for it."""
        from . import arena  # noqa: F401
        from .movers import create_mover

        devices = {self.config.device_for(r) for r in self.ranks}
        for dev in devices:
            mover = create_mover("copy_engine" if dev.is_cuda else "host")
            if not dev.is_cuda:  # compile the host mover's parallel loop (it runs above 1 MiB)
                import numpy as np

                a, b = np.zeros(2 << 20, np.uint8), np.ones(2 << 20, np.uint8)
                mover.copy(a, b, stream=None)
            else:
                import cupy

                with cupy.cuda.Device(dev.index):
                    cupy.cuda.Stream(non_blocking=True).synchronize()

    def run(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Listen, stage every rank and make it resident, then serve until :attr:`stop` is set."""
        self._warm_up()
        self._listen()
        accept = threading.Thread(target=self._accept_loop, name="flashboot-serve-accept", daemon=True)
        accept.start()
        try:
            for rank in self.ranks:
                res = self.residents[rank]
                try:
                    cb = (lambda d, t, r=rank: progress(r, d, t)) if progress else None
                    r = stage_rank(self.config.image_dir, rank, shm_dir=self.config.shm_dir, threads=self.config.threads,
                                   io=self.config.io, chunk_bytes=self.config.chunk_bytes,
                                   device=self.config.device_for(rank), numa_policy=self.config.numa_policy,
                                   verify=self.config.verify, force=self.config.force, progress=cb, stop=self.stop)
                    self.log(_describe_stage(r))
                    self._make_resident(rank)
                    self.log(f"rank {rank}: resident ({res.state}{f', pinned in {res.pin_ms:.0f} ms' if res.pinned else ''})")
                except BaseException as exc:
                    res.error, res.state = exc, "failed"
                    self.log(f"rank {rank}: failed: {type(exc).__name__}: {exc}")
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                finally:
                    res.event.set()
                if self.stop.is_set():
                    break
            self.log(f"serving {len(self.ranks)} rank(s) on {self.sock_path}")
            while not self.stop.wait(0.2):
                pass
        finally:
            self.close()
            accept.join(timeout=2)

    def close(self) -> None:
        """Stop listening, unpin and unmap everything (the staged files stay)."""
        self.stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            _unlink_quietly(self.sock_path)
        for t in list(self._threads):
            t.join(timeout=30)
        for res in self.residents.values():
            if res.pinned is not None:
                try:
                    res.pinned.unregister()
                except FlashBootError as exc:
                    self.log(f"rank {res.rank}: unpinning failed: {exc}")
                res.pinned = None
            if res.mapping is not None:
                res.mapping.close()
                res.mapping = None

    # ---- the socket --------------------------------------------------------------------------
    def _listen(self) -> None:
        self.sock_path.parent.mkdir(parents=True, exist_ok=True)
        _unlink_quietly(self.sock_path)  # a leftover of a dead daemon (the pid file says we own the dir)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o600)  # same user only: requests carry descriptors of GPU memory
        s.listen(64)
        s.settimeout(0.2)
        self._listener = s

    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), name="flashboot-serve-conn", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            with conn:
                try:
                    conn.settimeout(10)
                    msg, fds, _flags, _ = socket.recv_fds(conn, 1 << 20, SCM_MAX_FD)
                    if not msg:
                        return
                    req = json.loads(msg)
                    op = req.get("op")
                    if op == "status":
                        reply = self.status()
                    elif op == "load":
                        if not fds:
                            raise RendezvousError("load request without the arena's fd attached")
                        count = len(req.get("descriptor", {}).get("fds", ()))
                        recv_more_fds(conn, fds, count, timeout_s=10)  # arenas of > SCM_MAX_FD segments
                        reply = self._serve_load(req, fds)
                    else:
                        raise FlashBootError(f"unknown request op {op!r}; known: load, status")
                except BaseException as exc:  # every failure goes back to the engine, named
                    reply = _error_payload(exc)
                    self.log(f"request failed: {type(exc).__name__}: {exc}")
                conn.settimeout(10)
                conn.send(json.dumps(reply).encode())
        except OSError as exc:
            self.log(f"engine connection lost: {exc}")
        finally:
            for fd in fds:
                os.close(fd)

    def status(self) -> dict:
        return {"ok": True, "pid": os.getpid(), "image_dir": self.config.image_dir,
                "ranks": {str(r): {"state": res.state, "nbytes": res.nbytes, "pin_ms": res.pin_ms,
                                   "error": str(res.error) if res.error else None}
                          for r, res in self.residents.items()}}

    def _lock_for(self, key: str) -> threading.Lock:
        with self._locks_lock:
            return self._copy_locks.setdefault(key, threading.Lock())

    def _serve_load(self, req: dict, fds: list[int]) -> dict:
        from .arena import Arena, ArenaDescriptor
        from .movers import create_mover

        rank = req.get("rank")
        res = self.residents.get(rank)
        if res is None:
            raise LayoutError(f"this preloader serves ranks {self.ranks} of {self.config.image_dir}; rank {rank!r} was asked")
        timeout_s = float(req.get("timeout_s", 60))
        if not res.event.wait(timeout_s):
            raise WaitTimeoutError(f"rank {rank} of {self.config.image_dir} was not staged and pinned within "
                                   f"{timeout_s:g} s (daemon pid {os.getpid()}, state {res.state})")
        if res.error is not None:
            return {**_error_payload(res.error), "message": f"staging rank {rank} failed in the daemon: {res.error}"}
        if req.get("metadata_sha256") != res.metadata_sha256 or req.get("nbytes") != res.nbytes:
            raise LayoutError(f"the daemon holds rank {rank} of another pre-pack ({res.nbytes:,} bytes, metadata "
                              f"{res.metadata_sha256[:12]}) than the engine asked for ({req.get('nbytes')} bytes, "
                              f"{str(req.get('metadata_sha256'))[:12]}); restart the preloader")
        desc = ArenaDescriptor.from_dict(req["descriptor"])
        t0 = time.perf_counter()
        if desc.backend == "cuda":
            index = _device_by_bus_id(req.get("pci_bus_id"), desc.device_index)
            desc = dataclasses.replace(desc, device_index=index)  # the engine's ordinal may differ from ours
            arena = Arena.open(desc, device=index, fds=fds)
        else:
            arena = Arena.open(desc, device="cpu", fds=fds)
        try:
            map_ms = (time.perf_counter() - t0) * 1e3
            if arena.nbytes < res.nbytes:
                raise OutOfMemoryError(f"engine arena {desc.arena_id} for rank {rank}", res.nbytes, arena.nbytes)
            from .memory import CPU, Span

            src = Span(res.mapping.ptr, res.nbytes, CPU, pinned=res.pinned is not None, owner=res.mapping)
            with self._lock_for(str(arena.device)):
                t1 = time.perf_counter()
                if arena.device.is_cuda:
                    import cupy

                    mover = create_mover("copy_engine")
                    with cupy.cuda.Device(arena.device.index):
                        stream = cupy.cuda.Stream(non_blocking=True)
                        for off in range(0, res.nbytes, SERVE_CHUNK_BYTES):
                            n = min(SERVE_CHUNK_BYTES, res.nbytes - off)
                            mover.copy(arena.span(off, n), src.sub(off, n), stream=stream)
                        stream.synchronize()
                else:
                    create_mover("host").copy(arena.span(0, res.nbytes), src, stream=None)
                h2d_ms = (time.perf_counter() - t1) * 1e3
        finally:
            arena.close()
        return {"ok": True, "rank": rank, "nbytes": res.nbytes, "map_ms": map_ms, "h2d_ms": h2d_ms,
                "pinned": res.pinned is not None, "pin_ms": res.pin_ms, "pid": os.getpid()}


def _device_by_bus_id(bus_id: str | None, fallback: int) -> int:
    """This process's ordinal of the GPU with PCI address ``bus_id`` (CUDA_VISIBLE_DEVICES may differ)."""
    if not bus_id:
        return fallback
    from . import _cuda

    drv = _cuda.driver()
    dev = _cuda.check(drv.cuDeviceGetByPCIBusId(bus_id.encode()), f"cuDeviceGetByPCIBusId({bus_id})")
    return int(dev)


def _describe_stage(r: StageResult) -> str:
    if r.skipped:
        return f"rank {r.rank}: already staged at {r.staged} ({r.nbytes:,} bytes)"
    how = r.io_mode + (f" ({r.io_reason})" if r.io_reason else "")
    numa = f"NUMA node {r.numa_node}" if r.numa_node is not None else f"no NUMA binding: {r.numa_reason}"
    return (f"rank {r.rank}: staged {r.nbytes:,} bytes in {r.read_s:.3f} s ({r.gbps:.2f} GB/s), {r.threads} threads, "
            f"{how}; {numa}{'; verified' if r.verified else ''}")


# ========================================================================= the engine's side
def _connect(path: Path, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(str(path))
            return s
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            s.close()
            last = type(exc).__name__
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(f"waited {timeout_s:g} s for the preloader's socket {path} ({last}); is "
                                   "`flashboot preload DIR --serve` running?")
        time.sleep(_POLL_S)


def _request(path: Path, req: dict, *, connect_timeout_s: float, reply_timeout_s: float) -> dict:
    with _connect(path, connect_timeout_s) as s:
        s.sendall(json.dumps(req).encode())
        return _read_reply(s, path, f"{req.get('op')!r} for rank {req.get('rank')}", reply_timeout_s)


def _read_reply(sock: socket.socket, path: Path, what: str, timeout_s: float) -> dict:
    """The daemon's JSON reply on ``sock``, waiting at most ``timeout_s``; errors name ``what``."""
    sock.settimeout(timeout_s)
    try:
        raw = sock.recv(1 << 20)
    except socket.timeout:
        raise WaitTimeoutError(f"the preloader at {path} did not answer {what} within {timeout_s:g} s") from None
    if not raw:
        raise RendezvousError(f"the preloader at {path} closed the connection without answering")
    return json.loads(raw)


def serve_status(image_dir, shm_dir=None, *, timeout_s: float = 10.0) -> dict:
    """Ask a running served-load daemon what it holds."""
    path = socket_path(image_dir, shm_dir)
    reply = _request(path, {"op": "status"}, connect_timeout_s=timeout_s, reply_timeout_s=timeout_s)
    if not reply.get("ok"):
        _raise_remote(reply, f"preloader at {path}")
    return reply


def served_ready(image_dir, rank: int, metadata_sha256: str, where: str, *, timeout_s: float,
                 shm_dir=None) -> ReadyInfo:
    """Wait for the ``.ready`` of rank ``rank`` staged from the metadata whose sha256 is
    ``metadata_sha256`` (read from ``where``); returns it. The preloader writes ``.ready`` only
    after its strict reader accepted that metadata and the image was staged, so its ``nbytes``
    is the validated image size.

    A ``.ready`` of another pre-pack is waited out while a preloader runs (it may be re-staging)
    and refused otherwise, or at ``timeout_s`` (LayoutError naming both). WaitTimeoutError names
    the ``.ready`` path, and the daemon's socket when none listens.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = wait_ready(image_dir, rank, timeout_s=max(0.0, deadline - time.monotonic()), shm_dir=shm_dir)
        except WaitTimeoutError as exc:
            sock = socket_path(image_dir, shm_dir)
            if sock.exists():
                raise
            raise WaitTimeoutError(f"{exc}; and no served-load daemon listens at {sock}: is `flashboot preload "
                                   f"{image_dir} --serve` running?") from None
        if info.metadata_sha256 == metadata_sha256:
            return info
        if _running_pid(pid_file(image_dir, shm_dir)) is None or time.monotonic() >= deadline:
            raise LayoutError(
                f"{info.path}: staged rank {rank} is of another pre-pack ({info.nbytes:,} bytes, metadata sha256 "
                f"{info.metadata_sha256[:12]}) than {where} ({metadata_sha256[:12]}); re-run flashboot preload "
                f"{image_dir}")
        time.sleep(_POLL_S)


class ServedCopy:
    """A served load in flight: the request, with the arena's fd, is with the daemon, which maps
    the arena and copies into it; :meth:`wait` reads its reply. Made by :func:`start_served_load`."""

    def __init__(self, sock: socket.socket, path: Path, rank: int, reply_timeout_s: float):
        self._sock: socket.socket | None = sock
        self.path, self.rank, self.reply_timeout_s = path, rank, reply_timeout_s
        self._reply: dict | None = None
        self._error: BaseException | None = None

    def wait(self) -> dict:
        """Block until the daemon answers (at most ``reply_timeout_s``); returns its reply
        (``h2d_ms``, ``map_ms``, ``pinned``...) or raises the daemon's error with its class."""
        if self._sock is not None:
            sock, self._sock = self._sock, None
            try:
                reply = _read_reply(sock, self.path, f"'load' for rank {self.rank}", self.reply_timeout_s)
                if not reply.get("ok"):
                    _raise_remote(reply, f"served load of rank {self.rank} by the preloader at {self.path}")
                self._reply = reply
            except BaseException as exc:
                self._error = exc
            finally:
                sock.close()
        if self._error is not None:
            raise self._error
        return self._reply

    def settle(self) -> None:
        """Wait for the daemon to be done with the arena, ignoring how it went: a failing load
        calls this before it closes the arena."""
        try:
            self.wait()
        except Exception:
            pass


def start_served_load(arena, *, image_dir, rank: int, nbytes: int, metadata_sha256: str, timeout_s: float,
                      shm_dir=None) -> ServedCopy:
    """Send the daemon for ``image_dir`` a request to copy rank ``rank`` (``nbytes``, staged from
    the metadata with sha256 ``metadata_sha256``) into ``arena``; returns at once.

    The arena's descriptor travels with its fd attached. The daemon refuses a request whose
    sha256 or size differ from what it holds. The socket's appearance is awaited up to
    ``timeout_s``; the reply (:meth:`ServedCopy.wait`) up to ``timeout_s`` (the daemon's
    staging) plus 60 s plus 1 s per GB.
    """
    from .fdshare import send_fds

    desc = arena.export()
    req = {"op": "load", "rank": rank, "descriptor": desc.to_dict(), "nbytes": nbytes,
           "metadata_sha256": metadata_sha256, "timeout_s": timeout_s, "pci_bus_id": None}
    if arena.device.is_cuda:
        from .pinning import gpu_pci_bus_id

        req["pci_bus_id"] = gpu_pci_bus_id(arena.device)
    path = socket_path(image_dir, shm_dir)
    sock = _connect(path, timeout_s)
    try:
        send_fds(sock, list(desc.fds), json.dumps(req).encode())
    except BaseException:
        sock.close()
        raise
    return ServedCopy(sock, path, rank, timeout_s + 60 + nbytes / 1e9)


def served_load(arena, source: RankSource, *, timeout_s: float, shm_dir=None) -> dict:
    """Have the daemon for ``source.image_dir`` copy rank ``source.rank`` into ``arena`` and wait
    for it (:func:`start_served_load` then :meth:`ServedCopy.wait`); returns the daemon's reply
    (``map_ms``, ``h2d_ms``...)."""
    return start_served_load(arena, image_dir=source.image_dir, rank=source.rank, nbytes=source.nbytes,
                             metadata_sha256=source.metadata_sha256, timeout_s=timeout_s, shm_dir=shm_dir).wait()


__all__ = [
    "PreloadConfig", "PreloadServer", "RankSource", "ReadyInfo", "ServedCopy", "ServiceStatus", "StageResult",
    "StagedPaths", "check_ready", "pid_file", "preload", "rank_source", "read_rate", "read_ready", "serve_status",
    "served_load", "served_ready", "start_served_load",
    "service_status", "shm_root", "socket_path", "stage_rank", "staged_paths", "staging_dir", "start_background",
    "stop_service", "unstage", "run_service", "wait_ready", "config_argv", "log_file",
]
