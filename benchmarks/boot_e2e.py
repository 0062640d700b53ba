"""``flashboot bench boot --end-to-end``: the boot as the engine sees it, not only its load call.

Each cell is a fresh process that holds its CUDA context and has imported its loader (as an
engine has), then, timed from there:

* optionally the early call, ``flashboot.prepare(...)``;
* a fixed GIL-bound engine workload W (pure Python, as an engine building its model is): a loop
  whose step count is calibrated in the measuring process itself, just before its timed section,
  to take ``w_s`` seconds alone (0, 0.25 and 1 s by default). A rate measured in another process
  is not the rate of this one (on the H200 machine a separate calibration made "1 s" run 0.39 s);
* the load: ``flashboot.load(..., prepared=handle)`` with the early call, ``served=True`` without.

Reported per cell: the total, W as it ran beside the early call's thread ("W slowed"), the load
call, and total / max(W alone, bulk H2D), where W alone is measured in its own fresh process and the
bulk H2D is :mod:`flashboot.benchmarks.boot`'s ceiling, all in the same run; and the same ratio with
W alone run again in the cell's own process after its boot (processes of the H200 machine ran the
loop at rates 2x apart, so the other process's W alone is a noisy bound: both are reported). With
W > 0 each process then runs W once more while the daemon copies the image into its arena again,
with no early call ("W beside a bare daemon copy"): the copy's DMA shares the host's memory with
the CPU that runs W, so this is the W that any boot overlapping the copy with W can have; W slowed
minus it is what the early call's own thread took (``w_taken_by_prepare_ms``, issue 19's GIL
budget), and the last ratio is total / max(W beside the copy, bulk). ``copy_request_ms``: from the
call that starts the copy (prepare, or the plain load) to the daemon's request sent. The GIL the
early call holds is also bounded directly, free of the machine's drift: its call (on the caller's
thread, before W) plus its background thread's CPU time (``prepare_gil_bound_ms``, against
:data:`GIL_BUDGET_MS` + 1 us per tensor). That CPU time includes the served hand-over's driver
calls, which make and export the later segments with the GIL released (``prepare_handover_cpu_ms``:
7.8 ms for A's 13.8 GB on the H200), so that bound is loose for large images; each call that
releases the GIL is timed where it is made (:mod:`flashboot.gil_time`), and the bound less that
time (``prepare_gil_held_bound_ms``) is the tight one. W's own speed drifts within one process on the H200
machine (the same loop 150-370 ms apart seconds later), so W-based ratios are noisy there; each W
is also timed in its thread's CPU time (``w_cpu_ms`` ...): ``w_off_cpu_ms``, W's wall time less
its CPU time during the boot, is what W waited for the GIL or the machine, whatever the CPU's
clock did (:func:`timed_workload`). ``x_bound_cpu`` divides the total by max(W's CPU time during
the boot, bulk): the bound at the speed the machine ran W at in that very boot. The H200
machine's clock drifts under one process (benchmarks/probes/w_beside_dma.py, 2026-12-02: the same
loop, calibrated to 250 ms, ran 262-335 ms in one round and 430-500 ms in the next, idle or
beside any DMA alike, with no steal time and its CPU time equal to its wall time), so W alone
from another process, or from this one seconds later, is not the W this boot ran. A thread of
the boot that takes the GIL from W adds to W's wall time, not its CPU time: it stays in the
total, so ``x_bound_cpu`` still charges the early call for it. The load verifies as
by default (on CUDA the daemon digests what it copied, inside the timed load); the weights are
verified again after the timed section (chunk checksums on the device), as in the other columns.
"""

from __future__ import annotations

import time
from typing import Callable

W_LEVELS_S = (0.0, 0.25, 1.0)
GIL_BUDGET_MS, GIL_BUDGET_US_PER_TENSOR = 20.0, 1.0
"""Issue 19's budget for the GIL the early call holds: 20 ms plus 1 us per tensor."""
CALIBRATE_WINDOW_S = 0.05
"""The calibration times windows of this length until two in a row agree (the first ones run while
the CPU's clock and the interpreter's caches warm up)."""
CALIBRATE_AGREE = 0.03
CALIBRATE_MAX_WINDOWS = 40


def engine_workload(steps: int) -> int:
    """``steps`` iterations of pure-Python integer work: holds the GIL the whole time, as an
    engine's model construction does. Returns a value so the loop cannot be skipped."""
    x = 1
    for _ in range(steps):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    return x


