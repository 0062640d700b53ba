"""How much a background ``flashboot.prepare`` slows an engine's GIL-bound start-up work.

Issue 19's budget: the GIL time the early call's thread takes from the engine is at most 20 ms
plus 1 us per tensor. This reproduces it with the served daemon (any backend: on the host one it
runs on a CPU machine): shape C's 40,250 tensors by default (``--shape``) (scaled: the bytes do not matter here), a
``flashboot preload --serve`` daemon in its own process, then fresh processes that each run a
pure-Python loop W of ``w_s`` seconds (calibrated in that process, as
:mod:`flashboot.benchmarks.boot_e2e` does):

* ``alone``: W only;
* ``early``: ``flashboot.prepare`` then W then the load (W as slowed is what counts);
* ``profile`` (``--profile``): the same with the prepare's background thread (what follows its
  call) under cProfile, printing the functions with the most own time (its Python; time blocked
  in C shows too, marked by name).

Usage: ``python -m flashboot.benchmarks.prepare_gil [--device cpu] [--w 1] [--repeats 3] [--profile]``.
Prints one line per cell and a summary (W slowed - W alone, against the budget), and with
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BUDGET_MS = 20.0
BUDGET_US_PER_TENSOR = 1.0


def _child(spec: dict) -> dict:
    """One cell in this fresh process (see the module docstring)."""
    if spec["what"] != "profile":
        from flashboot.benchmarks.boot_e2e import child

        return child({**spec, "what": "alone" if spec["what"] == "alone" else "boot", "early": True})
    import cProfile
    import io
    import pstats

    from flashboot.flashload.prepared import PreparedLoad

    profile = cProfile.Profile()
    run, phase = PreparedLoad._run, PreparedLoad.phase
    cpu_ms: dict[str, float] = {}
    last = [0.0]

    def profiled(self, *args):  # the background part (what ran on the caller's thread is prepare()'s own time)
        last[0] = time.thread_time()
        t0 = last[0]
        profile.enable()
        try:
            run(self, *args)
        finally:
            profile.disable()
            cpu_ms["thread"] = (time.thread_time() - t0) * 1e3

    def timed_phase(self, name, t0):  # this thread's CPU time per phase: what it can have held the GIL for
        now = time.thread_time()
        cpu_ms[name] = cpu_ms.get(name, 0.0) + (now - last[0]) * 1e3
        last[0] = now
        return phase(self, name, t0)

    PreparedLoad._run, PreparedLoad.phase = profiled, timed_phase
    from flashboot.benchmarks.boot_e2e import child

    out = child({**spec, "what": "boot", "early": True})
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    out["profile"] = text.getvalue()
    out["thread_cpu_ms"] = {k: round(v, 1) for k, v in cpu_ms.items()}
    out.pop("report", None)
    return out


def _run_child(spec: dict) -> dict:
    cmd = [sys.executable, "-m", "flashboot.benchmarks.prepare_gil", "--child", json.dumps(spec)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"child {spec['what']} exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(*, device: str, w_s: float, repeats: int, profile: bool, root: Path, scale: float | None,
        shape: str = "C") -> dict:
    import flashboot
    from flashboot.benchmarks.checkpoints import CHECKPOINTS, make_checkpoint
    from flashboot.flashload.client import serve_status
    from flashboot.flashload.service import start_background, stop_service
    from flashboot.flashload.staging import PreloadConfig

    spec = CHECKPOINTS[shape].scaled(scale if scale is not None else (1.0 if device.startswith("cuda") else 1e-3))
    root.mkdir(parents=True, exist_ok=True)
    ckpt_dir, img_dir, shm = root / f"ckpt-{shape}", root / f"image-{shape}", root / "staged"
    ckpt = make_checkpoint(str(ckpt_dir), spec, device="cpu")
    if not img_dir.exists():
        flashboot.prepack(str(ckpt_dir), str(img_dir), progress=False)
    budget_ms = BUDGET_MS + BUDGET_US_PER_TENSOR * ckpt.tensor_count / 1e3
    print(f"{shape}: {ckpt.tensor_count:,} tensors, {ckpt.nbytes / 1e6:.1f} MB on {device}; W {w_s:g} s; GIL budget "
          f"{budget_ms:.0f} ms", flush=True)
    start_background(PreloadConfig(str(img_dir), ranks=[0], shm_dir=str(shm), serve=True, devices={0: device}),
                     timeout_s=60)
    rows = []
    try:
        deadline = time.monotonic() + 300
        while serve_status(str(img_dir), str(shm))["ranks"]["0"]["state"] not in ("pinned", "mapped"):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not hold the image within 300 s")
            time.sleep(0.05)
        base = {"device": device, "image": str(img_dir), "shm": str(shm), "w_s": w_s}
        for i in range(repeats):
            alone = _run_child({**base, "what": "alone"})
            early = _run_child({**base, "what": "early"})
            phases = {k: round(v, 1) for k, v in early["report"]["details"].get("prepared", {}).items()}
            row = {"w_alone_ms": alone["w_ms"], "w_slowed_ms": early["w_ms"], "load_ms": early["load_ms"],
                   "total_ms": early["total_ms"], "slowdown_ms": early["w_ms"] - alone["w_ms"],
                   "prepare_phases_ms": phases}
            rows.append(row)
            print(f"run {i + 1}: W alone {row['w_alone_ms']:.0f} ms, beside prepare {row['w_slowed_ms']:.0f} ms "
                  f"(+{row['slowdown_ms']:.0f} ms), load after W {row['load_ms']:.1f} ms; prepare phases "
                  f"{json.dumps(phases) if phases else '?'}", flush=True)
        if profile:
            prof = _run_child({**base, "what": "profile"})
            print("prepare thread under cProfile (own time; C calls that release the GIL included):")
            print(prof["profile"])
            print(f"prepare thread CPU time by phase (under cProfile; an upper bound of its GIL time; the load "
                  f"makes the views): {json.dumps(prof['thread_cpu_ms'])}")
    finally:
        stop_service(str(img_dir), str(shm))
    slow = statistics.median(r["slowdown_ms"] for r in rows)
    print(f"W slowed by prepare: median +{slow:.0f} ms over {len(rows)} runs; budget {budget_ms:.0f} ms "
          f"({'met' if slow <= budget_ms else 'missed'})")
    return {"device": device, "tensors": ckpt.tensor_count, "w_s": w_s, "budget_ms": budget_ms, "rows": rows,
            "median_slowdown_ms": slow}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--w", type=float, default=1.0, help="engine workload W in seconds (default 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shape", default="C", help="checkpoint shape (A, B or C; default C, the most tensors)")
    p.add_argument("--scale", type=float, default=None, help="bytes scale of the shape (default 1 on CUDA, 1e-3 on cpu)")
    p.add_argument("--profile", action="store_true", help="also profile the prepare thread in one more process")
    p.add_argument("--dir", default="/dev/shm/flashboot-prepare-gil")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and image for the next run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    root = Path(args.dir)
    try:
        out = run(device=args.device, w_s=args.w, repeats=args.repeats, profile=args.profile, root=root,
                  scale=args.scale, shape=args.shape)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
