"""Writing one rank's image: bytes straight to their final offsets (their chunk checksums summed
as they are written: no read-back), then the metadata last, each step durable (fsync) before the next."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from pathlib import Path

from flashboot.errors import LayoutError
from flashboot.fileio import fsync_dir

from .format import (
    DEFAULT_CHUNK_BYTES, IMAGE_FILE, METADATA_FILE, ChecksumTable, ImageMetadata, Layout, TensorEntry,
)
from .table import TABLE_FILE, decode_table, encode_table

_MAX_PWRITE = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below
_PAGE = 4096


def pwrite_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte is written."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:done + _MAX_PWRITE], offset + done)
        if n <= 0:
            raise LayoutError(f"pwrite at offset {offset + done:,} wrote {n} bytes")
        done += n


def _preallocate(fd: int, nbytes: int) -> None:
    """Allocate the file's blocks up front: pieces arrive out of order and from several threads,
    and ext4 then places them contiguously (measured here: 4 threads writing 4 MB pieces, 1.0 GB/s
    preallocated vs 0.4-0.55 GB/s into a sparse file). Filesystems without it (tmpfs before 6.x,
    some FUSE) keep the sparse file."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise LayoutError(f"cannot allocate {nbytes:,} bytes for the image: {exc.strerror}") from None


