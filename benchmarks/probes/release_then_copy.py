"""Issue 17: what a bulk H2D started right after a release of 14 GB waits for, and whether the SM
copy kernel on a second stream fills that wait (one CUDA GPU, raw driver steps of stay_sweep).

The 2026-12-01 sweep found a copy-engine H2D started at once after a release ~25 ms late, one
started 50 ms later not late, and the SM kernel not slowed; but the SM kernel for the first
segments then the copy engine for the rest, *on one stream*, was as late as the copy engine
alone. Each row here runs with and without a release of range ``a`` just before (after a rest),
copying the whole pinned backup into range ``x`` (mapped long before), timed to the last sync:

* ``ce``: one copy-engine H2D;
* ``tiny_ce``: a 1 MiB copy-engine H2D waited for (its time: how long the copy engine is held),
  then the bulk;
* ``ce2``: the copy engine on two streams, halves;
* ``split_K``: the SM kernel on stream 1 for the first K GiB and the copy engine on stream 2 for
  the rest, at once (K = 1, 2, 4);
* ``sm``: the SM kernel alone.

Run: ``python3 benchmarks/probes/release_then_copy.py [repeats]``: one JSON line of medians (ms).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

GIB = 1 << 30


def main(repeats: int) -> dict:
    import torch

    from flashboot import _cuda
    from flashboot.benchmarks.stay_sweep import REST_S, _Copier, _Range
    from flashboot.flashload.lifecycle import HostBackup
    from flashboot.memory import Device, Span

    nbytes = 13_760_000_000 // (256 << 20) * (256 << 20)
    _cuda.use_device(0)
    backup = HostBackup(nbytes, Device("cuda", 0))
    copier = _Copier(0, backup, nbytes)
    a, x = _Range(0, nbytes, 256 << 20), _Range(0, nbytes, 256 << 20)
    x.back()
    second = torch.cuda.Stream(device=0)
    drv, check = copier.drv, copier.check
    dev = Device("cuda", 0)

    def ce(offset: int, n: int, stream: int) -> None:
        check(drv.cuMemcpyHtoDAsync(x.ptr + offset, copier.src.ptr + offset, n, stream), "cuMemcpyHtoDAsync")

    def sm(offset: int, n: int, stream: int) -> None:
        copier.sm(Span(x.ptr + offset, n, dev), Span(copier.src_dev_ptr + offset, n, dev), n, stream)

    def row(kind: str) -> dict:
        t0 = time.perf_counter()
        out = {}
        if kind == "ce":
            ce(0, nbytes, copier.stream)
        elif kind == "tiny_ce":
            ce(0, 1 << 20, copier.stream)
            copier.sync()
            out["tiny_ms"] = (time.perf_counter() - t0) * 1e3
            ce(1 << 20, nbytes - (1 << 20), copier.stream)
        elif kind == "ce2":
            half = nbytes // 2
            ce(0, half, copier.stream)
            ce(half, nbytes - half, second.cuda_stream)
        elif kind.startswith("split_"):
            k = int(kind.split("_")[1]) * GIB
            sm(0, k, copier.stream)
            ce(k, nbytes - k, second.cuda_stream)
        elif kind == "sm":
            sm(0, nbytes, copier.stream)
        copier.sync()
        second.synchronize()
        out["ms"] = (time.perf_counter() - t0) * 1e3
        return out

    kinds = ("ce", "tiny_ce", "ce2", "split_1", "split_2", "split_4", "sm")
    for kind in kinds:  # compile / first use, untimed
        row(kind)
    samples: dict = {f"{k}_{w}": [] for k in kinds for w in ("rested", "after_release")}
    for _ in range(repeats):
        for kind in kinds:
            for when in ("rested", "after_release"):
                time.sleep(REST_S)
                if when == "after_release":
                    a.back()
                    torch.cuda.synchronize()
                    time.sleep(REST_S)
                    t = time.perf_counter()
                    a.release("release_then_unmap")
                    samples[f"{kind}_{when}"].append({"release_ms": (time.perf_counter() - t) * 1e3, **row(kind)})
                else:
                    samples[f"{kind}_{when}"].append(row(kind))
    out = {"nbytes": nbytes, "repeats": repeats}
    for key, rows in samples.items():
        out[key] = {f: round(statistics.median(r[f] for r in rows), 2) for f in rows[0]}
        out[key]["all_ms"] = [round(r["ms"], 1) for r in rows]
    a.close()
    x.close()
    backup.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)))