def timed_workload(steps: int) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of :func:`engine_workload`. Their difference is the time W's
    thread was off the CPU: waiting for the GIL (another thread of the process held it) or
    descheduled by the machine. The CPU time is as slow as the CPU's clock, so a drift of the
    clock moves both and leaves their difference."""
    t0, c0 = time.perf_counter(), time.thread_time()
    engine_workload(steps)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def binding_pass_ms(tensors) -> float:
    """One pass over every loaded tensor as an engine's binding makes (name, shape, dtype and
    data pointer of each), in ms: timed after the load, so that what a load leaves to its first
    use (a lazy view, say) shows here rather than nowhere."""
    t0 = time.perf_counter()
    for _name, t in tensors.items():
        t.shape, t.dtype, t.data_ptr()
    return (time.perf_counter() - t0) * 1e3


def calibrate_steps_per_s() -> float:
    """Steps of :func:`engine_workload` per second in this process, now: the rate of the last of
    two consecutive windows of :data:`CALIBRATE_WINDOW_S` that agree within
    :data:`CALIBRATE_AGREE` (or of the last window after :data:`CALIBRATE_MAX_WINDOWS`)."""
    steps, prev = 20_000, None
    for _ in range(CALIBRATE_MAX_WINDOWS):
        t0 = time.perf_counter()
        engine_workload(steps)
        rate = steps / (time.perf_counter() - t0)
        if prev is not None and abs(rate - prev) <= CALIBRATE_AGREE * prev:
            break
        prev, steps = rate, max(1_000, int(rate * CALIBRATE_WINDOW_S))
    return rate


def child(spec: dict) -> dict:
    """One cell in this (fresh) process; see the module docstring. ``spec["what"]``: "alone" (W
    only) or "boot" (``early``: bool); ``spec["w_s"]``: W's seconds, calibrated here."""
    from flashboot.benchmarks.timing import engine_context

    dev = spec["device"]
    engine_context(dev, loader=True)
    import flashboot

    from flashboot.benchmarks.load import _sync
    from flashboot.flashload.landing import verify_loaded

    rate = calibrate_steps_per_s() if spec["w_s"] else 0.0
    steps = int(rate * spec["w_s"])
    if spec["what"] == "alone":
        w_ms, w_cpu_ms = timed_workload(steps)
        return {"w_ms": w_ms, "w_cpu_ms": w_cpu_ms, "steps_per_s": rate, "steps": steps}

    t0 = time.perf_counter()
    handle = None
    if spec["early"]:
        handle = flashboot.prepare(spec["image"], 0, dev, mode="served", shm_dir=spec["shm"], timeout_s=60)
    t1, c1 = time.perf_counter(), time.thread_time()
    engine_workload(steps)
    t2, c2 = time.perf_counter(), time.thread_time()
    li = flashboot.load(spec["image"], 0, dev, served=handle is None, prepared=handle, shm_dir=spec["shm"],
                        timeout_s=60)  # verified as by default: on CUDA by the daemon
    _sync(dev)
    t3 = time.perf_counter()
    pass_ms = binding_pass_ms(li.tensors)
    verify_loaded(li.arena, li.metadata, f"end to end, early call {spec['early']}")  # raises on a bad chunk
    out = {"total_ms": (t3 - t0) * 1e3, "w_ms": (t2 - t1) * 1e3, "load_ms": (t3 - t2) * 1e3,
           "prepare_call_ms": (t1 - t0) * 1e3, "w_cpu_ms": (c2 - c1) * 1e3, "pass_ms": pass_ms, "verified": True,
           "report": li.report.to_dict(),
           "steps_per_s": rate, "steps": steps}
    out["copy_request_ms"] = _copy_request_ms(li.report.details, li.report)
    # W alone again, in this process once its boot is over: the H200 machine's processes ran the same
    # loop at 5-10 M steps/s from one to the next, so W alone from another process is a noisy bound
    out["w_after_ms"], out["w_after_cpu_ms"] = timed_workload(steps)
    if steps:
        out["w_beside_copy_ms"], out["w_beside_copy_cpu_ms"] = w_beside_daemon_copy(li, spec, steps)
    li.close()
    return out


