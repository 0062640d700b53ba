"""NIXL across network namespaces against a plain TCP socket between the same namespaces (CPU, root).

``python -m flashboot.benchmarks.nixl_netns [--nbytes 512MiB] [--repeats 3] [--json FILE]``

Two namespaces joined by veths (:mod:`flashboot.benchmarks.netns`). In one run, alternating:

* **socket**: a Python server in namespace 0 ``sendall``s ``nbytes`` from memory, a client in
  namespace 1 ``recv_into``s a preallocated buffer; the client times first byte asked to last byte in.
* **nixl**: a seed in namespace 0 (``seed(..., nixl=True)``, host arena), a fresh clone process in
  namespace 1 with ``transport="nixl"`` and ``UCX_TLS=tcp`` (otherwise UCX copies through ``cma``
  and never touches the link); its ``transfer_ms`` (first READ posted to last byte in), and its
  critical-path setup apart (``setup_ms``; agent creation, overlapped with connecting, apart again).
  Each clone is verified against the seed's checksums after the timing.

* **ring** (``--ring N``, N >= 2 namespaces): N members, each with its own copy of the image (one
  file the namespaces share), ``schedule="ring", transport="nixl"``: each loads its 1/N shard and
  READs the other (N-1)/N from its predecessor over its veth. Its rate is the bytes it gathered
  over the link divided by its ``transfer_ms``, beside the same socket figure and beside N plain
  sockets at once, each namespace pulling the same bytes from its predecessor (the ring's ceiling
  when N transfers share the machine's cores).

Prints a table and the ratio nixl / socket (medians); the veth's received bytes prove the link was used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from flashboot.units import parse_bytes

from .netns import Hosts
from .timing import dump_json

TOKEN = "flashboot-bench-netns-token-0123456789"
PORT_STORE, PORT_SOCKET = 29611, 29612

_SOCKET_SERVER = """
import socket, sys, numpy as np
n, reps = int(sys.argv[1]), int(sys.argv[2])
buf = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[3], int(sys.argv[4]))); srv.listen(1)
print("ready", flush=True)
for _ in range(reps):
    c, _ = srv.accept()
    c.recv(1)
    c.sendall(memoryview(buf))
    c.close()
"""

_SOCKET_CLIENT = """
import socket, sys, time, numpy as np, json
n = int(sys.argv[1])
buf = np.empty(n, dtype=np.uint8); view = memoryview(buf)
c = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=60)
t0 = time.perf_counter(); c.sendall(b"g"); got = 0
while got < n:
    k = c.recv_into(view[got:], n - got)
    if k == 0: raise SystemExit("short read")
    got += k
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "gbps": n / dt / 1e9}))
"""

_SEED = """
import sys, numpy as np, flashboot
from flashboot.arena import Arena
a = Arena.create(int(sys.argv[1]), "cpu")
a.bytes().numpy()[:] = np.random.default_rng(1).integers(0, 256, a.nbytes, dtype=np.uint8)
s = flashboot.seed(sys.argv[2], a, nixl=True, serve_nccl=False, timeout_s=60)
print("ready", flush=True)
s.serve_forever()
"""

_CLONE = """
import sys, json, flashboot
r = flashboot.clone(sys.argv[1], "cpu", "star", transport="nixl", verify=True, timeout_s=60)
rep = r.report
print(json.dumps({"seconds": rep.transfer_ms / 1e3, "gbps": rep.gbps, "setup_ms": rep.setup_ms,
                  "detail": rep.exchange_detail, "nbytes": rep.nbytes, "verified": rep.verified}), flush=True)
r.close()
"""

_RING = """
import sys, json, flashboot
r = flashboot.clone(sys.argv[1], "cpu", "ring", image=sys.argv[2], clones=int(sys.argv[3]), transport="nixl",
                    verify=True, timeout_s=120, name=sys.argv[4], chunk_bytes=int(sys.argv[5]) or None)
