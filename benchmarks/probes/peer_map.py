"""Probe behind SEGMENT_BYTES: what granting a GPU access to a peer's memory costs, by allocation size.

An exporter (child process, cuda:0) creates 8 GiB in several physical layouts (one allocation;
1 GiB / 256 / 128 / 64 MiB segments; a graded mix) and exports POSIX fds; the importer (cuda:1)
imports, maps and grants access segment by segment and times each grant, alone, with a small or a
large peer mapping kept alive, and interleaved with the copies of the segments already mapped.
Run from the repository root on 2 GPUs: ``python3 benchmarks/probes/peer_map.py`` (JSON lines).
"""
import json
import multiprocessing as mp
import os
import sys
import time

GiB = 1 << 30
TOTAL = 8 * GiB
LAYOUTS = {"warm": [GiB // 4], "one": [TOTAL], "seg1g": [GiB] * 8, "seg256m": [GiB // 4] * 32, "seg128m": [GiB // 8] * 64,
           "seg64m": [GiB // 16] * 128, "graded": [GiB // 8] * 2 + [GiB // 4] * 3 + [GiB // 2] * 2 + [GiB] * 6 + [GiB // 4],
           "hold1g": [GiB], "hold256m": [GiB // 4]}


def drv_init(index):
    from cuda.bindings import driver as d
    from flashboot import _cuda
    _cuda.use_device(index)
    return d, _cuda.check


def prop_for(d, index):
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = index
    p.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


def access(d, chk, ptr, n, dev):
    a = d.CUmemAccessDesc()
    a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = dev
    a.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    chk(d.cuMemSetAccess(ptr, n, [a], 1), "setaccess")


def exporter(conn):
    d, chk = drv_init(0)
    p = prop_for(d, 0)
    out = {}
    keep = []
    for name, sizes in LAYOUTS.items():
        t0 = time.perf_counter()
        hs = [chk(d.cuMemCreate(s, p, 0), "create") for s in sizes]
        base = chk(d.cuMemAddressReserve(sum(sizes), 0, 0, 0), "reserve")
        off = 0
        for h, s in zip(hs, sizes):
            chk(d.cuMemMap(int(base) + off, s, 0, h, 0), "map")
            off += s
        access(d, chk, base, sum(sizes), 0)
        create_ms = (time.perf_counter() - t0) * 1e3
        # fill with a pattern so copies are checkable
        chk(d.cuMemsetD32(base, 0x01020304, sum(sizes) // 4), "memset")
        fds = [int(chk(d.cuMemExportToShareableHandle(h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export")) for h in hs]
        keep.append((hs, base))
        out[name] = {"fds": fds, "sizes": sizes, "create_map_ms": create_ms}
    chk(d.cuCtxSynchronize(), "sync")
    conn.send({"pid": os.getpid(), "layouts": out})
    conn.recv()  # wait until the importer is done


def main():
    from flashboot.fdshare import pidfd_getfd
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=exporter, args=(b,))
    proc.start()
    info = a.recv()
    d, chk = drv_init(1)
    kind = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    dst = chk(d.cuMemAlloc(TOTAL + GiB), "alloc dst")
    stream = chk(d.cuStreamCreate(1), "stream")
    ev0, ev1 = chk(d.cuEventCreate(0), "ev"), chk(d.cuEventCreate(0), "ev")
    res = []
    L = info["layouts"]

    def run(name, *, copy=False, tag=""):
        lay = L[name]
        chk(d.cuCtxSynchronize(), "sync")
        total = sum(lay["sizes"])
        t0 = time.perf_counter()
        base = chk(d.cuMemAddressReserve(total, 0, 0, 0), "reserve")
        hs, per, off, first = [], [], 0, None
        chk(d.cuEventRecord(ev0, stream), "rec")
        for fd, s in zip(lay["fds"], lay["sizes"]):
            own = pidfd_getfd(info["pid"], fd)
            h = chk(d.cuMemImportFromShareableHandle(own, kind), "import")
            os.close(own)
            hs.append(h)
            chk(d.cuMemMap(int(base) + off, s, 0, h, 0), "map")
            ts = time.perf_counter()
            access(d, chk, int(base) + off, s, 1)
            per.append(round((time.perf_counter() - ts) * 1e3, 3))
            if first is None:
                first = (time.perf_counter() - t0) * 1e3
            if copy:
                chk(d.cuMemcpyDtoDAsync(int(dst) + off, int(base) + off, s, stream), "copy")
            off += s
        mapped = (time.perf_counter() - t0) * 1e3
        chk(d.cuEventRecord(ev1, stream), "rec")
        chk(d.cuStreamSynchronize(stream), "sync")
        wall = (time.perf_counter() - t0) * 1e3
        dev_ms = chk(d.cuEventElapsedTime(ev0, ev1), "elapsed")
        tu = time.perf_counter()
        off = 0
        for s in lay["sizes"]:
            chk(d.cuMemUnmap(int(base) + off, s), "unmap")
            off += s
        chk(d.cuMemAddressFree(base, total), "free")
        for h in hs:
            chk(d.cuMemRelease(h), "release")
        r = {"exp": f"{name}{tag}{'/copy' if copy else ''}", "first_ms": round(first, 3), "all_mapped_ms": round(mapped, 3),
             "access_ms": per if len(per) <= 40 else per[:20] + ["..."] + per[-5:], "access_sum_ms": round(sum(per), 3),
             "unmap_ms": round((time.perf_counter() - tu) * 1e3, 3)}
        if copy:
            r.update(wall_ms=round(wall, 3), device_ms=round(dev_ms, 3), GBps_wall=round(total / wall / 1e6, 1))
        res.append(r)
        print(json.dumps(r), flush=True)

    def hold(name):
        lay = L[name]
        s = lay["sizes"][0]
        own = pidfd_getfd(info["pid"], lay["fds"][0])
        h = chk(d.cuMemImportFromShareableHandle(own, kind), "import")
        os.close(own)
        base = chk(d.cuMemAddressReserve(s, 0, 0, 0), "reserve")
        chk(d.cuMemMap(base, s, 0, h, 0), "map")
        ts = time.perf_counter()
        access(d, chk, base, s, 1)
        print(json.dumps({"exp": f"hold {name}", "access_ms": (time.perf_counter() - ts) * 1e3}), flush=True)
        return base, s, h

    run("warm")
    for name in ("seg256m", "seg256m", "seg128m", "seg64m", "graded", "one", "seg256m", "seg1g", "one"):
        run(name)
    held = hold("hold1g")
    for name in ("one", "seg1g", "seg256m", "one"):
        run(name, tag="+held1g")
    chk(d.cuMemUnmap(held[0], held[1]), "unmap")
    chk(d.cuMemAddressFree(held[0], held[1]), "free")
    chk(d.cuMemRelease(held[2]), "release")
    held = hold("hold256m")
    for name in ("one", "seg256m"):
        run(name, tag="+held256m")
    for name in ("seg256m", "seg128m", "graded", "one"):
        for rep in range(2):
            run(name, copy=True, tag="+held256m")
    a.send("done")
    proc.join(30)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe2.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
