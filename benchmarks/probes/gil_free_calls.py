"""Probe: do the served hand-over's driver calls and sends leave the GIL to the engine? (issue 19's
GIL bound, which counts the early call's thread's CPU less its time inside such calls,
:mod:`flashboot.gil_time`.)

In a fresh process holding its CUDA context and the loader imported (as an engine), W (the pure
Python loop of ``bench boot``, ~``W_MS`` alone) runs on the main thread while a thread makes an
arena of NBYTES as a served load does (its first 4 segments, then the rest in batches of 4) and
exports and sends every segment's fd over a socket pair, as the hand-over to the daemon does.
Rounds alternate with W alone. Per round: W's wall and CPU time (wall less CPU: the time W was
off the CPU, waiting for the GIL or descheduled), the thread's CPU time and, of it, the CPU
inside the calls that release the GIL. If those calls held the GIL, W beside the thread would
be off the CPU for about the thread's whole CPU time; if they release it, for about the rest.
One JSON line.

``python benchmarks/probes/gil_free_calls.py [NBYTES] [ROUNDS]`` (default 13.76e9, 5)."""
import json
import socket
import statistics
import sys
import threading
import time

W_MS = 250.0


def _make_and_send(nbytes: int, sock: socket.socket, out: dict) -> None:
    from flashboot.arena import Arena
    from flashboot.fdshare import send_fds
    from flashboot.gil_time import gil_free_cpu_s

    c0, f0, t0 = time.thread_time(), gil_free_cpu_s(), time.perf_counter()
    arena = Arena.create(nbytes, "cuda:0", segments_now=4)
    for lo in range(0, arena.segments, 4):
        send_fds(sock, arena.export_segments(lo, min(arena.segments, lo + 4)), b"{}")
    out.update(thread_ms=(time.perf_counter() - t0) * 1e3, thread_cpu_ms=(time.thread_time() - c0) * 1e3,
               gil_free_cpu_ms=(gil_free_cpu_s() - f0) * 1e3, segments=arena.segments)
    out["arena"] = arena


_DRAIN = """
import os, socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while True:
    msg, fds, _flags, _addr = socket.recv_fds(s, 16, 64)
    for fd in fds:
        os.close(fd)
    if not msg:
        break
"""


def _drain(sock: socket.socket):
    """The daemon's side in another process, as it is in a served load: it takes the fds and
    closes them; it must not take this process's GIL."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", _DRAIN, str(sock.fileno())], pass_fds=[sock.fileno()])


def main(nbytes: int, rounds: int) -> dict:
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    from flashboot.benchmarks.boot_e2e import calibrate_steps_per_s, timed_workload
    from flashboot.flashload.warm import import_loader
    from flashboot.gil_time import driver_releases_gil

    import_loader("cuda:0")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    drain = _drain(b)
    b.close()
    warm: dict = {}
    _make_and_send(nbytes, a, warm)  # the process's first arena and exports: not measured
    warm.pop("arena").close()
    steps = max(1_000, int(calibrate_steps_per_s() * W_MS / 1e3))  # as bench boot calibrates W
    beside, alone = [], []
    for _ in range(rounds):
        wall, cpu = timed_workload(steps)
        alone.append({"w_ms": wall, "w_cpu_ms": cpu, "w_off_cpu_ms": wall - cpu})
        res: dict = {}
        t = threading.Thread(target=_make_and_send, args=(nbytes, a, res))
        t.start()
        wall, cpu = timed_workload(steps)
        t.join()
        res.pop("arena").close()
        res.update(w_ms=wall, w_cpu_ms=cpu, w_off_cpu_ms=wall - cpu,
                   gil_held_bound_ms=res["thread_cpu_ms"] - res["gil_free_cpu_ms"])
        beside.append(res)

    def med(rows, key):
        return round(statistics.median(r[key] for r in rows), 3)

    a.close()  # the drain sees the end of the stream and exits
    drain.wait(10)
    import cuda.bindings

    return {"nbytes": nbytes, "rounds": rounds, "cuda_bindings": cuda.bindings.__version__,
            "driver_releases_gil": driver_releases_gil(), "w_steps": steps,
            "alone": {k: med(alone, k) for k in ("w_ms", "w_cpu_ms", "w_off_cpu_ms")},
            "beside": {k: med(beside, k) for k in ("w_ms", "w_cpu_ms", "w_off_cpu_ms", "thread_ms", "thread_cpu_ms",
                                                   "gil_free_cpu_ms", "gil_held_bound_ms")},
            "segments": beside[0]["segments"], "all_beside": beside, "all_alone": alone}


if __name__ == "__main__":
    size = int(float(sys.argv[1])) if len(sys.argv) > 1 else int(13.76e9)
    print(json.dumps(main(size, int(sys.argv[2]) if len(sys.argv) > 2 else 5)), flush=True)
