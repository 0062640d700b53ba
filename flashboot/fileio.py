"""Reading files in large pieces, ``O_DIRECT`` where the filesystem allows it: what the
preloader, the streamed load and pre-pack's shard reader share.

``O_DIRECT`` wants the buffer, the offset and the length aligned to the logical block size
(<= 4096). A filesystem may refuse the flag at ``open`` (EINVAL: tmpfs before Linux 6.6) or only
at the first read (EINVAL again): callers then reopen the file buffered and say so.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import stat
import threading
import time
from typing import Callable

from .errors import CapabilityError, FlashBootError, ImageReadError, LayoutError
from .units import limit_text

DIRECT_ALIGNMENT = 4096


def io_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of ``nbytes`` for ``O_DIRECT`` reads (and the writes after them): a
    private anonymous mapping with huge pages asked for (``MADV_HUGEPAGE``).

    The disk's DMA then lands in 2 MiB pages, so a 32 MiB read is a few large segments, not 8,192
    pages to pin and describe one by one. Reads of 4 x 32 MiB in flight from the CPU machine's
    virtio disk (2026-12-04): 1.65-1.84 GB/s into shared anonymous pages (``mmap(-1, n)``'s
    default), 1.88-2.11 into private ones, 2.94-3.15 with the advice. Where the kernel has no
    transparent huge pages the advice is refused and the pages stay small: only slower, never wrong."""
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # EINVAL without transparent huge pages
            pass
    return buf


_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def out_of_fds(exc: OSError) -> str | None:
    """Why an open failed with ``exc`` when this process or the system has no file descriptor
    left, in words with the limit (the bare "Too many open files" named none); None otherwise."""
    if exc.errno == errno.EMFILE:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (f"this process has all the {soft:,} files open that it may (`ulimit -n`; the hard limit is "
                f"{limit_text(hard)})")
    if exc.errno == errno.ENFILE:
        return "the system's table of open files is full (fs.file-max)"
    return None


