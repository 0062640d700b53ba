"""What a level-1 sleep's host backup costs to allocate and pin, by how its memory is made (the
twenty-fifth session measured 4,325 ms for 13.76 GB on the H200 machine: a private anonymous
mapping, ``cuMemHostRegister``ed whole, so the register faults in and zeroes 3.4 M small pages
on one thread).

``python benchmarks/probes/backup_pin.py GIB [DEVICE]``, in a process holding its CUDA context;
each way in turn, twice, the buffer unpinned and unmapped between:

* ``small``: ``mmap`` private anonymous, then register (what ``HostBackup`` did);
* ``huge``: :func:`flashboot.fileio.io_buffer` (huge pages asked for), then register;
* ``huge+touch``: the same, its pages first faulted in by 8 threads (numpy fills, the GIL
  released), then register.

One JSON line per sample: ms to allocate (and touch), to register, and the total.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
import threading
import time


def _touch(buf, threads: int = 8) -> None:
    import numpy as np

    a = np.frombuffer(buf, np.uint8)
    step = -(-len(a) // threads // (2 << 20)) * (2 << 20)
    parts = [a[i:i + step] for i in range(0, len(a), step)]
    workers = [threading.Thread(target=p.fill, args=(0,)) for p in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def sample(way: str, nbytes: int, device) -> dict:
    from flashboot.fileio import io_buffer
    from flashboot.pinning import register_host

    t0 = time.perf_counter()
    buf = (mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if way == "small"
           else io_buffer(nbytes))
    if way == "huge+touch":
        _touch(buf)
    t1 = time.perf_counter()
    cbuf = (ctypes.c_uint8 * nbytes).from_buffer(buf)
    pinned = register_host(ctypes.addressof(cbuf), nbytes, device)
    t2 = time.perf_counter()
    pinned.unregister()
    del cbuf
    buf.close()
    return {"way": way, "gib": nbytes / 2**30, "alloc_ms": round((t1 - t0) * 1e3, 1),
            "register_ms": round((t2 - t1) * 1e3, 1), "total_ms": round((t2 - t0) * 1e3, 1)}


def main() -> None:
    import torch

    from flashboot.memory import Device

    dev = sys.argv[2] if len(sys.argv) > 2 else "cuda:0"
    torch.zeros(1, device=dev)
    nbytes = int(float(sys.argv[1]) * 2**30)
    for _ in range(2):
        for way in ("small", "huge", "huge+touch"):
            print(json.dumps(sample(way, nbytes, Device.parse(dev))), flush=True)


if __name__ == "__main__":
    main()
