"""Sizes and constants shared by both backends: capacity rounding, segment sizes, fd room, dtypes."""

from __future__ import annotations

import os
from typing import Any, Sequence

from ..errors import ArenaError


SEGMENT_BYTES = 256 << 20
"""Default size of an arena's physical allocations (the last one may be shorter).

Measured on H200 x2 (benchmarks/RESULTS.md, "Peer mapping cost"): granting a GPU access to a
peer's allocation of 512 MiB or more costs ~9.5 ms the first time (whatever the size: 512 MiB and
8 GiB alike), ~1 ms below that, ~0.05 ms per further segment. Arenas of 256 MiB segments are mapped
by a clone segment by segment, just ahead of each segment's copy, so the mapping overlaps the copy
instead of standing before its first byte."""

HOST_GRANULARITY = 2 << 20
"""Capacity rounding of host arenas: 2 MiB, the CUDA VMM granularity on our GPUs (see module doc)."""

HANDLE_POSIX_FD = "posix_fd"
HANDLE_FABRIC_POSIX_FD = "fabric+posix_fd"
HANDLE_MEMFD = "memfd"


def _check_nbytes(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise ArenaError(f"arena size must be an int number of bytes, got {nbytes!r}")
    if nbytes <= 0:
        raise ArenaError(f"arena size must be positive, got {nbytes:,} bytes")
    return nbytes


def _round_up(n: int, granularity: int) -> int:
    return (n + granularity - 1) // granularity * granularity


def parse_dtype(dtype: Any):
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float16"``)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip()
        name = name[len("torch."):] if name.startswith("torch.") else name
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    raise ArenaError(f"unknown dtype {dtype!r}: use a torch.dtype or its name, e.g. 'bfloat16'")


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _segment_count(nbytes: int, segment_bytes: int) -> int:
    if segment_bytes <= 0:
        raise ArenaError(f"segment size must be positive, got {segment_bytes:,} bytes")
    return -(-nbytes // segment_bytes)


def _segment_sizes(nbytes: int, segment_bytes: int) -> list[int]:
    """Sizes of the segments of an ``nbytes`` arena: all ``segment_bytes`` but a shorter last one."""
    count = _segment_count(nbytes, segment_bytes)
    return [segment_bytes] * (count - 1) + [nbytes - segment_bytes * (count - 1)]


def _adjacent_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending segment ``indices`` as ``[(first, last + 1), ...]`` runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


def _check_segment_bytes(segment_bytes: Any, granularity: int) -> int:
    if segment_bytes is None:
        return _round_up(SEGMENT_BYTES, granularity)
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes <= 0:
        raise ArenaError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
    if segment_bytes % granularity:
        raise ArenaError(f"segment_bytes {segment_bytes:,} is not a multiple of the allocation granularity "
                         f"{granularity:,}")
    return segment_bytes


def _make_fd_room(count: int, what: str) -> None:
    """Raise the soft open-file limit (up to the hard one) so ``count`` more fds fit, and grow the
    fd table for them (:func:`~flashboot.fdshare.grow_fd_table`); ArenaError if they cannot fit."""
    import resource

    from ..fdshare import grow_fd_table

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    in_use = len(open_fds)
    need = in_use + count + 64  # headroom for sockets and files the caller opens next
    if soft != resource.RLIM_INFINITY and need > soft:
        if hard != resource.RLIM_INFINITY and need > hard:
            raise ArenaError(f"{what} needs {count:,} fds (one per segment) and {in_use:,} are open, with 64 kept free "
                             f"for the sockets and files that follow: {need:,} in all; the hard limit on open files "
                             f"is {hard:,}: raise it (ulimit -Hn) or use larger segments")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    grow_fd_table(count + 64, highest=max(open_fds, default=2))
