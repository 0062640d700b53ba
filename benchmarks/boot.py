"""``flashboot bench boot``: the first load in a fresh engine process, against the bulk-H2D ceiling.

An engine boots once, so what counts is the first call in a new process (one that already holds
its CUDA context and has imported its loader, as an engine has), not the best of five after a
warm-up. For each shape (A: 3,170 tensors / 13.8 GB, B: 18,722 / 11.8 GB, C: 40,250 / 2.6 GB,
synthetic, generated in /dev/shm), every loader runs in its own fresh process and is timed on its
first and its second call:

* ``flashload served``: ``flashboot.load(..., served=True)`` with the preloader daemon holding the
  image pinned, no early call;
* ``flashload prepared``: ``flashboot.prepare(...)`` at process start, waited for (its time, the
  early copy included, reported beside), then ``flashboot.load(..., prepared=handle)``, which
  only finds the copy done: this column times the call an engine makes after building its model
  for longer than the copy; ``--end-to-end`` times the whole boot; the second call prepares again first;
* ``flashload prepared, pinned here``: the same without a daemon (the process pins the staged image);
* ``flashload streamed``: no preloader at all, the image on a real disk (``--disk-dir``, default
  /var/tmp), its page cache dropped before each call: the load streams it through the bounded
  ring (peak extra host memory reported); for shape C only unless ``--stream-shapes`` says more,
  as a 13.8 GB read from a ~1 GB/s disk takes 14 s a call (``flashboot bench stream`` measures
  the large image against the disk's O_DIRECT rate);
* ``safetensors``, ``instanttensor``, ``fastsafetensors`` where installed (from the tmpfs checkpoint).

The ceiling is one pinned bulk H2D of the checkpoint's bytes (what every loader delivers; the
image adds its alignment) in the parent, median of 3 after a warm-up, in the same run. Every result is verified (FlashLoad: chunk checksums on the device; peers: the
source tensors' checksums), outside the timed call. FlashLoad's timed calls also verify as they do by
default (a served load on CUDA: by the daemon, inside the call); the "verified" column says who
checked inside each call: "daemon", "load", or "after" (only outside the clock).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from flashboot.benchmarks.load import _free_device_memory as _free
from flashboot.benchmarks.load import _sync
from flashboot.errors import FlashBootError

SHAPES = ("A", "B", "C")
FLASH_LOADERS = ("flashload served", "flashload prepared", "flashload prepared, pinned here", "flashload streamed")
PEER_LOADERS = ("safetensors", "instanttensor", "fastsafetensors")
CHILD_TIMEOUT_S = 300.0


# ================================================================================ the child
def _child(spec: dict) -> dict:
    """One loader, first and second call, in this (fresh) process; returns what it measured."""
    from flashboot.benchmarks.timing import engine_context

    dev = spec["device"]
    engine_context(dev)
    loader = spec["loader"]
    if loader == "end to end":
        from flashboot.benchmarks.boot_e2e import child

        return child(spec)
    calls = []
    if loader == "flashload streamed":
        import flashboot
        from flashboot.benchmarks.disk import drop_file_cache
        from flashboot.benchmarks.stream import _reset_peak_rss, _status
        from flashboot.flashload import pipeline, stream  # noqa: F401  (an engine imported its loader)
        from flashboot.flashload.landing import verify_loaded

        for _ in range(2):
            drop_file_cache(spec["image_file"])
            _reset_peak_rss()
            rss0 = _status()["VmRSS"]
            t = time.perf_counter()
            li = flashboot.load(spec["image"], 0, dev, shm_dir=spec["shm"], timeout_s=60, verify=False)
            _sync(dev)
            ms = (time.perf_counter() - t) * 1e3
            peak = _status()["VmHWM"] - rss0 - (0 if li.device.is_cuda else li.nbytes)
            verify_loaded(li.arena, li.metadata, f"{loader} call {len(calls) + 1}")
            calls.append({"ms": ms, "verified": True, "peak_extra_host_bytes": peak, "report": li.report.to_dict()})
            li.close()
            _free(dev)
    elif loader.startswith("flashload"):
        import flashboot
        from flashboot.flashload.warm import import_loader

        import_loader(dev)  # as the engine plugins do at engine start

        for _ in range(2):
            prepared, prepare_ms = None, 0.0
            if loader != "flashload served":
                mode = "served" if loader == "flashload prepared" else "staged"
                t = time.perf_counter()
                prepared = flashboot.prepare(spec["image"], 0, dev, mode=mode, shm_dir=spec["shm"], timeout_s=60)
                prepared.wait()  # an engine builds its model meanwhile
                prepare_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            # verify as by default (a served copy: by the daemon); the check after the clock is independent
            li = flashboot.load(spec["image"], 0, dev, served=prepared is None, prepared=prepared,
                                shm_dir=spec["shm"], timeout_s=60)
            _sync(dev)
            ms = (time.perf_counter() - t) * 1e3
            from flashboot.benchmarks.boot_e2e import binding_pass_ms
            from flashboot.flashload.landing import verify_loaded

            pass_ms = binding_pass_ms(li.tensors)
            verify_loaded(li.arena, li.metadata, f"{loader} call {len(calls) + 1}")  # raises on a bad chunk
            calls.append({"ms": ms, "prepare_ms": prepare_ms, "pass_ms": pass_ms, "verified": True,
                          "report": li.report.to_dict()})
            if li.release_thread is not None:
                li.release_thread.join()
            li.close()
            _free(dev)
    else:
        from flashboot.benchmarks.checkpoints import open_checkpoint, tensors_digest
        from flashboot.benchmarks.peers import FastSafetensorsLoader, InstantTensorLoader, SafetensorsLoader

        cls = {c.name: c for c in (SafetensorsLoader, InstantTensorLoader, FastSafetensorsLoader)}[loader]
        ckpt = open_checkpoint(spec["checkpoint"])
        expected = ckpt.expected_digest()
        peer = cls(ckpt.files, dev)
        peer.prepare()
        # the peer's library imported before the clock, as the FlashLoad children import theirs
        # (import_loader): the module imported here had been the adapters' own, leaving the
        # library's import inside the peer's first timed call
        import importlib

        importlib.import_module(cls.module)
        for _ in range(2):
            t = time.perf_counter()
            out = peer.load()
            _sync(dev)
            ms = (time.perf_counter() - t) * 1e3
            calls.append({"ms": ms, "verified": tensors_digest(out) == expected})
            del out
            _free(dev)
        peer.release()
    return {"loader": loader, "calls": calls}


def _run_child(spec: dict, log: Callable[[str], None]) -> dict:
    cmd = [sys.executable, "-m", "flashboot.benchmarks.boot", "--child", json.dumps(spec)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"loader": spec["loader"], "error": f"timed out after {CHILD_TIMEOUT_S:g} s"}
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"loader": spec["loader"], "error": f"exit {p.returncode}: {' | '.join(tail)}"}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out.setdefault("loader", spec["loader"])
    out["process_s"] = time.perf_counter() - t
    return out


# ================================================================================ the parent
def _ceiling_ms(staged_file: str, nbytes: int, dev: str, repeats: int = 3) -> float:
    """One bulk H2D of the staged image (pinned here) into a device buffer: median of ``repeats``
    after one warm-up. On the host backend, one memcpy of it."""
    import numpy as np

    from flashboot.memory import Device
    from flashboot.pinning import MappedFile, register_host

    device = Device.parse(dev)
    with MappedFile(staged_file, nbytes) as mapping:
        if not device.is_cuda:
            src, dst = mapping.array(), np.empty(nbytes, np.uint8)
            samples = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                np.copyto(dst, src)
                samples.append((time.perf_counter() - t) * 1e3)
            return sorted(samples[1:])[len(samples[1:]) // 2]
        import cupy

        with register_host(mapping.ptr, nbytes, device, path=staged_file), cupy.cuda.Device(device.index):
            dst = cupy.cuda.alloc(nbytes)
            stream = cupy.cuda.Stream(non_blocking=True)
            samples = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for off in range(0, nbytes, 1 << 30):
                    n = min(1 << 30, nbytes - off)
                    cupy.cuda.runtime.memcpyAsync(dst.ptr + off, mapping.ptr + off, n,
                                                  cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                stream.synchronize()
                samples.append((time.perf_counter() - t) * 1e3)
            del dst
        return sorted(samples[1:])[len(samples[1:]) // 2]


def bench_shape(spec, *, device: str, root: Path, loaders: list[str], log: Callable[[str], None],
                disk_root: Path | None = None, stream: bool = False, end_to_end=(),
                e2e_repeats: int = 1) -> dict:
    """Every loader on one checkpoint shape; see the module docstring."""
    import flashboot
    from flashboot.benchmarks.checkpoints import make_checkpoint
    from flashboot.flashload.client import serve_status
    from flashboot.flashload.service import start_background, stop_service
    from flashboot.flashload.shm import staged_paths
    from flashboot.flashload.staging import PreloadConfig

    ckpt_dir, img_dir, shm = root / f"ckpt-{spec.name}", root / f"image-{spec.name}", root / "staged"
    t0 = time.perf_counter()
    ckpt = make_checkpoint(str(ckpt_dir), spec, device=device if device.startswith("cuda") else "cpu")
    if not img_dir.exists():
        flashboot.prepack(str(ckpt_dir), str(img_dir), progress=False)
    log(f"{spec.name}: {ckpt.tensor_count:,} tensors, {ckpt.nbytes / 1e9:.2f} GB; checkpoint and image in "
        f"{time.perf_counter() - t0:.1f} s")
    out: dict = {"shape": spec.name, "tensors": ckpt.tensor_count, "nbytes": ckpt.nbytes, "loaders": []}
    start_background(PreloadConfig(str(img_dir), ranks=[0], shm_dir=str(shm), serve=True, devices={0: device}),
                     timeout_s=60)
    try:
        deadline = time.monotonic() + 600
        while (state := serve_status(str(img_dir), str(shm))["ranks"]["0"])["state"] not in ("pinned", "mapped"):
            if state["state"] == "failed" or time.monotonic() > deadline:
                raise FlashBootError(f"the served-load daemon did not hold rank 0 of {img_dir}: {state}")
            time.sleep(0.05)
        staged_file = str(staged_paths(str(img_dir), 0, str(shm)).image)
        image_nbytes = os.path.getsize(staged_file)
        out["image_nbytes"] = image_nbytes
        # the ceiling moves the checkpoint's bytes, what every loader delivers: the image's, its
        # alignment included (2x the bytes at small scales), had made it slower, every ratio kinder
        out["ceiling_nbytes"] = min(ckpt.nbytes, image_nbytes)
        out["ceiling_ms"] = _ceiling_ms(staged_file, out["ceiling_nbytes"], device)
        log(f"{spec.name}: bulk H2D ceiling {out['ceiling_ms']:.1f} ms "
            f"({out['ceiling_nbytes'] / out['ceiling_ms'] / 1e6:.1f} GB/s)")
        for loader in loaders:
            if loader in ("flashload prepared, pinned here", "flashload streamed"):
                continue  # need the daemon gone: below
            res = _run_child({"loader": loader, "device": device, "image": str(img_dir), "shm": str(shm),
                              "checkpoint": str(ckpt_dir)}, log)
            out["loaders"].append(res)
            log(_describe(spec.name, res, out["ceiling_ms"]))
        if end_to_end:
            from flashboot.benchmarks.boot_e2e import run_shape

            out["end_to_end"] = run_shape(lambda s: _run_child(s, log), device=device, image=str(img_dir),
                                          shm=str(shm), ceiling_ms=out["ceiling_ms"], w_levels=end_to_end,
                                          log=lambda line: log(f"{spec.name}: end to end: {line}"),
                                          repeats=e2e_repeats)
    finally:
        stop_service(str(img_dir), str(shm))
    if "flashload prepared, pinned here" in loaders:
        res = _run_child({"loader": "flashload prepared, pinned here", "device": device, "image": str(img_dir),
                          "shm": str(shm), "checkpoint": str(ckpt_dir)}, log)
        out["loaders"].append(res)
        log(_describe(spec.name, res, out["ceiling_ms"]))
    if stream and "flashload streamed" in loaders:
        disk_dir = Path(disk_root or "/var/tmp/flashboot-boot") / f"image-{spec.name}"
        shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.copytree(img_dir, disk_dir)
        try:
            from flashboot.fileio import read_rate
            from flashboot.layouts import read_image

            image_file = str(read_image(str(disk_dir), 0).path)
            res = _run_child({"loader": "flashload streamed", "device": device, "image": str(disk_dir),
                              "shm": str(root / "no-shm"), "image_file": image_file}, log)
            from flashboot.benchmarks.disk import drop_file_cache

            drop_file_cache(image_file)
            out["disk_gbps"], out["disk_mode"] = read_rate(image_file, io="direct")
            out["loaders"].append(res)
            log(_describe(spec.name, res, out["ceiling_ms"]) + f"; disk {out['disk_gbps']:.2f} GB/s ({out['disk_mode']})")
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
    for res in out["loaders"]:
        for c in res.get("calls", ()):
            c["x_ceiling"] = c["ms"] / out["ceiling_ms"]
            if "disk_gbps" in out and res["loader"] == "flashload streamed":
                c["x_disk"] = (out["image_nbytes"] / (c["ms"] * 1e-3) / 1e9) / out["disk_gbps"]
    return out


def _describe(shape: str, res: dict, ceiling_ms: float) -> str:
    if "error" in res:
        return f"{shape}: {res['loader']}: FAILED: {res['error']}"
    c = res["calls"]
    prep = f" (prepare {c[0]['prepare_ms']:.0f} ms before)" if c[0].get("prepare_ms") else ""
    return (f"{shape}: {res['loader']}: 1st {c[0]['ms']:.1f} ms ({c[0]['ms'] / ceiling_ms:.2f}x){prep}, "
            f"2nd {c[1]['ms']:.1f} ms ({c[1]['ms'] / ceiling_ms:.2f}x), verified {_verified_cell(c)}"
            + "".join(f"; {n} call: {_phases_text(x)}" for n, x in zip(("1st", "2nd"), c) if x.get("report")))


def _phases_text(call: dict) -> str:
    """A FlashLoad call's phases and the served path's own split of its first-call costs, in ms."""
    r = call["report"]
    parts = [f"{k} {r[k + '_ms']:.1f}" for k in ("wait", "metadata", "alloc", "exchange", "h2d", "verify", "bind")
             if r.get(k + "_ms")]
    d = r.get("details", {})
    parts += [f"{k[:-3]} {d[k]:.1f}" for k in ("setup_ms", "request_ms", "handover_ms", "copy_wait_ms") if isinstance(d.get(k), float)]
    if "pass_ms" in call:  # after the call, outside its time: what touching every tensor then costs
        parts.append(f"then a pass over every tensor {call['pass_ms']:.1f}")
    return ", ".join(parts)


def run(*, shapes=SHAPES, scale: float | None = None, device: str | None = None, root: str | None = None,
        loaders=None, keep: bool = False, specs=(), stream_shapes=("C",), disk_root: str | None = None,
        end_to_end=(), e2e_repeats: int = 1, log: Callable[[str], None] = print) -> dict:
    """The whole benchmark; returns ``{"device", "scale", "shapes": [...]}``. ``shapes``: names of
    :data:`~flashboot.benchmarks.checkpoints.CHECKPOINTS` (scaled by ``scale``); ``specs``: more
    :class:`~flashboot.benchmarks.checkpoints.CheckpointSpec` objects, used as given;
    ``stream_shapes``: the shapes the streamed loader runs on (from ``disk_root``); ``end_to_end``:
    the engine workloads W (seconds) of :mod:`flashboot.benchmarks.boot_e2e`'s cells, none if empty."""
    from flashboot.benchmarks.checkpoints import CHECKPOINTS
    from flashboot.benchmarks.peers import FastSafetensorsLoader, InstantTensorLoader
    from flashboot.memory import Device

    from flashboot.benchmarks.timing import check_count, check_scale
    from flashboot.units import is_finite_number

    dev = str(Device.parse(device))
    if scale is None:
        scale = 1.0 if dev.startswith("cuda") else 1e-3
    scale = check_scale(scale, "scale")  # inf had ended in an OverflowError traceback from the shapes' dimensions
    # before any checkpoint is made: a W of NaN had failed every end-to-end child after the setup, -1 ran as a
    # row of a workload of -1 s
    bad_w = [w for w in end_to_end if not is_finite_number(w) or w < 0]
    if bad_w:
        raise FlashBootError(f"end-to-end workloads W must be finite seconds >= 0, got {', '.join(map(repr, bad_w))}")
    check_count(e2e_repeats, "e2e_repeats")
    unknown = [s for s in shapes if s not in CHECKPOINTS]
    if unknown:
        raise FlashBootError(f"unknown shapes {unknown}; known: {', '.join(CHECKPOINTS)}")
    if loaders is None:
        loaders = list(FLASH_LOADERS) + ["safetensors"]
        loaders += [c.name for c in (InstantTensorLoader, FastSafetensorsLoader) if c.availability(dev)[0]]
    bad = [x for x in loaders if x not in FLASH_LOADERS + PEER_LOADERS]
    if bad:
        raise FlashBootError(f"unknown loaders {bad}; known: {', '.join(FLASH_LOADERS + PEER_LOADERS)}")
    base = Path(root or "/dev/shm/flashboot-boot")
    base.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        named = [(CHECKPOINTS[name].scaled(scale), name in stream_shapes) for name in shapes]
        for spec, stream in named + [(s, False) for s in specs]:
            results.append(bench_shape(spec, device=dev, root=base, loaders=loaders, log=log,
                                       disk_root=Path(disk_root) if disk_root else None, stream=stream,
                                       end_to_end=tuple(end_to_end), e2e_repeats=e2e_repeats))
            if not keep:
                for d in base.glob(f"*-{spec.name}"):
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    from flashboot.bytecode import bytecode_status

    # whether the processes imported FlashBoot from bytecode (a wheel's install) or compiled it
    return {"device": dev, "scale": scale, "shapes": results, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "bytecode": bytecode_status()}


