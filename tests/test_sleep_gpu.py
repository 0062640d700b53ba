"""Sleep and wake on a real GPU: the arena gives its memory back and keeps its addresses, a wake
that fails halfway rolls back, and a CUDA graph captured over the weights replays bitwise equal
after a sleep/wake cycle (level 1 from the backup, level 2 from the disk).

Every test here needs a CUDA device (``gpu``)."""

from __future__ import annotations

import ctypes
import json

import pytest

import flashboot
import flashboot.arena.backing_cuda as cuda_backing
from flashboot import Arena, OutOfMemoryError
from flashboot._cuda import check, driver, use_device
from flashboot.errors import ArenaError, CudaError

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30
SEGMENT = 256 * MiB
"""The tolerance the issue names for "free memory back": one segment."""
GRANULE = 2 * MiB  # the VMM allocation granularity of an H200


def gpu_free(index: int = 0) -> int:
    use_device(index)
    free, _total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def test_sleep_gives_the_memory_back_and_wake_keeps_the_addresses():
    import torch

    before = gpu_free()
    with Arena.create(2 * GiB, 0) as a:
        w = a.view(4096, (1024, 1024), torch.bfloat16)
        tail = a.view(a.nbytes - 4096, 1024, torch.int32)
        ptrs = (a.ptr, w.data_ptr(), tail.data_ptr())
        a.export()  # a plain export is revoked by the sleep: its fds must not keep the memory
        assert before - gpu_free() >= 2 * GiB - SEGMENT
        a.sleep()
        torch.cuda.synchronize(0)
        assert abs(gpu_free() - before) <= SEGMENT
        a.wake()
        assert (a.ptr, w.data_ptr(), tail.data_ptr()) == ptrs
        w.fill_(1.5)
        tail.fill_(-7)
        assert float(w.float().sum()) == 1.5 * 1024 * 1024 and int(tail.sum()) == -7 * 1024
        assert a.export().arena_id == a.arena_id
    torch.cuda.synchronize(0)
    assert abs(gpu_free() - before) <= SEGMENT


def test_wake_failing_halfway_rolls_back_and_stays_asleep(monkeypatch):
    import torch

    before = gpu_free()
    with Arena.create(1 * GiB, 0, segment_bytes=SEGMENT) as a:
        view = a.view(0, 16, torch.int64)
        a.sleep()
        asleep = gpu_free()
        real, calls = cuda_backing._Mappings.map, []

        def broken(self, ptr, handle, nbytes):
            calls.append(ptr)
            if len(calls) < 3:
                return real(self, ptr, handle, nbytes)
            raise CudaError("cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY", "injected")

        monkeypatch.setattr(cuda_backing._Mappings, "map", broken)
        with pytest.raises(OutOfMemoryError, match=f"waking arena {a.arena_id}.*injected.*needs 1,073,741,824 bytes"):
            a.wake()
        assert a.asleep and abs(gpu_free() - asleep) <= SEGMENT // 4  # the two segments made are released
        monkeypatch.undo()
        a.wake()
        view.fill_(3)
        assert int(view.sum()) == 48
    assert abs(gpu_free() - before) <= SEGMENT


def test_pipelined_wake_copies_each_segment_once_mapped_and_a_failed_copy_rolls_back():
    """wake(fill): the copy into each 256 MiB segment is issued on a stream as soon as it is mapped
    and granted; the bytes arrive exact. A fill failing at the third segment settles the copies
    already issued, then releases the new segments: asleep, memory back."""
    import cupy
    import torch

    from flashboot.flashload.lifecycle import HostBackup, _stream
    from flashboot.memory import Device
    from flashboot.movers import create_mover

    nbytes = 4 * SEGMENT
    backup = HostBackup(nbytes, Device.parse("cuda:0"))
    try:
        host = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(backup.ptr), dtype=torch.uint8)
        host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
        with Arena.create(nbytes, 0, segment_bytes=SEGMENT) as a:
            a.sleep()
            asleep = gpu_free()
            mover, stream, src = create_mover("copy_engine"), _stream(a.device), backup.span(nbytes)
            issued = []

            def fill(offset, span):
                issued.append(offset)
                mover.copy(span, src.sub(offset, span.nbytes), stream=stream)

            parts = {}
            a.wake(fill, settle=stream.synchronize, timings=parts)
            stream.synchronize()
            assert issued == [0, SEGMENT, 2 * SEGMENT, 3 * SEGMENT] and parts["access_ms"] > 0
            assert torch.equal(a.bytes().cpu(), host)
            a.sleep()

            def failing(offset, span):
                if offset == 2 * SEGMENT:
                    raise CudaError("cuMemcpyAsync", 1, "CUDA_ERROR_INVALID_VALUE", "injected")
                fill(offset, span)

            with pytest.raises(CudaError, match="injected"):
                a.wake(failing, settle=stream.synchronize)
            assert a.asleep and abs(gpu_free() - asleep) <= SEGMENT // 4
            with cupy.cuda.Device(0):
                cupy.cuda.runtime.deviceSynchronize()  # no copy faulted on released memory
    finally:
        backup.close()


