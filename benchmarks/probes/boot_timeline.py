"""Where the early call's time goes in an engine-like boot: W's stalls, each put against what the
early call's background thread was doing then (issue 19: shape B at W = 0.25 s misses 1.10x by a
few ms, and "W slowed" alone does not say by what).

``python benchmarks/probes/boot_timeline.py IMAGE_DIR [--device cuda:0] [--w 0.25] [--repeats 4]``
starts a serving daemon for IMAGE_DIR (rank 0), then runs fresh processes in turn, each holding its
CUDA context and the loader imported (as :mod:`flashboot.benchmarks.boot_e2e`'s cells):

* ``alone``: W only, timed in slices of :data:`SLICE_STEPS` steps;
* ``early``: ``flashboot.prepare``, W in the same slices, then the load; with ``--variants``, also
  ``sync_handover`` (prepare() hands the later batches over itself before it returns) and
  ``sync_all`` (prepare() also reads and validates the metadata: its background thread only waits
  for the daemon's reply), each in its own fresh process.

A slice that took longer than W's usual slice (the median of the ``alone`` process's) is a stall:
W's thread was off the CPU or waiting for the GIL. Each stall's excess is charged to the
background step that ran at its middle (:data:`HOOKS`: the later batches' hand-over, the metadata's
finish, the strict read, the flat tensor, the wait for the daemon's reply), or to "none". One JSON
line per process, then a summary: the stalls' total, count and split by step, the prepare call
and the load, against W alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time

SLICE_STEPS = 1000
"""W's steps between two timestamps (~0.1-0.2 ms at the H200 machine's 5-10 M steps/s)."""
STALL_FACTOR = 1.5
"""A slice this many times W's usual slice or longer is a stall."""
HOOKS = (("flashboot.flashload.client", "ServedCopy", "hand_over_rest", "handover"),
         ("flashboot.layouts.image", "PendingMetadata", "finish", "metadata_finish"),
         ("flashboot.flashload.prepared", "PreparedLoad", "open_metadata", "strict_read"),
         ("flashboot.arena.range", "Arena", "bytes", "flat_tensor"),
         ("flashboot.flashload.client", "ServedCopy", "wait", "reply_wait"))


