"""First calls in a fresh process: what a restart and a plain load pay before the copy, and the
checksum kernel's first call.

``python -m flashboot.benchmarks.first_calls views IMAGE_DIR... --device D``: for each image, a
parent process creates and exports an arena of its size (what ``flashboot hold`` keeps), then a
fresh child (CUDA context made, ``flashboot`` imported and the loader's import warm-up run, as
an engine restarting whose plugin ran it at start; ``warm_ms`` reports it) times ``Arena.open`` of
it and the mapping of every segment (what ``open_held`` does: ``open_ms``, split into the first
segment at open and ``map_rest_ms``; the metadata files are read and hashed in threads meanwhile,
as restart does), the rest of the strict metadata read (``tensors.bin`` decoded) and the views,
and reports each and microseconds per tensor, against the target 20 ms + 2 us/tensor.
The metadata is read as restart reads it (``shm.begin_rank_source``) and
the views made with ``make_views``' default threads (:data:`flashboot.flashload.views.VIEW_THREADS`);
``--view-threads N`` makes them by N threads instead.

``python -m flashboot.benchmarks.first_calls checksum --device D``: a fresh child times the import
of the checksum and its first call on 64 MiB of the device, then a second call, whether the
checksum imported Triton or ``cuda.bindings``, and the garbage collector's share of the first call
(``gc_ms``); run it with an empty ``FLASHBOOT_KERNEL_CACHE`` and ``TRITON_CACHE_DIR`` for the
cold compile, and after ``flashboot warm`` for the cubin launched without Triton (target:
``first_call_with_import_ms`` <= 20 ms). ``checksum-parts``: the same first call after
``flashboot warm``, taken apart (``parts_ms``).

Both print one JSON line per measurement; ``summary FILE...`` prints such files' lines in words.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

from flashboot.benchmarks.timing import engine_context


FIRST_CALL_TARGET_MS = 20.0
"""Issue 19: the checksum's first call in a fresh process (torch and its CUDA context there,
after ``flashboot warm``), its import included."""


def _views_child(image: str, device: str, descriptor: dict, threads: int | None) -> dict:
    engine_context(device)
    import flashboot  # noqa: F401
    from flashboot.arena import Arena, ArenaDescriptor
    from flashboot.flashload.views import make_views
    from flashboot.flashload.shm import begin_rank_source
    from flashboot.flashload.warm import import_loader

    warm_ms = import_loader(device)  # what the engine plugins run at engine start, before any load
    t0 = time.perf_counter()
    finish_source = begin_rank_source(image, 0)  # as restart: the files read and hashed while the arena is mapped
    desc = ArenaDescriptor.from_dict(descriptor)
    timings: dict = {}
    arena = Arena.open(desc, timings=timings) if desc.backend == "host" else Arena.open(desc, device, timings=timings)
    t_open = time.perf_counter()
    arena.map_range()  # as restart's _map_held: every segment mapped before the views
    t1, c1 = time.perf_counter(), time.thread_time()  # CPU time too: on a busy machine the wall time is not ours
    meta = finish_source().metadata  # the table decoded, the strict read, beside the files' hash
    t2, c2 = time.perf_counter(), time.thread_time()
    arena.bytes()  # the flat tensor the views are made of (torch wraps the range once): timed apart
    t_flat = time.perf_counter()
    views = make_views(arena, meta, threads=threads)  # None: make_views' default, as restart makes them
    t3, c3 = time.perf_counter(), time.thread_time()
    again = make_views(arena, meta, threads=threads)
    t4 = time.perf_counter()
    n = len(views)
    del views, again
    map_stats = arena.map_stats
    arena.close()
    total_ms = (t3 - t0) * 1e3
    return {"image": image, "tensors": n, "view_threads": threads, "warm_ms": warm_ms, "open_ms": (t1 - t0) * 1e3,
            "open_first_segment_ms": (t_open - t0) * 1e3, "map_rest_ms": (t1 - t_open) * 1e3,
            "segments": desc.segments, "open_timings_ms": {k: round(v, 3) for k, v in timings.items()},
            "map_stats": map_stats, "metadata_ms": (t2 - t1) * 1e3,
            "views_ms": (t3 - t2) * 1e3, "views_flat_ms": (t_flat - t2) * 1e3, "views_us_per_tensor": (t3 - t2) * 1e6 / max(n, 1),
            "views_second_us_per_tensor": (t4 - t3) * 1e6 / max(n, 1), "restart_ms": total_ms,
            "restart_target_ms": 20 + 2e-3 * n, "metadata_us_per_tensor": (t2 - t1) * 1e6 / max(n, 1),
            "metadata_cpu_ms": (c2 - c1) * 1e3, "views_cpu_us_per_tensor": (c3 - c2) * 1e6 / max(n, 1)}


class _GcClock:
    """Milliseconds spent in the garbage collector while it is installed: a collection lands on
    whichever step allocates the object that triggers it, so a part's time may include one."""

    def __init__(self):
        self.ms, self.collections, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.collections += 1

    def stop(self) -> dict:
        gc.callbacks.remove(self._callback)
        return {"gc_ms": round(self.ms, 3), "gc_collections": self.collections}


