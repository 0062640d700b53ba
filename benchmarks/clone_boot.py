"""A clone's boot as an engine and as the CLI see it (issue 19), against a seed on the same GPU.

``python -m flashboot.benchmarks.clone_boot seed --store H:P --bytes N --ready FILE``: a seed of N
random bytes on ``--device`` (cuda:0; cpu for a dry run; hosting the store), serving until SIGTERM; FILE appears once it is published.

``python -m flashboot.benchmarks.clone_boot engine --store H:P [--early W_S]``: an engine-like
fresh process: torch imported and its CUDA context made, ``flashboot`` imported, then (with
``--early``) the early call :func:`flashboot.prepare_clone` and W_S seconds of the engine's own
work, then a verified star clone. Prints ready, verify, ready + verify (target 100 ms), the
transfer's GB/s against a D2D copy of the same size in the same process (target 0.85x), the
clone's phases and its summary line: one JSON line.

``python -m flashboot.benchmarks.clone_boot cli --store H:P [--repeats N]``: N pairs of a bare
``import torch; torch.zeros(1, device='cuda')`` process and a fresh ``flashboot clone --verify``
process, each timed from its spawn (to its CUDA context, and to verified weights), which of the
two goes first alternating from pair to pair: the target is clone <= bare + 150 ms. Reports the
difference of the medians, of the least times, and the median of the pairs. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def seed_main(store: str, nbytes: int, ready: str, device: str) -> None:
    import flashboot
    from flashboot.arena import Arena
    from flashboot.benchmarks.clone import fill_random

    arena = Arena.create(nbytes, device)
    fill_random(arena, nbytes, 3)
    s = flashboot.seed(store, arena, device, nbytes=nbytes)
    with open(ready + ".tmp", "w") as f:
        json.dump({"generation": s.generation, "nbytes": nbytes}, f)
    os.replace(ready + ".tmp", ready)
    try:
        s.serve_forever()
    finally:
        s.close()
        arena.close()


def engine_main(store: str, early_s: float | None, device: str) -> dict:
    t_start = time.perf_counter()
    import torch

    torch.zeros(1, device=device)
    t_context = time.perf_counter()
    import flashboot
    import flashboot.flashclone.cloning  # noqa: F401  (the package imports its pieces on first use)

    t_imported = time.perf_counter()
    warm = None
    if early_s is not None:
        warm = flashboot.prepare_clone(device, verify=True)
        t_w = time.perf_counter()
        x = 0
        while time.perf_counter() - t_w < early_s:  # the engine's own GIL-bound start-up work
            x += 1
    t_call = time.perf_counter()
    result = flashboot.clone(store, device, "star", verify=True, timeout_s=60, prepared=warm)
    call_ms = (time.perf_counter() - t_call) * 1e3
    rep = result.report
    triton_imported = "triton" in sys.modules  # the verify's checksum ran from the cubin when False
    cupy_imported = "cupy" in sys.modules  # the clone's CUDA path imports none (~0.2 s, GIL held)
    from flashboot.benchmarks.clone import copy_ceiling
    from flashboot.bytecode import bytecode_status

    nbytes = rep.nbytes
    result.close()  # room for the ceiling's two arenas
    ceiling = copy_ceiling([device], nbytes, repeats=3)
    groups = _map_group_sweep(store, device)
    chunks = _chunk_sweep(store, device)
    return {"mode": "engine", "early_s": early_s, "nbytes": nbytes, "context_ms": (t_context - t_start) * 1e3,
            "import_flashboot_ms": (t_imported - t_context) * 1e3, "call_ms": call_ms, "ready_ms": rep.ready_ms,
            "verify_ms": rep.verify_ms, "ready_plus_verify_ms": rep.ready_ms + rep.verify_ms,
            "target_ms": 100.0, "transfer_ms": rep.transfer_ms, "transfer_gbps": rep.gbps,
            "stream_gbps": rep.stream_gbps, "d2d_ceiling_gbps": ceiling["gbps"],
            "transfer_vs_ceiling": rep.gbps / ceiling["gbps"] if ceiling["gbps"] else 0.0, "target_ratio": 0.85,
            "phases_ms": {k: round(v, 2) for k, v in rep.phases().items()}, "warm_detail": rep.warm_detail,
            "connect_detail": rep.connect_detail, "verified": rep.verified, "triton_imported": triton_imported,
            "cupy_imported": cupy_imported, "bytecode": bytecode_status(),
            **_fine(rep.to_dict()), "map_group_sweep": groups, "chunk_sweep": chunks,
            "d2d_ceiling_ms": nbytes / ceiling["gbps"] / 1e6 if ceiling["gbps"] else 0.0, "summary": rep.summary()}


def _fine(rep: dict) -> dict:
    """The report's fine breakdown: the exchange's parts (seed record, join, the seed's fds,
    reserve, its first segment's import/map/grant), the warm-up's waits by stage and the source
    segments mapped during the copy."""
    return {"exchange_detail": {k: round(v, 3) for k, v in rep["exchange_detail"].items()},
            "warm_waits": {k: round(v, 3) for k, v in rep["warm_waits"].items()},
            "map_ahead": [round(rep["map_ahead_ms"], 3), rep["segments_mapped_ahead"]],
            "map_during_copy": [round(rep["map_during_copy_ms"], 3), rep["segments_mapped_during_copy"]],
            "alloc_ms": round(rep["alloc_ms"], 3), "alloc_detail": rep["alloc_detail"], "chunk_bytes": rep["chunk_bytes"]}


def _map_group_sweep(store: str, device: str) -> dict:
    """Clones again in this (now warm) process, one per ``MAP_GROUP_MAX_SEGMENTS`` (source segments
    mapped before their copies are issued): transfer GB/s and the mapping's host time for each."""
    import flashboot
    from flashboot.flashclone import executor

    out, default = {}, executor.MAP_GROUP_MAX_SEGMENTS
    try:
        for width in (1, default, 16):
            executor.MAP_GROUP_MAX_SEGMENTS = width
            with flashboot.clone(store, device, "star", timeout_s=60) as r:
                rep = r.report
                out[width] = {"transfer_ms": round(rep.transfer_ms, 3), "gbps": round(rep.gbps, 1),
                              "map_during_copy_ms": round(rep.map_during_copy_ms, 3),
                              "mapped_ahead": rep.segments_mapped_ahead,
                              "ready_ms": round(rep.ready_ms, 3), "alloc_ms": round(rep.alloc_ms, 3),
                              "exchange_ms": round(rep.exchange_ms, 3)}
    finally:
        executor.MAP_GROUP_MAX_SEGMENTS = default
    return out


CHUNK_SWEEP = (256 << 20, 1 << 30, 4 << 30)
"""The star clone's chunk (default: :func:`~flashboot.schedulers.plan.default_chunk_bytes`) tried in the engine process."""


def _chunk_sweep(store: str, device: str) -> dict:
    """Clones again in this (now warm) process, one per chunk of :data:`CHUNK_SWEEP`: the
    transfer's host time and GB/s, and the lanes' own GPU time (``stream_gbps``), for each."""
    import flashboot

    out = {}
    for chunk in CHUNK_SWEEP:
        with flashboot.clone(store, device, "star", timeout_s=60, chunk_bytes=chunk) as r:
            rep = r.report
            out[f"{chunk >> 20} MiB"] = {"transfer_ms": round(rep.transfer_ms, 3), "gbps": round(rep.gbps, 1),
                                         "stream_gbps": round(rep.stream_gbps, 1),
                                         "steps": sum(lane.get("steps", 0) for lane in rep.lanes),
                                         "lanes": len(rep.lanes)}
    return out


def _spawn_s(cmd: list[str], env: dict, timeout_s: float) -> tuple[float, str]:
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode:
        raise RuntimeError(f"{cmd[:4]} exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}")
    return t0, p.stdout


def cli_main(store: str, repeats: int, device: str) -> dict:
    env = dict(os.environ)
    bare, bare_torch, clone, lines = [], [], [], []
    bare_cmd = [sys.executable, "-c", "import time; t = time.time(); import torch; "
                f"torch.zeros(1, device={device!r}); print(time.time() - t, time.time())"]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            # a pair shares its moment (the machine's import speed drifts over a run by more than the
            # target); which of the two goes first alternates, so a drift weighs on both alike
            for which in (("bare", "clone") if i % 2 == 0 else ("clone", "bare")):
                if which == "bare":
                    t0, out = _spawn_s(bare_cmd, env, 120)
                    torch_s, end = map(float, out.strip().splitlines()[-1].split())
                    bare.append(end - t0)
                    bare_torch.append(torch_s)
                    continue
                js = os.path.join(tmp, f"clone{i}.json")
                t0, out = _spawn_s([sys.executable, "-m", "flashboot.cli", "clone", "--store", store, "--device", device,
                                    "--schedule", "star", "--verify", "--json", js, "--timeout", "60"], env, 180)
                rep = json.load(open(js))
                clone.append({"to_ready_s": rep["ready_unix"] - t0, "to_verified_s": rep["finished_unix"] - t0,
                              "before_clone_ms": round((rep["ready_unix"] - t0) * 1e3 - rep["ready_ms"], 3),
                              "ready_ms": rep["ready_ms"], "verify_ms": rep["verify_ms"], **_fine(rep),
                              "connect_detail": rep["connect_detail"], "warm_detail": rep["warm_detail"],
                              "warm_wait_ms": rep["warm_wait_ms"]})
                lines.append(out.strip().splitlines()[0])
    verified = [c["to_verified_s"] for c in clone]
    bare_s, verified_s = statistics.median(bare), statistics.median(verified)
    pairs = [(v - b) * 1e3 for b, v in zip(bare, verified)]
    # Each process less its own import of torch (the bare one's also less its CUDA context, which the
    # clone makes beside that import): torch's import speed drifts by seconds between processes
    # here, so this difference is the clone's own cost with that drift taken out. It would hide a
    # clone that slows its own import of torch: the plain pairs stay the target's figure.
    own = [(v - c["connect_detail"].get("torch_import_early_ms", float("nan")) / 1e3 - (b - bt)) * 1e3
           for b, bt, v, c in zip(bare, bare_torch, verified, clone)]
    return {"mode": "cli", "bare_torch_import_context_s": bare_torch,
            "over_bare_less_torch_pairs_ms": [round(x, 1) for x in own],
            "over_bare_less_torch_median_ms": statistics.median(own), "bare_torch_context_s": bare, "clone_verified_s": verified,
            "bare_median_s": bare_s, "clone_median_s": verified_s, "over_bare_ms": (verified_s - bare_s) * 1e3,
            "over_bare_pairs_ms": [round(x, 1) for x in pairs], "over_bare_pair_median_ms": statistics.median(pairs),
            # the machine's noise only ever adds time: the least each kind took is the least noisy figure
            "over_bare_min_ms": (min(verified) - min(bare)) * 1e3,
            "target_over_bare_ms": 150.0, "runs": clone, "summaries": lines}


def _bytecode(row: dict) -> str:
    """``"M of N"`` (without it every module is compiled from source in the timed call: see flashboot.bytecode)."""
    b = row.get("bytecode") or {}
    return f"{b.get('with_bytecode', '?')} of {b.get('modules', '?')}"


def show(row: dict) -> str:
    """A result line for people (the JSON line is for the record)."""
    r = row
    if r["mode"] == "engine":
        return (f"engine early={r['early_s']}: ready {r['ready_ms']:.1f} + verify {r['verify_ms']:.1f} = "
                f"{r['ready_plus_verify_ms']:.1f} ms (target 100); transfer {r['transfer_gbps']:.0f} GB/s = "
                f"{r['transfer_vs_ceiling']:.3f}x D2D {r['d2d_ceiling_gbps']:.0f} GB/s (target 0.85); clone call "
                f"{r['call_ms']:.1f} ms; Triton imported: {r['triton_imported']}; CuPy imported: "
                f"{r.get('cupy_imported', '?')}; FlashBoot modules with bytecode: {_bytecode(r)}\n"
                f"  phases {r['phases_ms']}\n"
                f"  warm-up {r['warm_detail']} waits {r['warm_waits']}\n  exchange {r['exchange_detail']}\n"
                f"  alloc {r['alloc_ms']} ms {r.get('alloc_detail')}; source segments mapped while our arena was made (ms, count) "
                f"{r.get('map_ahead')}, during the copy {r['map_during_copy']}"
                f"\n  map group sweep (segments: ...) {r['map_group_sweep']}\n  chunk sweep {r.get('chunk_sweep')}"
                f"\n  {r['summary']}")
    runs = "\n".join(f"  spawn to clone() {c['before_clone_ms']} ms; connect {c['connect_detail']} warm-up "
                     f"{c['warm_detail']} waits {c['warm_waits']}\n  exchange {c['exchange_detail']}\n  {line}"
                     for c, line in zip(r["runs"], r["summaries"]))
    return (f"bare torch + context {[round(x, 3) for x in r['bare_torch_context_s']]} s; clone --verify to verified "
            f"{[round(x, 3) for x in r['clone_verified_s']]} s; median over bare {r['over_bare_ms']:.0f} ms; least over "
            f"least {r.get('over_bare_min_ms', float('nan')):.0f} ms; each clone over the bare process beside it "
            f"{r.get('over_bare_pairs_ms')} ms, median {r.get('over_bare_pair_median_ms', float('nan')):.0f} "
            f"(target 150); less each one's own torch import + context {r.get('over_bare_less_torch_pairs_ms')} ms, "
            f"median {r.get('over_bare_less_torch_median_ms', float('nan')):.0f}\n{runs}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashboot.benchmarks.clone_boot", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["seed", "engine", "cli", "show"], help="show: JSON lines on stdin, for people")
    p.add_argument("--store")
    p.add_argument("--bytes", type=int, default=13_760_000_000)
    p.add_argument("--ready", default=None)
    p.add_argument("--early", type=float, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run on the host backend")
    args = p.parse_args(argv)
    if args.mode == "show":
        for line in sys.stdin:
            if line.strip():
                print(show(json.loads(line)))
        return 0
    if args.store is None:
        p.error("--store is required")
    if args.mode == "seed":
        seed_main(args.store, args.bytes, args.ready, args.device)
        return 0
    res = (engine_main(args.store, args.early, args.device) if args.mode == "engine"
           else cli_main(args.store, args.repeats, args.device))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
