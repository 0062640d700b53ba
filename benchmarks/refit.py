"""``flashboot bench refit``: a trainer's weights into a running engine (issue 18), one run.

On the same bytes, against the D2D bulk copy of the same run (measured before and after):

1. **pack**: the trainer's tensors into the publishing arena in the image's layout -- the table
   kernel (one launch), a ``copy_`` per tensor, and the copy engine (one ``cuMemcpyBatchAsync``
   over the same rows, where every row is contiguous);
2. **publish**: chunk checksums on the device, and the seed record;
3. **refit**: the engine's copy, atomic (staging copy + verify + remap) and in place (copy +
   verify), from the report of ``LoadedImage.refit``; and, with two GPUs, an atomic refit from
   a trainer on the other GPU against the P2P ceiling;
4. **per-tensor baseline**: what engines do today, a ``copy_`` per parameter from the trainer's
   tensors into the engine's views, and the speed-up of refit over it.

The checkpoint shapes are ``benchmarks/checkpoints.py``'s (A: 3,170 tensors / 13.8 GB; C: 40,250
tensors / 2.6 GB); ``--scale`` shrinks the bytes and keeps the tensor count. The checkpoint is
written sparse (headers only: pre-pack reads zeros) and the image pre-packed into a temporary
directory (``/dev/shm`` where it exists); the trainer's tensors are random. On the host backend
(``--device cpu``) the same steps run with the host clock: a check of the machinery.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import tempfile
import time
from typing import Any


def write_sparse_checkpoint(root: str, spec) -> None:
    """``spec`` as one safetensors file whose data region is a hole (reads as zeros), plus config.json."""
    names = spec.tensors()
    header, offset = {}, 0
    for name, shape in names:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"model_type": "flashboot_synthetic_moe", "num_hidden_layers": spec.layers,
                   "hidden_size": spec.hidden, "vocab_size": spec.vocab, "_name_or_path": f"synthetic/{spec.name}"}, f)


def _timer(device):
    """``time(fn, repeats)`` -> median ms of ``fn(stream)``: CUDA events on a GPU, the host clock otherwise."""
    from flashboot.benchmarks.timing import time_cuda, time_host

    if device.is_cuda:
        return lambda fn, repeats: time_cuda(fn, device=device.index, repeats=repeats, warmup=1).median_ms
    return lambda fn, repeats: time_host(lambda: fn(None), repeats=repeats, warmup=1).median_ms


def _ceiling_ms(arena_a, arena_b, nbytes: int, time_ms, repeats: int) -> float:
    """One bulk copy of ``nbytes`` between two arenas (torch copy_: the copy engine on a GPU)."""
    import torch

    src, dst = arena_a.bytes()[:nbytes], arena_b.bytes()[:nbytes]

    def copy(stream):
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    return time_ms(copy, repeats)


def _copy_engine_pack(table, device):
    """The pack as one copy-engine batch over the same rows, or None where a row is strided."""
    import numpy as np

    from flashboot.memory import Span
    from flashboot.movers import create_mover

    rows = table.rows
    if not device.is_cuda or (rows[:, 3] != rows[:, 2]).any():
        return None
    lo, hi = int(rows[:, 1].min()), int((rows[:, 1] + rows[:, 2]).max())
    dst = table.arena.span(0, table.plan.metadata.image_nbytes)
    src = Span(lo, hi - lo, device, False, table)  # the trainer's tensors: one device, one address span
    chunks = np.stack([rows[:, 0] - dst.ptr, rows[:, 1] - lo, rows[:, 2]], axis=1)
    batch = create_mover("copy_engine").batch(dst, src, chunks)
    return lambda stream: batch.run(stream=stream)


PACK_SWEEP = [{"programs_per_sm": p, "num_warps": w, "block_bytes": b}
              for p, w, b in ((1, 4, 32768), (2, 4, 32768), (4, 4, 32768), (2, 8, 32768), (2, 4, 16384),
                              (4, 4, 16384))]
"""Launch settings of the pack's table kernel tried beside the default (PACK_TUNING), same rows; 16 KiB
tiles divide checkpoint C's 48 KiB experts, which 32 KiB tiles end with a masked half tile."""

