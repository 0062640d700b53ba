"""Whether an image's views, made in a background thread while the engine's GIL-bound start-up
work W runs, cost the engine less than making them after W on its own thread (issue 19: shape B
at W = 0.25 s needs its load's ~20 ms of views off the critical path).

``python benchmarks/probes/views_beside_w.py make DIR SHAPE`` once (the shape at a small scale:
the views' cost depends on the tensor count, not the bytes), then per fresh process
``python benchmarks/probes/views_beside_w.py run DIR MODE THREADS INTERVAL_MS W_S``:

* ``caller``: W, then ``make_views`` on the caller's thread (what the load does today);
* ``beside``: ``make_views`` with THREADS threads started in a background thread, then W on the
  caller's thread, then the join.

The switch interval is INTERVAL_MS during the views (restored after). One JSON line: W's wall and
CPU ms, when the views were done relative to W's end, and the total from W's start.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def run(root: str, mode: str, threads: int, interval_ms: float, w_s: float) -> dict:
    import torch  # noqa: F401

    from flashboot.arena import Arena
    from flashboot.benchmarks.boot_e2e import calibrate_steps_per_s, engine_workload
    from flashboot.flashload.views import make_views
    from flashboot.flashload.warm import import_loader
    from flashboot.layouts import read_image

    import_loader("cpu")
    image = read_image(f"{root}/img", 0)
    arena = Arena.create(image.nbytes, "cpu")
    arena.bytes()
    steps = int(calibrate_steps_per_s() * w_s)
    before = sys.getswitchinterval()
    out: dict = {"mode": mode, "threads": threads, "interval_ms": interval_ms, "tensors": len(image.metadata.tensors)}
    done_at = {}

    def views() -> None:
        make_views(arena, image.metadata, threads=threads)
        done_at["t"] = time.perf_counter()

    sys.setswitchinterval(interval_ms / 1e3)
    t0, c0 = time.perf_counter(), time.thread_time()
    if mode == "beside":
        worker = threading.Thread(target=views)
        worker.start()
        engine_workload(steps)
        t_w, c_w = time.perf_counter(), time.thread_time()
        worker.join(60)
    else:
        sys.setswitchinterval(before)
        engine_workload(steps)
        t_w, c_w = time.perf_counter(), time.thread_time()
        views()
    t_end = time.perf_counter()
    sys.setswitchinterval(before)
    out.update(w_ms=round((t_w - t0) * 1e3, 2), w_cpu_ms=round((c_w - c0) * 1e3, 2),
               views_done_after_w_ms=round((done_at["t"] - t_w) * 1e3, 2), total_ms=round((t_end - t0) * 1e3, 2),
               over_w_cpu_ms=round((t_end - t0) * 1e3 - (c_w - c0) * 1e3, 2))
    arena.close()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "make":
        from flashboot.benchmarks.checkpoints import make_small_image

        make_small_image(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]))))
