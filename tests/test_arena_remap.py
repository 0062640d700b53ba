"""replace_backing on the host backend: a staging arena's segments move under a live arena's
addresses (views keep their addresses and read the new bytes), and a failure half-way maps the
old segments back. GPU version: tests/test_weight_update_gpu.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from flashboot.arena import Arena
from flashboot.arena import backing_host
from flashboot.arena.remap import replace_backing, staging_for
from flashboot.errors import ArenaError

SEG = 2 << 20


def _filled(nbytes: int, value: int, like: Arena | None = None) -> Arena:
    a = Arena.create(nbytes, "cpu", segment_bytes=SEG) if like is None else staging_for(like)
    a.bytes().numpy()[:] = value
    return a


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_staging_segments_replace_the_live_ones_under_the_same_views():
    live = _filled(3 * SEG, 1)
    staging = _filled(3 * SEG, 2, like=live)
    view = live.view(SEG - 8, (16,), "int8")  # spans two segments
    ptr = view.data_ptr()
    fds = _fds()
    timings: dict = {}
    ms = replace_backing(live, staging, timings)
    staging.close()
    assert ms >= 0 and view.data_ptr() == ptr
    # the swap's steps are reported; the references taken before it and freeing the old
    # segments after it are outside its ms
    assert set(timings) == {"prepare_ms", "sync_ms", "unmap_ms", "map_ms", "release_old_ms"}
    assert timings["sync_ms"] + timings["unmap_ms"] + timings["map_ms"] <= ms
    assert (view.numpy() == 2).all() and (live.bytes().numpy() == 2).all()
    view[:] = 7  # the live arena owns the memory now: writable, and exported as its own
    other = Arena.open(live.export(), "cpu")
    assert (other.bytes().numpy()[SEG - 8:SEG + 8] == 7).all()
    other.close()
    live.close()
    assert _fds() <= fds - 3  # the live arena's dups replaced its old memfds; the staging's are gone


def test_an_arena_with_segments_still_to_make_swaps_every_segment():
    """A live arena made with ``segments_now`` (a served load's arena is) makes the rest before the
    swap, so every segment moves and none is left unmade under the live addresses."""
    live = Arena.create(4 * SEG, "cpu", segment_bytes=SEG, segments_now=1)
    first = live.view(0, (16,), "int8")  # only segment 0 exists for it
    first[:] = 1
    assert live.mapped_nbytes == SEG
    staging = _filled(4 * SEG, 5, like=live)
    fds = _fds()
    replace_backing(live, staging)
    staging.close()
    assert live.mapped_nbytes == live.nbytes
    assert (first.numpy() == 5).all() and (live.bytes().numpy() == 5).all()
    desc = live.export()
    assert len(set(desc.fds)) == 4
    with Arena.open(desc, "cpu") as other:
        assert (other.bytes().numpy() == 5).all()
    live.close()
    assert _fds() <= fds - 4  # nothing of either arena is left open


def test_a_failure_half_way_maps_the_old_segments_back(monkeypatch):
    live = _filled(3 * SEG, 1)
    staging = _filled(3 * SEG, 2, like=live)
    view = live.view(0, (3 * SEG,), "uint8")
    real, calls = backing_host._host_map_segment, []

    def fail_second(addr, fd, size):
        calls.append(addr)
        if len(calls) == 2:
            raise OSError(12, "injected mmap failure")
        real(addr, fd, size)

    monkeypatch.setattr(backing_host, "_host_map_segment", fail_second)
    with pytest.raises(OSError, match="injected"):
        replace_backing(live, staging)
    monkeypatch.undo()
    assert (view.numpy() == 1).all() and not live.asleep
    assert (staging.bytes().numpy() == 2).all()
    view[:] = 3  # still the live arena's own, exportable memory
    other = Arena.open(live.export(), "cpu")
    assert (other.bytes().numpy() == 3).all()
    for a in (other, staging, live):
        a.close()


def test_refused_before_anything_moves():
    live, small = _filled(2 * SEG, 1), _filled(SEG, 2)
    imported_from, unrelated = _filled(2 * SEG, 3, like=live), _filled(2 * SEG, 4)
    imported = Arena.open(imported_from.export(), "cpu")
    with pytest.raises(ArenaError, match="names its memfds after itself.*staging_for"):
        replace_backing(live, unrelated)
    with pytest.raises(ArenaError, match=r"differ"):
        replace_backing(live, small)
    with pytest.raises(ArenaError, match="opened from another process's export"):
        replace_backing(live, imported)
    live.share("holder pid 1")
    with pytest.raises(ArenaError, match="other process\\(es\\) map it \\(holder pid 1\\)"):
        replace_backing(live, imported_from)
    live.unshare("holder pid 1")
    assert (live.bytes().numpy() == 1).all()
    for a in (imported, imported_from, unrelated, small, live):
        a.close()


def test_a_replace_that_loses_the_race_to_a_sleep_is_refused_by_name():
    """sleep() on another thread between replace_backing's checks and its lock: the late replace had
    asked the asleep arena for its segments (a raw AttributeError on the host backend, a failed
    cuMemRetainAllocationHandle on CUDA). It finds the arena asleep under the lock; both stay usable."""
    import threading
    import time

    live = _filled(2 * SEG, 1)
    staging = _filled(2 * SEG, 2, like=live)
    fds = _fds()
    real_lock, caller, slept, errors = live._map_lock, [], threading.Event(), []

    class LateLock:  # holds the replace between its checks and the lock until the sleep has run
        def __enter__(self):
            if threading.current_thread() is caller[0]:
                slept.wait(5)
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    def call():
        try:
            replace_backing(live, staging)
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    live._map_lock = LateLock()
    caller.append(threading.Thread(target=call))
    caller[0].start()
    time.sleep(0.05)
    live.sleep()
    slept.set()
    caller[0].join(5)
    live._map_lock = real_lock
    assert not caller[0].is_alive() and len(errors) == 1
    assert isinstance(errors[0], ArenaError) and "is asleep" in str(errors[0]) and "moving its segments" in str(errors[0])
    assert _fds() == fds - 2  # the sleep closed the live memfds; the replace kept no reference
    live.wake()
    live.bytes().numpy()[:] = 3
    assert (staging.bytes().numpy() == 2).all() and (live.bytes().numpy() == 3).all()
    replace_backing(live, staging)
    assert (live.bytes().numpy() == 2).all()
    for a in (staging, live):
        a.close()


@pytest.mark.gpu
def test_cuda_segments_swap_under_a_captured_cuda_graph():
    """A CUDA graph captured over a view reads the staging arena's bytes after the swap, with no
    re-capture; the arena exports its new segments to another mapping."""
    import torch

    nbytes = 3 * (2 << 20)
    live = Arena.create(nbytes, "cuda:0", segment_bytes=2 << 20)
    staging = staging_for(live)
    live.bytes().fill_(1)
    staging.bytes().fill_(2)
    x = live.view(0, (nbytes // 4,), torch.float32)
    out = torch.empty((), device="cuda:0")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out.copy_(x.sum())  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(x.sum())
    graph.replay()
    torch.cuda.synchronize()
    before = out.item()
    replace_backing(live, staging)
    staging.close()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.full((nbytes,), 2, dtype=torch.uint8, device="cuda:0").view(torch.float32).sum().item()
    assert out.item() == want != before
    other = Arena.open(live.export(), "cuda:0")
    assert bool((other.bytes() == 2).all())
    other.close()
    live.close()
