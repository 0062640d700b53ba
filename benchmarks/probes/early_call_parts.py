"""Where shape C's early call and views spend their time, in a fresh process holding its CUDA
context and the loader imported (as an engine has): one JSON line per process.

``python benchmarks/probes/early_call_parts.py make DIR`` once (shape C at a small scale: the
metadata's and the views' costs do not depend on the bytes), then per fresh process
``python benchmarks/probes/early_call_parts.py run DIR THREADS`` times, in order: the rank's
directory resolved, ``metadata.json`` read and hashed alone (a thread, as the reader does), the
table's columns decoded alone (names, checks), ``read_metadata_file(decode=True)`` as prepare
calls it (both beside each other), ``open_image`` (the strict read), the arena created, and the
views made with THREADS threads, first and second call."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run(root: str, threads: int) -> dict:
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.zeros(1, device=device)
    from flashboot.flashload.warm import import_loader

    import_loader(device)
    from flashboot.arena import Arena
    from flashboot.flashload.views import make_views
    from flashboot.layouts import image as image_mod
    from flashboot.layouts import table as table_mod

    out: dict = {"threads": threads}

    def lap(name: str, t0: float) -> float:
        now = time.perf_counter()
        out[name] = round((now - t0) * 1e3, 3)
        return now

    img = Path(root) / "img"
    t = time.perf_counter()
    rank_dir, _job = image_mod.resolve_rank(img, 0)
    t = lap("resolve_ms", t)
    _, read_json = image_mod._read_and_hash_beside(rank_dir / "metadata.json")
    raw, _sha = read_json()
    t = lap("read_hash_alone_ms", t)
    data = (rank_dir / "tensors.bin").read_bytes()
    t = lap("read_table_ms", t)
    table_mod.predecode_table(data, "probe", len(raw))
    t = lap("decode_alone_ms", t)
    mf = image_mod.read_metadata_file(img, 0, decode=True)
    t = lap("read_metadata_file_ms", t)
    image = image_mod.open_image(mf, 0)
    t = lap("open_image_ms", t)
    arena = Arena.create(image.nbytes, device)
    arena.bytes()
    t = lap("arena_ms", t)
    views = make_views(arena, image.metadata, threads=threads)
    t = lap("views_first_ms", t)
    out["tensors"] = n = len(views)
    del views
    t = time.perf_counter()
    views = make_views(arena, image.metadata, threads=threads)
    lap("views_second_ms", t)
    out["views_first_us_per_tensor"] = round(out["views_first_ms"] * 1e3 / n, 3)
    del views
    arena.close()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "make":  # the same image as the views' A/B
        from flashboot.benchmarks.checkpoints import make_small_image

        make_small_image(sys.argv[2], "C")
    else:
        print(json.dumps(run(sys.argv[2], int(sys.argv[3]))))
