"""Writing one rank's image: bytes straight to their final offsets, then checksums, then the
metadata last, each step durable (fsync) before the next."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from flashboot.errors import LayoutError

from .format import (
    DEFAULT_CHUNK_BYTES, IMAGE_FILE, METADATA_FILE, ChecksumTable, ImageMetadata, Layout, TensorEntry,
)

_MAX_PWRITE = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below


def pwrite_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte is written."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:done + _MAX_PWRITE], offset + done)
        if n <= 0:
            raise LayoutError(f"pwrite at offset {offset + done:,} wrote {n} bytes")
        done += n


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ImageWriter:
    """One rank's image file, sized to the layout up front (padding reads as zeros), filled
    piece by piece at final offsets with ``pwrite``; :meth:`finish` adds checksums and the
    metadata file, which is written last and atomically."""

    def __init__(self, rank_dir: Path, layout: Layout):
        self.rank_dir = Path(rank_dir)
        self.layout = layout
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.rank_dir / IMAGE_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, layout.image_nbytes)
        self.written_nbytes = 0

    def write(self, entry: TensorEntry, elem_offset: int, data) -> None:
        """Write ``data`` (bytes-like) at element ``elem_offset`` of tensor ``entry``."""
        view = memoryview(data).cast("B")
        start = entry.offset + elem_offset * entry.itemsize
        if elem_offset < 0 or start + view.nbytes > entry.end:
            raise LayoutError(f"{self.path}: write of {view.nbytes:,} bytes at element {elem_offset} overruns "
                              f"tensor {entry.name!r} (bytes {entry.offset:,}..{entry.end:,})")
        pwrite_all(self.fd, view, start)
        self.written_nbytes += view.nbytes

    def checksums(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ChecksumTable:
        """Chunk digests of the file as written (read back, one chunk in memory at a time)."""
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
        tmp = self.rank_dir / (METADATA_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(meta.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.rank_dir / METADATA_FILE)
        fsync_dir(self.rank_dir)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


def commit_job(tmp: Path, out_dir: Path, job: dict, ranks: list[int]) -> None:
    """Publish a pre-pack written into ``tmp`` (its ``rank-R/`` directories) as ``out_dir``.

    Each entry of ``job["ranks"]`` gets ``metadata_sha256``, the sha256 of that rank's
    ``metadata.json`` as written, which every reader checks (tamper evidence, FORMAT.md).

    The order makes a crash at any point safe: the job file is written and synced in ``tmp``;
    the old job file goes first (an image without it is never taken as complete), the old rank
    directories are moved aside, the new ones moved in, and the new job file renamed in last.
    ``tmp`` is removed at the end.
    """
    import json
    import shutil

    from .format import JOB_FILE
    from .image import list_rank_dirs, rank_dir_name

    for entry in job["ranks"]:
        meta = tmp / rank_dir_name(entry["rank"]) / METADATA_FILE
        entry["metadata_sha256"] = hashlib.sha256(meta.read_bytes()).hexdigest()
    with open(tmp / JOB_FILE, "w") as f:
        json.dump(job, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
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
