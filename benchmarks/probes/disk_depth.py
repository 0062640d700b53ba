"""The machine disk's O_DIRECT read rate by reads in flight and read size (the twenty-sixth
session's `bench stream` found one 16 MiB stream at 2.40 GB/s against 1.93-2.02 with the stream's
own 4 reads of 32 MiB in flight, on the same file, minutes apart).

``python benchmarks/probes/disk_depth.py FILE [DEVICE [CONFIGS ROUNDS]]``: FILE's cache dropped
before each read of all of it, through :func:`flashboot.fileio.read_rate`. Without
CONFIGS, :data:`CONFIGS` in that order, then the first two again (the disk's rate drifts), then
two reads into ring slots such as the stream's (``pinned`` on CUDA) rather than unpinned
:func:`~flashboot.fileio.io_buffer` buffers. With CONFIGS (``1x16,4x32``: reads in flight x MiB),
those in turn ROUNDS times, so that each is measured beside the others' drift. One JSON line per read.

Two more kinds of CONFIGS ask where a stream's rate goes below one dd-like stream's (the
twenty-seventh session: the stream at one 16 MiB read at a time 1.96 GB/s, one dd-like stream
2.24-2.46, minutes apart): ``r7x16``, one read at a time of 16 MiB into 7 pinned slots in turn
(the stream's ring, no copy); ``s1x16``, the loader itself (``stream_image`` into a DEVICE arena,
1 reader, 16 MiB slots, the read depth fixed); ``h1x16``, the same into a host arena (no pinned
ring, no copy to the GPU: the loader's threads and hand-offs alone); ``n1x16``, the loader into a
DEVICE arena with its copies out of the ring left out (the pinned ring, the device's context on
the readers, no DMA: the bytes are not loaded).
"""

from __future__ import annotations

import json
import sys

CONFIGS = [(1, 16), (4, 32), (1, 32), (2, 32), (2, 16), (4, 16), (8, 16), (8, 32), (4, 64), (1, 16), (4, 32)]


def _rotating_rate(path: str, slots: int, mib: int, device: str) -> float:
    """One O_DIRECT read at a time of ``mib`` MiB into ``slots`` pinned ring slots in turn."""
    import os
    import time

    from flashboot.fileio import read_exactly
    from flashboot.flashload.stream import Ring, _open
    from flashboot.memory import Device

    ring = Ring(slots, mib << 20, Device.parse(device))
    fd, mode, _ = _open(path, "direct")
    try:
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()
        for i, off in enumerate(range(0, size, mib << 20)):
            want = min(mib << 20, size - off)
            read_exactly(fd, ring.slots[i % slots].view[: -(-want // 4096) * 4096], off, want, direct=True,
                         path=path, file_nbytes=size)
        return size / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        ring.close()


def _stream_rate(path: str, threads: int, mib: int, device: str, copies: bool = True) -> float:
    """The loader's own stream of the whole file into an arena on ``device``, the depth fixed;
    ``copies`` False leaves out its copies out of the ring (nothing is loaded)."""
    import os

    from flashboot.arena import Arena
    from flashboot.flashload import stream
    from flashboot.flashload.stream import StreamConfig, stream_image

    size = os.path.getsize(path)
    real = stream._Copier.copy
    if not copies:
        stream._Copier.copy = lambda self, slot, offset, nbytes: None
    try:
        with Arena.create(size, device) as arena:
            stats = stream_image(path, size, arena, StreamConfig(threads=threads, slot_bytes=mib << 20, io="direct",
                                                                 adapt_reads=False))
    finally:
        stream._Copier.copy = real
    return stats.read_gbps


def main() -> None:
    from flashboot.benchmarks.disk import drop_file_cache
    from flashboot.fileio import read_rate

    path = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else None
    if len(sys.argv) > 3:
        runs = [c for _ in range(int(sys.argv[4])) for c in sys.argv[3].split(",")]
    else:
        runs = [f"{k}x{m}" for k, m in CONFIGS] + (["p4x32", "p1x16"] if device else [])
    if any(c[0] in "shn" for c in runs):  # the loader's one-time costs (ring pin, first copy) off the samples
        import os

        warm = f"{path}.warm"
        with open(warm, "wb") as f:
            f.write(os.urandom(64 << 20))
        try:
            for kind, dev in (("s", device), ("h", "cpu")):  # the host copy's numba compile too
                if any(c.startswith(kind) for c in runs):
                    _stream_rate(warm, 4, 16, dev)
        finally:
            os.unlink(warm)
    for config in runs:
        kind = config[0] if config[0] in "prshn" else ""
        in_flight, mib = (int(x) for x in config.lstrip("prshn").split("x"))
        drop_file_cache(path)
        if kind == "r":
            gbps, mode = _rotating_rate(path, in_flight, mib, device), "o_direct"
        elif kind in ("s", "h", "n"):
            gbps = _stream_rate(path, in_flight, mib, "cpu" if kind == "h" else device, copies=kind != "n")
            mode = "o_direct"
        else:
            ring = None
            if kind == "p":  # into ring slots such as the stream's, pinned on CUDA
                from flashboot.flashload.stream import Ring
                from flashboot.memory import Device

                ring = Ring(in_flight, mib << 20, Device.parse(device))
            try:
                gbps, mode = read_rate(path, io="direct", block_bytes=mib << 20, in_flight=in_flight,
                                       buffers=[s.view for s in ring.slots] if ring else None)
            finally:
                if ring is not None:
                    ring.close()
        print(json.dumps({"config": config, "in_flight": in_flight, "mib": mib, "kind": kind or "read_rate",
                          "gbps": round(gbps, 3), "mode": mode}), flush=True)


if __name__ == "__main__":
    main()
