"""Probe: create+map+close cycles of a 16 GiB arena as one allocation vs 256/128/512 MiB segments,
split into cuMemCreate, reserve+map, set access, export, unmap and release; back to back and
after an idle pause. Run from the repository root: ``python3 benchmarks/probes/create_cycles.py``.
"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from flashboot import _cuda
from flashboot import arena as am

torch.empty(1, device="cuda:0")
drv = _cuda.driver()
_cuda.use_device(0)
prop = am._allocation_prop(0, fabric=False)
G = 1 << 30


def cycle(total, seg, tag, export=False):
    n = total // seg
    t0 = time.perf_counter()
    hs = [_cuda.check(drv.cuMemCreate(seg, prop, 0), "create") for _ in range(n)]
    t1 = time.perf_counter()
    base = int(_cuda.check(drv.cuMemAddressReserve(total, 2 << 20, 0, 0), "reserve"))
    for i, h in enumerate(hs):
        _cuda.check(drv.cuMemMap(base + i * seg, seg, 0, h, 0), "map")
    t2 = time.perf_counter()
    am._set_access(base, total, [0])
    t3 = time.perf_counter()
    fds = []
    if export:
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fds = [int(_cuda.check(drv.cuMemExportToShareableHandle(h, kind, 0), "export")) for h in hs]
    t4 = time.perf_counter()
    for i in range(n):
        _cuda.check(drv.cuMemUnmap(base + i * seg, seg), "unmap")
    t5 = time.perf_counter()
    _cuda.check(drv.cuMemAddressFree(base, total), "free")
    for h in hs:
        _cuda.check(drv.cuMemRelease(h), "release")
    for fd in fds:
        os.close(fd)
    t6 = time.perf_counter()
    r = {"tag": tag, "create_ms": (t1 - t0) * 1e3, "reserve_map_ms": (t2 - t1) * 1e3, "access_ms": (t3 - t2) * 1e3,
         "export_ms": (t4 - t3) * 1e3, "unmap_ms": (t5 - t4) * 1e3, "release_ms": (t6 - t5) * 1e3}
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)


for tag, seg in (("one16g", 16 * G), ("seg256m", G // 4), ("seg256m", G // 4), ("one16g", 16 * G), ("seg128m", G // 8), ("seg512m", G // 2)):
    for _ in range(3):
        cycle(16 * G, seg, tag)
for _ in range(2):
    cycle(16 * G, G // 4, "seg256m+export", export=True)
# sleep between cycles: deferred work?
for _ in range(2):
    time.sleep(0.5)
    cycle(16 * G, G // 4, "seg256m after 0.5 s idle")
