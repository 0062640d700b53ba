"""The bytes of one rank copied into its staged file, and checked there: the preloader's copy
threads (``O_DIRECT`` reads where the filesystem allows them, bounce buffers on the GPU's NUMA
node) and the staged copy's verification against the image's chunk checksums. The protocol around
them (locks, room, ``.partial`` -> image + ``.ready``, engines sharing a copy) is
:mod:`flashboot.flashload.staging`'s."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path
from typing import Callable

from ..errors import ChecksumMismatchError, FlashBootError, ImageReadError
from ..fileio import DIRECT_ALIGNMENT, io_buffer, read_exactly
from ..memory import map_refused, thread_refused
from ..units import limit_text
from .shm import RankSource

# Module-level so tests can simulate a full /dev/shm without mounting a tiny tmpfs, and a disk
# that fails a read.
_pwrite = os.pwrite


def _preadv(fd: int, buffers, offset: int) -> int:
    return os.preadv(fd, buffers, offset)  # looked up per call: a test may patch either name


class StagedFileFull(Exception):
    """The staged file's filesystem is full: ``written`` bytes of it were written."""

    def __init__(self, written: int):
        self.written = written


def write_failed(path: str, what: str, exc: OSError) -> FlashBootError:
    """A write into the staged file failed (not ENOSPC: a full tmpfs is an OutOfMemoryError):
    the error naming the file, ``what`` was done (the bytes) and the system's error; EFBIG says
    the file size limit."""
    code = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    why = f"{code} ({exc.strerror or exc})"
    if exc.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        why += ("; this process may write files of at most "
                f"{limit_text(limit)} bytes (`ulimit -f`)")
    return FlashBootError(f"{path}: {what} failed: {why}; the rank is not staged (partial file removed)")


def copy_chunks(src_fd: int, dst_fd: int, nbytes: int, *, direct: bool, threads: int, chunk_bytes: int,
                 progress: Callable[[int, int], None] | None, stop: threading.Event | None,
                 numa_node: int | None, src_name: str, dst_name: str) -> None:
    """Copy ``nbytes`` from ``src_fd`` to ``dst_fd`` with ``threads`` workers, one chunk at a time each."""
    from ..pinning import bind_to_node

    n_chunks = -(-nbytes // chunk_bytes)
    # no larger than the file: a 127 KB rank mapped a 64 MiB buffer, refused under a tight `ulimit -v`
    buf_bytes = min(chunk_bytes, -(-nbytes // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT)
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
        buf = view = None
        try:  # the buffer too: a mapping refused (``ulimit -v``) had ended the thread unseen, and the
            # copy was renamed into place, zeros where its chunks were to be, under a .ready
            try:
                buf = io_buffer(buf_bytes)
            except OSError as exc:
                raise map_refused(f"staging {src_name}: the read buffer of one of {len(pool)} copy threads (stage "
                                  "with fewer, or smaller chunks)", buf_bytes, exc) from None
            view = memoryview(buf)
            if numa_node is not None:  # the bounce buffer too: it is read right after the disk writes it
                bind_to_node(ctypes.addressof(ctypes.c_char.from_buffer(buf)), buf_bytes, numa_node)
            while (i := take()) is not None:
                if stop is not None and stop.is_set():
                    raise FlashBootError(f"staging of {src_name} was interrupted")
                off = i * chunk_bytes
                want = min(chunk_bytes, nbytes - off)
                ask = -(-want // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT if direct else want
                try:
                    read_exactly(src_fd, view[:ask], off, want, direct=direct, path=src_name, file_nbytes=nbytes,
                                 preadv=_preadv)
                except ImageReadError as exc:
                    raise ImageReadError(exc.path, exc.offset, exc.nbytes, f"{exc.error}; the rank is not staged "
                                         "(partial file removed)") from None
                done = 0
                while done < want:
                    try:
                        done += _pwrite(dst_fd, view[done:want], off + done)
                    except OSError as exc:
                        if exc.errno == errno.ENOSPC:
                            raise StagedFileFull(off + done) from None
                        raise write_failed(dst_name, f"writing {want - done:,} bytes at byte {off + done:,}", exc) from None
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
                if view is not None:
                    view.release()
                if buf is not None:
                    buf.close()
            except BufferError:
                pass  # the stored error's traceback still holds a slice; the buffer goes with it

    pool = [threading.Thread(target=worker, name=f"flashboot-preload-{k}", daemon=True)
            for k in range(max(1, min(threads, n_chunks)))]
    started = []
    try:
        for t in pool:
            t.start()
            started.append(t)
    except RuntimeError as exc:  # "can't start new thread": a thread or address-space limit
        with lock:  # the threads started take no further chunk; their fds are closed only once they end
            if state["error"] is None:
                state["error"] = thread_refused(f"staging {src_name} with {len(pool)} threads (stage with fewer), "
                                                f"copy thread {len(started) + 1}", exc)
    for t in started:
        t.join()
    if state["error"] is not None:
        raise state["error"]


VERIFY_SLICE_BYTES = 256 << 20
"""A staged copy is checksummed this much at a time (whole checksum chunks), looking at ``stop``
between slices: a 140 GB rank takes ~70 s at 2 GB/s."""


def verify_staged(fd: int, nbytes: int, src: RankSource, where: Path,
                   stop: threading.Event | None = None) -> None:
    """The staged bytes of ``fd`` (``nbytes``) against ``src``'s chunk checksums, mapped read-only:
    ChecksumMismatchError naming the first bad chunk; FlashBootError once ``stop`` is set."""
    import mmap

    import numpy as np

    from flashboot.kernels.checksum import chunk_checksums_host

    cs = src.metadata.checksums
    step = max(1, VERIFY_SLICE_BYTES // cs.chunk_bytes) * cs.chunk_bytes  # each chunk is hashed on its own
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError as exc:  # ENOMEM under `ulimit -v`: named with the limit, not a bare OSError
        raise map_refused(f"verifying {where} (rank {src.rank})", nbytes, exc) from None
    try:
        data = np.frombuffer(mm, dtype=np.uint8)
        try:
            for lo in range(0, nbytes, step):
                if stop is not None and stop.is_set():
                    raise FlashBootError(f"verifying {where} (rank {src.rank}) was interrupted after {lo:,} of "
                                         f"{nbytes:,} bytes")
                found = chunk_checksums_host(data[lo:lo + step], cs.chunk_bytes)
                first = lo // cs.chunk_bytes
                for k, (want, got) in enumerate(zip(cs.digests[first:first + len(found)], found), first):
                    if want != got:
                        start, n = cs.chunk_range(k, nbytes)
                        raise ChecksumMismatchError(f"{where} (staged from {src.path}, rank {src.rank})", k, start, n,
                                                    want, got)
        finally:
            del data  # the mapping cannot close while a view of it lives
    finally:
        mm.close()


__all__ = ["VERIFY_SLICE_BYTES", "StagedFileFull", "copy_chunks", "verify_staged", "write_failed"]
