"""The clone's CUDA path without a GPU: a do-nothing CUDA driver (tests/stub_libcuda.c, compiled
here) answers cuda-bindings, so the copy-engine mover, its batches over side streams, the clone's
warm-up, the executor's stream pipeline (and its release-and-drain path) and the streamed load's
ring and copies run their real Python in a fresh interpreter. Nothing is copied: these check the calls' plumbing, the counts, the
errors, and that none of it imports CuPy. Byte-exact behaviour is checked on GPUs
(tests/test_cuda_streams.py, tests/test_clone_gpu.py, tests/test_stream.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_PRELUDE = """
import sys
from flashboot._cuda import cuda_available
assert cuda_available(), "the stub driver was not loaded"
from flashboot.memory import Span, cuda_device
dev = cuda_device(0)

class FakeArena:  # what the executor reads of an arena; the addresses are never touched
    def __init__(self, base, nbytes):
        self.ptr, self.nbytes, self.device = base, nbytes, dev
        self.mapped_nbytes, self.segment_bytes = nbytes, 1 << 28
    def span(self, off=0, n=None):
        return Span(self.ptr + off, self.nbytes - off if n is None else n, dev)
"""

_MOVER_AND_WARMUP = _PRELUDE + """
import gc
from flashboot.cuda_streams import Event, Stream, wait_event
from flashboot.flashclone.warmup import CloneWarmup
from flashboot.movers import create_mover

a, b = FakeArena(1 << 40, 64 << 20), FakeArena(2 << 40, 64 << 20)
class TorchLikeStream:
    cuda_stream, device_index = 12345, 0
for stream in (None, 7, TorchLikeStream(), Stream(0)):
    create_mover("copy_engine").copy(a.span(), b.span(), 4096, stream=stream)
try:  # cuMemcpyAsync: "the memory areas may not overlap"
    create_mover("copy_engine").copy(a.span(4096), a.span(), 8192, stream=None)
    print("overlap copied")
except Exception as exc:
    print("overlap refused:", exc)
mover = create_mover("copy_engine", batch_streams=4)
batch = mover.batch(a.span(), b.span(), [(o, o, 1 << 20) for o in range(0, 16 << 20, 2 << 20)])
batch.run(stream=Stream(0))
prepared = batch.prepared
print("batch", prepared.method, prepared.copies, len(prepared.side))
finalizers = [s._finalizer for s in prepared.side] + [e._finalizer for e in (prepared.fork, *prepared.joins)]
del batch, prepared
gc.collect()
print("alive after drop", sum(f.alive for f in finalizers), "of", len(finalizers))
warm = CloneWarmup.__new__(CloneWarmup)  # its plan and the copy's part, without its threads: torch's part
warm.device, warm.verify = dev, False    # would initialise CUDA in torch, which a stub driver cannot serve
steps = {name: (stage, step) for name, stage, step in warm._plan("copy_engine")}
stage, step = steps["copy stream"]
step()
print("warm parts", sorted(steps), "copy stream at", stage)
from flashboot.cuda_streams import POOL_KEEP, give_back, lend_event, lend_stream
lent = lend_stream(0)
give_back(lent)
print("stream reused", lend_stream(0) is lent, "new one", lend_stream(0) is not lent)
events = [lend_event(0, timing=True) for _ in range(POOL_KEEP + 3)]
give_back(*events)
print("events kept", sum(e._finalizer.alive for e in events), "untimed apart", lend_event(0) not in events)
print("cupy", "cupy" in sys.modules)
"""

_EXECUTOR = _PRELUDE + """
import threading
import time
import flashboot.flashclone.lanes as lanes
from flashboot.flashclone.executor import Endpoint, Executor, StepFailure
from flashboot.schedulers import build_plan

lanes.DRAIN_TIMEOUT_S = 1.0
threads_before = threading.active_count()
for schedule in ("chain", "star"):
    plan = build_plan(schedule, 3, 64 << 20, 4 << 20)
    eps = {0: Endpoint(0, "seed", FakeArena(1 << 40, 64 << 20))}
    for p in plan.receivers():
        eps[p.index] = Endpoint(p.index, p.name, FakeArena((p.index + 2) << 40, 64 << 20),
                                FakeArena((p.index + 10) << 40, 4096))
    try:
        rep = Executor(plan, eps, [1, 2, 3], timeout_s=0.3).run()
        print(schedule, "ran", rep.backend, rep.mover, sum(l.steps for l in rep.lanes), "of", len(plan))
        from flashboot import cuda_streams
        print(schedule, "idle streams", len(cuda_streams._idle.get(("stream", 0), [])))
    except StepFailure as e:
        print(schedule, "failed", e.step.id, e.released, "|", str(e))
time.sleep(0.2)  # a finished wait's thread has returned; a stuck one stays blocked in the driver
print("threads left", threading.active_count() - threads_before)
print("cupy", "cupy" in sys.modules)
"""


_STREAMED = _PRELUDE + """
import threading
from flashboot import cuda_streams
from flashboot.flashload.stream import StreamConfig, stream_image

