"""``flashboot bench clone``'s section 4: from process start to weights ready, NCCL against
FlashClone, each in a fresh worker process of this module (the same interpreter start and the
same imports on both sides, :func:`_prelude`).

NCCL: the seed rank is already resident (started first, weights in place), then the receiving
process starts: set_device + buffer, ``init_process_group``, a first collective, one broadcast of
the same bytes (or one per tensor, as SGLang's R-Fork does). FlashClone: a resident seed, one
process that starts, connects, maps and copies. Verification is part of neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from flashboot.benchmarks.clone import _collect, _env, _wait_until


def _worker_cmd(cfg: dict) -> list[str]:
    return [sys.executable, "-m", "flashboot.benchmarks.clone_from_start", "--worker", json.dumps(cfg)]


def _worker_env(token: str | None = None) -> dict:
    """Workers see every GPU (each picks its own with set_device, so NCCL can use P2P/NVLink
    between them), never NVLink multicast (NCCL_NVLS_ENABLE=0), and log NCCL's transports."""
    env = _env(token) if token else dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env.setdefault("NCCL_DEBUG", "INFO")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _nccl_transports(log: str) -> list[str]:
    """The transports NCCL's INFO log names for its channels (``P2P/CUMEM/read``, ``SHM``, ...)."""
    found = []
    for line in log.splitlines():
        if " via " in line and "Channel" in line:
            t = line.split(" via ", 1)[1].strip()
            if t not in found:
                found.append(t)
    return found


