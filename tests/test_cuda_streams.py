"""flashboot.cuda_streams (private driver streams and events) and the copy-engine mover through
the driver: ordering across streams, timing, release when dropped, every kind of stream a caller
passes, and a copy from a thread that has no CUDA context yet. GPU tests are marked ``gpu``."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest

from flashboot.errors import CapabilityError, CudaError

MiB = 1 << 20


def test_a_finalizer_run_inside_the_primary_context_lock_does_not_deadlock(monkeypatch):
    """A stream's finalizer calls ``use_device``; the collector may run it while this thread is
    inside ``_primary_context`` retaining another device's context (any allocation there can
    trigger a collection). Simulated with a fake driver whose ``cuDeviceGet`` runs that nested call."""
    from flashboot import _cuda

    nested = []

    class FakeDriver:
        def cuDeviceGet(self, index):
            if index == 1 and not nested:
                nested.append(_cuda._primary_context(0))  # what a device-0 stream's finalizer reaches
            return 0, f"dev{index}"

        def cuDevicePrimaryCtxRetain(self, dev):
            return 0, f"ctx-{dev}"

    monkeypatch.setattr(_cuda, "driver", lambda: FakeDriver())
    monkeypatch.setattr(_cuda, "check", lambda result, call: result[1])
    monkeypatch.setattr(_cuda, "_primary_contexts", {0: "ctx-dev0"})  # device 0's context is retained already
    got = []
    t = threading.Thread(target=lambda: got.append(_cuda._primary_context(1)), daemon=True)
    t.start()
    t.join(5)
    assert got == ["ctx-dev1"], "the nested call deadlocked on the primary-context lock"
    assert nested == ["ctx-dev0"]


def test_a_stream_without_a_cuda_driver_is_refused_by_name():
    from flashboot import _cuda
    from flashboot.cuda_streams import Event, Stream

    try:
        _cuda.driver()
    except CapabilityError:
        pass
    else:
        pytest.skip("this machine has a CUDA driver: the refusal is for machines without one")
    with pytest.raises(CapabilityError, match="CUDA"):
        Stream(0)
    with pytest.raises(CapabilityError, match="CUDA"):
        Event(0, timing=True)


@pytest.mark.gpu
def test_an_event_orders_a_second_stream_after_the_first_and_times_it():
    import torch

    from flashboot.cuda_streams import Event, Stream, wait_event
    from flashboot.movers import create_mover

    mover = create_mover("copy_engine")
    n = 256 * MiB
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros_like(a)
    c = torch.zeros_like(a)
    torch.cuda.synchronize(0)  # filled on torch's stream: our non-blocking streams do not wait for it
    first, second = Stream(0), Stream(0)
    start, mid = Event(0, timing=True), Event(0, timing=True)
    start.record(first)
    mover.copy(b, a, stream=first)
    mid.record(first)
    wait_event(second, mid)  # without it, the second copy would read b before it is filled
    mover.copy(c, b, stream=second)
    second.synchronize()
    assert mid.done and torch.equal(c, a)
    assert start.elapsed_ms(mid) > 0.0  # the timestamps are kept: 256 MiB lies between them
    untimed = Event(0)
    untimed.record(second)
    second.synchronize()
    with pytest.raises(CudaError, match="cuEventElapsedTime"):  # an event made without timing has none
        start.elapsed_ms(untimed)
    for obj in (first, second, start, mid, untimed):
        obj.close()
        obj.close()  # a second close does nothing


@pytest.mark.gpu
def test_a_dropped_batch_destroys_its_side_streams_and_events():
    import torch

    from flashboot.movers import create_mover

    mover = create_mover("copy_engine", batch_streams=4)
    src = torch.arange(16 * MiB, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    batch = mover.batch(dst, src, [(o, o, MiB) for o in range(0, 16 * MiB, MiB)])
    prepared = batch.prepared
    finalizers = [s._finalizer for s in prepared.side] + [e._finalizer for e in (prepared.fork, *prepared.joins)]
    assert len(prepared.side) == 4 and all(f.alive for f in finalizers)
    batch.run(stream=None)
    torch.cuda.synchronize(0)
    assert torch.equal(dst, src)
    del batch, prepared
    gc.collect()
    assert not any(f.alive for f in finalizers)


@pytest.mark.gpu
def test_copy_engine_takes_every_kind_of_stream():
    import cupy
    import torch

    from flashboot.cuda_streams import Stream
    from flashboot.movers import create_mover

    mover = create_mover("copy_engine")
    src = torch.randint(0, 255, (4 * MiB + 3,), dtype=torch.uint8, device="cuda:0")
    torch_stream = torch.cuda.Stream(device=0)
    with cupy.cuda.Device(0):
        cupy_stream = cupy.cuda.Stream(non_blocking=True)
    ours = Stream(0)
    for stream in (None, torch_stream, cupy_stream, ours, ours.ptr, torch_stream.cuda_stream):
        dst = torch.zeros_like(src)
        torch.cuda.synchronize(0)  # src and dst filled on torch's stream before a non-blocking one copies
        mover.copy(dst, src, stream=stream)
        torch.cuda.synchronize(0)
        assert torch.equal(dst, src), type(stream).__name__


@pytest.mark.gpu
def test_copy_from_a_thread_without_a_context_uses_the_owners():
    import torch

    from flashboot._cuda import check, driver
    from flashboot.movers import create_mover

    mover = create_mover("copy_engine")
    src = torch.randint(0, 255, (MiB,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    seen: list = []

    def fresh_thread():
        try:
            seen.append(int(check(driver().cuCtxGetCurrent(), "cuCtxGetCurrent")))  # none yet
            mover.copy(dst, src, stream=None)
            seen.append(int(check(driver().cuCtxGetCurrent(), "cuCtxGetCurrent")))  # the owner's, kept
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            seen.append(exc)

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join(30)
    torch.cuda.synchronize(0)
    assert seen[0] == 0 and isinstance(seen[1], int) and seen[1] != 0, seen
    assert torch.equal(dst, src)


_CLONE_ON_GPU = """
import sys
import torch
torch.zeros(1, device="cuda:0")  # an engine: torch and its CUDA context already there
import flashboot
from flashboot.arena import Arena
warm = flashboot.prepare_clone(0, verify=True)
arena = Arena.create(64 << 20, 0)
arena.bytes().copy_(torch.randint(0, 255, (arena.nbytes,), dtype=torch.uint8, device="cuda:0"))
torch.cuda.synchronize(0)  # the seed's weights are final before clones read them on their own streams
seed = flashboot.seed(sys.argv[1], arena, 0)
with flashboot.clone(sys.argv[1], 0, "star", verify=True, timeout_s=60, prepared=warm) as r:
    assert r.report.verified and torch.equal(r.arena.bytes(), arena.bytes())
    print("detail", sorted(r.report.warm_detail), "note", r.report.warm_note)
