"""NIXL on one GPU: a clone and a ring of 2 over NIXL, all on device 0, byte-exact (a check, not a figure).

``python3 benchmarks/gpu_nixl_one.py [--nbytes 1GiB]`` on a GPU machine with the NIXL wheel installed.
One GPU cannot give the two-GPU figures of issue 11 (UCX emulates a READ of a VMM arena over
tcp/lo here, see RESULTS.md); this runs the NIXL transport's VRAM paths end to end: agent
creation, registration, READs, a ring member's shard load and its READs of its predecessor,
and closing (outstanding READs settled, the agent destroyed before the arena is unmapped).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

from flashboot.units import parse_bytes

_CLONE = """
import json, sys, flashboot
dev = int(sys.argv[6]) if sys.argv[6].isdigit() else sys.argv[6]
r = flashboot.clone(sys.argv[1], dev, sys.argv[2], transport="nixl", verify=True, timeout_s=120,
                    image=sys.argv[3] or None, clones=int(sys.argv[4]) or None, name=sys.argv[5])
rep = r.report.to_dict()
print(json.dumps({k: rep.get(k) for k in ("schedule", "position", "transport", "verified", "transfer_ms", "setup_ms",
                                          "source", "recovered")} | {"gbps": r.report.gbps}), flush=True)
from flashboot.flashclone import linger
linger(r, timeout_s=60)
r.close()
"""


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CLONE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=240)
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        raise SystemExit(f"clone failed (rc {p.returncode}):\n{out}\n{err[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    import numpy as np

    import flashboot
    from flashboot.arena import Arena
    from flashboot.benchmarks.clone import fill_random
    from flashboot.flashclone.rendezvous import free_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", default="1GiB")
    ap.add_argument("--device", default="0", help="0 on a GPU machine; cpu checks the script itself")
    args = ap.parse_args(argv)
    nbytes = parse_bytes(args.nbytes)
    os.environ.setdefault("FLASHBOOT_TOKEN", secrets.token_hex(16))
    results = {}
    # a chain of 1 from a resident seed
    addr = f"127.0.0.1:{free_port()}"
    arena = Arena.create(nbytes, args.device if args.device == "cpu" else int(args.device))
    fill_random(arena, arena.nbytes, 1)
    seed = flashboot.seed(addr, arena, nixl=True, serve_nccl=False, timeout_s=120)
    try:
        t0 = time.perf_counter()
        results["clone"] = _result(_spawn(addr, "chain", "", "0", "default", args.device))
        results["clone"]["wall_s"] = time.perf_counter() - t0
    finally:
        seed.close()
        arena.close()
    # a ring of 2 over NIXL, each member with the same host image
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = os.path.join(d, "image.bin")
        np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8).tofile(path)
        addr = f"127.0.0.1:{free_port()}"
        members = [_spawn(addr, "ring", path, "2", "ring", args.device) for _ in range(2)]
        results["ring"] = [_result(m) for m in members]
    for k, v in results.items():
        print(k, json.dumps(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
