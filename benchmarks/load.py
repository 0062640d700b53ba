"""``flashboot bench load``: FlashLoad against the loaders people use, on synthetic MoE checkpoints.

For each checkpoint (A: 3,170 tensors, ~14 GB; B: 18,722 tensors, ~12 GB; see
:mod:`flashboot.benchmarks.checkpoints`), in one run:

1. generate it (safetensors shards, in /dev/shm by default) and pre-pack it (``flashboot.prepack``,
   image on disk by default); time the pre-pack;
2. measure the disk: one ``dd``-like O_DIRECT sequential read of the image file and one
   sequential write with fsync (up to 4 GiB), then stage it with the preloader (disk -> shm) and
   time that; each step's input is evicted from the page cache first (``posix_fadvise``);
3. time each loader's first call in this process (the warm-up, reported) and the median of the
   repeats after it, every call on this bench's clock with a device sync after it: safetensors,
   InstantTensor and fastsafetensors (where installed), per-tensor copies from pinned memory, one bulk pinned copy (the limit),
   FlashLoad with the pin on the critical path, pinned early (``flashboot.stage``), and served
   (the preloader daemon holds the image pinned and copies into the engine's arena).

Every loader's result is verified against the source: the checksum of every loaded tensor
(GPU kernel on CUDA, numba on the host) combined into one digest, compared with the digest of
the generated tensors. The table gives GB/s (the checkpoint's bytes for every loader), the ratio of each time to the bulk copy's, and
the speedups of FlashLoad over InstantTensor and fastsafetensors. On a machine without CUDA
the same run uses the host backend (a small ``--scale`` by default).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from flashboot.errors import FlashBootError

FLASH_SERVED = "FlashLoad served"
FLASH_EARLY = "FlashLoad pinned early"
FLASH_CRITICAL = "FlashLoad pin on critical path"
LIMIT = "bulk pinned H2D (limit)"


@dataclass
class LoaderResult:
    checkpoint: str
    loader: str
    nbytes: int
    """The checkpoint's tensor bytes, for every loader: what each delivers (FlashLoad copies its
    image, alignment included: ``details["image_nbytes"]``; counting those had inflated its GB/s)."""
    tensors: int
    median_ms: float
    samples_ms: list[float]
    verified: bool
    first_ms: float = 0.0
    """The first call of this loader in this process (a warm-up when there is one): its one-time
    costs, which the median of the later calls leaves out (``flashboot bench boot`` times the
    first call in a fresh process)."""
    gbps: float = 0.0
    x_limit: float = 0.0
    """This loader's time over the bulk copy's (1.0 = at the limit)."""
    speedup_vs: dict[str, float] = field(default_factory=dict)
    """FlashLoad rows: peer time / this time, per peer measured."""
    details: dict = field(default_factory=dict)
    skipped: str = ""


@dataclass
class PipelineResult:
    checkpoint: str
    step: str
    nbytes: int
    seconds: float
    gbps: float
    vs_disk: float
    detail: str = ""


def _fs_of(path: str) -> str:
    """The filesystem type holding ``path`` (longest mount-point prefix in /proc/mounts)."""
    real, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _free_device_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _measure(name: str, once: Callable[[], tuple[float, Any]], cleanup: Callable[[Any], None],
             verify: Callable[[Any], bool], *, warmup: int, repeats: int):
    """Run ``once`` (returns ``(ms, result)``) warmup + repeats times; verify every result.
    Returns the timing of the repeats, the first call's ms (the warm-up's, when there is one: kept,
    not dropped) and whether every result verified (the last alone had been: the first call, a
    row of the table, was reported 'verified' whatever it loaded)."""
    from flashboot.benchmarks.timing import Timing, check_count

    check_count(repeats, "repeats")
    timing = Timing()
    ok, first_ms = True, 0.0
    for i in range(warmup + repeats):
        ms, result = once()
        if i == 0:
            first_ms = ms
        if i >= warmup:
            timing.samples_ms.append(ms)
        ok = bool(verify(result)) and ok
        cleanup(result)
        del result
    return timing, first_ms, ok


PHASES = ("wait", "pin", "alloc", "exchange", "metadata", "h2d", "bind")
"""LoadReport phases shown per FlashLoad mode (milliseconds)."""


def bench_checkpoint(spec, *, device: str, ckpt_root: Path, image_root: Path, shm_root: Path, warmup: int,
                     repeats: int, log: Callable[[str], None], keep: bool) -> tuple[list[LoaderResult], list[PipelineResult], dict]:
    """All measurements for one checkpoint spec; see the module docstring. Unless ``keep``, the
    checkpoint, the image and the staged files go however the run ends (Ctrl-C or an error midway
    had left the checkpoint's hundreds of MB in /dev/shm)."""
    try:
        return _bench_checkpoint(spec, device=device, ckpt_root=ckpt_root, image_root=image_root,
                                 shm_root=shm_root, warmup=warmup, repeats=repeats, log=log)
    finally:
        if not keep:
            _remove_checkpoint(spec, ckpt_root=ckpt_root, image_root=image_root, shm_root=shm_root, log=log)


def _remove_checkpoint(spec, *, ckpt_root: Path, image_root: Path, shm_root: Path, log: Callable[[str], None]) -> None:
    """Remove what :func:`bench_checkpoint` made for ``spec``; a staged copy that cannot go (a
    preloader still up) is said, not raised: it must not hide the run's own error."""
    from flashboot.flashload.staging import unstage

    img_dir = image_root / f"image-{spec.name}"
    try:
        unstage(str(img_dir), shm_dir=str(shm_root))
    except (FlashBootError, OSError) as exc:
        log(f"warning: the staged copy of {img_dir} under {shm_root} was not removed: {exc}")
    shutil.rmtree(img_dir, ignore_errors=True)
    shutil.rmtree(ckpt_root / f"ckpt-{spec.name}", ignore_errors=True)


def _bench_checkpoint(spec, *, device: str, ckpt_root: Path, image_root: Path, shm_root: Path, warmup: int,
                      repeats: int, log: Callable[[str], None]) -> tuple[list[LoaderResult], list[PipelineResult], dict]:
    from flashboot.benchmarks.checkpoints import make_checkpoint, tensors_digest
    from flashboot.benchmarks.disk import drop_file_cache, write_rate
    from flashboot.benchmarks.peers import PEERS

    import flashboot
    from flashboot.flashload.client import serve_status
    from flashboot.flashload.service import start_background, stop_service
    from flashboot.fileio import read_rate
    from flashboot.flashload.staging import PreloadConfig, stage_rank, unstage

    ckpt_dir = ckpt_root / f"ckpt-{spec.name}"
    img_dir = image_root / f"image-{spec.name}"
    t0 = time.perf_counter()
    ckpt = make_checkpoint(str(ckpt_dir), spec, device=device if device.startswith("cuda") else "cpu")
    log(f"{spec.name}: {ckpt.tensor_count:,} tensors, {ckpt.nbytes / 1e9:.3f} GB in {len(ckpt.files)} files "
        f"({_fs_of(str(ckpt_dir))}), ready in {time.perf_counter() - t0:.1f} s")
    expected = ckpt.expected_digest()
    pipeline: list[PipelineResult] = []
    extra: dict = {"checkpoint_dir": str(ckpt_dir), "checkpoint_fs": _fs_of(str(ckpt_dir)),
                   "image_dir": str(img_dir), "image_fs": _fs_of(str(image_root)), "shm_dir": str(shm_root)}

    # ---- pre-pack, disk rates, preload -----------------------------------------------------------
    # Every step starts cold: the files it reads are evicted from the page cache first (on tmpfs,
    # where the checkpoint is by default, nothing can be: its detail says so).
    cache = [drop_file_cache(f) for f in ckpt.files][-1]
    t0 = time.perf_counter()
    rep = flashboot.prepack(str(ckpt_dir), str(img_dir), progress=False)
    prepack_s = time.perf_counter() - t0
    image_nbytes = rep.image_nbytes
    image_file = str(rep.ranks[0].dir / "image.bin")
    drop_file_cache(image_file)
    disk_gbps, disk_mode = read_rate(image_file, io="direct")
    write_gbps = write_rate(str(image_root), min(image_nbytes, 4 << 30))
    extra["prepack"] = rep.to_dict()
    extra["cache_drop"] = cache
    pipeline.append(PipelineResult(spec.name, f"disk read ({disk_mode}, dd-like)", image_nbytes, image_nbytes / disk_gbps / 1e9,
                                   disk_gbps, 1.0, f"{extra['image_fs']} {image_file}"))
    pipeline.append(PipelineResult(spec.name, "disk write (dd-like, fsync)", image_nbytes, image_nbytes / write_gbps / 1e9,
                                   write_gbps, write_gbps / disk_gbps, f"{min(image_nbytes, 4 << 30):,} bytes"))
    modes = sorted(set(rep.read_io.values()))
    pipeline.append(PipelineResult(spec.name, "pre-pack (ckpt -> image)", image_nbytes, prepack_s,
                                   image_nbytes / prepack_s / 1e9, image_nbytes / prepack_s / 1e9 / disk_gbps,
                                   f"family {rep.family}{' (fallback)' if rep.fallback else ''}; "
                                   f"{image_nbytes / prepack_s / 1e9 / write_gbps:.2f}x disk write; ckpt on "
                                   f"{extra['checkpoint_fs']} read {', '.join(modes)}"))
    unstage(str(img_dir), shm_dir=str(shm_root))
    drop_file_cache(image_file)
    staged = stage_rank(str(img_dir), 0, shm_dir=str(shm_root), device=device, force=True)
    pipeline.append(PipelineResult(spec.name, "preload (image -> shm)", image_nbytes, staged.read_s, staged.gbps,
                                   staged.gbps / disk_gbps, f"{staged.io_mode} {staged.io_reason}".strip()))
    log(f"{spec.name}: disk read {disk_gbps:.2f} GB/s ({disk_mode}), write {write_gbps:.2f} GB/s, pre-pack "
        f"{image_nbytes / prepack_s / 1e9:.2f} GB/s, preload {staged.gbps:.2f} GB/s ({staged.io_mode})")

    results: list[LoaderResult] = []

    def verify_dict(tensors) -> bool:
        return tensors_digest(tensors) == expected

    # ---- the peers -----------------------------------------------------------------------------
    for cls in PEERS:
        ok, why = cls.availability(device)
        if not ok:
            results.append(LoaderResult(spec.name, cls.name, ckpt.nbytes, ckpt.tensor_count, 0.0, [], False, skipped=why))
            log(f"{spec.name}: {cls.name} skipped: {why}")
            continue
        loader = cls(ckpt.files, device)
        loader.prepare()

        def once(loader=loader):
            _sync(device)
            t = time.perf_counter()
            out = loader.load()
            _sync(device)
            return (time.perf_counter() - t) * 1e3, out

        timing, first_ms, ok = _measure(cls.name, once, lambda out: _free_device_memory(device), verify_dict,
                                        warmup=warmup, repeats=repeats)
        loader.release()
        del loader
        _free_device_memory(device)
        results.append(LoaderResult(spec.name, cls.name, ckpt.nbytes, ckpt.tensor_count, timing.median_ms,
                                    timing.samples_ms, ok, first_ms=first_ms))
        log(f"{spec.name}: {cls.name}: {timing.median_ms:.1f} ms, verified={ok}")

    # ---- FlashLoad -------------------------------------------------------------------------------
    def verify_loaded(li) -> bool:
        return verify_dict(li.tensors)

    def close_loaded(li) -> None:
        if li.release_thread is not None:
            li.release_thread.join()
        li.close()
        _free_device_memory(device)

    reports: dict[str, dict] = {}

    def flash(name: str, **kw) -> None:
        runs: list = []

        def once():
            # the same clock as the peers': the call and a device sync after it (the load's own
            # report.total_ms had been taken instead, inside the call)
            _sync(device)
            t = time.perf_counter()
            li = flashboot.load(str(img_dir), 0, device, shm_dir=str(shm_root), **kw)
            _sync(device)
            ms = (time.perf_counter() - t) * 1e3
            runs.append(li.report.to_dict())
            return ms, li

        timing, first_ms, ok = _measure(name, once, close_loaded, verify_loaded, warmup=warmup, repeats=repeats)
        median = sorted(runs[warmup:], key=lambda r: r["total_ms"])[len(runs[warmup:]) // 2]
        reports[name] = median
        results.append(LoaderResult(spec.name, name, ckpt.nbytes, len(ckpt.checksums), timing.median_ms,
                                    timing.samples_ms, ok, first_ms=first_ms,
                                    details={"image_nbytes": image_nbytes,
                                             "phases_ms": {k: median[f"{k}_ms"] for k in PHASES},
                                                                     "pinned_early_ms": median["pinned_early_ms"],
                                                                     "overlapped": median.get("overlapped"),
                                                                     "report_details": median.get("details")}))
        log(f"{spec.name}: {name}: {timing.median_ms:.1f} ms, verified={ok}")

    flash(FLASH_CRITICAL)
    early = flashboot.stage(str(img_dir), 0, device, shm_dir=str(shm_root)).wait()
    try:
        flash(FLASH_EARLY, staged=early)
    finally:
        early.close()
    cfg = PreloadConfig(str(img_dir), ranks=[0], shm_dir=str(shm_root), serve=True, devices={0: device})
    start_background(cfg, timeout_s=60)
    try:
        deadline = time.monotonic() + 600
        while True:
            state = serve_status(str(img_dir), str(shm_root))["ranks"]["0"]
            if state["state"] in ("pinned", "mapped"):
                break
            if state["state"] == "failed":
                raise FlashBootError(f"the served-load daemon failed to hold rank 0: {state['error']}")
            if time.monotonic() > deadline:
                raise FlashBootError(f"the served-load daemon did not hold rank 0 within 600 s (state {state['state']})")
            time.sleep(0.05)
        extra["daemon_pin_ms"] = state["pin_ms"]
        flash(FLASH_SERVED, served=True, timeout_s=120)
    finally:
        stop_service(str(img_dir), str(shm_root))
    extra["flashload_reports"] = reports
    return results, pipeline, extra


def _ratios(results: list[LoaderResult]) -> None:
    by = {(r.checkpoint, r.loader): r for r in results if not r.skipped}
    for r in results:
        if r.skipped or r.median_ms <= 0:
            continue
        r.gbps = r.nbytes / (r.median_ms * 1e-3) / 1e9
        limit = by.get((r.checkpoint, LIMIT))
        r.x_limit = r.median_ms / limit.median_ms if limit else 0.0
        if r.loader.startswith("FlashLoad"):
            for peer in ("instanttensor", "fastsafetensors", "safetensors"):
                p = by.get((r.checkpoint, peer))
                if p:
                    r.speedup_vs[peer] = p.median_ms / r.median_ms


def run(*, scale: float | None = None, checkpoints: list = ("A", "B"), device: str | None = None,
        ckpt_root: str | None = None, image_root: str | None = None, shm_root: str | None = None,
        warmup: int = 1, repeats: int = 3, keep: bool = False, log: Callable[[str], None] = print) -> dict:
    """The whole benchmark; returns ``{"device", "scale", "loaders": [...], "pipeline": [...], "extra": {...}}``.

    ``checkpoints``: names of :data:`~flashboot.benchmarks.checkpoints.CHECKPOINTS` (scaled by
    ``scale``) or :class:`~flashboot.benchmarks.checkpoints.CheckpointSpec` objects (used as given).
    """
    from flashboot.benchmarks.checkpoints import CHECKPOINTS, CheckpointSpec

    from flashboot.benchmarks.timing import check_count, check_scale
    from flashboot.memory import Device

    check_count(repeats, "repeats")  # before the checkpoints are generated
    check_count(warmup, "warmup", least=0)  # -1 had left a repeat out and ended in 'no median for empty data'
    dev = str(Device.parse(device))
    if scale is None:
        scale = 1.0 if dev.startswith("cuda") else 1e-3
    scale = check_scale(scale, "scale")
    unknown = [c for c in checkpoints if not isinstance(c, CheckpointSpec) and c not in CHECKPOINTS]
    if unknown:
        raise FlashBootError(f"unknown checkpoints {unknown}; known: {', '.join(CHECKPOINTS)}")
    ckpt_root = Path(ckpt_root or "/dev/shm/flashboot-bench")
    image_root = Path(image_root or "/tmp/flashboot-bench-images")
    shm_root = Path(shm_root or ckpt_root / "staged")
    made = [d for d in (ckpt_root, image_root, shm_root) if not d.exists()]
    for d in (ckpt_root, image_root, shm_root):
        d.mkdir(parents=True, exist_ok=True)
    loaders, pipeline, extra = [], [], {}
    try:
        for name in checkpoints:
            spec = name if isinstance(name, CheckpointSpec) else CHECKPOINTS[name].scaled(scale)
            lr, pr, ex = bench_checkpoint(spec, device=dev, ckpt_root=ckpt_root, image_root=image_root,
                                          shm_root=shm_root, warmup=warmup, repeats=repeats, log=log, keep=keep)
            loaders += lr
            pipeline += pr
            extra[spec.name] = ex
    finally:  # the folders this run made, where nothing was kept in them (an interrupted run left them)
        from flashboot.flashload.shm import remove_if_empty

        for d in reversed(made):
            remove_if_empty(d)
    _ratios(loaders)
    return {"device": dev, "scale": scale, "warmup": warmup, "repeats": repeats,
            "loaders": [asdict(r) for r in loaders], "pipeline": [asdict(p) for p in pipeline], "extra": extra}


def print_results(out: dict) -> None:
    from flashboot.benchmarks.timing import print_table

    rows = []
    for r in out["loaders"]:
        if r["skipped"]:
            rows.append([r["checkpoint"], r["loader"], "-", "-", "-", "-", "-", "-", f"skipped: {r['skipped']}"])
            continue
        sp = r["speedup_vs"]
        rows.append([r["checkpoint"], r["loader"], r["first_ms"] / 1e3, r["median_ms"] / 1e3, r["gbps"], r["x_limit"],
                     f"{sp['instanttensor']:.2f}x" if "instanttensor" in sp else "-",
                     f"{sp['fastsafetensors']:.2f}x" if "fastsafetensors" in sp else "-",
                     "yes" if r["verified"] else "NO"])
    print_table(f"load on {out['device']} (scale {out['scale']:g}; 1st: the loader's first call in this process; "
                f"s, GB/s, ratios: median of {out['repeats']} after {out['warmup']} warm-up)",
                ["ckpt", "loader", "1st s", "s", "GB/s", "x limit", "vs InstantTensor", "vs fastsafetensors", "verified"], rows)
    prow = [[p["checkpoint"], p["step"], p["seconds"], p["gbps"], p["vs_disk"], p["detail"]] for p in out["pipeline"]]
    print_table("pre-pack and preload vs the disk (same run)", ["ckpt", "what", "s", "GB/s", "x disk", "detail"], prow)


def register_bench(sub) -> None:
    p = sub.add_parser("load", help="FlashLoad vs safetensors, InstantTensor, fastsafetensors on checkpoints A and B",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=None,
                   help="bytes relative to the full checkpoints (default 1 on CUDA, 0.001 on the host backend)")
    p.add_argument("--checkpoints", nargs="+", default=["A", "B"], choices=["A", "B"])
    p.add_argument("--dir", default=None, help="where checkpoints are generated (default /dev/shm/flashboot-bench)")
    p.add_argument("--image-dir", default=None, help="where images are pre-packed (default /tmp/flashboot-bench-images: disk)")
    p.add_argument("--shm-dir", default=None, help="staging root (default DIR/staged)")
    p.add_argument("--device", default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep checkpoints, images and staged files")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import dump_json

    out = run(scale=args.scale, checkpoints=args.checkpoints, device=args.device, ckpt_root=args.dir,
              image_root=args.image_dir, shm_root=args.shm_dir, warmup=args.warmup, repeats=args.repeats,
              keep=args.keep)
    print_results(out)
    dump_json(out, args.json)
    return 0 if all(r["verified"] or r["skipped"] for r in out["loaders"]) else 1


__all__ = ["run", "bench_checkpoint", "print_results", "register_bench", "main", "LoaderResult", "PipelineResult"]
