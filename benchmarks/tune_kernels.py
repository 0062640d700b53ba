"""``flashboot bench tune``: sweep the Triton copy and checksum knobs on this GPU.

Prints GB/s per configuration next to the copy engine (``cudaMemcpyAsync``) on the same bytes in
the same run, so the defaults in ``kernels/copy.py`` and ``kernels/checksum.py`` come from a
measurement. d2d always; p2p (kernel on the destination GPU, reading the peer arena) with two GPUs.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from flashboot.units import parse_bytes


@dataclass
class TuneRow:
    kernel: str
    path: str
    knobs: dict
    gbps: float
    copy_engine_gbps: float
    ratio: float
    verified: bool


def run(nbytes: int, checksum_nbytes: int, quick: bool = False) -> list[TuneRow]:
    import torch

    from flashboot.arena import Arena
    from flashboot.benchmarks.timing import time_cuda
    from flashboot.kernels.checksum import checksum
    from flashboot.kernels.copy import sm_copy, tma_copy, tma_available
    from flashboot.movers import create_mover

    from flashboot._cuda import cuda_available
    from flashboot.errors import CapabilityError

    if not cuda_available():  # it times kernels against the copy engine; the interpreter has no rate to tune
        raise CapabilityError("bench tune tunes the Triton copy and checksum kernels on a GPU, against the copy "
                              "engine; this machine has no CUDA device (bench movers and bench arena run here)")
    rows: list[TuneRow] = []
    ce = create_mover("copy_engine")
    n_gpus = torch.cuda.device_count()
    paths = ["d2d"] + (["p2p"] if n_gpus > 1 else [])
    src_arena = Arena.create(max(nbytes, checksum_nbytes), device=0, access="all" if n_gpus > 1 else None)
    src_all = src_arena.bytes()
    src_all.view(torch.int64).random_()
    torch.cuda.synchronize()

    # checksum: read-only; GB/s = bytes hashed / time
    data = src_all[:checksum_nbytes]
    ref = checksum(data)
    grid = itertools.product((4096, 8192), (4, 8), (1, 2, 4), (1,)) if not quick else [(4096, 8, 2, 1)]
    for bw, nw, pps, st in grid:
        knobs = dict(block_words=bw, num_warps=nw, programs_per_sm=pps, num_stages=st)
        try:
            ok = checksum(data, **knobs) == ref
            t = time_cuda(lambda s: checksum(data, stream=s, **knobs), repeats=3)
            rows.append(TuneRow("checksum", "read", knobs, t.gbps(checksum_nbytes), 0.0, 0.0, ok))
        except Exception as exc:  # a knob set Triton cannot compile: report, keep sweeping
            rows.append(TuneRow("checksum", "read", {**knobs, "error": str(exc)[:80]}, 0.0, 0.0, 0.0, False))

    for path in paths:
        dst_dev = 1 if path == "p2p" else 0
        dst_arena = Arena.create(nbytes, device=dst_dev, access="all" if n_gpus > 1 else None)
        src, dst = src_all[:nbytes], dst_arena.bytes()[:nbytes]
        expected = checksum(src)
        t_ce = time_cuda(lambda s: ce.copy(dst, src, nbytes, stream=s), device=dst_dev, repeats=5)
        ce_gbps = t_ce.gbps(nbytes)
        rows.append(TuneRow("copy_engine", path, {}, ce_gbps, ce_gbps, 1.0, checksum(dst) == expected))
        kernels = [("sm_copy", sm_copy)] + ([("tma_copy", tma_copy)] if tma_available()[0] else [])
        for name, fn in kernels:
            grid = itertools.product((16384, 65536), (4, 8), (1, 2, 4), (1, 3)) if not quick else [(32768, 4, 2, 3)]
            for bb, nw, pps, st in grid:
                knobs = dict(block_bytes=bb, num_warps=nw, programs_per_sm=pps, num_stages=st)
                try:
                    dst.fill_(0xAB)
                    t = time_cuda(lambda s: fn(dst, src, nbytes, stream=s, **knobs), device=dst_dev, repeats=5)
                    ok = checksum(dst) == expected
                    rows.append(TuneRow(name, path, knobs, t.gbps(nbytes), ce_gbps, t.gbps(nbytes) / ce_gbps, ok))
                except Exception as exc:
                    rows.append(TuneRow(name, path, {**knobs, "error": str(exc)[:80]}, 0.0, ce_gbps, 0.0, False))
        dst_arena.close()
    src_arena.close()
    return rows


def register_bench(sub) -> None:
    p = sub.add_parser("tune", help="sweep Triton copy/checksum knobs against the copy engine")
    p.add_argument("--size", default="1GB", help="copy bytes (default 1GB)")
    p.add_argument("--checksum-size", default="4GB")
    p.add_argument("--quick", action="store_true", help="one configuration each")
    p.add_argument("--top", type=int, default=6, help="rows shown per kernel and path")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import check_count, dump_json, print_table

    # before the sweep: 0 had shown an empty table, -1 each kernel's rows less its slowest, unsaid
    check_count(args.top, "--top")
    rows = run(parse_bytes(args.size), parse_bytes(args.checksum_size), args.quick)
    shown = []
    for key in sorted({(r.kernel, r.path) for r in rows}):
        best = sorted((r for r in rows if (r.kernel, r.path) == key), key=lambda r: -r.gbps)[: args.top]
        shown += [[r.kernel, r.path, " ".join(f"{k}={v}" for k, v in r.knobs.items()), r.gbps, r.ratio,
                   "yes" if r.verified else "NO"] for r in best]
    print_table("kernel tuning (best first)", ["kernel", "path", "knobs", "GB/s", "vs copy engine", "verified"], shown)
    # the top rows by GB/s leave out every configuration that failed (0 GB/s) and any that copied
    # wrong bytes below them: each is named here, and wrong bytes fail the run
    failed = [r for r in rows if "error" in r.knobs]
    wrong = [r for r in rows if not r.verified and "error" not in r.knobs]
    for r in failed:
        print(f"failed: {r.kernel} {r.path} {' '.join(f'{k}={v}' for k, v in r.knobs.items() if k != 'error')}: "
              f"{r.knobs['error']}")
    for r in wrong:
        print(f"WRONG BYTES: {r.kernel} {r.path} {' '.join(f'{k}={v}' for k, v in r.knobs.items())}")
    dump_json({"rows": rows}, args.json)
    return 1 if wrong else 0
