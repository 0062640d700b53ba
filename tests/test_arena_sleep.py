"""Arena sleep and wake at stable addresses, on the host backend (every path CI can reach).

Sleep releases the segments and keeps the reserved range; wake maps new segments at the same
addresses in one transaction. These tests check the addresses, the release (fds and mappings
gone), the bytes written after wake through views made before the sleep, and the refusals.
"""

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