def _mlp_image(tmp_path):
    """A 3-layer bf16 MLP (hidden 1024, 4 MiB of weights) pre-packed from safetensors."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    weights = {f"layers.{i}.weight": (torch.randn(1024, 1024, generator=g) / 32).bfloat16() for i in range(3)}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(weights, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "tiny_mlp", "_name_or_path": "org/mlp"}))
    flashboot.prepack(ckpt, tmp_path / "image", progress=False)
    return tmp_path / "image"


@pytest.mark.parametrize("level", [1, 2])
def test_cuda_graph_replays_bitwise_after_sleep_and_wake(tmp_path, level):
    import torch

    image = _mlp_image(tmp_path)
    with flashboot.load(image, 0, "cuda:0", stream=True) as loaded:
        w = [loaded.tensors[f"layers.{i}.weight"] for i in range(3)]
        x = torch.randn(64, 1024, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(1)).bfloat16()

        def forward():
            h = x
            for weight in w:
                h = torch.relu(h @ weight.t())
            return h

        stream = torch.cuda.Stream(0)
        stream.wait_stream(torch.cuda.current_stream(0))
        with torch.cuda.stream(stream):
            forward()  # warm-up outside the capture (cuBLAS workspace)
        torch.cuda.current_stream(0).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        graph.replay()
        torch.cuda.synchronize(0)
        want = out.clone()
        assert float(want.float().abs().sum()) > 0

        torch.cuda.synchronize(0)
        free_awake = gpu_free()
        report = loaded.sleep(level=level)
        assert report.level == level and loaded.arena.asleep
        torch.cuda.synchronize(0)
        # the weights' memory is back (measured around the sleep alone: other tests of this process
        # may release cached memory while this one runs; bench swap checks the whole load's)
        # (one 2 MiB granule of slack: level 1's first D2H makes torch take a small device block)
        assert loaded.arena.nbytes - GRANULE <= gpu_free() - free_awake <= loaded.arena.nbytes + SEGMENT
        woke = loaded.wake(shm_dir=tmp_path / "no-daemon")
        assert woke.source == ("backup" if level == 1 else "disk")
        assert [t.data_ptr() for t in w] == [loaded.tensors[f"layers.{i}.weight"].data_ptr() for i in range(3)]
        graph.replay()
        torch.cuda.synchronize(0)
        assert torch.equal(out, want)  # bitwise: same pointers, same bytes
        del graph, out


def test_drained_sleep_frees_each_segment_behind_its_copy():
    """sleep(drain): the D2H of every 256 MiB segment is issued on one stream, each segment is
    released once its event has passed, and the backup holds every byte; the memory is back."""
    import cupy
    import torch

    from flashboot.flashload.lifecycle import HostBackup, _drain_into
    from flashboot.memory import Device

    nbytes = 4 * SEGMENT
    backup = HostBackup(nbytes, Device.parse("cuda:0"))
    try:
        with Arena.create(nbytes, 0, segment_bytes=SEGMENT) as a:
            flat = a.bytes()
            flat.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0",
                                     generator=torch.Generator("cuda:0").manual_seed(5)))
            want = flat.cpu()
            torch.cuda.synchronize(0)
            awake = gpu_free()
            drain, settle = _drain_into(backup, nbytes, a.device)
            parts = {}
            a.sleep(drain=drain, timings=parts)
            settle()
            assert a.asleep and parts["drain_ms"] > 0
            assert nbytes - GRANULE <= gpu_free() - awake <= nbytes + SEGMENT
            host = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(backup.ptr), dtype=torch.uint8)
            assert torch.equal(host, want)
            with cupy.cuda.Device(0):
                cupy.cuda.runtime.deviceSynchronize()  # no copy faulted on a released segment
    finally:
        backup.close()


def test_wake_with_a_donor_takes_its_segments_without_freeing_or_allocating():
    """B (asleep) takes A's segments: A is asleep, B reads A's bytes (the memory moved, no copy),
    the device's free memory did not change, B exports its new segments; a B with fewer full
    segments creates its short last one and releases the donor's two it has no place for."""
    import torch

    with Arena.create(4 * SEGMENT, 0, segment_bytes=SEGMENT) as a, \
            Arena.create(4 * SEGMENT, 0, segment_bytes=SEGMENT) as b, \
            Arena.create(2 * SEGMENT + SEGMENT // 2, 0, segment_bytes=SEGMENT) as small:
        a.bytes().copy_(torch.arange(4 * SEGMENT // 8, dtype=torch.int64, device="cuda:0").view(torch.uint8))
        want = a.bytes().cpu()
        views = (a.view(0, 8, torch.int64), b.view(SEGMENT, 8, torch.int64))
        b.sleep()
        small.sleep()
        torch.cuda.synchronize(0)
        before = gpu_free()
        parts = {}
        b.wake(donor=a, timings=parts)
        assert a.asleep and not b.asleep and parts["reused"] == 4 and parts["donor_ms"] > 0
        assert abs(gpu_free() - before) <= SEGMENT // 4  # nothing freed, nothing allocated
        assert torch.equal(b.bytes().cpu(), want) and views[1].tolist() == list(range(SEGMENT // 8, SEGMENT // 8 + 8))
        assert b.export().arena_id == b.arena_id
        with pytest.raises(ArenaError, match="asleep"):
            small.wake(donor=a)
        small.wake(donor=b, timings=parts)
        assert b.asleep and parts["reused"] == 2  # the two full segments; the short last one is new
        assert gpu_free() - before >= 4 * SEGMENT - (2 * SEGMENT + SEGMENT // 2) - SEGMENT // 4  # the other two freed
        assert torch.equal(small.bytes()[:2 * SEGMENT].cpu(), want[:2 * SEGMENT])
        a.wake()
        views[0].fill_(1)
        assert int(views[0].sum()) == 8


def test_swap_by_handover_keeps_bytes_graph_pointers_and_memory(tmp_path):
    """swapping.swap's default on CUDA: the incoming image takes the outgoing one's segments and
    gets its bytes from the backup; the device's free memory is unchanged, and a swap back wakes
    the first image from the disk byte for byte."""
    import shutil

    import torch

    from flashboot.flashload import swapping
    from flashboot.flashload.landing import verify_loaded

    image = _mlp_image(tmp_path)
    second = shutil.copytree(image, tmp_path / "second")
    with flashboot.load(image, 0, "cuda:0", stream=True) as a, flashboot.load(second, 0, "cuda:0", stream=True) as b:
        want = {n: t.clone() for n, t in b.tensors.items()}
        b.sleep(level=1)
        torch.cuda.synchronize(0)
        before = gpu_free()
        r = swapping.swap(a, b)
        assert r.released == "handover" and r.why == "" and r.wake.source == "backup"
        assert r.wake.details["wake"]["reused"] == b.arena.segments and r.sleep.release_ms > 0
        assert a.arena.asleep and not b.arena.asleep
        assert all(torch.equal(b.tensors[n], t) for n, t in want.items())
        torch.cuda.synchronize(0)
        assert abs(gpu_free() - before) <= SEGMENT // 4
        back = swapping.swap(b, a, shm_dir=tmp_path / "no-daemon")
        assert back.released == "handover" and back.wake.source == "disk" and b.arena.asleep
        verify_loaded(a.arena, a.metadata, "after the swap back")