def w_beside_daemon_copy(li, spec: dict, steps: int) -> tuple[float, float]:
    """W (wall and CPU ms, :func:`timed_workload`) while the daemon copies the same image into the
    loaded arena again, as it did during the boot, with no early call's thread in this process:
    what the copy alone does to W. Its DMA reads the pinned image from host memory at the H2D rate,
    which the CPU running W shares; so "W slowed" minus this is what the early call's own thread
    took from W (issue 19's GIL budget)."""
    from flashboot.flashload.client import start_served_load

    src = li.source
    copy = start_served_load(li.arena, image_dir=spec["image"], rank=src.rank, nbytes=src.nbytes,
                             metadata_sha256=src.metadata_sha256, timeout_s=60, shm_dir=spec["shm"],
                             verify=spec["device"].startswith("cuda"))  # the daemon digests as in the boot
    timed = timed_workload(steps)
    copy.wait()
    return timed


def _copy_request_ms(details: dict, report) -> float | None:
    """From the call that starts the copy (prepare, or the plain load) to the daemon's request sent."""
    if details.get("copy_started_after_prepare_ms") is not None:
        return details["copy_started_after_prepare_ms"]
    if "request_ms" not in details:
        return None
    return details.get("setup_ms", 0.0) + report.wait_ms + report.alloc_ms + details["request_ms"]


def run_shape(run_child: Callable[[dict], dict], *, device: str, image: str, shm: str, ceiling_ms: float,
              w_levels=W_LEVELS_S, log: Callable[[str], None] = print, repeats: int = 1) -> dict:
    """Every cell of one shape while the daemon serves ``image``; returns rows and the rates of W
    measured in the W-alone processes. ``repeats``: fresh processes per cell, a W-alone process,
    the plain load and the early call alternating, so that W alone is measured beside the boots it
    bounds (the H200 machine's speed drifts over a run: a W alone measured once, minutes before,
    bounded later cells at another speed); a row is the process of the median total, with every
    total in ``totals_ms``, and W alone the median of its processes (one process's speed varies
    from the next by up to 25 % on the H200 machine: a difference of a few ms between two single
    processes says little)."""
    base = {"loader": "end to end", "device": device, "image": image, "shm": shm}
    rows, medians = [], {}
    for w_s in w_levels:
        alones: list[dict] = []
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(repeats):
            if w_s:
                alones.append(run_child({**base, "what": "alone", "w_s": w_s}))
            for early in (False, True):
                runs[early].append(run_child({**base, "what": "boot", "w_s": w_s, "early": early}))
        alone = medians[w_s] = _median_alone(alones) if w_s else {"w_ms": 0.0}
        for early in (False, True):
            row = _row(runs[early], alone, w_s, early, ceiling_ms)
            rows.append(row)
            log(describe(row))
    rates = {w: a["steps_per_s"] for w, a in medians.items() if a.get("steps_per_s")}
    return {"steps_per_s": rates, "rows": rows}


