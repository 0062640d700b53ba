"""Probe: does a kept-alive small peer mapping remove the ~1 ms first grant of a peer segment?
Opens an 8 GiB segmented arena of another process on cuda:1 cold, with a granule of our own
cuda:0 memory kept mapped, and with a small imported arena kept mapped.
Run from the repository root on 2 GPUs: ``python3 benchmarks/probes/warm_mapping.py``.
"""
import json, multiprocessing as mp, os, sys, time
sys.path.insert(0, os.getcwd())


def exporter(conn):
    from flashboot import Arena
    a = Arena.create(8 << 30, 0)
    b = Arena.create(64 << 20, 0)
    conn.send((a.export().to_dict(), b.export().to_dict()))
    conn.recv()


def main():
    from flashboot import Arena, ArenaDescriptor
    from flashboot import arena as am
    from flashboot import _cuda
    ctx = mp.get_context("spawn")
    x, y = ctx.Pipe()
    p = ctx.Process(target=exporter, args=(y,)); p.start()
    big, small = (ArenaDescriptor.from_dict(d) for d in x.recv())
    out = []

    def trial(tag):
        t = {}
        t0 = time.perf_counter()
        a = Arena.open(big, 1, timings=t)
        t["open_total_ms"] = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter(); a.map_range(); t["map_rest_ms"] = (time.perf_counter() - t1) * 1e3
        a.close()
        out.append({"tag": tag, **{k: round(v, 3) for k, v in t.items()}})
        print(json.dumps(out[-1]), flush=True)

    _cuda.use_device(1)
    for i in range(3):
        trial("cold")
    undo = am._Undo("warm")
    prop = am._allocation_prop(0, fabric=False)
    h = _cuda.check(_cuda.driver().cuMemCreate(2 << 20, prop, 0), "create")
    undo.push("rel", lambda: _cuda.check(_cuda.driver().cuMemRelease(h), "rel"))
    am._map_handle(undo, h, 2 << 20, 2 << 20, [1])
    for i in range(3):
        trial("own 2MB on cuda:0 kept mapped on cuda:1")
    undo.release()
    held = Arena.open(small, 1)
    for i in range(3):
        trial("imported 64MB kept mapped")
    held.close()
    trial("cold again")
    x.send("done"); p.join(30)


if __name__ == "__main__":
    main()