def open_regular(path, error: type[Exception] = LayoutError, *, max_bytes: int | None = None):
    """``path`` opened for binary reading, refused by name (``error``) unless it is a regular file
    of at most ``max_bytes`` (where given: for a file the caller reads whole).

    Opened without blocking and checked on the open fd, so no swap can come between the check
    and the read: a named pipe in a file's place would block a plain ``open`` until some writer
    came (an image's ``tensors.bin`` made one hung ``inspect`` and every load), a device such
    as ``/dev/zero`` never ends a read, and a sparse file of 50 GB reads as 50 GB of memory.
    FileNotFoundError and other OSErrors pass through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if (why := out_of_fds(exc)) is None:
            raise
        raise FlashBootError(f"cannot open {os.fspath(path)}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
            raise error(f"{os.fspath(path)}: not a regular file ({kind})")
        if max_bytes is not None and st.st_size > max_bytes:
            raise error(f"{os.fspath(path)}: {st.st_size:,} bytes, more than the {max_bytes:,} this file may hold "
                        "(damaged, or not what it is named?)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


READ_PIECE_BYTES = 1 << 20
""":func:`read_regular` reads a file that grew after its size was taken this much at a time."""


def read_regular(path, max_bytes: int, error: type[Exception] = LayoutError) -> bytes:
    """The whole of the regular file ``path``, at most ``max_bytes`` (see :func:`open_regular`).

    Reads at most one byte past ``max_bytes``: a file grown after the size check (a writer
    appending, a sparse extension) is refused, not read whole into memory. Asks for the file's
    size (and one byte more), then pieces of at most :data:`READ_PIECE_BYTES`: ``read(max_bytes +
    1)`` allocated the whole limit first (1 GiB for a 2 KB metadata.json), a MemoryError on a
    node with ``ulimit -v`` or strict overcommit."""
    with open_regular(path, error, max_bytes=max_bytes) as f:
        ask = min(os.fstat(f.fileno()).st_size, max_bytes) + 1
        pieces = [f.read(ask)]
        total = len(pieces[0])
        while total <= max_bytes and len(pieces[-1]) == ask:  # grown since: the rest, at most one past the limit
            ask = min(READ_PIECE_BYTES, max_bytes + 1 - total)
            pieces.append(f.read(ask))
            total += len(pieces[-1])
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    if len(data) > max_bytes:
        raise error(f"{os.fspath(path)}: grew past the {max_bytes:,} bytes this file may hold while it was read")
    return data


def open_for_reads(path, io: str) -> tuple[int, str, str]:
    """Open ``path`` for reading: ``(fd, mode, reason)``. O_DIRECT unless ``io`` says buffered or
    the filesystem refuses it (tmpfs does); ``io="direct"`` makes a refusal an error."""
    try:
        return _open_for_reads(path, io)
    except OSError as exc:
        if (why := out_of_fds(exc)) is None:
            raise
        raise FlashBootError(f"cannot open {os.fspath(path)} to read it: {why}") from None


def _open_for_reads(path, io: str) -> tuple[int, str, str]:
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


def read_rate(path: str | os.PathLike, *, io: str = "direct", nbytes: int | None = None,
              block_bytes: int = 16 << 20, in_flight: int = 1, buffers: list | None = None) -> tuple[float, str]:
    """Read rate of the whole of ``path`` in GB/s: ``block_bytes`` reads, ``in_flight`` of them at
    once (threads taking the next block in file order, the GIL released in the read); one in flight
    is ``dd bs=16M iflag=direct``. Returns ``(gbps, mode)``; falls back to buffered reads where
    O_DIRECT is refused (mode says). A streamed load's own ceiling is this at its reader count and
    read size: the disk's rate with the same reads in flight, not a single stream's. The reads
    land in :func:`io_buffer` buffers, as the loader's do, or in ``buffers``
    (``in_flight`` writable buffers of ``block_bytes`` each, page-aligned, the caller's: the
    stream's own ring slots)."""
    if in_flight < 1:
        raise FlashBootError(f"in_flight must be >= 1, got {in_flight}")
    if buffers is not None and (len(buffers) != in_flight or any(len(b) != block_bytes for b in buffers)):
        raise FlashBootError(f"read_rate wants {in_flight} buffers of {block_bytes:,} bytes, got "
                             f"{[len(b) for b in buffers]}")
    fd, mode, _ = open_for_reads(path, "auto" if io == "direct" else "buffered")
    size = os.fstat(fd).st_size if nbytes is None else nbytes
    owned = buffers is None
    bufs = [io_buffer(block_bytes) for _ in range(in_flight)] if owned else list(buffers)
    done = [0] * in_flight
    errors: list[BaseException] = []
    next_block = itertools.count()

    def reader(k: int) -> None:
        view = memoryview(bufs[k])
        try:
            while (off := next(next_block) * block_bytes) < size:
                done[k] += os.preadv(fd, [view], off)  # whole blocks: O_DIRECT wants aligned lengths
        except BaseException as exc:  # re-raised below, after every reader stopped
            errors.append(exc)
        finally:
            view.release()

    try:
        t0 = time.perf_counter()
        if in_flight == 1:
            reader(0)
        else:
            pool = [threading.Thread(target=reader, args=(k,), name=f"flashboot-read-rate-{k}", daemon=True)
                    for k in range(in_flight)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        dt = time.perf_counter() - t0
    finally:
        if owned:
            for b in bufs:
                b.close()
        os.close(fd)
    if errors:
        raise errors[0]
    return (sum(done) / dt / 1e9 if dt > 0 else float("inf")), mode


def sign_lock(fd: int) -> None:
    """Write this process's pid into a lock file it holds (flock), for the next one refused to name
    (:func:`lock_signer`). Best effort: a lock file on hugetlbfs takes no write."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def lock_signer(path) -> str:
    """The pid :func:`sign_lock` wrote into the lock file ``path``, or ``unknown`` (not written yet,
    or unreadable)."""
    try:
        with open(path, "rb") as f:
            return f.read(32).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


class DirectReadRefused(Exception):
    """A read under O_DIRECT failed with EINVAL: the filesystem takes the flag, not the I/O."""


def read_exactly(fd: int, view: memoryview, offset: int, need: int, *, direct: bool, path: str,
                 file_nbytes: int, preadv: Callable = os.preadv) -> None:
    """Fill at least the first ``need`` bytes of ``view`` from ``fd`` at ``offset``.

    Each read asks for the rest of ``view`` (under O_DIRECT its length is a multiple of 4096, so
    the file's last read may come back short: only ``need`` bytes are required). Raises
    DirectReadRefused on EINVAL under O_DIRECT, ImageReadError (naming ``path``, the byte and
    the system's error) on any other I/O error, and LayoutError when the file ends first (naming
    where, and the ``file_nbytes`` expected).
    """
    got = 0
    while got < need:
        try:
            n = preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise DirectReadRefused(str(exc)) from None
            code = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
            raise ImageReadError(path, offset + got, len(view) - got, f"{code} ({exc.strerror or exc})") from None
        if n == 0:
            try:  # where it ends: a reader of a later piece finds its end past it (it had named that piece's offset)
                end = min(os.fstat(fd).st_size, offset + got)
            except OSError:
                end = offset + got
            raise LayoutError(f"{path}: ends at byte {end:,}; {file_nbytes:,} bytes were expected "
                              "(the file shrank while it was read)")
        got += n


__all__ = ["DIRECT_ALIGNMENT", "DirectReadRefused", "io_buffer", "read_exactly"]


def fsync_dir(path) -> None:
    """``fsync`` a directory: the renames and new names in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
