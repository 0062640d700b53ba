"""A/B of the bulk views in a fresh process: the installed views module or another file's (a
``.py`` path, e.g. an older commit's ``git show REV:flashboot/flashload/views.py``), by 1 or N
threads, on a CUDA arena with shape C's 40,250 tensors at a small scale (the views' cost does not
depend on the bytes).

``python -m flashboot.benchmarks.views_ab make DIR`` once, then per fresh process
``python -m flashboot.benchmarks.views_ab run DIR {installed|PATH.py} [threads]``: one JSON line."""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def run(root: str, which: str, threads: int) -> dict:
    import torch

    torch.zeros(1, device="cuda:0")  # an engine's context exists before the load
    from flashboot.arena import Arena
    from flashboot.flashload.warm import import_loader
    from flashboot.layouts import read_image

    import_loader("cuda:0")
    if which == "installed":
        from flashboot.flashload import views as module
    else:
        spec = importlib.util.spec_from_file_location("flashboot.flashload._views_ab", which)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    meta = read_image(f"{root}/img", 0).metadata
    arena = Arena.create(read_image(f"{root}/img", 0).nbytes, "cuda:0")
    arena.bytes()
    kw = {"threads": threads} if threads > 1 else {}
    out = {"views": which, "threads": threads}
    for call in ("first", "second"):
        t = time.perf_counter()
        views = module.make_views(arena, meta, **kw)
        out[f"{call}_us_per_tensor"] = (time.perf_counter() - t) * 1e6 / len(views)
        del views
    arena.close()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "make":
        from flashboot.benchmarks.checkpoints import make_small_image

        make_small_image(sys.argv[2], "C")
    else:
        print(json.dumps(run(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1)))