PACK_SWEEP_WIDE = ([{"programs_per_sm": p, "num_warps": 4, "block_bytes": b, "num_stages": 3}
                    for p in (1, 2, 3, 4) for b in (8192, 16384, 32768)]
                   + [{"programs_per_sm": 2, "num_warps": 8, "block_bytes": b, "num_stages": 3} for b in (8192, 16384)]
                   + [{"programs_per_sm": p, "num_warps": 4, "block_bytes": 16384, "num_stages": 2} for p in (2, 4)])
"""``--sweep``: the grid around the default (2/SM, 4 warps, 16 KiB, 3 stages) to pick it from one run
(16 settings, 6 compiled variants: a device call is short)."""

REFIT_SWEEP = [{"mover": m, "chunk_bytes": c} for m in ("copy_engine", "triton_sm")
               for c in (64 << 20, 256 << 20, 1 << 30, 4 << 30)]
"""``--sweep``: the refit copy's mover and pipeline chunk (default copy_engine, 256 MiB), each atomic and in place."""


def _pack_sweep(plan, tensors, arena, table, time_ms, repeats: int, wide: bool = False) -> tuple[dict, list[dict]]:
    """The default pack table's shape (element width, 16-byte vectors, grid, tiles) and the pack
    timed under each of :data:`PACK_SWEEP` (:data:`PACK_SWEEP_WIDE` with ``wide``; same rows, same arena)."""
    from flashboot.weight_update.pack import PackTable

    t = table._device_table
    shape = {"elem_bytes": t.elem_bytes, "align16": t.align16, "grid": t.grid[0], "tiles": t.n_tiles,
             "tuning": dict(table.tuning)}
    sweep = []
    for knobs in PACK_SWEEP_WIDE if wide else PACK_SWEEP:
        other = PackTable(plan, tensors, arena, tuning=knobs)
        sweep.append({**knobs, "ms": time_ms(lambda s, o=other: o.launch(stream=s), repeats)})
    return shape, sweep


def _refit_sweep(pub, loaded, tensors, store: str, version: int, repeats: int) -> tuple[list[dict], int]:
    """Refit copies under each of :data:`REFIT_SWEEP`, atomic and in place (a new version each);
    the median copy (host wall and lanes' GPU time) per setting, and the last version published."""
    from flashboot.movers import create_mover

    out = []
    for knobs in REFIT_SWEEP:
        mover = create_mover(knobs["mover"])
        for mode in ("atomic", "in_place"):
            reps = []
            for _ in range(repeats):
                version += 1
                pub.publish(tensors, version)
                reps.append(loaded.refit(store, version, atomic=mode == "atomic", timeout_s=120, mover=mover,
                                         chunk_bytes=knobs["chunk_bytes"]))
            out.append({**knobs, "mode": mode, "copy_ms": statistics.median(r.copy_ms for r in reps),
                        "copy_gpu_ms": statistics.median(r.breakdown.get("copy_gpu_ms", 0.0) for r in reps),
                        "total_ms": statistics.median(r.total_ms for r in reps)})
    return out, version


