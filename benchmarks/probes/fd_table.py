"""Probe: what taking an arena's segment fds costs a fresh, threaded process (an engine or a clone)
when its fd table must grow during the take, and when it was grown ahead (``grow_fd_table``).

The clone's first exchange on the H200 spent 28-45 ms in ``pidfd_getfd`` of the seed's 52 fds,
against 0.75-1.0 ms in a probe's importer and ~3 ms in later clones of the same process. The
kernel doubles a process's fd table when an fd past its end is opened, and with threads it waits
for an RCU grace period each time. Run: ``python -m flashboot.benchmarks.probes.fd_table [FDS
[OPEN]]`` (FDS: the segment fds taken, default 52; OPEN: fds the process holds before, as CUDA's
device files do, default 40). Prints one JSON line: per mode (cold / grown ahead), the ms of the
growth and of the take, and the fd table's slots before and after.
"""

from __future__ import annotations

import json
import subprocess
import sys

_IMPORTER = r"""
import json, os, sys, threading, time
from flashboot.fdshare import grow_fd_table, take_fds
def size():
    return int(next(l for l in open('/proc/self/status') if l.startswith('FDSize:')).split()[1])
pid, theirs, open_before, grow = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(',')], int(sys.argv[3]), sys.argv[4] == '1'
stop = threading.Event()
for _ in range(4):  # an engine's threads (CUDA's, torch's): what makes the kernel wait at each growth
    threading.Thread(target=stop.wait, daemon=True).start()
held = [os.open('/dev/null', os.O_RDONLY) for _ in range(open_before)]
s0 = size()
t0 = time.perf_counter()
if grow:
    grow_fd_table()
t1 = time.perf_counter()
s1 = size()
mine = take_fds(pid, theirs)
t2 = time.perf_counter()
print(json.dumps({"grown_ahead": grow, "grow_ms": (t1 - t0) * 1e3, "take_ms": (t2 - t1) * 1e3, "fds": len(mine),
                  "table_before": s0, "table_after_grow": s1, "table_after_take": size()}))
stop.set()
"""


def main(argv: list[str]) -> dict:
    n = int(argv[0]) if argv else 52
    open_before = int(argv[1]) if len(argv) > 1 else 40
    exporter = subprocess.Popen([sys.executable, "-c",
                                 "import os, sys; fds = [os.memfd_create('seg%d' % i) for i in range(int(sys.argv[1]))]; "
                                 "print(','.join(map(str, fds)), flush=True); sys.stdin.read()", str(n)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        fds = exporter.stdout.readline().strip()
        runs = []
        for grow in ("0", "1", "0", "1", "0", "1"):
            p = subprocess.run([sys.executable, "-c", _IMPORTER, str(exporter.pid), fds, str(open_before), grow],
                               capture_output=True, text=True, timeout=60)  # close_fds: a fresh process's table
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            runs.append(json.loads(p.stdout))
    finally:
        exporter.stdin.close()
        exporter.wait(10)
    out = {"fds": n, "open_before": open_before, "runs": runs}
    for key, grown in (("cold_take_ms", False), ("grown_take_ms", True)):
        out[key] = sorted(round(r["take_ms"], 3) for r in runs if r["grown_ahead"] == grown)
    out["grow_ms"] = sorted(round(r["grow_ms"], 3) for r in runs if r["grown_ahead"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