def _imported(before: set[str]) -> dict:
    """Whether the checksum imported Triton or ``cuda.bindings`` (``before``: the modules loaded
    before it; some torch builds import ``cuda.bindings`` themselves)."""
    added = set(sys.modules) - before
    return {"triton_imported": "triton" in added, "cuda_bindings_imported": "cuda.bindings" in added}


def _checksum_child(device: str) -> dict:
    engine_context(device)
    import torch

    import flashboot  # noqa: F401

    buf = torch.ones(64 << 20, dtype=torch.uint8, device=device)
    before = set(sys.modules)
    gc_clock = _GcClock()
    t0 = time.perf_counter()
    from flashboot.kernels.checksum import chunk_checksums

    t1 = time.perf_counter()
    chunk_checksums(buf, 1 << 20)
    t2 = time.perf_counter()
    gc_first = gc_clock.stop()
    chunk_checksums(buf, 1 << 20)
    t3 = time.perf_counter()
    return {"device": device, "import_ms": (t1 - t0) * 1e3, "first_call_ms": (t2 - t1) * 1e3,
            "second_call_ms": (t3 - t2) * 1e3, "first_call_with_import_ms": (t2 - t0) * 1e3,
            "target_ms": FIRST_CALL_TARGET_MS, **gc_first, **_imported(before)}


def _checksum_parts_child(device: str) -> dict:
    """The checksum's first call taken apart, each part timed as it is first paid: the import of
    the checksum's modules, the driver opened through ctypes (``libcuda.so.1``, ``cuInit``), the
    launch knobs, the SM count, the compute capability, the cache key (the kernel source's
    sha256, Triton's version read from its package), the cubin read and checked, the launcher
    the call uses (key and entry again: ``repeated_ms``), ``cuModuleLoadData`` +
    ``cuModuleGetFunction``, then the call itself (its output buffer, the launch, the wait and the
    read-back) and a second call. ``first_call_ms`` is the parts' sum less what was repeated."""
    engine_context(device)
    import torch

    import flashboot  # noqa: F401

    buf = torch.ones(64 << 20, dtype=torch.uint8, device=device)
    dev = torch.device(device).index or 0
    parts: dict[str, float] = {}
    before = set(sys.modules)
    gc_clock = _GcClock()
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        parts[name] = round((now - t) * 1e3, 3)
        t = now

    from flashboot.kernels import checksum_gpu, cubin, launch_ctypes
    from flashboot.kernels.checksum import chunk_checksums
    from flashboot.kernels.views import sm_count
    mark("import checksum modules")
    launch_ctypes._driver()
    mark("driver through ctypes (dlopen, cuInit)")
    knobs = checksum_gpu._gpu_knobs({})
    mark("launch knobs")
    sm_count(dev)
    mark("sm count (driver attribute)")
    arch = launch_ctypes.compute_capability(dev)
    mark("compute capability")
    key = checksum_gpu.words_kernel_key(arch, knobs, False)
    mark("cache key (source sha256, triton version)")
    cached, why = cubin.load(key)
    mark("cubin read + sha256")
    if cached is None:
        return {"device": device, "parts_ms": parts, "error": why}
    launcher = checksum_gpu._words_launcher(dev, knobs, False)
    mark("launcher (key and cubin read again)")
    launcher.function(dev)
    mark("cuModuleLoadData + GetFunction")
    chunk_checksums(buf, 1 << 20)
    mark("first call (buffer, launch, wait, read-back)")
    gc_first = gc_clock.stop()
    chunk_checksums(buf, 1 << 20)
    mark("second call")
    repeated = parts["cache key (source sha256, triton version)"] + parts["cubin read + sha256"]
    first = sum(parts.values()) - parts["second call"] - repeated
    return {"device": device, "parts_ms": parts, "first_call_ms": round(first, 3), "repeated_ms": round(repeated, 3),
            "target_ms": FIRST_CALL_TARGET_MS, **gc_first, **_imported(before)}


