"""What a level-1 sleep's host backup costs to allocate and pin, by how its memory is made (the
twenty-fifth session measured 4,325 ms for 13.76 GB on the H200 machine: a private anonymous
mapping, ``cuMemHostRegister``ed whole, so the register faults in and zeroes 3.4 M small pages
on one thread).

``python benchmarks/probes/backup_pin.py GIB [DEVICE [WAYS]]``, in a process holding its CUDA
context; each way in turn (WAYS: a comma list, default the first three), twice, the buffer
unpinned and unmapped between:

* ``small``: ``mmap`` private anonymous, then register (what ``HostBackup`` did);
* ``huge``: :func:`flashboot.fileio.io_buffer` (huge pages asked for), then register;
* ``huge+touch``: the same, its pages first faulted in by 8 threads (numpy fills, the GIL
  released), then register;
* ``file``: a staged image's way, a file of GIB in /dev/shm mapped shared
  (:class:`flashboot.pinning.MappedFile`), then register (the daemon's and ``stage``'s pin);
* ``file+populate``: the same, its page tables first filled by 8 threads
  (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 on, through ctypes: the GIL released), then register.

One JSON line per sample: ms to allocate (and touch), to register, and the total.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
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


MADV_POPULATE_WRITE = 23
SHM_FILE = "/dev/shm/flashboot-pin-probe.bin"


def _populate_write(ptr: int, nbytes: int, threads: int = 8) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    step = -(-nbytes // threads // (2 << 20)) * (2 << 20)
    errors = []

    def one(lo: int) -> None:
        if libc.madvise(ptr + lo, min(step, nbytes - lo), MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    workers = [threading.Thread(target=one, args=(lo,)) for lo in range(0, nbytes, step)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise OSError(errors[0], f"madvise(MADV_POPULATE_WRITE): errno {errors[0]}")


def sample(way: str, nbytes: int, device) -> dict:
    from flashboot.fileio import io_buffer
    from flashboot.pinning import MappedFile, register_host

    if way.startswith("file"):
        t0 = time.perf_counter()
        mapped = MappedFile(SHM_FILE, nbytes)
        if way == "file+populate":
            _populate_write(mapped.ptr, nbytes)
        t1 = time.perf_counter()
        pinned = register_host(mapped.ptr, nbytes, device, path=SHM_FILE)
        t2 = time.perf_counter()
        pinned.unregister()
        mapped.close()
        return {"way": way, "gib": nbytes / 2**30, "alloc_ms": round((t1 - t0) * 1e3, 1),
                "register_ms": round((t2 - t1) * 1e3, 1), "total_ms": round((t2 - t0) * 1e3, 1)}
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
    nbytes = int(float(sys.argv[1]) * 2**30) // 4096 * 4096
    ways = sys.argv[3].split(",") if len(sys.argv) > 3 else ["small", "huge", "huge+touch"]
    if any(w.startswith("file") for w in ways):
        with open(SHM_FILE, "wb") as f:  # written, so its pages exist as a staged image's do
            chunk = bytes(64 << 20)
            for lo in range(0, nbytes, len(chunk)):
                f.write(chunk[: min(len(chunk), nbytes - lo)])
    try:
        for _ in range(2):
            for way in ways:
                print(json.dumps(sample(way, nbytes, Device.parse(dev))), flush=True)
    finally:
        if os.path.exists(SHM_FILE):
            os.unlink(SHM_FILE)


if __name__ == "__main__":
    main()