def run(spec, device_name: str, *, repeats: int = 5, store: str | None = None, peer: str | None = None,
        workdir: str | None = None, sweep: bool = False) -> dict[str, Any]:
    """Every section for ``spec`` on ``device_name``; returns the results as a dict. ``sweep``
    (CUDA): the wide pack sweep and the refit copy sweep, to pick defaults from one run."""
    import torch

    import flashboot
    from flashboot.arena import Arena
    from flashboot.errors import CudaError
    from flashboot.flashclone.rendezvous import Rendezvous, free_port
    from flashboot.memory import Device
    from flashboot.weight_update import Publisher
    from flashboot.weight_update.pack import PackTable, pack_per_tensor

    dev = Device.parse(device_name)
    os.environ.setdefault("FLASHBOOT_TOKEN", "flashboot-bench-refit-token")
    base = workdir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    tmp = tempfile.TemporaryDirectory(prefix="flashboot-bench-refit-", dir=base)
    store = store or f"127.0.0.1:{free_port()}"
    hosted = Rendezvous.connect(store, None, host=True, timeout_s=60)
    time_ms = _timer(dev)
    res: dict[str, Any] = {"spec": spec.name, "device": str(dev), "tensors": spec.tensor_count}
    try:
        t0 = time.perf_counter()
        write_sparse_checkpoint(os.path.join(tmp.name, "ckpt"), spec)
        flashboot.prepack(os.path.join(tmp.name, "ckpt"), os.path.join(tmp.name, "img"), progress=False)
        res["prepack_s"] = time.perf_counter() - t0
        image = os.path.join(tmp.name, "img")
        loaded = flashboot.load(image, rank=0, device=dev)
        gen = torch.Generator(device=str(dev) if dev.is_cuda else "cpu").manual_seed(0)
        tensors = {n: torch.randn(s, dtype=torch.bfloat16, device=str(dev) if dev.is_cuda else "cpu", generator=gen)
                   for n, s in spec.tensors()}
        if dev.is_cuda:
            torch.cuda.synchronize(dev.index)  # the timed streams do not wait for the default one
        pub = Publisher(image, 0, store=store, device=dev)
        try:
            plan = pub.plan(tensors)
            table = PackTable(plan, tensors, pub.arena)
            nbytes, image_nbytes = table.nbytes, loaded.metadata.image_nbytes
            res.update(nbytes=nbytes, image_nbytes=image_nbytes, rows=len(table.rows))
            other = Arena.create(image_nbytes, dev)
            try:
                ceiling_before = _ceiling_ms(pub.arena, other, image_nbytes, time_ms, repeats)
                res["pack_kernel_ms"] = time_ms(lambda s: table.launch(stream=s), repeats)
                if dev.is_cuda:
                    res["pack_table"], res["pack_sweep"] = _pack_sweep(plan, tensors, pub.arena, table, time_ms,
                                                                       repeats, wide=sweep)

                def per_tensor(stream, arena=pub.arena):
                    if stream is None:
                        return pack_per_tensor(plan, tensors, arena)
                    with torch.cuda.stream(stream):
                        pack_per_tensor(plan, tensors, arena)

                res["pack_copy_per_tensor_ms"] = time_ms(per_tensor, repeats)
                ce = _copy_engine_pack(table, dev)
                res["pack_copy_engine_ms"], res["copy_engine_note"] = None, (
                    "GPU only" if not dev.is_cuda else "strided rows")
                if ce is not None:
                    try:  # a comparison row: the driver refusing it is reported in the row, the bench goes on
                        res["pack_copy_engine_ms"], res["copy_engine_note"] = time_ms(ce, repeats), ""
                    except CudaError as exc:
                        res["copy_engine_note"] = f"failed: {exc}"
                        torch.cuda.synchronize(dev.index)
                res["baseline_per_parameter_ms"] = time_ms(lambda s: per_tensor(s, loaded.arena), repeats)
                ceiling_after = _ceiling_ms(pub.arena, other, image_nbytes, time_ms, repeats)
            finally:
                other.close()
            res["d2d_ceiling_ms"] = [ceiling_before, ceiling_after]
            publishes, refits = [], {"atomic": [], "in_place": []}
            version = 0
            for _ in range(repeats):
                for mode in ("atomic", "in_place"):
                    version += 1
                    publishes.append(pub.publish(tensors, version))
                    refits[mode].append(loaded.refit(store, version, atomic=mode == "atomic", timeout_s=120))
            # every tensor the plan moved, compared with the trainer's (the first 50 pieces had been)
            sources = dict.fromkeys(p.source for p in plan.pieces)
            ok = all(torch.equal(loaded.tensors[n].flatten(), tensors[n].flatten()) for n in sources)
            res["refit_bytes_equal_trainer"] = bool(ok)
            res["refit_tensors_compared"] = len(sources)
            res["publish"] = {k: statistics.median(getattr(p, k) for p in publishes)
                              for k in ("pack_ms", "checksum_ms", "publish_ms")}
            for mode, reps in refits.items():
                res[f"refit_{mode}"] = {k: statistics.median(getattr(r, k) for r in reps)
                                        for k in ("copy_ms", "verify_ms", "remap_ms", "total_ms")}
                res[f"refit_{mode}"]["transport"] = reps[-1].transport
                # the first refit of this run maps the trainer's arena; the later ones read it held
                res[f"refit_{mode}"]["first"] = {k: getattr(reps[0], k) for k in ("copy_ms", "total_ms")}
                # where total_ms went (median of each step; see flashboot.weight_update.engine.refit)
                res[f"refit_{mode}"]["breakdown"] = {k: statistics.median(r.breakdown.get(k, 0.0) for r in reps)
                                                     for k in reps[-1].breakdown}
            if sweep and dev.is_cuda:
                res["refit_sweep"], version = _refit_sweep(pub, loaded, tensors, store, version, repeats)
        finally:
            pub.close()
        if peer is not None:
            res["p2p"] = _p2p(image, loaded, tensors, store, peer, repeats)
        loaded.close()
    finally:
        hosted.close()
        tmp.cleanup()
    _ratios(res)
    return res


