"""The disk under a benchmark: evict a file from the page cache, and measure the disk's
sequential write rate (the read rate is :func:`flashboot.fileio.read_rate`).

Benchmarks that read from or write to a real disk call these between steps, so each step
measures the disk, not the page cache left by the step before."""

from __future__ import annotations

import mmap
import os
import time


def drop_file_cache(path: str | os.PathLike) -> str:
    """Evict ``path``'s pages from the page cache (written back first); returns how, for the report.

    ``posix_fadvise(DONTNEED)`` on the file, plus ``/proc/sys/vm/drop_caches`` where this process
    may write it (root). On tmpfs nothing can be evicted: the pages are the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    how = "posix_fadvise(DONTNEED)"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        how += " + drop_caches"
    except OSError:
        pass
    return how


def write_rate(directory: str | os.PathLike, nbytes: int, *, block_bytes: int = 16 << 20) -> float:
    """Sequential write rate in GB/s into a new file in ``directory``, fsync included (like
    ``dd bs=16M conv=fsync``), its blocks allocated first as pre-pack's are (``posix_fallocate``,
    where the filesystem has it); the file is removed afterwards."""
    path = os.path.join(directory, f".flashboot-write-rate-{os.getpid()}")
    buf = mmap.mmap(-1, block_bytes)
    buf.write(os.urandom(4096) * (block_bytes // 4096))  # not zeros: some disks compress or skip them
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            pass  # not every filesystem preallocates: then as dd does
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(buf)[: min(block_bytes, nbytes - done)])
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        os.unlink(path)
    return done / dt / 1e9 if dt > 0 else float("inf")


__all__ = ["drop_file_cache", "write_rate"]