print("cupy", "cupy" in sys.modules)
seed.close()
"""


@pytest.mark.gpu
def test_a_verified_clone_on_a_gpu_imports_no_cupy():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FLASHBOOT_TOKEN": "cuda-streams-test-token-0123456789"}
    p = subprocess.run([sys.executable, "-c", _CLONE_ON_GPU, f"127.0.0.1:{port}"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "cupy False" in p.stdout, p.stdout
    assert "'copy stream'" in p.stdout and "copy stream:" not in p.stdout, p.stdout  # the part ran, and did not fail


def test_wait_events_wakes_when_the_work_ends_raises_its_error_and_bounds_a_stuck_wait():
    """wait_events (the clone's wait for plain copies): True once every event has passed, the
    driver's error raised in the caller, False after the timeout on an event that never passes,
    and a later wait not held up by the stuck one."""
    from flashboot.cuda_streams import wait_events
    from flashboot.errors import CudaError

    passed, release = [], threading.Event()

    class Ev:
        def __init__(self, name, block=None, error=None):
            self.name, self.block, self.error = name, block, error

        def synchronize(self):
            if self.block is not None:
                self.block.wait()
            if self.error is not None:
                raise self.error
            passed.append(self.name)

    assert wait_events([Ev("a"), Ev("b")], 5.0) is True and passed == ["a", "b"]
    with pytest.raises(CudaError, match="device fault"):
        wait_events([Ev("c", error=CudaError("cuEventSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "device fault"))], 5.0)
    assert wait_events([Ev("stuck", block=release)], 0.2) is False
    assert wait_events([Ev("d")], 5.0) is True and passed[-1] == "d"  # its own thread: not behind the stuck one
    release.set()


@pytest.mark.gpu
def test_wait_events_returns_once_a_real_copy_has_ended():
    import torch

    from flashboot.cuda_streams import Event, Stream, wait_events
    from flashboot.movers import create_mover

    a = torch.randint(0, 255, (512 * MiB,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros_like(a)
    torch.cuda.synchronize(0)
    s, ev = Stream(0), Event(0)
    create_mover("copy_engine").copy(b, a, stream=s)
    ev.record(s)
    assert wait_events([ev], 30.0) is True
    assert ev.done and torch.equal(a, b)