path, nbytes = sys.argv[1], int(sys.argv[2])
arena = FakeArena(1 << 40, 1 << 30)
threads_before = threading.active_count()
stats = stream_image(path, nbytes, arena, StreamConfig(buffer_bytes=1 << 20, slot_bytes=64 << 10, threads=3))
print("streamed", stats.chunks, "chunks", stats.io_mode, "slots", stats.slots, "readers", stats.threads)
from flashboot.flashload.landing import bulk_copy, mover_for, warm_copy
from flashboot.memory import CPU
mover = mover_for(dev)
warm_copy(dev, mover)
staged = Span(4 << 40, 10 << 20, CPU, pinned=True)
print("pinned-here chunks", bulk_copy(mover, arena, staged, 10 << 20, 4 << 20, meanwhile=lambda: "views"))
print("idle streams", len(cuda_streams._idle.get(("stream", 0), [])))
from pathlib import Path
from flashboot.flashload.lifecycle import HostBackup
backup = HostBackup(6 << 20, dev)  # a level-1 sleep's backup: populated by threads, then pinned
smaps = Path("/proc/self/smaps").read_text().split("\\n")
head = next(i for i, line in enumerate(smaps) if line.startswith(f"{backup.ptr:x}-"))
rss = int(next(line for line in smaps[head:] if line.startswith("Rss:")).split()[1]) * 1024
print("backup resident", rss >= 6 << 20, "pinned", backup._pinned is not None)
backup.close()
import flashboot.pinning
from flashboot.errors import OutOfMemoryError
flashboot.pinning.device_free_bytes = lambda device: 4 << 20  # the host has less than the backup needs
maps_before = Path("/proc/self/maps").read_text().count("\\n")
try:
    HostBackup(6 << 20, dev)
except OutOfMemoryError as exc:
    print("backup refused:", exc, "| mappings added", Path("/proc/self/maps").read_text().count("\\n") - maps_before)
print("threads left", threading.active_count() - threads_before)
print("cupy", "cupy" in sys.modules)
"""


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub CUDA driver")
    out = tmp_path_factory.mktemp("stub-driver")
    src = Path(__file__).with_name("stub_libcuda.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out / "libcuda.so.1"), str(src), "-ldl"], check=True,
                   capture_output=True, timeout=120)
    return out


def _run(script: str, lib: Path, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("FLASHBOOT_FORCE_HOST", "STUB_NOT_READY")}
    e.update(LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}", **env)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=e)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_copy_engine_batches_and_warmup_run_through_the_driver_without_cupy(stub_driver):
    out = _run(_MOVER_AND_WARMUP, stub_driver)
    assert "batch cuMemcpyBatchAsync 8 4" in out  # 8 non-contiguous chunks, over 4 side streams
    assert "overlap refused: copy_engine: the destination 0x10000001000 and the source 0x10000000000 overlap " \
           "(8,192 bytes on cuda:0)" in out
    assert "alive after drop 0 of 9" in out  # 4 streams, the fork and 4 join events destroyed with the batch
    assert ("warm parts ['CUDA context + peer import', 'copy stream', 'executor lanes', 'fd table', 'torch CUDA'] "
            "copy stream at copy") in out
    # the pool lends back what was handed back, keeps at most POOL_KEEP of a kind, and keeps timed
    # events apart from untimed ones
    assert "stream reused True new one True" in out
    assert "events kept 16 untimed apart True" in out
    assert "cupy False" in out


def test_executor_runs_every_step_on_driver_streams_without_cupy(stub_driver):
    out = _run(_EXECUTOR, stub_driver)
    assert "chain ran cuda copy_engine 48 of 48" in out and "star ran cuda copy_engine 48 of 48" in out
    assert "threads left 0" in out  # each end-of-copy wait's thread is gone once the run returns
    # a run that ended cleanly hands its three lanes' streams and its side stream back; the next reuses them
    assert "chain idle streams 4" in out and "star idle streams 4" in out
    assert "cupy False" in out


def test_executor_releases_and_names_a_stream_that_never_completes(stub_driver):
    out = _run(_EXECUTOR, stub_driver, STUB_NOT_READY="1")
    # a chain's steps wait on flags: polled; a star's are plain copies: waited for in the driver,
    # on a thread, with the GIL released (else this process could not time out at all)
    for schedule, why in (("chain", "made no progress for 0.3 s"), ("star", "did not end within 0.3 s")):
        line = next(x for x in out.splitlines() if x.startswith(f"{schedule} failed"))
        assert f"step 0 (bytes 0..4,194,304 into clone0) {why}" in line
        assert "did not drain within 1 s" in line  # the release was tried, and the drain bounded
    assert "threads left 1" in out  # the star's stuck wait, blocked in the driver (as documented)
    assert "cupy False" in out


def test_a_streamed_load_copies_its_slots_through_the_driver_without_cupy(stub_driver, tmp_path):
    """The streamed load's CUDA copies (the ring pinned, a private stream, a timed pair of events
    per copy, each slot's last copy awaited before a reader refills it) go through the driver, and
    so do the pinned-here load's warm-up and chunked bulk copy: an engine's first streamed or
    pinned-here load pays no CuPy import."""
    image = tmp_path / "image.bin"
    nbytes = (1 << 20) + 12345  # 17 chunks of 64 KiB, the last one short
    image.write_bytes(os.urandom(nbytes))
    script = _STREAMED.replace("path, nbytes = sys.argv[1], int(sys.argv[2])", f"path, nbytes = {str(image)!r}, {nbytes}")
    out = _run(script, stub_driver)
    assert "streamed 17 chunks" in out and "slots 14 readers 3" in out
    assert "idle streams 1" in out  # the copy stream went back to the pool once its copies had run
    assert "pinned-here chunks (3, 'views')" in out
    assert "backup resident True pinned True" in out
    assert ("backup refused: a level-1 sleep's host backup (MemAvailable; level 2 keeps nothing on the host): "
            "needs 6,291,456 bytes but only 4,194,304 are free (short by 2,097,152) | mappings added 0") in out
    assert "threads left 0" in out
    assert "cupy False" in out
