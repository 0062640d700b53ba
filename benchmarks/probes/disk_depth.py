"""The machine disk's O_DIRECT read rate by reads in flight and read size (the twenty-sixth
session's `bench stream` found one 16 MiB stream at 2.40 GB/s against 1.93-2.02 with the stream's
own 4 reads of 32 MiB in flight, on the same file, minutes apart).

``python benchmarks/probes/disk_depth.py FILE [DEVICE [CONFIGS ROUNDS]]``: FILE's cache dropped
before each read of all of it, through :func:`flashboot.flashload.staging.read_rate`. Without
CONFIGS, :data:`CONFIGS` in that order, then the first two again (the disk's rate drifts), then
two reads into ring slots such as the stream's (``pinned`` on CUDA) rather than unpinned
:func:`~flashboot.fileio.io_buffer` buffers. With CONFIGS (``1x16,4x32``: reads in flight x MiB),
those in turn ROUNDS times, so that each is measured beside the others' drift. One JSON line per read.
"""

from __future__ import annotations

import json
import sys

CONFIGS = [(1, 16), (4, 32), (1, 32), (2, 32), (2, 16), (4, 16), (8, 16), (8, 32), (4, 64), (1, 16), (4, 32)]


def main() -> None:
    from flashboot.benchmarks.disk import drop_file_cache
    from flashboot.flashload.staging import read_rate

    path = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else None
    if len(sys.argv) > 3:
        pairs = [tuple(int(x) for x in c.split("x")) for c in sys.argv[3].split(",")]
        runs = [(k, m, False) for _ in range(int(sys.argv[4])) for k, m in pairs]
    else:
        runs = [(k, m, False) for k, m in CONFIGS] + ([(4, 32, True), (1, 16, True)] if device else [])
    for in_flight, mib, pinned in runs:
        ring = None
        if pinned:
            from flashboot.flashload.stream import Ring
            from flashboot.memory import Device

            ring = Ring(in_flight, mib << 20, Device.parse(device))
        try:
            drop_file_cache(path)
            gbps, mode = read_rate(path, io="direct", block_bytes=mib << 20, in_flight=in_flight,
                                   buffers=[s.view for s in ring.slots] if ring else None)
        finally:
            if ring is not None:
                ring.close()
        print(json.dumps({"in_flight": in_flight, "mib": mib, "pinned": pinned, "gbps": round(gbps, 3),
                          "mode": mode}), flush=True)


if __name__ == "__main__":
    main()
