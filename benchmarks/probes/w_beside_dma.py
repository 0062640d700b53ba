"""Why an engine's GIL-bound start-up work W runs slower beside the daemon's copy (issue 19).

On the H200 machine, W (a pure-Python loop, calibrated to 0.25 s in its own process) took 15-20 %
more CPU time while the daemon copied the image into the engine's arena, with no thread of the
engine's taking the GIL. The copy is DMA only; this probe asks what of it slows the CPU: W is
timed (wall, its thread's CPU time, the machine's steal time) while this process keeps one kind
of copy running on the GPU, interleaved, several rounds:

* ``idle``: nothing copies;
* ``h2d_registered``: H2D from an anonymous mapping pinned with ``cuMemHostRegister`` (as the
  daemon's staged image is);
* ``h2d_hostalloc`` / ``h2d_writecombined``: H2D from ``cudaHostAlloc`` memory, default / write-
  combined (WC pages are not snooped by the PCIe reads);
* ``d2h_registered``: the DMA writing host memory instead;
* ``d2d``: a device-to-device copy (no host memory at all).

Then W pinned to single CPUs (``idle`` and ``h2d_registered``), to see whether where W runs
matters (the GPU's NUMA node, its interrupts). Prints one JSON line per condition (medians).

Usage: python3 benchmarks/probes/w_beside_dma.py [ROUNDS] [W_S]
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import time

GIB = 1 << 30


def steal_ticks() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8])  # cpu  user nice system idle iowait irq softirq steal


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    w_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    import cupy
    import torch

    from flashboot.benchmarks.boot_e2e import calibrate_steps_per_s, timed_workload

    torch.zeros(1, device="cuda")
    rt = cupy.cuda.runtime
    nbytes = 4 * GIB
    dev_a = cupy.empty(nbytes, cupy.uint8)
    dev_b = cupy.empty(nbytes, cupy.uint8)
    anon = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anon.write(b"\1" * (64 << 20))  # touch a little; the register below faults the rest in
    import ctypes

    anon_ptr = ctypes.addressof(ctypes.c_char.from_buffer(anon))
    t = time.perf_counter()
    rt.hostRegister(anon_ptr, nbytes, 0)
    register_s = time.perf_counter() - t
    host_default = rt.hostAlloc(nbytes, 0)
    host_wc = rt.hostAlloc(nbytes, rt.hostAllocWriteCombined)
    H2D, D2H, D2D = rt.memcpyHostToDevice, rt.memcpyDeviceToHost, rt.memcpyDeviceToDevice
    kinds = {
        "idle": None,
        "h2d_registered": (dev_a.data.ptr, anon_ptr, H2D),
        "h2d_hostalloc": (dev_a.data.ptr, host_default, H2D),
        "h2d_writecombined": (dev_a.data.ptr, host_wc, H2D),
        "d2h_registered": (anon_ptr, dev_a.data.ptr, D2H),
        "d2d": (dev_b.data.ptr, dev_a.data.ptr, D2D),
    }
    stream = cupy.cuda.Stream(non_blocking=True)

    def one(kind: str) -> dict:
        spec = kinds[kind]
        done = cupy.cuda.Event(block=True, disable_timing=False)
        start = cupy.cuda.Event(block=True, disable_timing=False)
        copies = 0
        if spec is not None:
            start.record(stream)
            # enough copies to outlast W (H2D ~55 GB/s: 4 GiB ~ 80 ms; D2D ~ 4 ms)
            copies = max(2, int((w_s + 0.2) / (0.004 if kind == "d2d" else 0.075)))
            for _ in range(copies):
                rt.memcpyAsync(*spec[:2], nbytes, spec[2], stream.ptr)
            done.record(stream)
        s0 = steal_ticks()
        w_ms, w_cpu_ms = timed_workload(steps)
        steal = steal_ticks() - s0
        still_copying = spec is not None and not done.done
        gbps = None
        if spec is not None:
            done.synchronize()
            gpu_ms = cupy.cuda.get_elapsed_time(start, done)
            gbps = copies * nbytes / gpu_ms / 1e6
        return {"w_ms": w_ms, "w_cpu_ms": w_cpu_ms, "steal_ticks": steal, "overlapped": still_copying or spec is None,
                "gbps": gbps}

    rate = calibrate_steps_per_s()
    steps = int(rate * w_s)
    order = list(kinds)
    results: dict[str, list[dict]] = {k: [] for k in order}
    for r in range(rounds):
        for kind in (order if r % 2 == 0 else order[::-1]):
            results[kind].append(one(kind))
    print(json.dumps({"what": "setup", "register_s": round(register_s, 3), "steps": steps, "rate": rate,
                      "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))}))
    for kind in order:
        print(json.dumps(summary(kind, results[kind])))

    # where W runs: each CPU of a sample, idle and beside the registered H2D
    allowed = sorted(os.sched_getaffinity(0))
    sample = allowed[:: max(1, len(allowed) // 8)]
    for cpu in sample:
        os.sched_setaffinity(0, {cpu})
        per = {k: [] for k in ("idle", "h2d_registered")}
        for r in range(max(2, rounds // 2)):
            for kind in per:
                per[kind].append(one(kind))
        for kind, rows in per.items():
            print(json.dumps({**summary(kind, rows), "cpu": cpu}))
    os.sched_setaffinity(0, set(allowed))
    rt.hostUnregister(anon_ptr)
    rt.freeHost(host_default)
    rt.freeHost(host_wc)


def summary(kind: str, rows: list[dict]) -> dict:
    med = lambda key: round(statistics.median(r[key] for r in rows), 2)  # noqa: E731
    out = {"what": kind, "w_ms": med("w_ms"), "w_cpu_ms": med("w_cpu_ms"), "steal_ticks": med("steal_ticks"),
           "w_ms_all": [round(r["w_ms"], 1) for r in rows], "overlapped": all(r["overlapped"] for r in rows)}
    if rows[0]["gbps"] is not None:
        out["copy_gbps"] = med("gbps")
    return out


if __name__ == "__main__":
    main()