def _verified_cell(calls: list[dict]) -> str:
    """"yes" (checked after the clock) plus who checked inside the timed calls: the daemon (a served
    load's default on CUDA), the load itself, or nobody (why: the report's ``verify_skipped``)."""
    if not all(c["verified"] for c in calls):
        return "NO"
    inside = []
    for c in calls:
        details = (c.get("report") or {}).get("details", {})
        said = details.get("verified") or ""
        inside.append("daemon" if "by the daemon" in said else "load" if said else "after" if "report" in c else "yes")
    return "yes (" + ", ".join(inside) + ")" if "report" in calls[0] else "yes"


def print_results(out: dict) -> None:
    from flashboot.benchmarks.timing import print_table

    if "bytecode" in out:
        b = out["bytecode"]
        print(f"FlashBoot's bytecode: {b['with_bytecode']} of {b['modules']} modules current"
              + ("" if b["with_bytecode"] == b["modules"] else " (run `flashboot warm`: the rest compile in every process)"))

    rows = []
    for s in out["shapes"]:
        for r in s["loaders"]:
            if "error" in r:
                rows.append([s["shape"], r["loader"], "-", "-", "-", "-", "-", f"FAILED: {r['error']}"])
                continue
            c1, c2 = r["calls"]
            note = c1.get("prepare_ms") or "-"
            if "x_disk" in c1:
                note = (f"{c1['x_disk']:.2f}x disk ({s['disk_gbps']:.2f} GB/s), peak extra host "
                        f"{c1['peak_extra_host_bytes'] / 2**20:.0f} MiB")
            rows.append([s["shape"], r["loader"], c1["ms"], c1["x_ceiling"], c2["ms"], c2["x_ceiling"], note,
                         _verified_cell(r["calls"])])
    print_table(f"first load in a fresh process on {out['device']} (scale {out['scale']:g}); ceiling: one pinned "
                "bulk H2D, same run", ["shape", "loader", "1st ms", "x ceil", "2nd ms", "x ceil", "prepare ms / stream",
                                       "verified"], rows)
    from flashboot.benchmarks.boot_e2e import print_rows

    print_rows(out)
    print_table("ceilings", ["shape", "tensors", "bytes copied", "image bytes", "bulk H2D ms", "GB/s"],
                [[s["shape"], s["tensors"], s.get("ceiling_nbytes", s["image_nbytes"]), s["image_nbytes"], s["ceiling_ms"],
                  s.get("ceiling_nbytes", s["image_nbytes"]) / s["ceiling_ms"] / 1e6] for s in out["shapes"]])