class ImageWriter:
    """One rank's image file, sized to the layout up front (padding reads as zeros), filled
    piece by piece at final offsets with ``pwrite`` (from several threads at once if need be);
    :meth:`finish` adds the metadata file, which is written last and atomically.

    The chunk checksums of ``chunk_bytes`` are summed from the pieces as they are written
    (:class:`~flashboot.kernels.checksum.ChunkDigests`), so the image is never read back. The
    pages a write fills whole are handed to the kernel's writeback at once
    (``posix_fadvise(DONTNEED)`` starts it and then drops them from the page cache): the disk
    writes while the checkpoint is still being read, instead of in one ``fsync`` at the end.
    """

    def __init__(self, rank_dir: Path, layout: Layout, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        from flashboot.kernels.checksum import ChunkDigests

        self.rank_dir = Path(rank_dir)
        self.layout = layout
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.rank_dir / IMAGE_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, layout.image_nbytes)
        _preallocate(self.fd, layout.image_nbytes)
        self.chunk_bytes = chunk_bytes
        self._digests = ChunkDigests(layout.image_nbytes, chunk_bytes)
        self._lock = threading.Lock()
        self.written_nbytes = 0

    def write(self, entry: TensorEntry, elem_offset: int, data) -> None:
        """Write ``data`` (bytes-like or a uint8 array) at element ``elem_offset`` of tensor ``entry``.
        Thread-safe: pieces are disjoint, the checksum sums are added under a lock."""
        view = memoryview(data).cast("B")
        start = entry.offset + elem_offset * entry.itemsize
        if elem_offset < 0 or start + view.nbytes > entry.end:
            raise LayoutError(f"{self.path}: write of {view.nbytes:,} bytes at element {elem_offset} overruns "
                              f"tensor {entry.name!r} (bytes {entry.offset:,}..{entry.end:,})")
        pwrite_all(self.fd, view, start)
        self._digests.add(start, view)
        first, last = -(-start // _PAGE) * _PAGE, (start + view.nbytes) // _PAGE * _PAGE
        if last > first:  # pages no other piece shares: start their writeback now
            os.posix_fadvise(self.fd, first, last - first, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.written_nbytes += view.nbytes

    def checksums(self, chunk_bytes: int | None = None) -> ChecksumTable:
        """Chunk digests of the file as written: summed from the writes when ``chunk_bytes`` is
        the writer's (the default), else read back (one chunk in memory at a time)."""
        if chunk_bytes is None or chunk_bytes == self.chunk_bytes:
            return ChecksumTable(self.chunk_bytes, tuple(self._digests.digests()))
        return self.read_back_checksums(chunk_bytes)

    def read_back_checksums(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ChecksumTable:
        """Chunk digests of the file read back from the filesystem."""
        from flashboot.kernels.checksum import checksum_host

        n = self.layout.image_nbytes
        buf = bytearray(min(chunk_bytes, n))
        digests = []
        for start in range(0, n, chunk_bytes):
            nbytes = min(chunk_bytes, n - start)
            view = memoryview(buf)[:nbytes]
            got = 0
            while got < nbytes:
                n_read = os.preadv(self.fd, [view[got:]], start + got)
                if n_read <= 0:
                    break
                got += n_read
            if got != nbytes:
                raise LayoutError(f"{self.path}: read back {got:,} of {nbytes:,} bytes at {start:,}")
            digests.append(checksum_host(view))
            view.release()
        return ChecksumTable(chunk_bytes, tuple(digests))

    def finish(self, meta: ImageMetadata) -> None:
        """fsync the image, then write ``metadata.json`` (temp file, fsync, rename, fsync dir)."""
        if meta.image_nbytes != self.layout.image_nbytes:
            raise LayoutError(f"{self.path}: metadata says {meta.image_nbytes:,} bytes, layout {self.layout.image_nbytes:,}")
        os.fsync(self.fd)
        self.close()
        text = meta.to_json().encode()
        table = encode_table(meta.tensors, text)  # before metadata.json, whose arrival means complete
        if table is not None:  # the writer writes only what the strict reader takes
            decode_table(table, text, str(self.rank_dir / TABLE_FILE))
        for name, data in ((TABLE_FILE, table), (METADATA_FILE, text)):
            if data is None:
                continue
            tmp = self.rank_dir / (name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.rank_dir / name)
        fsync_dir(self.rank_dir)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


JOB_TMP_MARK = ".flashboot-job"
"""Dropped into a job's temp directory (``OUT/.tmp-<job>``) when it is made: a later job removes
only temp directories that carry it, never a ``.tmp-*`` of someone else's."""
RANK_DIR_FILES = frozenset({IMAGE_FILE, METADATA_FILE, TABLE_FILE, METADATA_FILE + ".tmp", TABLE_FILE + ".tmp"})
"""What a rank directory of an image holds. A job replaces every ``rank-N`` directory of its
output, so one holding anything else is not replaced (:func:`check_out_dir`)."""


def job_tmp_path(out_dir: Path, job_id: str) -> Path:
    """Where job ``job_id`` writes in ``out_dir`` until its commit (:func:`make_job_tmp`)."""
    return Path(out_dir) / f".tmp-{job_id[:12]}"


class JobTmp:
    """A job's temp directory ``out_dir/.tmp-<job>`` (:attr:`path`), made (or joined: every rank of
    an engine job makes it), marked as a job's (:data:`JOB_TMP_MARK`) and claimed: this process
    holds a shared lock on the mark until :meth:`close`. An engine job's ranks write theirs before
    taking ``OUT/.lock``, and a ``flashboot prepack`` into the same output had swept it as stale
    under them (:func:`sweep_stale_jobs` now leaves a claimed one alone)."""

    def __init__(self, out_dir: Path, job_id: str):
        self.path = job_tmp_path(out_dir, job_id)
        self.path.mkdir(parents=True, exist_ok=True)
        mark = self.path / JOB_TMP_MARK
        self._fd = os.open(mark, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        except OSError as exc:  # ENOLCK: the commit's OUT/.lock could not be taken there either
            self.close()
            raise LayoutError(f"cannot lock {mark} ({exc.strerror}): pre-pack writes an image only where no other "
                              "job can sweep it meanwhile; choose an output on a local filesystem") from None

    def close(self) -> None:
        """Let the claim go (idempotent): the job is committed or given up."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "JobTmp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_job_tmp(out_dir: Path, job_id: str) -> JobTmp:
    """:class:`JobTmp` of job ``job_id`` in ``out_dir``; close it once the job is committed or given up."""
    return JobTmp(out_dir, job_id)


def sweep_stale_jobs(out_dir: Path, keep: Path | None = None) -> None:
    """Remove the temp directories interrupted jobs left in ``out_dir`` (the caller holds its
    lock): only those marked as a job's (:data:`JOB_TMP_MARK`), not a symlink, not ``keep``, and
    not claimed by a job still writing it (:class:`JobTmp`)."""
    import shutil

    for stale in Path(out_dir).glob(".tmp-*"):
        if stale == keep or stale.is_symlink() or not stale.is_dir():
            continue
        try:
            fd = os.open(stale / JOB_TMP_MARK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no mark (not a job's), or a link in its place
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a job writes it still (or the lock cannot be had): not stale
                continue
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            os.close(fd)


def check_out_dir(out_dir: Path) -> None:
    """LayoutError unless pre-pack may write an image into ``out_dir``: it is not itself a rank
    directory of an image (a reader takes the ``metadata.json`` there first, so the new job would
    never be read), and its ``rank-N`` directories hold only what pre-pack writes (they are all
    replaced, and anything else in them would be deleted with them: results, a checkpoint)."""
    from .image import is_rank_dir_name, list_rank_dirs

    out_dir = Path(out_dir)
    for name in (METADATA_FILE, IMAGE_FILE):
        if (out_dir / name).exists():
            raise LayoutError(f"{out_dir} holds {name}: it is one rank's directory of an image, not an image "
                              "directory; pre-pack into the directory above it, or into another")
    rank_dirs = list_rank_dirs(out_dir)
    others = sorted(p.name for p in out_dir.iterdir() if p not in rank_dirs.values() and is_rank_dir_name(p.name))
    if others:  # the commit renames rank-N directories over these names: a file there failed it midway
        raise LayoutError(f"{out_dir} holds {', '.join(others[:5])}, which is no directory: pre-pack writes its "
                          "ranks as rank-N directories and will not replace it; move it, or choose another output "
                          "directory")
    for rank_dir in sorted(rank_dirs.values()):
        foreign = sorted(p.name for p in rank_dir.iterdir() if p.name not in RANK_DIR_FILES or not p.is_file())
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise LayoutError(f"{rank_dir} holds {shown}, which pre-pack did not write; a pre-pack into {out_dir} "
                              "replaces every rank-N directory there, so it will not: move them, or choose another "
                              "output directory")


def commit_job(tmp: Path, out_dir: Path, job: dict, ranks: list[int]) -> None:
    """Publish a pre-pack written into ``tmp`` (its ``rank-R/`` directories) as ``out_dir``:
    :func:`stage_job`, then :func:`publish_job`."""
    stage_job(tmp, out_dir, job)
    publish_job(tmp, out_dir, ranks)


def stage_job(tmp: Path, out_dir: Path, job: dict) -> None:
    """Write the job file of a pre-pack written into ``tmp`` there, synced; nothing in
    ``out_dir`` is touched yet, so a failure here (a full disk) leaves the old image whole and
    the caller may discard ``tmp``.

    Each entry of ``job["ranks"]`` gets ``metadata_sha256``, the sha256 of that rank's
    ``metadata.json`` as written, which every reader checks (tamper evidence, FORMAT.md).
    """
    import json

    from .format import JOB_FILE
    from .image import rank_dir_name

    check_out_dir(out_dir)  # again at the commit, under the lock: the rank directories it moves aside
    for entry in job["ranks"]:
        meta = tmp / rank_dir_name(entry["rank"]) / METADATA_FILE
        entry["metadata_sha256"] = hashlib.sha256(meta.read_bytes()).hexdigest()
    with open(tmp / JOB_FILE, "w") as f:
        json.dump(job, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def publish_job(tmp: Path, out_dir: Path, ranks: list[int]) -> None:
    """Swap the job staged in ``tmp`` (:func:`stage_job`) into ``out_dir``.

    The order makes a crash at any point safe: the old job file goes first (an image without it
    is never taken as complete), the old rank directories are moved aside, the new ones moved in,
    and the new job file renamed in last. ``tmp`` is removed at the end.
    """
    import shutil

    from .format import JOB_FILE
    from .image import list_rank_dirs, rank_dir_name

    old_job = out_dir / JOB_FILE
    if old_job.exists():
        old_job.unlink()
        fsync_dir(out_dir)
    trash = tmp / "replaced"
    trash.mkdir()
    for old in list_rank_dirs(out_dir).values():
        os.rename(old, trash / old.name)
    for r in ranks:
        os.rename(tmp / rank_dir_name(r), out_dir / rank_dir_name(r))
    fsync_dir(out_dir)
    os.rename(tmp / JOB_FILE, out_dir / JOB_FILE)
    fsync_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
