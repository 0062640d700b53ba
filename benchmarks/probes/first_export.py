"""Probe: where a fresh process's first served load spends its 25 ms of 'alloc' and the daemon its
12-24 ms of first 'map' (H200, 2026-12-01 17:34: A first alloc 30.3 ms vs 5.7 second; daemon map
12.3 vs 0.9). Times Arena.create, per-segment export, and another process's open of the export."""
import json, os, subprocess, sys, time

NBYTES = int(float(sys.argv[2])) if len(sys.argv) > 2 and sys.argv[1] != "importer" else 13_755_351_040


def ctx():
    import torch
    torch.cuda.set_device(0); torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
    from flashboot.flashload.warm import import_loader
    import_loader("cuda:0")


def owner(tag):
    ctx()
    from flashboot.arena import Arena
    from flashboot import _cuda
    drv = _cuda.driver()
    out = {"tag": tag}
    for k in range(2):
        t0 = time.perf_counter(); a = Arena.create(NBYTES, "cuda:0"); t1 = time.perf_counter()
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        per = []
        for h in a._segments.handles:
            s = time.perf_counter(); err, fd = drv.cuMemExportToShareableHandle(h, kind, 0); per.append((time.perf_counter() - s) * 1e3); os.close(fd)
        t2 = time.perf_counter(); desc = a.export(); t3 = time.perf_counter()
        r = {"create_ms": (t1 - t0) * 1e3, "export_each_ms_first5": [round(x, 3) for x in per[:5]],
             "export_each_ms_sum": sum(per), "export_ms_after": (t3 - t2) * 1e3, "segments": len(per)}
        if k == 0:  # another fresh process opens it, maps all
            path = f"/dev/shm/probe-desc-{os.getpid()}.json"
            json.dump(desc.to_dict(), open(path, "w"))
            p = subprocess.run([sys.executable, __file__, "importer", path], capture_output=True, text=True, timeout=120)
            r["importer"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else p.stderr[-800:]
            p = subprocess.run([sys.executable, __file__, "importer", path], capture_output=True, text=True, timeout=120)
            r["importer2"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else p.stderr[-800:]
        out[f"call{k + 1}"] = r
        a.close()
    print(json.dumps(out))


def importer(path):
    ctx()
    from flashboot.arena import Arena, ArenaDescriptor
    desc = ArenaDescriptor.from_dict(json.load(open(path)))
    tm = {}
    t0 = time.perf_counter(); a = Arena.open(desc, device=0, timings=tm); t1 = time.perf_counter()
    a.map_range(0, desc.nbytes); t2 = time.perf_counter()
    print(json.dumps({"open_ms": (t1 - t0) * 1e3, "open_parts": {k: round(v, 3) for k, v in tm.items()},
                      "map_rest_ms": (t2 - t1) * 1e3, "stats": a.map_stats}))
    a.close()


if __name__ == "__main__":
    if sys.argv[1] == "importer":
        importer(sys.argv[2])
    else:
        owner(sys.argv[1])