def _p2p(image, loaded, tensors, store, peer: str, repeats: int) -> dict:
    """An atomic refit from a trainer on ``peer`` against the P2P ceiling of the same bytes."""
    import torch

    from flashboot.weight_update import Publisher

    moved = {n: t.to(peer) for n, t in tensors.items()}
    torch.cuda.synchronize(torch.device(peer))
    out = {"peer": peer, "copy_ms": [], "remap_ms": []}
    with Publisher(image, 0, store=store, device=peer, name="refit-p2p") as pub:
        n = loaded.metadata.image_nbytes
        src, dst = pub.arena.bytes()[:n], torch.empty(n, dtype=torch.uint8, device=str(loaded.device))
        from flashboot.benchmarks.timing import time_cuda

        def copy(stream):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        out["p2p_ceiling_ms"] = time_cuda(copy, device=loaded.device.index, repeats=repeats).median_ms
        for v in range(1, repeats + 1):
            pub.publish(moved, v + 1000)
            r = loaded.refit(store, v + 1000, name="refit-p2p", timeout_s=120)
            out["copy_ms"].append(r.copy_ms)
            out["remap_ms"].append(r.remap_ms)
    out["copy_ms"], out["remap_ms"] = statistics.median(out["copy_ms"]), statistics.median(out["remap_ms"])
    out["vs_p2p"] = out["p2p_ceiling_ms"] / out["copy_ms"]
    return out


def _ratios(res: dict) -> None:
    """Each path's rate as a fraction of the D2D ceiling's (1.0 = at the ceiling). The ceiling is the
    faster of its two samples (the strict one: the slower had credited a path with the drift) and
    its rate is over the bytes it copied, the image's (``image_nbytes``, alignment included); a
    pack writes the tensors' ``nbytes``, a refit copies the image's."""
    ceiling_ms = min(res["d2d_ceiling_ms"])
    res["d2d_ceiling_gbps"] = ceiling = res["image_nbytes"] / ceiling_ms / 1e6
    nbytes = res["nbytes"]

    def vs(nbytes_copied: int, ms) -> float:
        return nbytes_copied / ms / 1e6 / ceiling if ms else 0.0

    for key in ("pack_kernel_ms", "pack_copy_per_tensor_ms", "pack_copy_engine_ms", "baseline_per_parameter_ms"):
        if res.get(key):
            res[key.replace("_ms", "_vs_d2d")] = vs(nbytes, res[key])
    for row in res.get("pack_sweep", []):
        row["vs_d2d"] = vs(nbytes, row["ms"])
    for row in res.get("refit_sweep", []):
        row["vs_d2d"] = vs(res["image_nbytes"], row["copy_ms"])
        row["gpu_vs_d2d"] = vs(res["image_nbytes"], row["copy_gpu_ms"])
    for mode in ("atomic", "in_place"):
        r = res[f"refit_{mode}"]
        r["copy_vs_d2d"] = vs(res["image_nbytes"], r["copy_ms"])
        r["copy_gbps"] = res["image_nbytes"] / r["copy_ms"] / 1e6 if r["copy_ms"] else 0.0
    refit = res["publish"]["pack_ms"] + res["refit_atomic"]["total_ms"]
    res["speedup_vs_baseline"] = {
        "copy_atomic": res["baseline_per_parameter_ms"] / res["refit_atomic"]["copy_ms"],
        "pack_plus_refit_atomic": res["baseline_per_parameter_ms"] / refit,
    }