def nccl_from_start(devices: Sequence[str], nbytes: int, *, mode: str, tensors: int, timeout_s: float) -> dict:
    """NCCL from process start to weights ready, with a resident seed as FlashClone has one.

    Rank 0 (the seed, on ``devices[0]``) starts first and fills its weights; once it is ready the
    receiver (rank 1, on ``devices[-1]``) is started and timed from its spawn: imports, set_device
    and its buffer, ``init_process_group``, a first collective (NCCL connects its channels
    lazily), then one broadcast of ``nbytes`` (``mode="bulk"``) or ``tensors`` broadcasts of its
    pieces (``mode="per_tensor"``, as R-Fork does). Both processes see every GPU."""
    from flashboot.flashclone.rendezvous import free_port

    port = free_port()
    pair = [devices[0], devices[-1]]
    with tempfile.TemporaryDirectory(prefix="flashboot-nccl-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        ready = os.path.join(tmp, "seed.ready")

        def spawn(rank):
            cfg = {"kind": "nccl", "rank": rank, "devices": pair, "nbytes": nbytes, "mode": mode, "tensors": tensors,
                   "port": port, "out": outs[rank], "timeout_s": timeout_s, "ready_file": ready}
            return subprocess.Popen(_worker_cmd(cfg), env=_worker_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)

        procs = [spawn(0)]
        try:
            _wait_until(lambda: os.path.exists(ready), procs[0], timeout_s, "the NCCL seed rank being ready",
                        poll_s=0.01)
            t_spawn = time.time()
            procs.append(spawn(1))
        except BaseException:
            for p in procs:
                p.kill()
            raise
        (r0, r1), logs = _collect(procs, outs, timeout_s * 2 + 60, f"NCCL {mode}", with_logs=True)
    # "broadcasts": those the receiver made, the first collective's included: the pieces asked for are
    # cut from what the first 64 MiB leave, so a payload under 64 MiB is one broadcast whatever
    # ``tensors`` says (the table had read '(3170 tensors)' for it)
    return {"mode": mode, "tensors": tensors if mode == "per_tensor" else 1, "broadcasts": r1["broadcasts"],
            "backend": r1["backend"],
            "devices": pair, "visible_gpus": [r0["visible_gpus"], r1["visible_gpus"]],
            "transports": _nccl_transports(logs[0] + logs[1]),
            "from_start_s": r1["ready_unix"] - t_spawn, "import_s": r1["imported_unix"] - t_spawn,
            "buffer_ms": r1["buffer_ms"], "init_ms": r1["init_ms"], "first_collective_ms": r1["first_collective_ms"],
            "setup_ms": r1["init_ms"] + r1["first_collective_ms"], "transfer_ms": r1["transfer_ms"],
            "transfer_gbps": (nbytes - r1["first_collective_bytes"]) / (r1["transfer_ms"] * 1e-3) / 1e9
            if r1["transfer_ms"] > 0 else 0.0,
            "payload_bytes": r1["payload_bytes"], "byte_exact": r0["checksum"] == r1["checksum"]}


def _prelude(cuda: bool) -> None:
    """The imports both from-start workers make, so neither side is charged for the other's."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import flashboot.flashclone.cloning  # noqa: F401  (the package imports its pieces on first use)
    import flashboot.arena  # noqa: F401
    from flashboot.movers import create_mover

    create_mover("copy_engine" if cuda else "host")


def _nccl_worker(cfg: dict) -> None:
    t_enter = time.time()
    rank, dev = cfg["rank"], cfg["devices"][cfg["rank"]]
    cuda = dev.startswith("cuda")
    _prelude(cuda)
    t_imported = time.time()
    import datetime

    import torch
    import torch.distributed as dist

    nbytes = cfg["nbytes"]
    tb = time.time()
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
    if rank == 0:
        with open(cfg["ready_file"], "w") as f:
            f.write("ready\n")
    kw = {"device_id": torch.device(dev)} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=cfg["timeout_s"]), **kw)
    t1 = time.time()
    # NCCL connects its channels on the first collective (lazily): the first 64 MiB of the weights,
    # timed on its own; large enough to take the same ring/Simple path as the bulk broadcast. The
    # transfer then sends the rest, so NCCL moves the bytes FlashClone does, once (it had sent
    # these 64 MiB twice: 2x the bytes for a payload of at most 64 MiB)
    first = min(nbytes, 64 << 20)
    dist.broadcast(buf[:first], 0)
    payload, broadcasts = first, 1
    if cuda:
        torch.cuda.synchronize()
    t2 = time.time()
    if cfg["mode"] == "bulk":
        if nbytes > first:
            dist.broadcast(buf[first:], 0)
            payload += nbytes - first
            broadcasts += 1
    else:  # the tensors, cut from the rest: as many broadcasts as tensors
        n = max(1, cfg["tensors"])
        rest = nbytes - first
        cuts = [first + rest * i // n for i in range(n + 1)]
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                dist.broadcast(buf[lo:hi], 0)
                payload += hi - lo
                broadcasts += 1
    if cuda:
        torch.cuda.synchronize()
    t3 = time.time()
    from flashboot.kernels.checksum import checksum

    digest = checksum(buf)
    with open(cfg["out"], "w") as f:
        json.dump({"rank": rank, "backend": "nccl" if cuda else "gloo", "started_unix": t_enter,
                   "imported_unix": t_imported, "visible_gpus": torch.cuda.device_count() if cuda else 0,
                   "buffer_ms": (t0 - tb) * 1e3, "init_ms": (t1 - t0) * 1e3, "first_collective_ms": (t2 - t1) * 1e3,
                   "transfer_ms": (t3 - t2) * 1e3, "ready_unix": t3, "payload_bytes": payload,
                   "broadcasts": broadcasts, "first_collective_bytes": first, "checksum": f"{digest:016x}"}, f)
    dist.destroy_process_group()


def _flashclone_worker(cfg: dict) -> None:
    t_enter = time.time()
    cuda = cfg["device"].startswith("cuda")
    _prelude(cuda)
    t_imported = time.time()
    from flashboot.flashclone import clone

    with clone(cfg["store"], cfg["device"], "star", name=cfg["name"], timeout_s=cfg["timeout_s"]) as result:
        rep = result.report.to_dict()
    rep.update({"started_unix": t_enter, "imported_unix": t_imported})
    with open(cfg["out"], "w") as f:
        json.dump(rep, f)


def clone_from_start(store: str, token: str, device: str, name: str, timeout_s: float) -> dict:
    """One FlashClone process (the same worker script and imports as the NCCL side) from its spawn
    to weights ready; the seed is already resident. No verification (none on the NCCL side either)."""
    with tempfile.TemporaryDirectory(prefix="flashboot-bench-") as tmp:
        out = os.path.join(tmp, "clone.json")
        cfg = {"kind": "flashclone", "store": store, "device": device, "name": name, "timeout_s": timeout_s,
               "out": out}  # the token travels in the environment, not on the command line
        t_spawn = time.time()
        p = subprocess.Popen(_worker_cmd(cfg), env=_worker_env(token), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        (r,) = _collect([p], [out], timeout_s + 60, "FlashClone from process start")
    return {"device": device, "from_start_s": r["ready_unix"] - t_spawn, "import_s": r["imported_unix"] - t_spawn,
            "connect_ms": r["connect_ms"], "warm_ms": r["warm_ms"], "exchange_ms": r["exchange_ms"],
            "alloc_ms": r["alloc_ms"], "setup_ms": r["ready_ms"] - r["transfer_ms"],
            "transfer_ms": r["transfer_ms"], "transfer_gbps": r["gbps"], "verify_ms": r["verify_ms"]}


def _worker_main(argv: list[str]) -> None:
    cfg = json.loads(argv[argv.index("--worker") + 1])
    if cfg["kind"] == "nccl":
        _nccl_worker(cfg)
    elif cfg["kind"] == "flashclone":
        _flashclone_worker(cfg)
    else:
        raise SystemExit(f"unknown worker kind {cfg['kind']!r}")


if __name__ == "__main__":
    _worker_main(sys.argv)
