"""Probe: why ``cuMemcpyBatchAsync`` refused checkpoint C's pack batch on the H200 (2026-12-01:
``cuMemcpyBatchAsync(1254 of 1254 copies) failed with CUDA_ERROR_INVALID_VALUE``; A's ran).

Builds the batch ``bench refit`` builds (the trainer's tensors, from torch's allocator, packed
into the publishing arena as one copy-engine batch), issues it, and where the driver refuses it,
issues each copy alone (a batch of one, on a stream of its own) to find the ones refused, and
prints what they have in common: size, alignment, whether the copy merged several tensors, and
whether its source or destination crosses one allocation's end (``cuMemGetAddressRange``). Also
issues a small batch on the legacy default stream. Run: ``python benchmarks/probes/batch_copy.py
[C|A]``; prints JSON lines.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _range(drv, ptr: int) -> tuple[int, int]:
    err, base, size = drv.cuMemGetAddressRange(drv.CUdeviceptr(ptr))
    return (int(base), int(size)) if int(err) == 0 else (-int(err), 0)


def main(shape: str) -> None:
    import numpy as np
    import torch

    import flashboot
    from flashboot.benchmarks.checkpoints import CHECKPOINTS
    from flashboot.benchmarks.refit import write_sparse_checkpoint
    from flashboot import _cuda
    from flashboot.memory import Device, Span
    from flashboot.movers import create_mover
    from flashboot.movers.copy_engine import engine_copies
    from flashboot.weight_update import Publisher
    from flashboot.weight_update.pack import PackTable

    spec, dev = CHECKPOINTS[shape], Device.parse("cuda:0")
    os.environ.setdefault("FLASHBOOT_TOKEN", "probe-batch-copy")
    drv = _cuda.driver()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        write_sparse_checkpoint(os.path.join(tmp, "ckpt"), spec)
        flashboot.prepack(os.path.join(tmp, "ckpt"), os.path.join(tmp, "img"), progress=False)
        gen = torch.Generator(device="cuda:0").manual_seed(0)
        tensors = {n: torch.randn(s, dtype=torch.bfloat16, device="cuda:0", generator=gen) for n, s in spec.tensors()}
        torch.cuda.synchronize()
        from flashboot.flashclone.rendezvous import Rendezvous, free_port
        store = f"127.0.0.1:{free_port()}"
        hosted = Rendezvous.connect(store, None, host=True, timeout_s=60)
        pub = Publisher(os.path.join(tmp, "img"), 0, store=store, device=dev)
        try:
            table = PackTable(pub.plan(tensors), tensors, pub.arena)
            rows = table.rows
            lo, hi = int(rows[:, 1].min()), int((rows[:, 1] + rows[:, 2]).max())
            dst = table.arena.span(0, table.plan.metadata.image_nbytes)
            src = Span(lo, hi - lo, dev, False, table)
            chunks = np.stack([rows[:, 0] - dst.ptr, rows[:, 1] - lo, rows[:, 2]], axis=1)
            mover = create_mover("copy_engine")
            batch = mover.batch(dst, src, chunks)
            stream = torch.cuda.Stream()
            out = {"shape": shape, "rows": len(rows), "copies": batch.prepared.copies, "method": batch.prepared.method}
            try:
                batch.run(stream=stream)
                stream.synchronize()
                out["batch"] = "ok"
            except Exception as e:  # noqa: BLE001 - the probe reports what the driver says
                out["batch"] = str(e)
            print(json.dumps(out), flush=True)
            (dsts, srcs, sizes), = engine_copies(batch, 1, True)
            merged = np.diff(np.searchsorted(np.asarray(rows[:, 0]) - dst.ptr, np.asarray(dsts) - dst.ptr).tolist()
                             + [len(rows)])
            attrs = drv.CUmemcpyAttributes()
            attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            loc = drv.CUmemLocation()
            loc.type, loc.id = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0
            attrs.srcLocHint = attrs.dstLocHint = loc
            refused = []
            for i, (d, s, n) in enumerate(zip(dsts, srcs, sizes)):
                err, = drv.cuMemcpyBatchAsync([drv.CUdeviceptr(d)], [drv.CUdeviceptr(s)], [n], 1, [attrs], [0], 1,
                                              drv.CUstream(stream.cuda_stream))
                if int(err) != 0:
                    sb, ss = _range(drv, s)
                    db, ds = _range(drv, d)
                    refused.append({"i": i, "bytes": n, "tensors": int(merged[i]), "src_mod16": s % 16,
                                    "dst_mod16": d % 16, "src_in_one_alloc": sb >= 0 and s + n <= sb + ss,
                                    "dst_in_one_alloc": db >= 0 and d + n <= db + ds, "src_alloc": [sb, ss],
                                    "src_off": s - sb, "dst_alloc_size": ds, "err": int(err)})
            stream.synchronize()
            cross = sum(1 for d, s, n in zip(dsts, srcs, sizes) if s + n > sum(_range(drv, s)))
            print(json.dumps({"refused_alone": len(refused), "sources_crossing_an_allocation": cross,
                              "first": refused[:6], "sizes_min": int(min(sizes)), "sizes_max": int(max(sizes))}),
                  flush=True)
            g = batch.prepared.groups[0]
            err, = drv.cuMemcpyBatchAsync(g[0][:2], g[1][:2], g[2][:2], 2, g[4], g[5], g[6], drv.CUstream(0))
            print(json.dumps({"legacy_stream_batch_of_2": int(err)}), flush=True)
            torch.cuda.synchronize()
        finally:
            pub.close()
            hosted.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "C")