def rows(res: dict) -> list[list]:
    gb = res["nbytes"] / 1e9
    bulk = "D2D ceiling" if res["device"].startswith("cuda") else "host copy ceiling"
    out = [[f"{bulk} (before, after)", f"{res['d2d_ceiling_ms'][0]:.2f}, {res['d2d_ceiling_ms'][1]:.2f} ms",
            f"{res['d2d_ceiling_gbps']:.1f} GB/s", "1.00x"]]
    kernel = "pack: table kernel (1 launch)" if res["device"].startswith("cuda") else "pack: table rows (numpy)"
    for what, key in ((kernel, "pack_kernel"), ("pack: copy_ per tensor", "pack_copy_per_tensor"),
                      ("pack: copy engine batch", "pack_copy_engine"),
                      ("baseline: copy_ per parameter", "baseline_per_parameter")):
        ms = res.get(f"{key}_ms")
        out.append([what, f"{ms:.2f} ms" if ms else "n/a", f"{gb / ms * 1e3:.1f} GB/s" if ms else "",
                    f"{res[f'{key}_vs_d2d']:.2f}x" if ms else res["copy_engine_note"]])
    if res.get("pack_sweep"):
        best = max(res["pack_sweep"], key=lambda r: r["vs_d2d"])
        t = res["pack_table"]
        out.append([f"pack sweep best: {best['programs_per_sm']}/SM, {best['num_warps']} warps, "
                    f"{best['block_bytes'] >> 10} KiB tiles "
                    f"({'16B' if t['align16'] else str(t['elem_bytes']) + 'B'} words)", f"{best['ms']:.2f} ms",
                    f"{gb / best['ms'] * 1e3:.1f} GB/s", f"{best['vs_d2d']:.2f}x"])
    p = res["publish"]
    out.append(["publish: checksums / record", f"{p['checksum_ms']:.2f} / {p['publish_ms']:.2f} ms", "", ""])
    for mode in ("atomic", "in_place"):
        r = res[f"refit_{mode}"]
        out.append([f"refit {mode.replace('_', ' ')}: copy ({r['transport']})", f"{r['copy_ms']:.2f} ms",
                    f"{r['copy_gbps']:.1f} GB/s", f"{r['copy_vs_d2d']:.2f}x"])
        out.append([f"refit {mode.replace('_', ' ')}: verify / remap / total",
                    f"{r['verify_ms']:.2f} / {r['remap_ms']:.2f} / {r['total_ms']:.2f} ms", "", ""])
        if r.get("first"):  # the rows above are medians; the first refit maps the trainer's arena
            out.append([f"refit {mode.replace('_', ' ')}: its first of the run, copy / total",
                        f"{r['first']['copy_ms']:.2f} / {r['first']['total_ms']:.2f} ms", "", ""])
        b = r.get("breakdown", {})
        if b:
            out.append([f"refit {mode.replace('_', ' ')}: record / staging / exchange / closes",
                        f"{b.get('record_ms', 0):.2f} / {b.get('staging_create_ms', 0):.2f} / "
                        f"{b.get('clone_exchange_ms', 0):.2f} / "
                        f"{b.get('clone_close_ms', 0) + b.get('staging_close_ms', 0):.2f} ms",
                        f"copy lanes {b.get('copy_gpu_ms', 0):.2f} ms", ""])
    for mode in ("atomic", "in_place"):
        best = max((r for r in res.get("refit_sweep", []) if r["mode"] == mode), key=lambda r: r["vs_d2d"],
                   default=None)
        if best is not None:
            out.append([f"refit sweep best, {mode.replace('_', ' ')}: {best['mover']}, "
                        f"{best['chunk_bytes'] >> 20} MiB chunks", f"{best['copy_ms']:.2f} ms",
                        f"GPU {best['copy_gpu_ms']:.2f} ms", f"{best['vs_d2d']:.2f}x"])
    out.append(["engine's tensors equal the trainer's after the refits",
                f"{res.get('refit_tensors_compared', 0):,} tensors", "yes" if res["refit_bytes_equal_trainer"] else "NO", ""])
    s = res["speedup_vs_baseline"]
    out.append(["speed-up over the baseline", f"copy {s['copy_atomic']:.2f}x",
                f"pack+refit {s['pack_plus_refit_atomic']:.2f}x", ""])
    if "p2p" in res:
        q = res["p2p"]
        out.append([f"refit atomic from {q['peer']}: copy / remap", f"{q['copy_ms']:.2f} / {q['remap_ms']:.2f} ms", "",
                    f"{q['vs_p2p']:.2f}x P2P"])
    return out


