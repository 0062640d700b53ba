"""What a served copy does to the bytes, apart from the socket and the requests: the pieces a CUDA
copy issues, each digested on its own stream while the next copies, the host backend's pread of
the staged image, and the stage-time warm-up of a rank's first copy. The daemon
(:mod:`~flashboot.flashload.server`) calls these with its resident ranks (``_Resident``) and
attached arenas (``_Attached``), the types the annotations name."""

from __future__ import annotations

import ctypes
import os
import time

from ..errors import LayoutError

SERVE_CHUNK_BYTES = 1 << 30
"""The daemon's H2D goes in 1 GB chunks (hardware.md: streams and smaller chunks do not help)."""


def _warm_cuda_copy(res: "_Resident", dev, dst) -> None:
    """The checksum kernel compiled for each piece shape of ``res``'s verifying copies, then one H2D
    of the staged mapping's first bytes into ``dst`` (an opened arena's span) on a fresh stream,
    awaited from a second stream through an event (see :meth:`PreloadServer._warm_rank`)."""
    import cupy

    from flashboot.kernels.checksum import warm_chunk_checksums

    from ..memory import CPU, Span
    from ..movers import create_mover

    if _pipelined_digests(res):
        shapes = sorted({n for _, n in serve_pieces(res.nbytes, res.checksum_chunk_bytes)})
    else:
        shapes = [res.nbytes]
    for nbytes in shapes:
        warm_chunk_checksums(dev.index, nbytes, res.checksum_chunk_bytes)
    src = Span(res.mapping.ptr, dst.nbytes, CPU, pinned=res.pinned is not None, owner=res.mapping)
    with cupy.cuda.Device(dev.index):
        copy_stream, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        create_mover("copy_engine").copy(dst, src, stream=copy_stream)
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(copy_stream)
        other.wait_event(copied)
        other.synchronize()


HOST_READ_CHUNK_BYTES = 64 << 20
"""The host backend's copy reads the staged file in pieces of this size, several at once."""


def _check_staged_size(res: "_Resident") -> None:
    """Refuse a staged image that something shrank since it was staged: a copy from it would read
    past its end (a mapping's SIGBUS, a pinned copy's stale pages)."""
    found = os.fstat(res.fd).st_size
    if found < res.nbytes:
        raise LayoutError(f"{res.path}: the staged image of rank {res.rank} holds {found:,} bytes; {res.nbytes:,} were "
                          "staged (it was truncated since); restart the preloader to stage it again")


def _read_staged(res: "_Resident", dst, engine=None) -> None:
    """Host backend: the staged image into ``dst`` (a host Span) with pread, not from a mapping, so
    that a file truncated during the copy ends the read short (LayoutError naming where) instead of
    killing the daemon with SIGBUS. The destination cannot shrink: host arenas are sealed.
    ``engine`` (``serve_socket._Engine``): its hang-up ends the copy before the next piece."""
    from concurrent.futures import ThreadPoolExecutor

    from ..fileio import read_exactly

    view = memoryview((ctypes.c_uint8 * res.nbytes).from_address(dst.ptr)).cast("B")
    offsets = range(0, res.nbytes, HOST_READ_CHUNK_BYTES)

    def read(off: int) -> None:
        if engine is not None:
            engine.check(f"was copied (at byte {off:,} of {res.nbytes:,})")
        n = min(HOST_READ_CHUNK_BYTES, res.nbytes - off)
        read_exactly(res.fd, view[off:off + n], off, n, direct=False, path=res.path, file_nbytes=res.nbytes)

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(offsets), os.cpu_count() or 1))) as pool:
        for _ in pool.map(read, offsets):
            pass


def serve_pieces(nbytes: int, checksum_chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of the pieces a CUDA served copy issues: about :data:`SERVE_CHUNK_BYTES`,
    in whole checksum chunks, so a verifying copy digests each piece on its own while the next
    one is copied (a chunk's digest does not depend on where its piece starts). The daemon warms
    the checksum kernel for exactly these shapes when the rank becomes resident."""
    piece = max(1, SERVE_CHUNK_BYTES // checksum_chunk_bytes) * checksum_chunk_bytes
    return [(off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]


def _pipelined_digests(res: "_Resident") -> bool:
    """Whether a verifying CUDA copy of ``res`` digests piece by piece during the copy: the word
    kernel needs chunks of whole 4-byte words; other chunk sizes are digested after the copy."""
    return res.checksum_chunk_bytes % 4 == 0 and res.nbytes > 0


def wait_without_spinning(stream) -> None:
    """Wait for the work queued on the CuPy ``stream`` through a blocking-sync event: the thread
    sleeps until the device signals, where ``stream.synchronize()`` would spin a CPU core for the
    whole copy (CUDA spins when the cores outnumber the GPUs). An engine builds its model beside
    the daemon's copy, and a spinning thread takes a core, or an SMT sibling, from it."""
    import cupy

    done = cupy.cuda.Event(block=True, disable_timing=True)
    done.record(stream)
    done.synchronize()


def _start_piece_digests(attached: "_Attached", off: int, n: int):
    """Launch the digests of the piece ``[off, off + n)`` on the verify stream, after the copy
    issued so far on the copy stream (an event between them: the two run on different engines)."""
    import cupy

    from flashboot.kernels.checksum import start_device_chunk_checksums

    copied = cupy.cuda.Event(disable_timing=True)
    copied.record(attached.stream)
    attached.verify_stream.wait_event(copied)
    return start_device_chunk_checksums(attached.arena.span(off, n), attached.res.checksum_chunk_bytes,
                                        stream=attached.verify_stream)


def _collect_digests(attached: "_Attached", pending: list, copied_at: float) -> dict:
    """The digests launched during the copy, read back in order; ``checksum_ms``: how long after
    the copy's end they were all in (the rest overlapped the copy)."""
    res = attached.res
    wait_without_spinning(attached.verify_stream)  # the read-backs below then find the digests done
    digests = [d for piece in pending for d in piece.digests()]
    return {"digests": [int(d) for d in digests], "checksum_chunk_bytes": res.checksum_chunk_bytes,
            "checksum_ms": max(0.0, (time.perf_counter() - copied_at) * 1e3), "checksum_overlapped": True}


def _digest_copied(attached: "_Attached") -> dict:
    """The chunk checksums of the bytes just copied into the engine's arena (on its device, on the
    copy's stream), for the engine to compare with its metadata."""
    from flashboot.kernels.checksum import chunk_checksums

    res = attached.res
    t0 = time.perf_counter()
    if attached.stream is not None:
        import cupy

        with cupy.cuda.Device(attached.arena.device.index):
            digests = chunk_checksums(attached.arena.span(0, res.nbytes), res.checksum_chunk_bytes,
                                      stream=attached.stream)
    else:
        digests = chunk_checksums(attached.arena.span(0, res.nbytes), res.checksum_chunk_bytes)
    return {"digests": [int(d) for d in digests], "checksum_chunk_bytes": res.checksum_chunk_bytes,
            "checksum_ms": (time.perf_counter() - t0) * 1e3}