def _child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "flashboot.benchmarks.first_calls", "--child", *args],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip().splitlines()[-3:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def views(images: list[str], device: str, threads: int | None = None) -> list[dict]:
    """One fresh child per image; see the module docstring."""
    from flashboot.arena import Arena
    from flashboot.layouts import read_image

    out = []
    for image in images:
        nbytes = read_image(image, 0).nbytes
        with Arena.create(nbytes, device) as arena:
            out.append(_child(["views", image, device, json.dumps(arena.export().to_dict()), str(threads or 0)]))
    return out


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per measurement of :func:`views` or the checksum, against its target."""
    lines = []
    for r in rows:
        if "tensors" in r:
            lines.append(f"{r['image'].rsplit('/', 1)[-1]} (view threads {r['view_threads'] or 'default'}): "
                         f"{r['tensors']} tensors: open {r['open_ms']:.1f} ms, metadata {r['metadata_ms']:.1f} ms, "
                         f"views {r['views_ms']:.1f} ms ({r['views_us_per_tensor']:.2f} us/t; 2nd "
                         f"{r['views_second_us_per_tensor']:.2f}); restart {r['restart_ms']:.1f} ms vs target "
                         f"{r['restart_target_ms']:.1f} ms")
        elif "first_call_ms" in r:
            lines.append(f"checksum: import {r.get('import_ms', 0.0):.1f} ms, first call {r['first_call_ms']:.1f} ms, "
                         f"with import {r.get('first_call_with_import_ms', float('nan')):.1f} ms, second "
                         f"{r.get('second_call_ms', float('nan')):.2f} ms (target {FIRST_CALL_TARGET_MS:g} ms)")
        elif "error" in r:
            lines.append(f"error: {r['error']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind = argv[1]
        res = (_views_child(argv[2], argv[3], json.loads(argv[4]), int(argv[5]) or None) if kind == "views"
               else _checksum_parts_child(argv[2]) if kind == "checksum-parts" else _checksum_child(argv[2]))
        print(json.dumps(res))
        return 0
    p = argparse.ArgumentParser(prog="python -m flashboot.benchmarks.first_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["views", "checksum", "checksum-parts", "summary"])
    p.add_argument("images", nargs="*")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--view-threads", type=int, default=None,
                   help="threads that make the views (default: make_views' own, as a restart makes them)")
    args = p.parse_args(argv)
    if args.what == "summary":  # IMAGES: JSON-lines files of the other commands (a line may carry a label first)
        for path in args.images:
            with open(path) as f:
                for line in filter(str.strip, f):
                    label = line[:line.index("{")].strip()
                    print(*[f"{label} {x}" if label else x for x in summary_lines([json.loads(line[len(label):])])],
                          sep="\n")
        return 0
    rows = views(args.images, args.device, args.view_threads) if args.what == "views" else [_child([args.what, args.device])]
    for row in rows:
        print(json.dumps(row))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
