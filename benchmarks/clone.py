"""``flashboot bench clone``: FlashClone on two GPUs in one run (issue 4's figures).

Sections, each against a ceiling or peer measured in the same run:

1. **P2P ceiling**: one copy-engine copy of the same bytes GPU0 -> GPU1.
2. **Descriptor exchange + map**: per clone, from requesting the seed's record to the first byte
   of its sources readable: every segment's fd taken, the range reserved, the first segment
   mapped (``exchange_ms`` of the clone's report, split in ``exchange_detail``); the other
   segments are mapped during the copy, each ahead of its first read, and reported beside it
   (``map_during_copy_ms``). The driver's one-time warm-up (``warm_ms``) runs before,
   overlapped with connecting. NCCL's setup
   before its first byte (``init_process_group`` + first collective) beside it.
3. **Star and chain**: 1..K clone processes; the seed lives in this process on GPU0, clone i
   runs on GPU (1 + i) mod n, so the first clone is always remote and a chain alternates
   GPU0 -> GPU1 -> GPU0 ... Clones are started one after another, each once the previous one
   has taken its position, so position i is on the GPU given to it. Per-clone GB/s end to end
   (bytes over the time from the common start to that clone holding every byte; CUDA events
   and host clock), each clone's device beside it, every clone byte-exact (``--verify``).
4. **From process start to weights ready**: the same worker script (same interpreter start and
   the same imports) on both sides. NCCL: the seed rank is already resident (started first,
   weights in place), then the receiving process starts: set_device + buffer, then
   ``init_process_group``, a first collective, one broadcast of the same bytes (and a per-tensor
   broadcast as SGLang's R-Fork does it). FlashClone: a resident seed, one process that starts,
   connects, maps and copies. Verification is not part of either (reported separately). Its
   workers are :mod:`flashboot.benchmarks.clone_from_start`.
5. **Ring load**: N=2 processes (separate processes: pinning in one process serialises on its
   mm lock) each load half of a host image in /dev/shm and gather the rest, against one process
   loading all of it with the same loader; with the pin on the critical path, and with the
   shard pinned early (before the start barrier, as FlashLoad's pin-early and served modes).

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
                 chunk_bytes: int | None, timeout_s: float, verify: bool, image: str | None = None,
                 pin_early: bool = False, transport: str = "auto"):
    cmd = [sys.executable, "-m", "flashboot.cli", "clone", "--store", store, "--device", device, "--schedule", schedule,
           "--name", name, "--json", out, "--timeout", str(timeout_s), "--transport", transport]
    if clones is not None:
        cmd += ["--clones", str(clones)]
    if chunk_bytes:
        cmd += ["--chunk-bytes", str(chunk_bytes)]
    if verify:
        cmd.append("--verify")
    if image is not None:
        cmd += ["--image", image]
    if pin_early:
        cmd.append("--pin-early")
    return subprocess.Popen(cmd, env=_env(token), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _collect(procs: list, outs: list[str], timeout_s: float, what: str, *, with_logs: bool = False):
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
    return (reports, logs) if with_logs else reports


def clone_device(devices: Sequence[str], i: int) -> str:
    """The device of clone ``i`` (0-based) when the seed is on ``devices[0]``: ``devices[(1 + i) % n]``,
    so the first clone is remote and a chain alternates between the GPUs."""
    return devices[(1 + i) % len(devices)]


def _wait_until(ready, proc, timeout_s: float, what: str, *, poll_s: float = 0.005) -> None:
    """Poll ``ready()`` until true; FlashBootError (with its output's tail) if ``proc`` exits
    first, WaitTimeoutError after ``timeout_s``. ``what``: what is awaited, in both messages."""
    from flashboot.errors import FlashBootError, WaitTimeoutError

    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise FlashBootError(f"{what}: its process exited (code {proc.returncode}) first:\n"
                                 f"{(proc.communicate()[0] or '')[-3000:]}")
        if time.monotonic() > deadline:
            raise WaitTimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)


def run_group(store: str, token: str, devices: Sequence[str], schedule: str, clones: int, *, name: str,
              chunk_bytes: int | None, timeout_s: float, verify: bool = True, joined=None,
              transport: str = "auto") -> list[dict]:
    """``clones`` clone processes of the seed published under ``name``; clone i on
    :func:`clone_device` (the seed is on ``devices[0]``). Positions go by arrival, so with
    ``joined`` (a callable returning how many have taken a position) each process is started once
    the previous one has joined: position i + 1 is then clone i, on the device given to it. They
    still start copying together (start barrier). Their reports, by position."""
    with tempfile.TemporaryDirectory(prefix="flashboot-bench-") as tmp:
        outs = [os.path.join(tmp, f"clone{i}.json") for i in range(clones)]
        procs = []
        try:
            for i in range(clones):
                procs.append(_spawn_clone(store, token, clone_device(devices, i), schedule, name, outs[i],
                                          clones=clones, chunk_bytes=chunk_bytes, timeout_s=timeout_s, verify=verify,
                                          transport=transport))
                if joined is not None and i + 1 < clones:
                    _wait_until(lambda want=i + 1: joined() >= want, procs[-1], timeout_s,
                                f"{schedule} with {clones} clone(s): clone {i + 1} taking its position")
        except BaseException:
            for p in procs:
                p.kill()
            raise
        reports = _collect(procs, outs, timeout_s * 3 + 60, f"{schedule} with {clones} clone(s)")
    return sorted(reports, key=lambda r: r["position"])


def ring_load_group(store: str, token: str, devices: Sequence[str], image: str, members: int, *, name: str,
                    chunk_bytes: int | None, timeout_s: float, pin_early: bool = False) -> dict:
    """``members`` processes (one per member: pinning in one process would serialise on its mm
    lock) ring-loading ``image``; member i on ``devices[i % len(devices)]``.

    The critical path of a member: arena + descriptor exchange + mapping/pinning its shard (unless
    ``pin_early``: then that runs before the start barrier and is reported as ``off_path_ms``) +
    H2D and gather. Connecting, the driver warm-up and the start barrier are left out, as for
    the single load."""
    with tempfile.TemporaryDirectory(prefix="flashboot-ring-") as tmp:
        outs = [os.path.join(tmp, f"member{i}.json") for i in range(members)]
        procs = [_spawn_clone(store, token, devices[i % len(devices)], "ring", name, outs[i], clones=members,
                              chunk_bytes=chunk_bytes, timeout_s=timeout_s, verify=True, image=image,
                              pin_early=pin_early)
                 for i in range(members)]
        reports = _collect(procs, outs, timeout_s * 3 + 60, f"ring load with {members} member(s)")
    paths = [r["alloc_ms"] + r["exchange_ms"] + (0.0 if pin_early else r["load_ms"]) + r["transfer_ms"]
             for r in reports]
    return {"members": members, "pin_early": pin_early, "critical_path_ms": max(paths), "member_paths_ms": paths,
            "devices": [r["device"] for r in reports], "alloc_ms": [r["alloc_ms"] for r in reports],
            "exchange_ms": [r["exchange_ms"] for r in reports], "load_ms": [r["load_ms"] for r in reports],
            "pin_ms": [r["pin_ms"] for r in reports], "transfer_ms": [r["transfer_ms"] for r in reports],
            "off_path_ms": [r["load_ms"] if pin_early else 0.0 for r in reports],
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
    from flashboot.flashclone.executor import Endpoint, Executor, create_flags
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
# Transports side by side
# ============================================================================================


def transports_section(store: str, token: str, devices: Sequence[str], arena, manifest, nbytes: int,
                       transports: Sequence[str], *, chunk_bytes: int | None, timeout_s: float,
                       groups: Sequence[tuple[str, int]] = (("star", 1), ("chain", 2))) -> list[dict]:
    """The same arena's bytes cloned over each transport in turn (one seed serving them all), for
    each (schedule, clones) of ``groups``: per clone GB/s and the setup apart from the transfer."""
    from flashboot.flashclone import seed
    from flashboot.flashclone.common import _gkey

    from flashboot.errors import FlashBootError

    dev0 = arena.device
    out = []
    for transport in transports:
        for schedule, k in groups:
            name = f"{transport}-{schedule}{k}-{secrets.token_hex(3)}"
            t0 = time.perf_counter()
            row = {"transport": transport, "schedule": schedule, "clones": k, "reports": []}
            try:
                with seed(store, arena, dev0, token=token, name=name, nbytes=nbytes, manifest=manifest,
                          timeout_s=timeout_s, serve_nccl=transport == "nccl", nixl=transport == "nixl") as s:
                    row["seed_setup_ms"] = (time.perf_counter() - t0) * 1e3  # nixl: the seed's agent + registration
                    join_key = _gkey(s.generation, schedule, "join")
                    row["reports"] = run_group(store, token, devices, schedule, k, name=name,
                                               chunk_bytes=chunk_bytes, timeout_s=timeout_s, transport=transport,
                                               joined=lambda s=s, key=join_key: s.rendezvous.add(key, 0))
            except FlashBootError as exc:  # one transport failing must not cost the others' figures
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"{transport} {schedule} x{k} failed: {row['error'][-3000:]}", file=sys.stderr, flush=True)
            out.append(row)
    return out


def _transport_rows(res: dict) -> list[list]:
    rows = []
    ceiling = res.get("ceiling", {}).get("gbps")
    for g in res.get("transports", []):
        reps = g["reports"]
        if "error" in g:
            rows.append([f"{g['transport']} {g['schedule']} x{g['clones']}", 0.0, "failed", g["error"][:300]])
            continue
        gb = [r["gbps"] for r in reps]  # host clock, first byte asked to last byte in: the same for every transport
        setup = []
        for r in reps:
            d = r.get("exchange_detail", {})
            if r["transport"] == "nixl":
                setup.append(f"setup {r.get('setup_ms', 0):.1f} ms on the path (register {d.get('register_ms', 0):.1f}, "
                             f"add_remote {d.get('add_remote_ms', 0):.1f}), agent {d.get('agent_create_ms', 0):.0f} ms "
                             f"off the path")
            else:
                setup.append(f"exchange {r['exchange_ms']:.1f} ms")
        note = (f"{g['transport']} ({reps[0]['transport'] if reps else '?'}): per clone {', '.join('%.1f' % x for x in gb)} "
                f"GB/s on {', '.join(r['device'] for r in reps)}"
                + (f" = {', '.join('%.2f' % (x / ceiling) for x in gb)}x ceiling" if ceiling else "")
                + f"; {'; '.join(setup)}; seed setup {g.get('seed_setup_ms', 0):.0f} ms; "
                + ("all byte-exact" if all(r["verified"] for r in reps) else "NOT all verified"))
        rows.append([f"{g['transport']} {g['schedule']} x{g['clones']}", statistics.mean(gb) if gb else 0.0,
                     "GB/s/clone", note])
    return rows


# The whole run
# ============================================================================================


def run(nbytes: int, *, device: str | None = None, clone_counts: Sequence[int] = DEFAULT_CLONES,
        chunk_bytes: int | None = None, tensors: int = 3170, timeout_s: float = 120.0, repeats: int = 5,
        sections: Sequence[str] = ("ceiling", "clone", "nccl", "ring"), transports: Sequence[str] = ()) -> dict:
    """Every section of ``bench clone``; a JSON-ready dict."""
    from flashboot.benchmarks.clone_from_start import clone_from_start, nccl_from_start
    from flashboot.flashclone.common import _gkey
    from flashboot.flashclone import seed
    from flashboot.arena import Arena
    from flashboot.memory import Device
    from flashboot.flashclone.manifest import Manifest
    from flashboot.flashclone.rendezvous import Rendezvous, free_port

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
                                      timeout_s=timeout_s, serve_nccl=False) as s:
                                join_key = _gkey(s.generation, schedule, "join")
                                reports = run_group(store, token, devices, schedule, k, name=name,
                                                    chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                                                    joined=lambda s=s, key=join_key: s.rendezvous.add(key, 0))
                            out["clone"].append({"schedule": schedule, "clones": k, "reports": reports})
                if "nccl" in sections:
                    name = f"start-{secrets.token_hex(3)}"
                    with seed(store, arena, dev0, token=token, name=name, nbytes=nbytes, manifest=manifest,
                              timeout_s=timeout_s, serve_nccl=False):
                        out["flashclone_from_start"] = clone_from_start(store, token, devices[-1], name, timeout_s)
        if transports:
            with Arena.create(nbytes, dev0) as arena:
                fill_random(arena, nbytes, 5)
                manifest = Manifest.of_arena(arena, nbytes)
                out["transports"] = transports_section(store, token, devices, arena, manifest, nbytes, transports,
                                                       chunk_bytes=chunk_bytes, timeout_s=timeout_s)
        if "nccl" in sections:
            out["nccl"] = [nccl_from_start(devices, nbytes, mode="bulk", tensors=1, timeout_s=timeout_s),
                           nccl_from_start(devices, nbytes, mode="per_tensor", tensors=tensors, timeout_s=timeout_s)]
        if "ring" in sections:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(shm, f"flashboot-bench-ring-{secrets.token_hex(4)}.bin")
            try:
                write_image_file(path, nbytes)
                out["ring"] = {"image": path}
                for mode, early in (("pin_on_path", False), ("pin_early", True)):
                    single = ring_load_group(store, token, devices, path, 1, name=f"ring1-{secrets.token_hex(3)}",
                                             chunk_bytes=chunk_bytes, timeout_s=timeout_s, pin_early=early)
                    ring = ring_load_group(store, token, devices, path, len(devices),
                                           name=f"ringN-{secrets.token_hex(3)}", chunk_bytes=chunk_bytes,
                                           timeout_s=timeout_s, pin_early=early)
                    out["ring"][mode] = {"single": single, "ring": ring,
                                         "ratio": ring["critical_path_ms"] / single["critical_path_ms"]}
            finally:
                if os.path.exists(path):
                    os.unlink(path)
    finally:
        host.close()
    return out


def _breakdown(detail: dict) -> str:
    keys = ("seed_record_ms", "join_ms", "member_record_ms", "pidfd_getfd_ms", "reserve_ms", "import_ms", "map_ms",
            "set_access_ms", "flags_open_ms")
    names = {"seed_record_ms": "seed record (get+HMAC+decrypt)", "join_ms": "position", "member_record_ms":
             "clone record", "pidfd_getfd_ms": "pidfd_getfd (all segments)", "reserve_ms": "reserve",
             "import_ms": "import (first segment)", "map_ms": "map (first segment)",
             "set_access_ms": "set access (first segment)", "flags_open_ms": "flags arena"}
    return ", ".join(f"{names[k]} {detail[k]:.2f}" for k in keys if k in detail)


def _rows(res: dict) -> list[list]:
    rows = []
    ceiling = res.get("ceiling")
    if ceiling:
        rows.append([f"copy ceiling ({ceiling['path']})", ceiling["gbps"], "GB/s", f"{ceiling['ms']:.2f} ms, byte-exact "
                     f"{ceiling['byte_exact']}"])
    first_exchange = None
    for group in res.get("clone", []):
        reps = group["reports"]
        gb = [r["stream_gbps"] or r["gbps"] for r in reps]
        exch = [r["exchange_ms"] for r in reps]
        per_clone = ", ".join("%.4g (%s)" % (g, r["device"]) for g, r in zip(gb, reps))
        host_clock = ", ".join("%.4g" % r["gbps"] for r in reps)
        note = (f"per clone (CUDA events, common start to all bytes held) {per_clone}; host clock "
                f"{host_clock}; exchange+map median {statistics.median(exch):.2f} ms "
                f"(max {max(exch):.2f}); {'all byte-exact' if all(r['verified'] for r in reps) else 'NOT all verified'}")
        if ceiling:
            note += f"; {100 * min(gb) / ceiling['gbps']:.0f}% of ceiling (slowest)"
        rows.append([f"{group['schedule']} x{group['clones']}", statistics.mean(gb), "GB/s/clone", note])
        if first_exchange is None and reps:
            first_exchange = (group, reps[0])
    if first_exchange is not None:
        group, r = first_exchange
        rows.append([f"exchange+map, first clone of {group['schedule']} x{group['clones']} on {r['device']}",
                     r["exchange_ms"], "ms", f"{_breakdown(r.get('exchange_detail', {}))} ms; driver warm-up before it "
                     f"{r.get('warm_ms', 0):.1f} ms ({r.get('warm_note') or 'nothing to warm'}); the other "
                     f"{r.get('segments_mapped_during_copy', 0)} segments mapped during the copy in "
                     f"{r.get('map_during_copy_ms', 0):.2f} ms (host time, overlapped)"])
    fs = res.get("flashclone_from_start")
    if fs:
        rows.append(["FlashClone, process start -> weights ready", fs["from_start_s"], "s",
                     f"interpreter + imports {fs['import_s']:.2f} s; then connect {fs['connect_ms']:.0f} ms (driver "
                     f"warm-up {fs['warm_ms']:.0f} ms inside), exchange+map {fs['exchange_ms']:.2f} ms, arena "
                     f"{fs['alloc_ms']:.0f} ms, transfer {fs['transfer_ms']:.1f} ms ({fs['transfer_gbps']:.0f} GB/s); "
                     f"resident seed; no verify"])
    for n in res.get("nccl", []):
        rows.append([f"{n['backend']} {n['mode']} ({n['broadcasts']} broadcasts), process start -> weights ready",
                     n["from_start_s"], "s",
                     f"interpreter + imports {n['import_s']:.2f} s; set_device + buffer {n['buffer_ms']:.0f} ms; setup "
                     f"before the first byte {n['setup_ms']:.0f} ms (init_process_group {n['init_ms']:.0f} + first "
                     f"collective {n['first_collective_ms']:.0f}); transfer {n['transfer_ms']:.1f} ms "
                     f"({n['transfer_gbps']:.0f} GB/s); resident seed rank; GPUs visible {n['visible_gpus']}; "
                     f"transports {', '.join(n['transports']) or '?'}; byte-exact {n['byte_exact']}"])
    ring = res.get("ring")
    if ring:
        for mode, label in (("pin_on_path", "pin on the critical path"), ("pin_early", "shard pinned early")):
            if mode not in ring:
                continue
            m = ring[mode]
            for kind in ("single", "ring"):
                g = m[kind]
                what = "single-process load" if kind == "single" else f"ring load, {g['members']} processes"
                note = (f"{label}; alloc {', '.join(f'{x:.0f}' for x in g['alloc_ms'])}, exchange "
                        f"{', '.join(f'{x:.1f}' for x in g['exchange_ms'])}, map+pin "
                        f"{', '.join(f'{x:.0f}' for x in g['load_ms'])} (pin {', '.join(f'{x:.0f}' for x in g['pin_ms'])}"
                        f"{', off the path' if g['pin_early'] else ''}), H2D+gather "
                        f"{', '.join(f'{x:.0f}' for x in g['transfer_ms'])} ms; byte-exact {g['byte_exact']}")
                if kind == "ring":
                    note = f"{m['ratio']:.2f}x the single load; " + note
                rows.append([f"{what} ({label})", g["critical_path_ms"], "ms", note])
    return rows


def register_bench(sub) -> None:
    p = sub.add_parser("clone", help="FlashClone: map time, star/chain GB/s, NCCL from process start, ring load")
    p.add_argument("--nbytes", default=None, help=f"bytes replicated (default {DEFAULT_NBYTES}; 16MB with --device cpu)")
    p.add_argument("--device", default=None, help="cpu runs the machinery on the host backend (default: the GPUs)")
    p.add_argument("--clones", nargs="*", type=int, default=None, help="clone counts (default 1 2 4)")
    p.add_argument("--chunk-bytes", default=None, help="pipeline chunk (default: the schedulers' default)")
    p.add_argument("--tensors", type=int, default=3170, help="tensors of the per-tensor (R-Fork-like) broadcast")
    p.add_argument("--sections", nargs="*", default=None,
                   help="ceiling clone nccl ring (default: all; with --transport: ceiling)")
    p.add_argument("--transport", nargs="+", default=None, metavar="NAME",
                   help="side by side, same bytes, same run: posix_fd nixl nccl (one clone, chain of 2 each)")
    p.add_argument("--sweep", nargs="*", default=None, metavar="CHUNK",
                   help="instead: the in-process chunk-size sweep (e.g. 16MiB 64MiB 256MiB 1GiB)")
    p.add_argument("--schedule", default="chain", help="schedule of --sweep")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def print_results(res: dict) -> None:
    from flashboot.benchmarks.timing import print_table

    print_table(f"FlashClone on {', '.join(res['devices'])}, {res['nbytes'] / 1e9:.2f} GB",
                ["what", "value", "unit", "note"], _rows(res) + _transport_rows(res))


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import check_count, dump_json, print_table
    from flashboot.units import check_timeout

    # up front, before seeds and processes start: 0 had ended in statistics' empty-median error,
    # a NaN timeout in ValueError and -5 in 'Bad file descriptor'
    check_count(args.repeats, "--repeats")
    for k in args.clones or ():
        check_count(k, "--clones")
    check_timeout(args.timeout, "--timeout")
    check_count(args.tensors, "--tensors")  # 0 or -5 had run one broadcast labelled '(0 tensors)'
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
    if args.transport:
        from flashboot.flashclone.transports.registry import transport_class

        for name in args.transport:
            transport_class(name)  # UnknownNameError listing the registered ones
    sections = args.sections or (("ceiling",) if args.transport else ("ceiling", "clone", "nccl", "ring"))
    res = run(nbytes, device=args.device, clone_counts=args.clones or DEFAULT_CLONES,
              chunk_bytes=parse_bytes(args.chunk_bytes) if args.chunk_bytes else None, tensors=args.tensors,
              timeout_s=args.timeout, repeats=args.repeats, sections=sections, transports=args.transport or ())
    print_results(res)
    dump_json(res, args.json)
    exact = [r["verified"] for g in res.get("clone", []) + res.get("transports", []) for r in g["reports"]]
    exact += [False for g in res.get("transports", []) if "error" in g]
    exact += [n["byte_exact"] for n in res.get("nccl", [])]
    for mode in ("pin_on_path", "pin_early"):
        if mode in res.get("ring", {}):
            exact += [res["ring"][mode]["single"]["byte_exact"], res["ring"][mode]["ring"]["byte_exact"]]
    if res.get("ceiling"):
        exact.append(res["ceiling"]["byte_exact"])
    return 0 if all(exact) else 1
