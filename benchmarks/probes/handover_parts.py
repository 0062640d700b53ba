"""Probe: where a served load's hand-over of the later batches goes (issue 19: B's 7.1 ms and A's
9.4 ms inside the early call, H200 2026-12-03). In a fresh process holding its CUDA context and
the loader imported (as an engine), for each size: an arena made with its first 4 segments
(as the served load makes it), then each later batch of 4 segments made (create, map, grant:
the arena's own timings) and exported (one POSIX fd per segment) and sent over a socket pair
(SCM_RIGHTS, as to the daemon), timed per step; twice per size (first and second arena of the
process). One JSON line.

``python benchmarks/probes/handover_parts.py [NBYTES...]`` (default: shapes B and A)."""
import json
import os
import socket
import sys
import time


def main(sizes):
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    from flashboot.flashload.warm import import_loader

    import_loader("cuda:0")
    from flashboot.arena import Arena
    from flashboot.fdshare import send_fds

    out = {"rounds": []}
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for nbytes in sizes:
        for k in range(2):
            t0 = time.perf_counter()
            arena = Arena.create(nbytes, "cuda:0", segments_now=4)
            first = arena.export_segments(0, 4)
            t1 = time.perf_counter()
            steps = {"make_ms": 0.0, "create_ms": 0.0, "map_ms": 0.0, "access_ms": 0.0, "export_ms": 0.0, "send_ms": 0.0}
            send_fds(a, first, b"{}")
            for lo in range(4, arena.segments, 4):
                hi = min(arena.segments, lo + 4)
                s0 = time.perf_counter()
                timings: dict = {}
                arena._map_segments(0, hi, timings)
                s1 = time.perf_counter()
                fds = arena.export_segments(lo, hi)
                s2 = time.perf_counter()
                send_fds(a, fds)
                s3 = time.perf_counter()
                steps["make_ms"] += (s1 - s0) * 1e3
                for key in ("create_ms", "map_ms", "access_ms"):
                    steps[key] += float(timings.get(key, 0.0))
                steps["export_ms"] += (s2 - s1) * 1e3
                steps["send_ms"] += (s3 - s2) * 1e3
            t2 = time.perf_counter()
            b.setblocking(False)
            while True:  # drain what the socket pair holds (the received fds are closed)
                try:
                    _msg, anc, _flags, _ = b.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 64))
                except BlockingIOError:
                    break
                for level, kind, data in anc:
                    for i in range(0, len(data) - len(data) % 4, 4):
                        os.close(int.from_bytes(data[i:i + 4], "little"))
            arena.close()
            out["rounds"].append({"nbytes": nbytes, "arena": k + 1, "segments": arena.segments,
                                  "first_batch_ms": round((t1 - t0) * 1e3, 3), "later_batches_ms": round((t2 - t1) * 1e3, 3),
                                  **{key: round(v, 3) for key, v in steps.items()}})
    print(json.dumps(out))


if __name__ == "__main__":
    main([int(float(x)) for x in sys.argv[1:]] or [11_763_318_784, 13_755_351_040])
