"""How much of a fresh process's first views is the kernel faulting in new heap pages (issue 19:
shape B's 18,722 views cost ~0.9 us a tensor in the load's first call on the H200 machine, ~0.3 us
on a warm host, and each view's C++ tensor and Python object land in memory the process never
touched).

``python benchmarks/probes/view_faults.py make DIR SHAPE`` once (the shape at a small scale: the
views' cost depends on the tensor count, not the bytes), then per fresh process
``python benchmarks/probes/view_faults.py run DIR DEVICE THREADS``: an engine-like process (CUDA
context held, the loader imported) makes the image's views three times with ``make_views``:

* ``first``: the first call, in new memory;
* ``again``: the first call's views kept, so again in new memory, now with warm code;
* ``reused``: the second call's views dropped first, so in memory freed a moment ago.

``again - reused`` is what the new pages cost; ``first - again`` the first call's other costs.
One JSON line: each call's ms and minor faults (``ru_minflt``).
"""

from __future__ import annotations

import json
import resource
import sys
import time


def run(root: str, device: str, threads: int) -> dict:
    from flashboot.benchmarks.timing import engine_context

    engine_context(device, loader=True)
    from flashboot.arena import Arena
    from flashboot.flashload.views import make_views
    from flashboot.layouts import read_image

    image = read_image(f"{root}/img", 0)
    arena = Arena.create(image.nbytes, device)
    out: dict = {"device": device, "threads": threads, "tensors": len(image.metadata.tensors)}
    kept = []
    for label in ("first", "again", "reused"):
        if label == "reused":
            kept.pop()
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        kept.append(make_views(arena, image.metadata, threads=threads))
        ms = (time.perf_counter() - t0) * 1e3
        out[f"{label}_ms"] = round(ms, 2)
        out[f"{label}_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    kept.clear()
    arena.close()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "make":
        from flashboot.benchmarks.checkpoints import make_small_image

        make_small_image(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