def register_bench(sub) -> None:
    p = sub.add_parser("boot", help="first load in a fresh process: FlashLoad (served, prepared) vs peers vs bulk H2D",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--scale", type=float, default=None,
                   help="bytes relative to the full shapes (default 1 on CUDA, 0.001 on the host backend)")
    p.add_argument("--loaders", nargs="+", default=None, choices=list(FLASH_LOADERS + PEER_LOADERS),
                   help="default: every FlashLoad mode, safetensors, and the installed peers")
    p.add_argument("--dir", default=None, help="where checkpoints, images and staged copies go (default /dev/shm/flashboot-boot)")
    p.add_argument("--disk-dir", default=None, help="a real disk for the streamed loader's image (default /var/tmp/flashboot-boot)")
    p.add_argument("--stream-shapes", nargs="*", default=["C"], choices=list(SHAPES),
                   help="shapes the streamed loader runs on (default C)")
    p.add_argument("--end-to-end", nargs="*", type=float, default=None, metavar="W_S",
                   help="also time the boot end to end: a fresh process, [prepare], a GIL-bound engine workload of "
                        "W_S seconds, the load (default W: 0 0.25 1)")
    p.add_argument("--e2e-repeats", type=int, default=1, metavar="N",
                   help="fresh processes per end-to-end cell, plain and early alternating; the row is the median total")
    p.add_argument("--device", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import dump_json

    from flashboot.benchmarks.boot_e2e import W_LEVELS_S

    e2e = () if args.end_to_end is None else (tuple(args.end_to_end) or W_LEVELS_S)
    if args.e2e_repeats < 1:
        raise FlashBootError(f"--e2e-repeats must be at least 1, got {args.e2e_repeats}")
    out = run(shapes=args.shapes, scale=args.scale, device=args.device, root=args.dir, loaders=args.loaders,
              keep=args.keep, stream_shapes=args.stream_shapes, disk_root=args.disk_dir, end_to_end=e2e,
              e2e_repeats=args.e2e_repeats)
    print_results(out)
    dump_json(out, args.json)
    ok = all("error" not in r and all(c["verified"] for c in r["calls"]) for s in out["shapes"] for r in s["loaders"])
    ok &= all("error" not in r for s in out["shapes"] for r in (s.get("end_to_end") or {"rows": [{}]}).get(
        "rows", [{"error": "-"}]))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))))
    else:
        raise SystemExit("usage: flashboot bench boot (this module's --child is for the benchmark itself)")