def _hook(events: list) -> None:
    """Wrap each of :data:`HOOKS` to record (step, thread, start, end, thread CPU ms)."""
    import importlib

    for module, cls_name, attr, step in HOOKS:
        cls = getattr(importlib.import_module(module), cls_name)
        inner = getattr(cls, attr)

        def wrapped(self, *a, __inner=inner, __step=step, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return __inner(self, *a, **k)
            finally:
                events.append((__step, threading.current_thread().name, t0, time.perf_counter(),
                               (time.thread_time() - c0) * 1e3))

        setattr(cls, attr, wrapped)


def _sliced_w(slices: int) -> tuple[list[float], float]:
    """W (boot_e2e's workload) in ``slices`` slices of :data:`SLICE_STEPS`; (the end of each, CPU ms)."""
    from flashboot.benchmarks.boot_e2e import engine_workload

    marks = [0.0] * (slices + 1)
    c0 = time.thread_time()
    marks[0] = time.perf_counter()
    for i in range(1, slices + 1):
        engine_workload(SLICE_STEPS)
        marks[i] = time.perf_counter()
    return marks, (time.thread_time() - c0) * 1e3


def _variant(name: str) -> None:
    """Patch the early call into ``name`` (see the module docstring); "early" is as shipped."""
    from flashboot.flashload import client, prepared

    if name in ("sync_handover", "sync_all"):
        start = client.start_served_load

        def start_then_hand_over(*a, **k):
            copy = start(*a, **k)
            copy.hand_over_rest()  # a no-op later, in the background thread
            return copy

        client.start_served_load = start_then_hand_over
    if name == "sync_all":
        def start_sync(self):
            steps = self._prepare()
            waiting = next(steps)
            while waiting is None:  # the caller's thread runs every step up to the wait for the reply
                waiting = next(steps)
            self._thread = threading.Thread(target=self._run, args=(steps, waiting), daemon=True,
                                            name=f"flashboot-prepare-rank{self.rank}")
            self._thread.start()

        prepared.PreparedLoad._start = start_sync


def child(spec: dict) -> dict:
    from flashboot.benchmarks.timing import engine_context

    dev = spec["device"]
    engine_context(dev, loader=True)
    import torch

    import flashboot
    from flashboot.benchmarks.boot_e2e import calibrate_steps_per_s

    _variant(spec["what"])
    events: list = []
    _hook(events)
    slices = max(1, int(calibrate_steps_per_s() * spec["w_s"] / SLICE_STEPS))
    out: dict = {"what": spec["what"], "slices": slices}
    t0 = time.perf_counter()
    handle = None
    if spec["what"] != "alone":
        handle = flashboot.prepare(spec["image"], 0, dev, mode="served", shm_dir=spec["shm"], timeout_s=60)
    t1 = time.perf_counter()
    marks, w_cpu = _sliced_w(slices)
    t2 = time.perf_counter()
    out.update(w_ms=(marks[-1] - marks[0]) * 1e3, w_cpu_ms=w_cpu, prepare_call_ms=(t1 - t0) * 1e3)
    if handle is not None:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        li = flashboot.load(spec["image"], 0, dev, prepared=handle, shm_dir=spec["shm"], timeout_s=60)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        out.update(load_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, load_ms=(t3 - t2) * 1e3, total_ms=(t3 - t0) * 1e3, tensors=len(li.tensors),
                   views_ms=li.report.bind_ms,
                   phases_ms={k: round(v, 2) for k, v in handle.phases_ms.items()},
                   thread_cpu_ms=handle.thread_cpu_ms)
        li.close()
    out["slice_ms"] = [round((b - a) * 1e3, 4) for a, b in zip(marks, marks[1:])]
    out["events"] = [(s, th, round((a - t0) * 1e3, 3), round((b - t0) * 1e3, 3), round(c, 3))
                     for s, th, a, b, c in events]
    out["w_start_ms"] = (marks[0] - t0) * 1e3
    return out


def stalls(row: dict, usual_ms: float) -> dict:
    """The slices of ``row`` over :data:`STALL_FACTOR` x ``usual_ms``: their excess, by the
    background step that ran at their middle."""
    by: dict[str, list[float]] = {}
    at = row["w_start_ms"]
    for ms in row["slice_ms"]:
        mid, at = at + ms / 2, at + ms
        if ms < STALL_FACTOR * usual_ms:
            continue
        step = next((s for s, th, a, b, _ in row["events"] if th != "MainThread" and a <= mid <= b), "none")
        by.setdefault(step, []).append(ms - usual_ms)
    return {s: {"n": len(v), "ms": round(sum(v), 2), "max": round(max(v), 3)} for s, v in sorted(by.items())}


def _run_child(spec: dict) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=300)
    if p.returncode:
        raise RuntimeError(f"{spec['what']} exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("image", nargs="?")
    ap.add_argument("--child")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shm", default="/dev/shm/fb-timeline")
    ap.add_argument("--w", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--variants", action="store_true", help="also sync_handover and sync_all")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    from flashboot.flashload.client import serve_status
    from flashboot.flashload.service import start_background, stop_service
    from flashboot.flashload.staging import PreloadConfig

    start_background(PreloadConfig(args.image, ranks=[0], shm_dir=args.shm, serve=True, devices={0: args.device}),
                     timeout_s=120)
    try:
        deadline = time.monotonic() + 300
        while serve_status(args.image, args.shm)["ranks"]["0"]["state"] not in ("pinned", "mapped"):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not hold the image within 300 s")
            time.sleep(0.05)
        base = {"device": args.device, "image": args.image, "shm": args.shm, "w_s": args.w}
        kinds = ("early", "sync_handover", "sync_all") if args.variants else ("early",)
        rows: dict[str, list] = {k: [] for k in kinds}
        for _ in range(args.repeats):
            alone = _run_child({**base, "what": "alone"})
            usual = statistics.median(alone["slice_ms"])
            for kind in kinds:
                early = _run_child({**base, "what": kind})
                row = {"kind": kind, "w_alone_ms": round(alone["w_ms"], 2),
                       "alone_stalls_ms": round(sum(v["ms"] for v in stalls(alone, usual).values()), 2),
                       "w_ms": round(early["w_ms"], 2), "w_cpu_ms": round(early["w_cpu_ms"], 2),
                       "alone_cpu_ms": round(alone["w_cpu_ms"], 2),
                       "prepare_call_ms": round(early["prepare_call_ms"], 2), "load_ms": round(early["load_ms"], 2),
                       "views_ms": round(early["views_ms"], 2), "load_faults": early["load_faults"], "total_ms": round(early["total_ms"], 2),
                       "over_w_alone_ms": round(early["total_ms"] - alone["w_ms"], 2),
                       "stalls": stalls(early, usual), "phases_ms": early["phases_ms"],
                       "thread_cpu_ms": round(early["thread_cpu_ms"], 2),
                       "events": [e for e in early["events"] if e[1] != "MainThread"]}
                rows[kind].append(row)
                print(json.dumps(row), flush=True)
        for kind, summary in rows.items():
            med = {key: statistics.median(r[key] for r in summary)
                   for key in ("w_alone_ms", "w_ms", "prepare_call_ms", "load_ms", "views_ms", "load_faults", "total_ms",
                               "over_w_alone_ms", "thread_cpu_ms", "alone_stalls_ms")}
            split = {s: round(statistics.median(r["stalls"].get(s, {}).get("ms", 0) for r in summary), 2)
                     for s in sorted({s for r in summary for s in r["stalls"]})}
            print(f"{kind}: medians " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()) + f"; W's stalls by step {split}")
    finally:
        stop_service(args.image, args.shm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