rep = r.report
gathered = rep.nbytes - (rep.nbytes // int(sys.argv[3]))
print(json.dumps({"seconds": rep.transfer_ms / 1e3, "gbps": gathered / (rep.transfer_ms / 1e3) / 1e9,
                  "setup_ms": rep.setup_ms, "detail": rep.exchange_detail, "nbytes": rep.nbytes,
                  "verified": rep.verified, "recovered": rep.recovered}), flush=True)
from flashboot.flashclone import linger
linger(r, timeout_s=60)
r.close()
"""


def _env(**extra) -> dict:
    e = dict(os.environ)
    e.update({"FLASHBOOT_TOKEN": TOKEN, "UCX_TLS": "tcp", **extra})
    return e


def _json_line(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def run(nbytes: int, repeats: int, ring: int = 0, ring_chunk: int = 0) -> dict:
    with Hosts(max(2, ring), tag="b") as hosts:
        server_addr = hosts.address(0)
        store = f"{server_addr}:{PORT_STORE}"
        sock = hosts.popen(0, [sys.executable, "-c", _SOCKET_SERVER, str(nbytes), str(repeats), server_addr,
                               str(PORT_SOCKET)], env=_env())
        seed = hosts.popen(0, [sys.executable, "-c", _SEED, str(nbytes), store], env=_env())
        try:
            for p, what in ((sock, "socket server"), (seed, "seed")):
                line = p.stdout.readline()
                if not line.startswith("ready"):
                    raise SystemExit(f"{what} did not start: {line}{p.communicate(timeout=10)[1][-2000:]}")
            rows = {"socket": [], "nixl": []}
            for _ in range(repeats):
                c = hosts.popen(1, [sys.executable, "-c", _SOCKET_CLIENT, str(nbytes), server_addr, str(PORT_SOCKET)],
                                env=_env())
                out, err = c.communicate(timeout=120)
                if c.returncode:
                    raise SystemExit(f"socket client failed: {err[-2000:]}")
                rows["socket"].append(_json_line(out))
                rx0 = hosts.rx_bytes(1)
                c = hosts.popen(1, [sys.executable, "-c", _CLONE, store], env=_env())
                out, err = c.communicate(timeout=180)
                if c.returncode:
                    raise SystemExit(f"nixl clone failed: {err[-3000:]}")
                row = _json_line(out)
                row["veth_rx_bytes"] = hosts.rx_bytes(1) - rx0
                rows["nixl"].append(row)
            if ring:
                rows["ring"] = _ring_rows(hosts, store, nbytes, repeats, ring, ring_chunk)
                rows["ring_socket"] = [r for _ in range(repeats) for r in _ring_socket_rows(hosts, nbytes, ring)]
        finally:
            for p in (sock, seed):
                if p.poll() is None:
                    p.terminate()
                try:
                    p.communicate(timeout=20)
                except Exception:  # noqa: BLE001 - a stuck child is killed
                    p.kill()
    med = {k: statistics.median(r["gbps"] for r in v) for k, v in rows.items()}
    return {"nbytes": nbytes, "repeats": repeats, "rows": rows, "median_gbps": med,
            "ratio_nixl_to_socket": med["nixl"] / med["socket"] if med["socket"] else 0.0,
            "ratio_ring_member_to_socket": med["ring"] / med["socket"] if ring and med["socket"] else None,
            "ratio_ring_to_ring_socket": med["ring"] / med["ring_socket"] if ring and med["ring_socket"] else None,
            "ucx_tls": "tcp", "cpus": os.cpu_count(), "loadavg": os.getloadavg()}


def _ring_rows(hosts, store: str, nbytes: int, repeats: int, members: int, chunk: int) -> list[dict]:
    """``repeats`` rings of ``members`` (one per namespace), one row per member per ring."""
    import tempfile

    import numpy as np

    rows = []
    with tempfile.TemporaryDirectory() as d:
        image = os.path.join(d, "image.bin")
        np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8).tofile(image)
        for rep in range(repeats):
            rx0 = [hosts.rx_bytes(i) for i in range(members)]
            procs = [hosts.popen(i, [sys.executable, "-c", _RING, store, image, str(members), f"ring{rep}", str(chunk)], env=_env())
                     for i in range(members)]
            for i, p in enumerate(procs):
                out, err = p.communicate(timeout=240)
                if p.returncode:
                    raise SystemExit(f"ring member failed: {err[-3000:]}")
                row = _json_line(out)
                row["veth_rx_bytes"] = hosts.rx_bytes(i) - rx0[i]
                row["repeat"] = rep
                rows.append(row)
    return rows


def _ring_socket_rows(hosts, nbytes: int, members: int) -> list[dict]:
    """The ring's ceiling in the same run: every namespace at once pulls what a member gathers,
    (N-1)/N of the image, from its predecessor over one plain TCP socket."""
    gathered = nbytes - nbytes // members
    servers = [hosts.popen(i, [sys.executable, "-c", _SOCKET_SERVER, str(gathered), "1", hosts.address(i),
                               str(PORT_SOCKET + 1 + i)], env=_env()) for i in range(members)]
    try:
        for p in servers:
            line = p.stdout.readline()
            if not line.startswith("ready"):
                raise SystemExit(f"ring socket server did not start: {line}{p.communicate(timeout=10)[1][-2000:]}")
        pred = [(i - 1) % members for i in range(members)]
        clients = [hosts.popen(i, [sys.executable, "-c", _SOCKET_CLIENT, str(gathered), hosts.address(pred[i]),
                                   str(PORT_SOCKET + 1 + pred[i])], env=_env()) for i in range(members)]
        rows = []
        for c in clients:
            out, err = c.communicate(timeout=240)
            if c.returncode:
                raise SystemExit(f"ring socket client failed: {err[-2000:]}")
            rows.append(_json_line(out))
        return rows
    finally:
        for p in servers:
            if p.poll() is None:
                p.terminate()
            p.communicate(timeout=20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", default="512MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ring", type=int, default=0, help="also a ring of N members over NIXL, one per namespace")
    ap.add_argument("--ring-chunk", default="0", help="the ring's sub-chunk (default: the plan's)")
    args = ap.parse_args(argv)
    res = run(parse_bytes(args.nbytes), args.repeats, args.ring, parse_bytes(args.ring_chunk) if args.ring_chunk != "0" else 0)
    print(f"{'run':<8} {'socket GB/s':>12} {'nixl GB/s':>10} {'nixl setup ms':>14} {'agent ms':>9} {'veth rx MB':>11}")
    for i, (s, n) in enumerate(zip(res["rows"]["socket"], res["rows"]["nixl"])):
        print(f"{i:<8} {s['gbps']:>12.2f} {n['gbps']:>10.2f} {n['setup_ms']:>14.1f} "
              f"{n['detail'].get('agent_create_ms', 0):>9.0f} {n['veth_rx_bytes'] / 1e6:>11.0f}")
    print(f"median: socket {res['median_gbps']['socket']:.2f} GB/s, nixl {res['median_gbps']['nixl']:.2f} GB/s, "
          f"ratio {res['ratio_nixl_to_socket']:.2f} ({res['nbytes'] / 2**20:.0f} MiB, load {res['loadavg'][0]:.1f})")
    if args.ring:
        for r in res["rows"]["ring"]:
            print(f"ring {r['repeat']}: member gathered {r['gbps']:.2f} GB/s in {r['seconds'] * 1e3:.0f} ms, "
                  f"setup {r['setup_ms']:.1f} ms, veth rx {r['veth_rx_bytes'] / 1e6:.0f} MB, verified {r['verified']}")
        print(f"ring of {args.ring}: median member {res['median_gbps']['ring']:.2f} GB/s, "
              f"{res['ratio_ring_member_to_socket']:.2f}x one socket alone; {args.ring} sockets at once (each "
              f"namespace pulling from its predecessor) {res['median_gbps']['ring_socket']:.2f} GB/s each: "
              f"{res['ratio_ring_to_ring_socket']:.2f}x")
    dump_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