def register_bench(sub) -> None:
    p = sub.add_parser("refit", help="publish (pack kernel vs copy_ vs copy engine) and refit (atomic, in place) "
                                     "against the D2D ceiling and a per-parameter baseline")
    p.add_argument("--checkpoint", nargs="+", default=["A", "C"], help="checkpoint shapes (benchmarks/checkpoints.py)")
    p.add_argument("--scale", type=float, default=None, help="bytes scale, tensor count kept (default 1; 0.001 on cpu)")
    p.add_argument("--device", default=None, help="cuda:N (default) or cpu (the host backend, small sizes)")
    p.add_argument("--peer", default=None, help="also refit from a trainer on this GPU (P2P), e.g. cuda:1")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true",
                   help="CUDA: also sweep the pack kernel's grid/warps/tiles/stages and the refit copy's mover "
                        "and chunk size (pick defaults from one run)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot._cuda import cuda_available
    from flashboot.benchmarks.checkpoints import CHECKPOINTS
    from flashboot.benchmarks.timing import dump_json, print_table

    from flashboot.benchmarks.timing import check_count, check_scale
    from flashboot.errors import FlashBootError

    device = args.device or ("cuda:0" if cuda_available() else "cpu")
    scale = args.scale if args.scale is not None else (1.0 if device != "cpu" else 0.001)
    # up front: --scale inf had ended in an OverflowError traceback, an unknown shape in a KeyError
    # after the shapes before it had run
    scale = check_scale(scale, "--scale")
    check_count(args.repeats, "--repeats")
    unknown = [name for name in args.checkpoint if name not in CHECKPOINTS]
    if unknown:
        raise FlashBootError(f"unknown checkpoints {', '.join(unknown)}; known: {', '.join(CHECKPOINTS)}")
    results = []
    for name in args.checkpoint:
        spec = CHECKPOINTS[name].scaled(scale)
        res = run(spec, device, repeats=args.repeats, peer=args.peer, sweep=args.sweep)
        results.append(res)
        print_table(f"refit, checkpoint {spec.name}: {res['tensors']:,} tensors, {res['nbytes'] / 1e9:.2f} GB on "
                    f"{device} ({res['rows']:,} table rows)", ["what", "time", "rate", "vs ceiling"], rows(res))
    dump_json({"refit": results}, args.json)
    return 0 if all(r["refit_bytes_equal_trainer"] for r in results) else 1  # wrong bytes had exited 0


__all__ = ["register_bench", "run", "write_sparse_checkpoint"]
