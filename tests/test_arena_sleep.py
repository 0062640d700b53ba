"""Arena sleep and wake at stable addresses, on the host backend (every path CI can reach).

Sleep releases the segments and keeps the reserved range; wake maps new segments at the same
addresses in one transaction. These tests check the addresses, the release (fds and mappings
gone), the bytes written after wake through views made before the sleep, and the refusals.
"""

import ctypes
import errno
import os

import pytest
import torch

import flashboot.arena.backing_host as host_backing
from flashboot import Arena, ArenaError, OutOfMemoryError

MiB = 1 << 20


def memfds(arena) -> list[str]:
    """This process's fds that are segments of ``arena``."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if arena.arena_id in target:
            out.append(target)
    return out


def segment_maps(arena) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if arena.arena_id in line]


def test_sleep_releases_segments_and_wake_keeps_every_address():
    with Arena.create(5 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        w = a.view(4096, (64, 32), torch.float32)
        tail = a.view(a.nbytes - 1024, 256, torch.int32)  # in the last segment
        ptrs = (a.ptr, w.data_ptr(), tail.data_ptr())
        w.copy_(torch.arange(64 * 32, dtype=torch.float32).view(64, 32))
        assert len(memfds(a)) == 3 and len(segment_maps(a)) == 3
        a.sleep()
        assert a.asleep and "asleep" in repr(a)
        assert memfds(a) == [] and segment_maps(a) == []  # nothing holds the pages any more
        a.wake()
        assert not a.asleep and len(memfds(a)) == 3 and len(segment_maps(a)) == 3
        assert (a.ptr, w.data_ptr(), tail.data_ptr()) == ptrs
        assert int(w.abs().sum()) == 0  # new segments: the old bytes are gone
        w.copy_(torch.full((64, 32), 7.5))
        tail.fill_(-3)
        flat = a.bytes()
        assert torch.equal(flat[4096:4096 + 64 * 32 * 4].view(torch.float32), torch.full((64 * 32,), 7.5))
        assert torch.equal(flat[a.nbytes - 1024:].view(torch.int32), torch.full((256,), -3, dtype=torch.int32))


def test_sleep_twice_and_wake_twice_are_no_ops():
    with Arena.create(2 * MiB, "cpu") as a:
        a.wake()  # awake: nothing to do
        a.bytes()[:4].fill_(9)
        assert int(a.bytes()[0]) == 9
        a.sleep()
        a.sleep()
        assert a.asleep and memfds(a) == []
        a.wake()
        a.wake()
        assert not a.asleep and len(memfds(a)) == 1


def test_close_while_asleep_releases_the_reservation():
    before_fds, before_maps = len(os.listdir("/proc/self/fd")), segment_maps_all()
    a = Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB)
    ptr = a.ptr
    a.sleep()
    assert any(f"{ptr:x}" in line.split()[0].split("-")[0] for line in open("/proc/self/maps"))  # still reserved
    a.close()
    assert not any(line.startswith(f"{ptr:x}-") for line in open("/proc/self/maps"))
    assert len(os.listdir("/proc/self/fd")) == before_fds and segment_maps_all() == before_maps


def test_an_asleep_arena_makes_no_new_views():
    """Nothing backs an asleep arena's range: a view made then faults on its first touch (it
    killed the process), so it is refused by name, as span() is."""
    with Arena.create(2 * MiB, "cpu") as a:
        a.sleep()
        for make in (lambda: a.view(0, (16,), "float32"), a.bytes, lambda: a.span(0, 16)):
            with pytest.raises(ArenaError, match="asleep .* wake\\(\\) it before"):
                make()
        a.wake()
        assert a.view(0, (16,), "float32").shape == (16,)


@pytest.mark.parametrize("late", ["wake", "sleep"])
def test_a_wake_or_sleep_that_loses_the_race_to_close_maps_nothing(late):
    """close() on another thread between a wake's (or sleep's) check and its lock: the late call
    finds the arena closed under the lock. Before, the wake mapped new memfds with MAP_FIXED over
    the range close() had given back, over whatever the process had put there since."""
    import threading
    import time

    before_fds, before_maps = len(os.listdir("/proc/self/fd")), segment_maps_all()
    a = Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB)
    if late == "wake":
        a.sleep()
    real_lock, caller = a._map_lock, []

    class LateLock:  # holds the late call between its check and the lock until close() has run
        def __enter__(self):
            if threading.current_thread() is caller[0]:
                closed.wait(5)
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    closed, errors = threading.Event(), []
    a._map_lock = LateLock()

    def call():
        try:
            getattr(a, late)()
        except ArenaError as exc:
            errors.append(exc)

    caller.append(threading.Thread(target=call))
    caller[0].start()
    time.sleep(0.05)
    a.close()
    closed.set()
    caller[0].join(5)
    assert not caller[0].is_alive()
    assert len(errors) == 1 and "is closed" in str(errors[0])
    assert len(os.listdir("/proc/self/fd")) == before_fds and segment_maps_all() == before_maps


def segment_maps_all() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "flashboot-arena" in line]


def test_wake_without_room_raises_with_numbers_and_stays_asleep(monkeypatch):
    with Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        view = a.view(0, 16, torch.int64)
        a.sleep()
        monkeypatch.setattr(host_backing, "_host_mem_available", lambda: 3 * MiB)
        with pytest.raises(OutOfMemoryError, match=f"waking arena {a.arena_id} .*needs 4,194,304 bytes but only "
                                                   "3,145,728 are free") as info:
            a.wake()
        assert (info.value.nbytes_needed, info.value.nbytes_free) == (4 * MiB, 3 * MiB)
        assert a.asleep and memfds(a) == []
        monkeypatch.undo()
        a.wake()
        view.fill_(5)
        assert int(a.bytes()[:8].view(torch.int64)[0]) == 5


@pytest.mark.parametrize("step", ["_host_memfd", "_host_truncate", "_host_map_segment"])
def test_wake_failing_halfway_rolls_back_and_stays_asleep(monkeypatch, step):
    """A fake allocator failure on the second segment: the first one is undone, nothing leaks."""
    with Arena.create(5 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        view = a.view(2 * MiB, 8, torch.int64)
        a.sleep()
        fds_asleep, maps_asleep = sorted(os.listdir("/proc/self/fd")), segment_maps(a)
        real, calls = getattr(host_backing, step), []

        def broken(*args):
            calls.append(args)
            if len(calls) < 2:
                return real(*args)
            raise OSError(errno.ENOMEM, f"injected failure in {step}")

        monkeypatch.setattr(host_backing, step, broken)
        with pytest.raises(OutOfMemoryError, match=f"waking arena {a.arena_id}.*injected failure in {step}.*needs "
                                                   "6,291,456 bytes"):
            a.wake()
        assert len(calls) == 2
        assert a.asleep and segment_maps(a) == maps_asleep == []
        assert sorted(os.listdir("/proc/self/fd")) == fds_asleep
        monkeypatch.undo()
        a.wake()
        view.fill_(11)
        assert int(a.bytes()[2 * MiB:2 * MiB + 8].view(torch.int64)[0]) == 11


def test_other_wake_failure_is_an_arena_error(monkeypatch):
    with Arena.create(2 * MiB, "cpu") as a:
        a.sleep()
        monkeypatch.setattr(host_backing, "_host_map_segment",
                            lambda *args: (_ for _ in ()).throw(OSError(errno.EINVAL, "injected")))
        with pytest.raises(ArenaError, match=f"waking arena {a.arena_id}.* failed: .*injected") as info:
            a.wake()
        assert not isinstance(info.value, OutOfMemoryError) and a.asleep


def test_shared_arena_refuses_sleep_by_name_until_unshared():
    with Arena.create(2 * MiB, "cpu") as a:
        a.share("holder 'engine-0' (registry /tmp/x)")
        with pytest.raises(ArenaError, match=r"cannot sleep: 1 other process\(es\) map it \(holder 'engine-0'"):
            a.sleep()
        assert not a.asleep and len(memfds(a)) == 1
        a.unshare("holder 'engine-0' (registry /tmp/x)")
        a.sleep()
        assert a.asleep


def test_export_is_revoked_at_sleep_and_renewed_at_wake():
    with Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        old = a.export()
        with Arena.open(old) as early:
            early.bytes()[:4].fill_(1)
            a.sleep()
            with pytest.raises(ArenaError, match="is asleep .*wake\\(\\) it before exporting it"):
                a.export()
            with pytest.raises(ArenaError, match="is asleep .*before copying"):
                a.span(0, 16)
            # the importer keeps its own mapping of the old segments: stale, never freed under it
            assert int(early.bytes()[0]) == 1
        a.wake()
        new = a.export()
        assert new.arena_id == old.arena_id and new.nbytes == old.nbytes
        a.bytes()[:4].fill_(42)
        with Arena.open(new) as late:
            assert int(late.bytes()[0]) == 42


def test_opened_arena_cannot_sleep():
    with Arena.create(2 * MiB, "cpu") as a, Arena.open(a.export()) as b:
        with pytest.raises(ArenaError, match="only its owner can put it to sleep"):
            b.sleep()


def test_wake_fills_each_segment_as_soon_as_it_is_mapped():
    """fill(offset, span) sees every new segment, in order, mapped (writable) before the next is made."""
    with Arena.create(5 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        views = [a.view(off, 4, torch.int64) for off in (0, 2 * MiB, 4 * MiB)]
        a.sleep()
        seen = []

        def fill(offset, span):
            seen.append((offset, span.ptr, span.nbytes, len(memfds(a))))
            buf = torch.frombuffer((ctypes.c_uint8 * span.nbytes).from_address(span.ptr), dtype=torch.int64)
            buf.fill_(100 + offset // MiB)  # written through the raw span, read back through the old views

        parts = {}
        a.wake(fill, timings=parts)
        base = views[0].data_ptr()
        assert seen == [(0, base, 2 * MiB, 1), (2 * MiB, base + 2 * MiB, 2 * MiB, 2), (4 * MiB, base + 4 * MiB, 2 * MiB, 3)]
        assert [int(v[0]) for v in views] == [100, 102, 104]
        assert set(parts) == {"create_ms", "map_ms", "fill_ms", "wake_ms"}
        assert parts["wake_ms"] >= parts["create_ms"] + parts["map_ms"] + parts["fill_ms"] > 0


def test_a_failing_fill_settles_its_copies_before_the_rollback():
    """fill fails on the third segment: settle runs while the new segments are still mapped (no
    copy may write freed memory), then they are released and the arena stays asleep."""
    with Arena.create(6 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        a.sleep()
        fds_asleep = sorted(os.listdir("/proc/self/fd"))
        mapped_at_settle = []

        def fill(offset, span):
            if offset == 4 * MiB:
                raise ArenaError("injected copy failure at segment 2")

        with pytest.raises(ArenaError, match="injected copy failure at segment 2"):
            a.wake(fill, settle=lambda: mapped_at_settle.append(len(segment_maps(a))))
        assert mapped_at_settle == [3]  # all three segments were still mapped when settle ran
        assert a.asleep and segment_maps(a) == [] and sorted(os.listdir("/proc/self/fd")) == fds_asleep
        a.wake()
        assert not a.asleep and len(memfds(a)) == 3


def test_sleep_reports_where_its_time_went():
    with Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        parts = {}
        a.sleep(timings=parts)
        assert set(parts) == {"sync_ms", "revoke_ms", "release_ms", "steps_ms"}
        assert set(parts["steps_ms"]) == {"close memfd", "unmap segment, keep the reservation"}
        assert parts["release_ms"] >= sum(parts["steps_ms"].values()) > 0


def test_mapped_runs_merge_adjacent_segments_only():
    """The CUDA backend unmaps one run of adjacent mappings per cuMemUnmap (pure Python, no driver)."""
    from flashboot.arena.backing_cuda import _runs

    assert _runs([(0x400000, 2 * MiB), (0, 2 * MiB), (2 * MiB, 2 * MiB)]) == [(0, 6 * MiB)]
    assert _runs([(0, 2 * MiB), (4 * MiB, 2 * MiB), (6 * MiB, 1 * MiB)]) == [(0, 2 * MiB), (4 * MiB, 3 * MiB)]
    assert _runs([]) == []


def test_drained_sleep_releases_each_segment_once_its_copy_ended():
    """sleep(drain): every segment's copy is issued before any release; then each segment is
    released when its wait returns, the later ones still mapped, and the bytes are all out."""
    with Arena.create(6 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        a.bytes().copy_(torch.arange(6 * MiB, dtype=torch.int64).to(torch.uint8))
        want = bytes(a.bytes().numpy())
        a.export()
        out, issued, mapped_at_wait = bytearray(6 * MiB), [], []

        def drain(offset, span):
            issued.append(offset)
            out[offset:offset + span.nbytes] = (ctypes.c_uint8 * span.nbytes).from_address(span.ptr)

            def wait():
                mapped_at_wait.append((offset, len(segment_maps(a)), len(issued)))
            return wait

        parts = {}
        a.sleep(drain=drain, timings=parts)
        assert a.asleep and bytes(out) == want and issued == [0, 2 * MiB, 4 * MiB]
        assert mapped_at_wait == [(0, 3, 3), (2 * MiB, 2, 3), (4 * MiB, 1, 3)]  # released one by one behind the waits
        assert memfds(a) == [] and segment_maps(a) == []  # the export was revoked first: nothing holds the pages
        assert parts["drain_ms"] > 0 and set(parts) == {"sync_ms", "revoke_ms", "drain_ms", "release_ms", "steps_ms"}
        a.wake()
        assert len(memfds(a)) == 3


def test_a_drain_failing_to_start_leaves_the_arena_awake_and_whole():
    with Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        v = a.view(2 * MiB, 4, torch.int64)
        v.fill_(11)

        def drain(offset, span):
            if offset:
                raise ArenaError("injected: no stream for segment 1")
            return None

        with pytest.raises(ArenaError, match="injected: no stream for segment 1"):
            a.sleep(drain=drain)
        assert not a.asleep and len(segment_maps(a)) == 2 and v.tolist() == [11] * 4
        assert a.export().arena_id == a.arena_id  # exported anew


def test_a_drained_copy_failing_puts_the_arena_to_sleep_and_names_the_segment():
    """The wait of segment 1 fails: segment 2's copy is still waited for before anything more is
    freed, every segment is released (asleep: the bytes from segment 1 on are not all out), and the
    ArenaError names the segment and its bytes."""
    with Arena.create(6 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        waited = []

        def drain(offset, span):
            def wait():
                waited.append((offset, len(segment_maps(a))))
                if offset == 2 * MiB:
                    raise OSError(errno.EIO, "injected copy failure")
            return wait

        with pytest.raises(ArenaError, match=r"copy out of segment 1 \(bytes 2,097,152\.\.4,194,304\) failed: OSError.*"
                                             r"injected copy failure.*asleep.*from segment 1 on"):
            a.sleep(drain=drain)
        assert waited == [(0, 3), (2 * MiB, 2), (4 * MiB, 2)]
        assert a.asleep and memfds(a) == [] and segment_maps(a) == []
        a.wake()
        assert not a.asleep and len(segment_maps(a)) == 3


def test_wake_refuses_a_donor_it_cannot_take_before_anything_moves():
    """Segments are handed over between CUDA arenas only (the GPU tests cover the handover): a host
    donor, the arena itself or a non-arena are refused by name, and both arenas stay as they were."""
    with Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB) as a, Arena.create(4 * MiB, "cpu", segment_bytes=2 * MiB) as b:
        b.sleep()
        with pytest.raises(ArenaError, match=f"arena {b.arena_id} cannot take the segments of arena {a.arena_id}: only "
                                             "CUDA arenas hand segments over"):
            b.wake(donor=a)
        with pytest.raises(ArenaError, match="wake\\(donor=...\\) needs another Arena"):
            b.wake(donor=b)
        with pytest.raises(ArenaError, match="needs another Arena, got 'a'"):
            b.wake(donor="a")
        assert b.asleep and not a.asleep and len(segment_maps(a)) == 2
        a.share("holder 'h'")
        with pytest.raises(ArenaError, match=r"cannot hand its segments over: 1 other process\(es\) map it"):
            b.wake(donor=a)
        assert b.asleep and not a.asleep