def _median_alone(alones: list[dict]) -> dict:
    """The W-alone process of the median W (the lower middle of an even count), with every one's
    W in ``w_all_ms``; the first error if one failed."""
    failed = [a for a in alones if "error" in a]
    if failed:
        return failed[0]
    ranked = sorted(alones, key=lambda a: a["w_ms"])
    return {**ranked[(len(ranked) - 1) // 2], "w_all_ms": [round(a["w_ms"], 2) for a in alones]}


def _row(results: list[dict], alone: dict, w_s: float, early: bool, ceiling_ms: float) -> dict:
    """One cell's row from its processes' results: the one of the median total (the upper middle
    of an even count: the lower had made a cell of two boots the faster of them, a best-of that
    favours the boot; W alone, the bound, takes the lower, the strict one), or the first error."""
    row = {"w_s": w_s, "early": early, "w_alone_ms": alone.get("w_ms"), "repeats": len(results)}
    if alone.get("w_all_ms"):
        row["w_alone_all_ms"] = alone["w_all_ms"]
    failed = [r for r in results if "error" in r]
    if failed or "error" in alone:
        row["error"] = failed[0]["error"] if failed else alone["error"]
        return row
    ranked = sorted(results, key=lambda r: r["total_ms"])
    res = ranked[len(ranked) // 2]
    row.update({k: res[k] for k in ("total_ms", "w_ms", "load_ms", "prepare_call_ms", "pass_ms", "verified",
                                    "steps_per_s", "w_after_ms")})
    row["copy_request_ms"] = res.get("copy_request_ms")
    for k in ("w_cpu_ms", "w_after_cpu_ms", "w_beside_copy_cpu_ms"):
        if res.get(k) is not None:
            row[k] = res[k]
    if res.get("w_cpu_ms") is not None:  # W's thread off the CPU during the boot: GIL waits or descheduled
        row["w_off_cpu_ms"] = res["w_ms"] - res["w_cpu_ms"]
    if alone.get("w_cpu_ms") is not None:
        row["w_alone_cpu_ms"] = alone["w_cpu_ms"]
    row["totals_ms"] = [round(r["total_ms"], 2) for r in results]
    row["x_bound"] = res["total_ms"] / max(alone["w_ms"], ceiling_ms)
    row["x_bound_same"] = res["total_ms"] / max(res["w_after_ms"], ceiling_ms)
    if res.get("w_cpu_ms") is not None:  # the bound at the speed the machine ran W at during this very boot
        row["x_bound_cpu"] = res["total_ms"] / max(res["w_cpu_ms"], ceiling_ms)
    if res.get("w_beside_copy_ms") is not None:
        row["w_beside_copy_ms"] = res["w_beside_copy_ms"]
        row["x_bound_beside_copy"] = res["total_ms"] / max(res["w_beside_copy_ms"], ceiling_ms)
        if early:  # what the early call's thread took from W beyond the copy's own effect on it
            row["w_taken_by_prepare_ms"] = res["w_ms"] - res["w_beside_copy_ms"]
    rep = res["report"]
    row["ready_before_load_ms"] = rep["details"].get("ready_before_load_ms")
    # where the load went (its phases; with the early call, what prepare's thread paid by phase)
    row["load_phases_ms"] = {k: round(rep.get(f"{k}_ms", 0.0), 2) for k in ("wait", "metadata", "bind", "h2d")}
    if rep["details"].get("prepared"):
        row["prepare_phases_ms"] = {k: round(v, 2) for k, v in rep["details"]["prepared"].items()}
    if early:  # the GIL the early call held: its call (before W), at most its thread's CPU time (beside W)
        row["prepare_thread_cpu_ms"] = rep["details"].get("prepare_thread_cpu_ms", 0.0)
        row["prepare_gil_bound_ms"] = row["prepare_call_ms"] + row["prepare_thread_cpu_ms"]
        # of that thread's CPU, the hand-over's driver calls and sends (GIL released), with the
        # Python of its loop over the batches: the bound without them is the tighter one
        row["prepare_handover_cpu_ms"] = rep["details"].get("prepare_handover_cpu_ms", 0.0)
        # the tighter bound: the thread's CPU less its time inside calls that release the GIL
        # (driver calls, sends: each timed where it is made, flashboot.gil_time)
        row["prepare_thread_gil_free_cpu_ms"] = rep["details"].get("prepare_thread_gil_free_cpu_ms", 0.0)
        row["prepare_gil_held_bound_ms"] = row["prepare_gil_bound_ms"] - row["prepare_thread_gil_free_cpu_ms"]
        row["prepare_gil_budget_ms"] = GIL_BUDGET_MS + GIL_BUDGET_US_PER_TENSOR * rep.get("tensors", 0) / 1e3
        # per boot: did the load wait for the copy's end on its own thread (it came before the reply)?
        row["copy_end_awaited_on"] = [r["report"]["details"].get("copy_end_awaited_on") for r in results]
    return row


def describe(row: dict) -> str:
    head = f"W {row['w_s']:g} s, {'early call' if row['early'] else 'plain served'}"
    if "error" in row:
        return f"{head}: FAILED: {row['error']}"
    many = f" (median of {row['repeats']}: {row['totals_ms']})" if row.get("repeats", 1) > 1 else ""
    at_cpu = f", {row['x_bound_cpu']:.2f}x max(W's own CPU time, bulk)" if row.get("w_s") and "x_bound_cpu" in row else ""
    return (f"{head}: total {row['total_ms']:.0f} ms{many} ({row['x_bound']:.2f}x max(W alone, bulk){at_cpu}), W "
            f"{row['w_ms']:.0f} ms (alone {row['w_alone_ms']:.0f}; {row['w_after_ms']:.0f} in the same process after "
            f"the boot: {row['x_bound_same']:.2f}x"
            + (f"; {row['w_beside_copy_ms']:.0f} beside a bare daemon copy: {row['x_bound_beside_copy']:.2f}x"
               if "w_beside_copy_ms" in row else "")
            + (f"; the early call's thread took {row['w_taken_by_prepare_ms']:.1f} ms of W beyond the copy's effect"
               if "w_taken_by_prepare_ms" in row else "")
            + (f"; W's thread off the CPU {row['w_off_cpu_ms']:.1f} ms of it (GIL waits or descheduled; W's CPU "
               f"{row['w_cpu_ms']:.0f}, alone {row.get('w_alone_cpu_ms') or 0:.0f})" if row.get("w_s") else "")
            + (f"; GIL held by the early call <= {row['prepare_gil_bound_ms']:.1f} ms (call "
               f"{row['prepare_call_ms']:.1f} + its thread's CPU {row['prepare_thread_cpu_ms']:.1f}, of which the "
               f"hand-over's driver calls and sends {row['prepare_handover_cpu_ms']:.1f}; less the CPU inside "
               f"calls that release the GIL ({row.get('prepare_thread_gil_free_cpu_ms', 0.0):.1f}): "
               f"{row.get('prepare_gil_held_bound_ms', row['prepare_gil_bound_ms']):.1f}; budget "
               f"{row['prepare_gil_budget_ms']:.1f})" if "prepare_gil_bound_ms" in row else "")
            + f"), copy requested {row['copy_request_ms'] or 0:.1f} ms after the call, load {row['load_ms']:.1f} ms, "
            f"then a pass over every tensor "
            f"{row['pass_ms']:.1f} ms; load phases {row.get('load_phases_ms')}"
            + (f", prepare's {row['prepare_phases_ms']}" if row.get("prepare_phases_ms") else ""))


def print_rows(out: dict) -> None:
    from flashboot.benchmarks.timing import print_table

    rows, gil = [], []
    for s in out["shapes"]:
        e2e = s.get("end_to_end")
        if not e2e:
            continue
        if "error" in e2e:
            rows.append([s["shape"], "-", "-", "-", "-", "-", "-", "-", "-", f"FAILED: {e2e['error']}", "-", "-", "-"])
            continue
        for r in e2e["rows"]:
            if "error" in r:
                rows.append([s["shape"], r["w_s"], "early" if r["early"] else "plain", "-", "-", "-", "-", "-", "-",
                             f"FAILED: {r['error']}", "-", "-", "-"])
                continue
            rows.append([s["shape"], r["w_s"], "early" if r["early"] else "plain", r["total_ms"], r["w_ms"],
                         r["w_alone_ms"], r["w_after_ms"], r.get("w_beside_copy_ms", "-"), r["load_ms"], r["x_bound"],
                         r["x_bound_same"], r.get("x_bound_beside_copy", "-"), r.get("x_bound_cpu", "-")])
            if "prepare_gil_held_bound_ms" in r:
                gil.append([s["shape"], r["w_s"], r["prepare_call_ms"], r["prepare_thread_cpu_ms"],
                            r["prepare_thread_gil_free_cpu_ms"], r["prepare_gil_held_bound_ms"],
                            r["prepare_gil_budget_ms"], r.get("w_off_cpu_ms", "-")])
    if rows:
        print_table(f"boot end to end on {out['device']} (fresh process: optional prepare, W, load; daemon serving; same-run "
                    "bulk H2D; x: total / max(W, bulk))", ["shape", "W s", "call", "total ms", "W slowed ms",
                                                          "W alone ms", "W after", "W beside copy", "load ms",
                                                          "x, W alone", "x, W after",
                                                          "x, W beside copy", "x, W's CPU"], rows)
    if gil:
        print_table("the GIL the early call held (ms): its call + its thread's CPU, less that CPU inside calls that "
                    "release the GIL (driver calls, sends); W's own time off the CPU beside it",
                    ["shape", "W s", "call", "thread CPU", "of it GIL-free", "GIL held <=", "budget",
                     "W off CPU"], gil)


def headline(out: dict) -> str | None:
    """One line for the demo: the early-call boot at the largest W against its bound."""
    for s in out["shapes"]:
        rows = [r for r in (s.get("end_to_end") or {}).get("rows", ()) if r["early"] and "error" not in r]
        if rows:
            r = max(rows, key=lambda r: r["w_s"])
            return (f"boot end to end ({s['shape']}): early call + {r['w_s']:g} s of engine work + load = "
                    f"{r['total_ms']:.0f} ms, {r['x_bound']:.2f}x max(W alone {r['w_alone_ms']:.0f} ms, bulk H2D "
                    f"{s['ceiling_ms']:.0f} ms); the weights were ready {r['ready_before_load_ms'] or 0:.0f} ms before "
                    "the engine asked")
    return None


__all__ = ["W_LEVELS_S", "child", "engine_workload", "headline", "print_rows", "run_shape"]
