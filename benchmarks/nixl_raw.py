"""Raw NIXL READ between two GPUs, outside FlashClone: what UCX does with the memory it is given.

``python -m flashboot.benchmarks.nixl_raw [--nbytes 8GiB] [--memory torch|arena] [--read-bytes 64MiB]
[--depth 8] [--json FILE]``

A target process on ``cuda:0`` registers ``nbytes`` (a torch tensor: cudaMalloc memory, which
UCX's ``cuda_ipc`` exports with a legacy IPC handle; or a FlashBoot arena: VMM memory, which it
exports only with a fabric handle or, in builds that have it, a POSIX fd); an initiator on
``cuda:1`` READs it in pieces of ``read_bytes`` with ``depth`` outstanding, three times, then
checks the bytes. The P2P copy-engine ceiling (``dst.copy_(src)``) is timed in the same process.
It separates what chunking buys from what the memory kind costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from flashboot.units import parse_bytes

from .timing import dump_json

_TARGET = """
import json, sys, time, torch
from flashboot.flashclone.transports import nixl
nbytes, memory, rec_path, stop_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.cuda.set_device(0)
if memory == "torch":
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"); ptr = buf.data_ptr(); keep = buf
else:
    from flashboot.arena import Arena
    keep = Arena.create(nbytes, 0); buf = keep.bytes()[:nbytes]; ptr = keep.ptr
buf.copy_(torch.arange(251, dtype=torch.uint8, device="cuda:0").repeat(-(-nbytes // 251))[:nbytes])
torch.cuda.synchronize()
mod = nixl.nixl_module(); agent = nixl._create_agent(mod, "raw-target")
seg = keep.segment_bytes if memory == "arena" else nbytes
descs = [(ptr + o, min(seg, nbytes - o), 0, "") for o in range(0, nbytes, seg)]
agent.register_memory(descs, "VRAM")
json.dump({"agent": "raw-target", "ptr": ptr, "seg": seg, "md": nixl._b64(agent.get_agent_metadata())},
          open(rec_path + ".tmp", "w"))
import os; os.rename(rec_path + ".tmp", rec_path)
while not os.path.exists(stop_path): time.sleep(0.05)
"""

_INIT = """
import json, os, sys, time, torch
from flashboot.flashclone.transports import nixl
nbytes, rec_path, read_bytes, depth = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.cuda.set_device(1)
dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
times = []
for _ in range(5):
    torch.cuda.synchronize(0); torch.cuda.synchronize(1); t = time.perf_counter()
    dst.copy_(src); torch.cuda.synchronize(1); times.append(time.perf_counter() - t)
ceiling = nbytes / sorted(times)[len(times) // 2] / 1e9
del src; torch.cuda.empty_cache()
mod = nixl.nixl_module(); t0 = time.perf_counter(); agent = nixl._create_agent(mod, "raw-init")
agent_ms = (time.perf_counter() - t0) * 1e3
t0 = time.perf_counter(); agent.register_memory([(dst.data_ptr(), nbytes, 1, "")], "VRAM")
reg_ms = (time.perf_counter() - t0) * 1e3
while not os.path.exists(rec_path): time.sleep(0.05)
rec = json.load(open(rec_path))
t0 = time.perf_counter(); name = agent.add_remote_agent(nixl._unb64(rec["md"])); add_ms = (time.perf_counter() - t0) * 1e3
name = name.decode() if isinstance(name, bytes) else name
def pieces():
    o = 0
    while o < nbytes:
        n = min(read_bytes, nbytes - o, (o // rec["seg"] + 1) * rec["seg"] - o)
        yield o, n; o += n
runs = []
for r in range(3):
    dst.zero_(); torch.cuda.synchronize(1)
    todo = list(pieces()); inflight = []; t = time.perf_counter()
    while todo or inflight:
        while todo and len(inflight) < depth:
            o, n = todo.pop(0)
            h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.data_ptr() + o, n, 1)], "VRAM"),
                                      agent.get_xfer_descs([(rec["ptr"] + o, n, 0)], "VRAM"), name)
            agent.transfer(h); inflight.append(h)
        still = []
        for h in inflight:
            s = agent.check_xfer_state(h)
            if s == "DONE": agent.release_xfer_handle(h)
            elif s == "ERR": raise SystemExit("READ failed")
            else: still.append(h)
        inflight = still
    runs.append(time.perf_counter() - t)
expect = torch.arange(251, dtype=torch.uint8, device="cuda:1").repeat(-(-nbytes // 251))[:nbytes]
ok = bool(torch.equal(dst, expect))
best = sorted(runs)[len(runs) // 2]
print(json.dumps({"ceiling_gbps": ceiling, "nixl_gbps": nbytes / best / 1e9, "ratio": nbytes / best / 1e9 / ceiling,
                  "runs_s": runs, "byte_exact": ok, "agent_ms": agent_ms, "register_ms": reg_ms,
                  "add_remote_ms": add_ms}))
"""


def run(nbytes: int, memory: str, read_bytes: int, depth: int, timeout_s: float = 150) -> dict:
    with tempfile.TemporaryDirectory(prefix="flashboot-nixl-raw-") as tmp:
        rec, stop = os.path.join(tmp, "rec.json"), os.path.join(tmp, "stop")
        target = subprocess.Popen([sys.executable, "-c", _TARGET, str(nbytes), memory, rec, stop],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            init = subprocess.run([sys.executable, "-c", _INIT, str(nbytes), rec, str(read_bytes), str(depth)],
                                  capture_output=True, text=True, timeout=timeout_s)
        finally:
            open(stop, "w").close()
            try:
                target.wait(20)
            except subprocess.TimeoutExpired:
                target.kill()
        lines = [line for line in init.stdout.splitlines() if line.startswith("{")]
        if init.returncode or not lines:
            return {"memory": memory, "error": (init.stdout + init.stderr)[-3000:]}
        return {"memory": memory, "nbytes": nbytes, "read_bytes": read_bytes, "depth": depth, **json.loads(lines[-1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", default="8GiB")
    ap.add_argument("--memory", nargs="+", default=["torch", "arena"])
    ap.add_argument("--read-bytes", nargs="+", default=["64MiB"])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for memory in args.memory:
        for rb in args.read_bytes:
            t = time.perf_counter()
            r = run(parse_bytes(args.nbytes), memory, parse_bytes(rb), args.depth)
            r["wall_s"] = time.perf_counter() - t
            rows.append(r)
            if "error" in r:
                print(f"{memory} {rb}: FAILED {r['error'][-800:]}", flush=True)
            else:
                print(f"{memory:<6} read {rb:>7} x{args.depth}: nixl {r['nixl_gbps']:.1f} GB/s, ceiling "
                      f"{r['ceiling_gbps']:.1f} GB/s, ratio {r['ratio']:.2f}, byte-exact {r['byte_exact']}, agent "
                      f"{r['agent_ms']:.0f} ms, register {r['register_ms']:.1f} ms, add_remote "
                      f"{r['add_remote_ms']:.1f} ms", flush=True)
    dump_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
