"""Probe: a same-GPU star clone's first transfer in fresh engine-like processes, with the source
segments mapped ahead copied at once (as shipped since `925459c`) or cut into groups of 1, 2, 4,
4, ... like the unmapped ones (the grouping before it), alternating, against a D2D copy of the
same bytes in each process.

Usage (repository root, GPU machine, a seed published at the store, as
``benchmarks/gpu_prelude.sh``'s ``clone_figures`` starts it):
``python3 benchmarks/probes/map_groups_ab.py --store H:P [--device cuda:0] [--rounds 3]``.
One JSON line per process, then one with the medians.
"""
import argparse
import json
import statistics
import subprocess
import sys


def _grouped_as_before(self, unit):
    """``Executor._mapping_groups`` before `925459c`: mapped segments count toward the widths."""
    from flashboot.flashclone.executor import MAP_GROUP_MAX_SEGMENTS

    arena = self.endpoints[unit[0].src].arena
    if arena.mapped_nbytes == arena.nbytes:
        return [list(unit)]
    seg = arena.segment_bytes
    groups, width, last_seg = [], 0, -1
    for u in unit:
        end_seg = (u.end - 1) // seg
        if groups and end_seg <= last_seg:
            groups[-1].append(u)
            continue
        width = min(max(1, 2 * width), MAP_GROUP_MAX_SEGMENTS)
        last_seg = max(end_seg, (u.offset // seg) + width - 1)
        groups.append([u])
    return groups


def child(store: str, device: str, variant: str) -> dict:
    import torch

    torch.zeros(1, device=device)
    import flashboot
    import flashboot.flashclone.cloning  # noqa: F401
    from flashboot.flashclone import executor

    if variant == "before":
        executor.Executor._mapping_groups = _grouped_as_before
    with flashboot.clone(store, device, "star", verify=True, timeout_s=60) as result:
        rep = result.report
        out = {"variant": variant, "transfer_ms": rep.transfer_ms, "gbps": rep.gbps, "ready_ms": rep.ready_ms,
               "mapped_ahead": rep.segments_mapped_ahead, "mapped_during_copy": rep.segments_mapped_during_copy,
               "map_during_copy_ms": rep.map_during_copy_ms, "verified": rep.verified}
    from flashboot.benchmarks.clone import copy_ceiling

    ceiling = copy_ceiling([device], rep.nbytes, repeats=3)
    out["d2d_gbps"] = ceiling["gbps"]
    out["x_d2d"] = rep.gbps / ceiling["gbps"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=("before", "shipped"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.store, a.device, a.child)))
        return
    rows = []
    for i in range(a.rounds):
        for variant in (("before", "shipped") if i % 2 == 0 else ("shipped", "before")):
            p = subprocess.run([sys.executable, __file__, "--store", a.store, "--device", a.device, "--child", variant],
                               capture_output=True, text=True, timeout=120)
            if p.returncode:
                print(json.dumps({"variant": variant, "error": p.stderr[-800:]}), flush=True)
                continue
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"medians": {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v)
                                      for k in ("x_d2d", "transfer_ms", "ready_ms", "mapped_ahead")}
                                  for v in ("before", "shipped") if any(r["variant"] == v for r in rows)}}))


if __name__ == "__main__":
    main()
