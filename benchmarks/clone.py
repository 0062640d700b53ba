"""``flashboot bench clone``: FlashClone on two GPUs in one run (issue 4's figures).

Sections, each against a ceiling or peer measured in the same run:

1. **P2P ceiling**: one copy-engine copy of the same bytes GPU0 -> GPU1.
2. **Descriptor exchange + map**: per clone, reading the seed's record from the store and mapping
   its arena (``manifest_ms + exchange_ms`` of the clone's report); NCCL's setup beside it.
3. **Star and chain**: 1..K clone processes (clones alternate between the GPUs, the seed lives in
   this process on GPU0), per-clone GB/s from each clone's report, every clone byte-exact
   (``--verify``: per-chunk checksums against the seed's manifest).
4. **NCCL from process start**: two fresh processes, ``init_process_group`` + one broadcast of the
   same bytes, and a per-tensor broadcast as SGLang's R-Fork does it; beside it a FlashClone
   process from its start to weights ready.
5. **Ring load**: N=2 processes each load half of a host image and gather the rest, against one
   process loading all of it with the same loader (pin + bulk H2D): the critical paths.

``--device cpu`` runs the same orchestration on the host backend (gloo instead of NCCL), with
small sizes: a check of the machinery, not a measurement. :func:`sweep_chunks` (in-process, the
chunk-size knob) is what the notebooks call.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from flashboot.units import parse_bytes

DEFAULT_NBYTES = "8GiB"
DEFAULT_CLONES = (1, 2, 4)
DEFAULT_SWEEP_CHUNKS = (16 << 20, 64 << 20, 256 << 20, 1 << 30)


# ============================================================================================
# Devices and payloads
# ============================================================================================


def bench_devices(device: str | None = None) -> list[str]:
    """``["cuda:0", "cuda:1"]`` (needs two GPUs), ``["cuda:0"]`` or ``["cpu", "cpu"]``."""
    from flashboot._cuda import device_count
    from flashboot.errors import CapabilityError

    if device == "cpu":
        return ["cpu", "cpu"]
    n = device_count()
    if n >= 2:
        return ["cuda:0", "cuda:1"]
    if n == 1:
        return ["cuda:0"]
    if device is None:
        return ["cpu", "cpu"]
    raise CapabilityError(f"bench clone on {device}: no CUDA device here; use --device cpu")


def fill_random(arena, nbytes: int, seed: int = 0) -> None:
    """Fill the first ``nbytes`` of ``arena`` with pseudo-random bytes (on its device)."""
    import torch

    gen = torch.Generator(device=str(arena.device))
    gen.manual_seed(seed)
    arena.bytes()[:nbytes].random_(0, 256, generator=gen)
    if arena.device.is_cuda:
        torch.cuda.synchronize(arena.device.index)


def write_image_file(path: str, nbytes: int, seed: int = 0) -> str:
    """A raw image file of ``nbytes`` pseudo-random bytes (a 16 MiB random block, each copy tagged
    with its index so no two chunks are alike). Returns the path."""
    import numpy as np

    block = np.random.default_rng(seed).integers(0, 256, 16 << 20, dtype=np.uint8)
    with open(path, "wb") as f:
        for i, off in enumerate(range(0, nbytes, block.size)):
            piece = block[: min(block.size, nbytes - off)].copy()
            piece[: min(8, piece.size)] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)[: min(8, piece.size)]
            f.write(piece.tobytes())
    return path


# ============================================================================================
# Ceiling
# ============================================================================================


def copy_ceiling(devices: Sequence[str], nbytes: int, repeats: int = 5) -> dict:
    """One copy of ``nbytes`` from an arena on ``devices[0]`` into one on ``devices[-1]``."""
    from flashboot.arena import Arena
    from flashboot.benchmarks.timing import time_cuda, time_host
    from flashboot.memory import Device
    from flashboot.movers import create_mover

    src_dev, dst_dev = Device.parse(devices[0]), Device.parse(devices[-1])
    access = "all" if src_dev.is_cuda else None
    with Arena.create(nbytes, src_dev, access=access) as src, Arena.create(nbytes, dst_dev, access=access) as dst:
        fill_random(src, nbytes, 1)
        if src_dev.is_cuda:
            mover = create_mover("copy_engine")
            t = time_cuda(lambda st: mover.copy(dst.span(0, nbytes), src.span(0, nbytes), stream=st),
                          device=dst_dev.index, repeats=repeats)
        else:
            mover = create_mover("host")
            t = time_host(lambda: mover.copy(dst.span(0, nbytes), src.span(0, nbytes)), repeats=repeats)
        from flashboot.kernels.checksum import checksum

        ok = checksum(dst.span(0, nbytes)) == checksum(src.span(0, nbytes))
    path = "p2p" if src_dev.is_cuda and src_dev != dst_dev else ("d2d" if src_dev.is_cuda else "host")
    return {"path": path, "nbytes": nbytes, "ms": t.median_ms, "gbps": t.gbps(nbytes), "byte_exact": ok}


# ============================================================================================
# Processes
# ============================================================================================


def _env(token: str) -> dict:
    env = dict(os.environ)
    env["FLASHBOOT_TOKEN"] = token
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _spawn_clone(store: str, token: str, device: str, schedule: str, name: str, out: str, *, clones: int | None,
                 chunk_bytes: int | None, timeout_s: float, verify: bool, image: str | None = None):
    cmd = [sys.executable, "-m", "flashboot.cli", "clone", "--store", store, "--device", device, "--schedule", schedule,
           "--name", name, "--json", out, "--timeout", str(timeout_s)]
    if clones is not None:
        cmd += ["--clones", str(clones)]
    if chunk_bytes:
        cmd += ["--chunk-bytes", str(chunk_bytes)]
    if verify:
        cmd.append("--verify")
    if image is not None:
        cmd += ["--image", image]
    return subprocess.Popen(cmd, env=_env(token), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _collect(procs: list, outs: list[str], timeout_s: float, what: str) -> list[dict]:
    from flashboot.errors import FlashBootError

    deadline = time.monotonic() + timeout_s
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise FlashBootError(f"{what}: a process did not finish within {timeout_s:g} s") from None
    reports = []
    for p, out, log in zip(procs, outs, logs):
        if p.returncode != 0 or not os.path.exists(out):
            raise FlashBootError(f"{what}: a process failed (exit {p.returncode}):\n{log[-3000:]}")
        with open(out) as f:
            reports.append(json.load(f))
    return reports


def run_group(store: str, token: str, devices: Sequence[str], schedule: str, clones: int, *, name: str,
              chunk_bytes: int | None, timeout_s: float, verify: bool = True) -> list[dict]:
    """``clones`` clone processes of the seed published under ``name``; clone i on
    ``devices[(i + 1) % len(devices)]`` (the seed is on ``devices[0]``). Their reports, by position."""
    with tempfile.TemporaryDirectory(prefix="flashboot-bench-") as tmp:
        outs = [os.path.join(tmp, f"clone{i}.json") for i in range(clones)]
        procs = [_spawn_clone(store, token, devices[(i + 1) % len(devices)], schedule, name, outs[i], clones=clones,
                              chunk_bytes=chunk_bytes, timeout_s=timeout_s, verify=verify) for i in range(clones)]
        reports = _collect(procs, outs, timeout_s * 3 + 60, f"{schedule} with {clones} clone(s)")
    return sorted(reports, key=lambda r: r["position"])


def _worker_cmd(cfg: dict) -> list[str]:
    return [sys.executable, "-m", "flashboot.benchmarks.clone", "--worker", json.dumps(cfg)]


def nccl_from_start(devices: Sequence[str], nbytes: int, *, mode: str, tensors: int, timeout_s: float) -> dict:
    """Two fresh processes: ``init_process_group`` then one broadcast of ``nbytes`` (``mode="bulk"``)
    or ``tensors`` broadcasts of its pieces (``mode="per_tensor"``, as R-Fork does). Timed from
    the spawn to the receiver's weights ready."""
    from flashboot.rendezvous import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="flashboot-nccl-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        t_spawn = time.time()
        procs = [subprocess.Popen(_worker_cmd({"kind": "nccl", "rank": r, "devices": list(devices[:2]) * (2 // len(devices[:2])),
                                               "nbytes": nbytes, "mode": mode, "tensors": tensors, "port": port,
                                               "out": outs[r], "timeout_s": timeout_s}),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        r0, r1 = _collect(procs, outs, timeout_s * 2 + 60, f"NCCL {mode}")
    return {"mode": mode, "tensors": tensors if mode == "per_tensor" else 1, "backend": r1["backend"],
            "from_start_s": r1["ready_unix"] - t_spawn, "init_ms": r1["init_ms"], "transfer_ms": r1["transfer_ms"],
            "transfer_gbps": nbytes / (r1["transfer_ms"] * 1e-3) / 1e9 if r1["transfer_ms"] > 0 else 0.0,
            "byte_exact": r0["checksum"] == r1["checksum"]}


def _nccl_worker(cfg: dict) -> None:
    t_enter = time.time()
    import datetime

    import torch
    import torch.distributed as dist

    rank, dev = cfg["rank"], cfg["devices"][cfg["rank"]]
    cuda = dev.startswith("cuda")
    nbytes = cfg["nbytes"]
    if cuda:
        torch.cuda.set_device(torch.device(dev))
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if rank == 0:  # the seed holds the weights before the group exists
        buf.random_(0, 256, generator=torch.Generator(device=dev).manual_seed(7))
    else:
        buf.zero_()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.time()
    kw = {"device_id": torch.device(dev)} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=cfg["timeout_s"]), **kw)
    t1 = time.time()
    if cfg["mode"] == "bulk":
        dist.broadcast(buf, 0)
    else:
        n = max(1, cfg["tensors"])
        cuts = [nbytes * i // n for i in range(n + 1)]
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                dist.broadcast(buf[lo:hi], 0)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.time()
    from flashboot.kernels.checksum import checksum

    digest = checksum(buf)
    with open(cfg["out"], "w") as f:
        json.dump({"rank": rank, "backend": "nccl" if cuda else "gloo", "started_unix": t_enter,
                   "init_ms": (t1 - t0) * 1e3, "transfer_ms": (t2 - t1) * 1e3, "ready_unix": t2,
                   "checksum": f"{digest:016x}"}, f)
    dist.destroy_process_group()


def clone_from_start(store: str, token: str, device: str, name: str, timeout_s: float) -> dict:
    """One FlashClone process from its spawn to weights ready (the seed is already resident)."""
    with tempfile.TemporaryDirectory(prefix="flashboot-bench-") as tmp:
        out = os.path.join(tmp, "clone.json")
        t_spawn = time.time()
        p = _spawn_clone(store, token, device, "star", name, out, clones=None, chunk_bytes=None, timeout_s=timeout_s,
                         verify=False)
        (r,) = _collect([p], [out], timeout_s + 60, "FlashClone from process start")
    return {"from_start_s": r["finished_unix"] - t_spawn, "setup_ms": r["connect_ms"] + r["manifest_ms"] +
            r["alloc_ms"] + r["exchange_ms"], "transfer_ms": r["transfer_ms"], "transfer_gbps": r["gbps"]}


def ring_load_group(store: str, token: str, devices: Sequence[str], image: str, members: int, *, name: str,
                    chunk_bytes: int | None, timeout_s: float) -> dict:
    """``members`` processes ring-loading ``image``; member i on ``devices[i % len(devices)]``.
    The critical path of a member: arena + descriptor exchange + mapping/pinning its shard + H2D
    and gather (the start barrier and connecting are left out, as for a single load)."""
    with tempfile.TemporaryDirectory(prefix="flashboot-ring-") as tmp:
        outs = [os.path.join(tmp, f"member{i}.json") for i in range(members)]
        procs = [_spawn_clone(store, token, devices[i % len(devices)], "ring", name, outs[i], clones=members,
                              chunk_bytes=chunk_bytes, timeout_s=timeout_s, verify=True, image=image)
                 for i in range(members)]
        reports = _collect(procs, outs, timeout_s * 3 + 60, f"ring load with {members} member(s)")
    paths = [r["alloc_ms"] + r["exchange_ms"] + r["load_ms"] + r["transfer_ms"] for r in reports]
    return {"members": members, "critical_path_ms": max(paths), "member_paths_ms": paths,
            "load_ms": [r["load_ms"] for r in reports], "transfer_ms": [r["transfer_ms"] for r in reports],
            "byte_exact": all(r["verified"] for r in reports)}


# ============================================================================================
# The chunk-size sweep (in one process; the notebooks call this)
# ============================================================================================


def sweep_chunks(schedule: str = "chain", chunk_sizes: Sequence[int] = DEFAULT_SWEEP_CHUNKS, nbytes: int = 4 << 30,
                 *, clones: int = 2, devices: Sequence[str] | None = None, mover: Any = None, repeats: int = 3,
                 timeout_s: float = 60.0, verify: bool = True) -> list[dict]:
    """Per chunk size, the schedule's per-clone bandwidth, pipeline fill and head-to-tail gradient.

    All participants live in this process (the mapping cost is measured by ``bench clone``, not
    here): the seed on ``devices[0]``, clone k on ``devices[(k + 1) % len(devices)]`` (ring: member
    i on ``devices[i % len(devices)]``, shards from a pinned host buffer). ``devices`` defaults to
    both GPUs, one GPU, or the host backend. One warm-up, then ``repeats`` runs, medians reported.

    Each row: ``schedule, chunk_bytes, nbytes, clones, steps, per_clone_gbps`` (median per clone,
    in order), ``mean_gbps, min_gbps, wall_s, fill_s`` (first chunk in place at the last clone),
    ``tail_s`` (last clone done minus first clone done), ``verified``.
    """
    import torch

    from flashboot.arena import Arena
    from flashboot.executor import Endpoint, Executor, create_flags
    from flashboot.kernels.checksum import checksum
    from flashboot.memory import Device, span_of
    from flashboot.schedulers import build_plan

    devs = [Device.parse(d) for d in (devices or bench_devices(None))]
    if schedule not in ("chain", "star", "ring"):
        raise ValueError(f"schedule must be chain, star or ring, got {schedule!r}")
    plans = {c: build_plan(schedule, clones, nbytes, int(c)) for c in chunk_sizes}
    first = next(iter(plans.values()))
    n_part = len(first.participants)

    def dev_of(i: int) -> Device:
        return devs[i % len(devs)]

    access = "all" if devs[0].is_cuda else None
    arenas, flags, keep = {}, {}, []
    try:
        for p in first.participants:
            arenas[p.index] = Arena.create(nbytes, dev_of(p.index), access=access)
            if p.role != "seed":
                flags[p.index] = create_flags(max(pl.flag_count(p.index) for pl in plans.values()), dev_of(p.index),
                                              access=access)
        host_image = None
        if schedule == "ring":
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=devs[0].is_cuda)
            src.random_(0, 256, generator=torch.Generator().manual_seed(3))
            keep.append(src)
            host_image = span_of(src)
            want = checksum(src)
        else:
            fill_random(arenas[0], nbytes, 3)
            want = checksum(arenas[0].span(0, nbytes))
        endpoints = {i: Endpoint(i, f"p{i}", arenas[i], flags.get(i)) for i in arenas}
        local = [p.index for p in first.receivers()]
        rows, epoch = [], 0
        for chunk, plan in plans.items():
            runs = []
            for r in range(repeats + 1):
                epoch += 1
                rep = Executor(plan, endpoints, local, mover=mover, host_image=host_image, timeout_s=timeout_s,
                               epoch=epoch).run()
                if r:
                    runs.append(rep)
            per_clone = [statistics.median(nbytes / rep.participant_seconds(i) / 1e9 for rep in runs) for i in local]
            ends = [[rep.participant_seconds(i) for i in local] for rep in runs]
            fills = [min((l.step_end_s[0] for l in rep.lanes if l.participant == local[-1] and l.step_end_s),
                         default=0.0) for rep in runs]
            ok = None
            if verify:
                ok = all(checksum(arenas[i].span(0, nbytes)) == want for i in local)
            rows.append({"schedule": schedule, "chunk_bytes": int(chunk), "nbytes": nbytes, "clones": clones,
                         "devices": [str(dev_of(i)) for i in range(n_part)], "steps": len(plan),
                         "per_clone_gbps": per_clone, "mean_gbps": statistics.mean(per_clone),
                         "min_gbps": min(per_clone), "wall_s": statistics.median(r.wall_s for r in runs),
                         "fill_s": statistics.median(fills), "tail_s": statistics.median(max(e) - min(e) for e in ends),
                         "verified": ok})
        return rows
    finally:
        for a in list(flags.values()) + list(arenas.values()):
            a.close()


# ============================================================================================
# The whole run
# ============================================================================================


def run(nbytes: int, *, device: str | None = None, clone_counts: Sequence[int] = DEFAULT_CLONES,
        chunk_bytes: int | None = None, tensors: int = 3170, timeout_s: float = 120.0, repeats: int = 5,
        sections: Sequence[str] = ("ceiling", "clone", "nccl", "ring")) -> dict:
    """Every section of ``bench clone``; a JSON-ready dict."""
    from flashboot._clone import seed
    from flashboot.arena import Arena
    from flashboot.memory import Device
    from flashboot.rendezvous import Manifest, Rendezvous, free_port

    devices = bench_devices(device)
    out: dict[str, Any] = {"devices": devices, "nbytes": nbytes}
    token = secrets.token_hex(16)
    store = f"127.0.0.1:{free_port()}"
    host = Rendezvous.connect(store, token, host=True, timeout_s=timeout_s)  # outlives every seed below
    try:
        if "ceiling" in sections:
            out["ceiling"] = copy_ceiling(devices, nbytes, repeats)
        dev0 = Device.parse(devices[0])
        if "clone" in sections or "nccl" in sections:
            with Arena.create(nbytes, dev0) as arena:
                fill_random(arena, nbytes, 5)
                manifest = Manifest.of_arena(arena, nbytes)
                if "clone" in sections:
                    out["clone"] = []
                    for schedule in ("star", "chain"):
                        for k in clone_counts:
                            name = f"{schedule}{k}-{secrets.token_hex(3)}"
                            with seed(store, arena, dev0, token=token, name=name, nbytes=nbytes, manifest=manifest,
                                      timeout_s=timeout_s, serve_nccl=False):
                                reports = run_group(store, token, devices, schedule, k, name=name,
                                                    chunk_bytes=chunk_bytes, timeout_s=timeout_s)
                            out["clone"].append({"schedule": schedule, "clones": k, "reports": reports})
                if "nccl" in sections:
                    name = f"start-{secrets.token_hex(3)}"
                    with seed(store, arena, dev0, token=token, name=name, nbytes=nbytes, manifest=manifest,
                              timeout_s=timeout_s, serve_nccl=False):
                        out["flashclone_from_start"] = clone_from_start(store, token, devices[-1], name, timeout_s)
        if "nccl" in sections:
            out["nccl"] = [nccl_from_start(devices, nbytes, mode="bulk", tensors=1, timeout_s=timeout_s),
                           nccl_from_start(devices, nbytes, mode="per_tensor", tensors=tensors, timeout_s=timeout_s)]
        if "ring" in sections:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(shm, f"flashboot-bench-ring-{secrets.token_hex(4)}.bin")
            try:
                write_image_file(path, nbytes)
                single = ring_load_group(store, token, devices, path, 1, name=f"ring1-{secrets.token_hex(3)}",
                                         chunk_bytes=chunk_bytes, timeout_s=timeout_s)
                ring = ring_load_group(store, token, devices, path, len(devices), name=f"ringN-{secrets.token_hex(3)}",
                                       chunk_bytes=chunk_bytes, timeout_s=timeout_s)
                out["ring"] = {"single": single, "ring": ring,
                               "ratio": ring["critical_path_ms"] / single["critical_path_ms"]}
            finally:
                if os.path.exists(path):
                    os.unlink(path)
    finally:
        host.close()
    return out


def _rows(res: dict) -> list[list]:
    rows = []
    ceiling = res.get("ceiling")
    if ceiling:
        rows.append([f"copy ceiling ({ceiling['path']})", ceiling["gbps"], "GB/s", f"{ceiling['ms']:.2f} ms, byte-exact "
                     f"{ceiling['byte_exact']}"])
    for group in res.get("clone", []):
        reps = group["reports"]
        gb = [r["stream_gbps"] or r["gbps"] for r in reps]
        exch = [r["manifest_ms"] + r["exchange_ms"] for r in reps]
        note = (f"per clone {', '.join(f'{g:.0f}' for g in gb)}; exchange+map {statistics.median(exch):.2f} ms; "
                f"{'all byte-exact' if all(r['verified'] for r in reps) else 'NOT all verified'}")
        if ceiling:
            note += f"; {100 * min(gb) / ceiling['gbps']:.0f}% of ceiling (slowest)"
        rows.append([f"{group['schedule']} x{group['clones']}", statistics.mean(gb), "GB/s/clone", note])
    fs = res.get("flashclone_from_start")
    if fs:
        rows.append(["FlashClone, process start -> ready", fs["from_start_s"], "s",
                     f"setup {fs['setup_ms']:.1f} ms, transfer {fs['transfer_ms']:.1f} ms ({fs['transfer_gbps']:.0f} GB/s)"])
    for n in res.get("nccl", []):
        rows.append([f"{n['backend']} {n['mode']} ({n['tensors']} tensors), process start -> ready", n["from_start_s"],
                     "s", f"init_process_group {n['init_ms']:.0f} ms, transfer {n['transfer_ms']:.1f} ms "
                          f"({n['transfer_gbps']:.0f} GB/s), byte-exact {n['byte_exact']}"])
    ring = res.get("ring")
    if ring:
        rows.append(["single-process load (pin + H2D)", ring["single"]["critical_path_ms"], "ms",
                     f"byte-exact {ring['single']['byte_exact']}"])
        rows.append([f"ring load, {ring['ring']['members']} members", ring["ring"]["critical_path_ms"], "ms",
                     f"{ring['ratio']:.2f}x the single load; byte-exact {ring['ring']['byte_exact']}"])
    return rows


def register_bench(sub) -> None:
    p = sub.add_parser("clone", help="FlashClone: map time, star/chain GB/s, NCCL from process start, ring load")
    p.add_argument("--nbytes", default=None, help=f"bytes replicated (default {DEFAULT_NBYTES}; 16MB with --device cpu)")
    p.add_argument("--device", default=None, help="cpu runs the machinery on the host backend (default: the GPUs)")
    p.add_argument("--clones", nargs="*", type=int, default=None, help="clone counts (default 1 2 4)")
    p.add_argument("--chunk-bytes", default=None, help="pipeline chunk (default: the schedulers' default)")
    p.add_argument("--tensors", type=int, default=3170, help="tensors of the per-tensor (R-Fork-like) broadcast")
    p.add_argument("--sections", nargs="*", default=None, help="ceiling clone nccl ring (default: all)")
    p.add_argument("--sweep", nargs="*", default=None, metavar="CHUNK",
                   help="instead: the in-process chunk-size sweep (e.g. 16MiB 64MiB 256MiB 1GiB)")
    p.add_argument("--schedule", default="chain", help="schedule of --sweep")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import dump_json, print_table

    nbytes = parse_bytes(args.nbytes or ("16MB" if args.device == "cpu" else DEFAULT_NBYTES))
    if args.sweep is not None:
        chunks = [parse_bytes(c) for c in args.sweep] or list(DEFAULT_SWEEP_CHUNKS)
        devices = bench_devices(args.device)
        rows = sweep_chunks(args.schedule, chunks, nbytes, clones=max(args.clones or [2]), devices=devices,
                            repeats=args.repeats, timeout_s=args.timeout)
        print_table(f"{args.schedule} chunk sweep, {nbytes / 1e9:.2f} GB", ["chunk MB", "mean GB/s", "min GB/s",
                    "fill ms", "tail ms", "verified"],
                    [[r["chunk_bytes"] / 2**20, r["mean_gbps"], r["min_gbps"], r["fill_s"] * 1e3, r["tail_s"] * 1e3,
                      r["verified"]] for r in rows])
        dump_json({"sweep": rows}, args.json)
        return 0 if all(r["verified"] is not False for r in rows) else 1
    res = run(nbytes, device=args.device, clone_counts=args.clones or DEFAULT_CLONES,
              chunk_bytes=parse_bytes(args.chunk_bytes) if args.chunk_bytes else None, tensors=args.tensors,
              timeout_s=args.timeout, repeats=args.repeats, sections=args.sections or ("ceiling", "clone", "nccl", "ring"))
    print_table(f"FlashClone on {', '.join(res['devices'])}, {nbytes / 1e9:.2f} GB", ["what", "value", "unit", "note"],
                _rows(res))
    dump_json(res, args.json)
    exact = [r["verified"] for g in res.get("clone", []) for r in g["reports"]]
    exact += [n["byte_exact"] for n in res.get("nccl", [])]
    if res.get("ring"):
        exact += [res["ring"]["single"]["byte_exact"], res["ring"]["ring"]["byte_exact"]]
    if res.get("ceiling"):
        exact.append(res["ceiling"]["byte_exact"])
    return 0 if all(exact) else 1


def _worker_main(argv: list[str]) -> None:
    cfg = json.loads(argv[argv.index("--worker") + 1])
    if cfg["kind"] == "nccl":
        _nccl_worker(cfg)
    else:
        raise SystemExit(f"unknown worker kind {cfg['kind']!r}")


if __name__ == "__main__":
    _worker_main(sys.argv)
