"""LoadedImage.sleep / wake on the host backend: every source (backup, served daemon, disk), the
reports, the addresses of views made before the sleep, and the bad inputs of issue 17."""

import os
import re
import shutil
import time

import pytest
import torch

import flashboot
import flashboot.arena.backing_host as host_backing
from flashboot.errors import ArenaError, FlashBootError, OutOfMemoryError
from flashboot.flashload import lifecycle, swapping
from flashboot.flashload.swapping import SWAP_RELEASES

from _preload_helpers import Daemon, make_tiny_image


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("lifecycle"))


def streamed(image_dir):
    """Rank 0 loaded on the host backend straight from disk (nothing staged, no daemon)."""
    return flashboot.load(image_dir, 0, "cpu", stream=True)


def image_bytes(image_dir) -> bytes:
    return flashboot.layouts.read_image(image_dir, 0).path.read_bytes()


def snapshot(loaded) -> dict:
    """name -> (address, bytes) of every view."""
    return {n: (t.data_ptr(), bytes(t.contiguous().view(-1).view(torch.uint8).numpy())) for n, t in loaded.tensors.items()}


def arena_bytes(loaded) -> bytes:
    return bytes(loaded.arena.bytes()[:loaded.nbytes].numpy())


def test_level1_sleep_and_wake_from_the_backup_keep_every_view(image):
    with streamed(image) as loaded:
        before = snapshot(loaded)
        s = loaded.sleep(level=1)
        assert (s.level, s.nbytes) == (1, loaded.nbytes) and s.backup_ms > 0 and s.backup_gbps > 0
        assert loaded.arena.asleep and "level 1" in s.summary()
        w = loaded.wake()
        assert w.source == "backup" and w.not_used == {} and w.nbytes == loaded.nbytes and w.copy_ms > 0
        assert "from backup" in w.summary() and s.release_parts["steps_ms"]["close memfd"] > 0
        parts = w.details["wake"]  # the copy was issued segment by segment during the arena's wake
        assert parts["fill_ms"] > 0 and w.map_ms == parts["create_ms"] + parts["map_ms"] > 0
        assert w.total_ms >= w.probe_ms + parts["wake_ms"] and parts["wake_ms"] >= parts["fill_ms"]
        assert snapshot(loaded) == before  # same addresses, same bytes
        assert arena_bytes(loaded) == image_bytes(image)
        assert loaded.lifecycle.backup is None  # freed at wake unless kept


def test_level2_wakes_from_disk_and_names_why_not_the_others(image, tmp_path):
    with streamed(image) as loaded:
        before = snapshot(loaded)
        s = loaded.sleep(level=2)
        assert s.level == 2 and s.backup_ms == 0 and loaded.lifecycle.backup is None
        w = loaded.wake(shm_dir=tmp_path / "no-shm", verify=True)
        assert w.source == "disk" and w.verify_ms > 0 and w.details["read_gbps"] > 0
        assert w.not_used["backup"] == "sleep(level=2) kept no backup"
        assert w.not_used["served"].startswith(f"no preloader serves {image}")
        assert snapshot(loaded) == before


def test_level2_wakes_from_the_daemons_copy(image, tmp_path):
    daemon = Daemon(image, tmp_path / "shm")
    try:
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=tmp_path / "shm", timeout_s=30) as loaded:
            before = snapshot(loaded)
            loaded.sleep(level=2)
            w = loaded.wake(shm_dir=tmp_path / "shm")
            assert w.source == "served" and list(w.not_used) == ["backup"]
            assert w.details["daemon_h2d_ms"] >= 0 and w.details["daemon_pid"] == os.getpid()
            assert snapshot(loaded) == before
            daemon.idle()
    finally:
        daemon.close()


def test_daemon_gone_at_wake_falls_to_the_disk_and_says_so(image, tmp_path):
    daemon = Daemon(image, tmp_path / "shm")
    with flashboot.load(image, 0, "cpu", served=True, shm_dir=tmp_path / "shm", timeout_s=30) as loaded:
        daemon.idle()
        loaded.sleep(level=2)
        daemon.close()
        w = loaded.wake(shm_dir=tmp_path / "shm")
        assert w.source == "disk" and "served" in w.not_used
        assert arena_bytes(loaded) == image_bytes(image)


def test_a_source_failing_mid_wake_passes_to_the_next(image, tmp_path, monkeypatch):
    """The daemon answers its status, then drops the copy request: the disk is used, the failure named."""
    daemon = Daemon(image, tmp_path / "shm")
    try:
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=tmp_path / "shm", timeout_s=30) as loaded:
            daemon.idle()
            loaded.sleep(level=2)

            def dropped(*args, **kw):
                raise flashboot.errors.RendezvousError("the preloader closed the connection without answering")

            monkeypatch.setattr(lifecycle, "_from_served", dropped)
            w = loaded.wake(shm_dir=tmp_path / "shm")
            assert w.source == "disk"
            assert w.not_used["served"] == "failed: RendezvousError: the preloader closed the connection without answering"
            assert arena_bytes(loaded) == image_bytes(image)
    finally:
        daemon.close()


def test_a_backup_copy_failing_mid_wake_rolls_back_and_passes_to_the_disk(image, tmp_path, monkeypatch):
    """The pipelined level-1 wake: the copy into the first segment fails, the new segments are
    released (asleep again), and the disk brings the bytes back; the report names the failure."""
    from flashboot.errors import MoverError
    from flashboot.flashload import landing as load_mod

    with streamed(image) as loaded:
        loaded.sleep(level=1)
        real, movers = load_mod.mover_for, []

        class Broken:
            def copy(self, dst, src, *, stream):
                raise MoverError(f"injected: copy of {dst.nbytes:,} bytes failed")

        def first_broken(device):  # the backup's copy gets the broken mover, the disk's the real one
            movers.append(device)
            return Broken() if len(movers) == 1 else real(device)

        monkeypatch.setattr(load_mod, "mover_for", first_broken)
        w = loaded.wake(shm_dir=tmp_path / "no-shm")
        assert w.source == "disk" and movers[0] == loaded.arena.device
        assert w.not_used["backup"] == f"failed: MoverError: injected: copy of {loaded.nbytes:,} bytes failed"
        assert "wake" in w.details and arena_bytes(loaded) == image_bytes(image)


def test_no_source_names_what_was_tried_and_stays_asleep(image, tmp_path):
    copy = shutil.copytree(image, tmp_path / "image")
    with streamed(copy) as loaded:
        loaded.sleep(level=2)
        path = loaded.source.path
        os.rename(path, str(path) + ".away")
        with pytest.raises(FlashBootError, match=r"no source has the bytes; backup: sleep\(level=2\) kept no backup; "
                                                 r"served: no preloader serves .*; disk: the image file .* is gone"):
            loaded.wake(shm_dir=tmp_path / "no-shm")
        assert loaded.arena.asleep
        os.rename(str(path) + ".away", path)
        assert loaded.wake(shm_dir=tmp_path / "no-shm").source == "disk"
        assert arena_bytes(loaded) == image_bytes(image)


def test_repacked_image_is_not_read_back(image, tmp_path):
    from _image_helpers import rewrite_metadata
    import json

    copy = shutil.copytree(image, tmp_path / "image")
    with streamed(copy) as loaded:
        loaded.sleep(level=2)
        rank_dir = loaded.source.path.parent
        meta = json.loads((rank_dir / "metadata.json").read_text())
        meta["note"] = "re-packed"
        rewrite_metadata(rank_dir, meta)
        with pytest.raises(FlashBootError, match=r"disk: .* was re-packed since the load"):
            loaded.wake(shm_dir=tmp_path / "no-shm")
        assert loaded.arena.asleep


def test_wake_without_room_stays_asleep_and_keeps_the_backup(image, monkeypatch):
    with streamed(image) as loaded:
        loaded.sleep(level=1)
        monkeypatch.setattr(host_backing, "_host_mem_available", lambda: 1 << 20)
        with pytest.raises(OutOfMemoryError, match=f"needs {loaded.arena.nbytes:,} bytes but only 1,048,576 are free"):
            loaded.wake()
        assert loaded.arena.asleep and loaded.lifecycle.backup is not None
        monkeypatch.undo()
        assert loaded.wake().source == "backup"
        assert arena_bytes(loaded) == image_bytes(image)


def test_sleep_twice_and_wake_twice_are_no_ops(image):
    with streamed(image) as loaded:
        assert loaded.wake().source == "awake"
        loaded.sleep(level=1)
        assert loaded.sleep(level=1).level == 0
        assert loaded.wake().source == "backup"
        assert loaded.wake().source == "awake"
        assert arena_bytes(loaded) == image_bytes(image)


def test_kept_backup_is_reused_without_a_new_allocation(image):
    with streamed(image) as loaded:
        first = loaded.sleep(level=1)
        loaded.wake(keep_backup=True)
        backup = loaded.lifecycle.backup
        second = loaded.sleep(level=1)
        assert backup is loaded.lifecycle.backup and second.pin_ms == 0 and first.pin_ms > 0
        loaded.wake()
        assert arena_bytes(loaded) == image_bytes(image)


def test_held_arena_refuses_sleep_by_name(image):
    with streamed(image) as loaded:
        loaded.arena.share("holder 'engine-0' (registry /tmp/reg)")
        with pytest.raises(ArenaError, match="cannot sleep: .*holder 'engine-0'"):
            loaded.sleep(level=2)
        assert not loaded.arena.asleep and arena_bytes(loaded) == image_bytes(image)


def test_bad_arguments_are_refused(image):
    with streamed(image) as loaded:
        for level in (3, True, 1.0):  # True == 1 had been taken, and reported level=True
            with pytest.raises(FlashBootError, match=rf"sleep level must be 1 .* or 2 .*, got {level!r}"):
                loaded.sleep(level=level)
        assert not loaded.arena.asleep
        with pytest.raises(FlashBootError, match="unknown wake source 'gpu'; known: auto, backup, served, disk"):
            loaded.wake(source="gpu")
        loaded.sleep(level=2)
        for bad in (float("nan"), float("inf"), 0, -1, "5"):  # inf had raised OverflowError, "5" TypeError
            with pytest.raises(FlashBootError, match=r"wake served_timeout_s must be a finite number of seconds in "
                                                     rf"\(0, .*\], got {re.escape(repr(bad))}"):
                loaded.wake(source="served", served_timeout_s=bad)
        assert loaded.arena.asleep
        with pytest.raises(FlashBootError, match=r"no source has the bytes; backup: sleep\(level=2\) kept no backup$"):
            loaded.wake(source="backup")
        assert loaded.arena.asleep
    with pytest.raises(FlashBootError, match="is closed"):
        loaded.sleep()


def threads_started_since(before: set[str], timeout_s: float = 5.0) -> set[str]:
    """This process's threads (task ids) that were not in ``before`` and are still alive after up
    to ``timeout_s``: a joined helper leaves /proc/self/task a moment after join() returns, and a
    thread of an earlier test that ends meanwhile is no leak of this one."""
    deadline = time.monotonic() + timeout_s
    while (new := set(os.listdir("/proc/self/task")) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new


def test_cycles_leave_fds_and_threads_flat(image):
    with streamed(image) as loaded:
        for level in (1, 2):  # warm-up of both paths: a pool that a first use starts is not a leak
            loaded.sleep(level=level)
            loaded.wake(shm_dir="/nonexistent-shm")
        fds, threads = len(os.listdir("/proc/self/fd")), set(os.listdir("/proc/self/task"))
        for i in range(10):
            loaded.sleep(level=1 + i % 2)
            loaded.wake(shm_dir="/nonexistent-shm")
        assert len(os.listdir("/proc/self/fd")) == fds and threads_started_since(threads) == set()
        assert arena_bytes(loaded) == image_bytes(image)


def test_swap_releases_the_outgoing_image_during_the_incoming_wake(image, tmp_path):
    second = shutil.copytree(image, tmp_path / "second")
    with streamed(image) as a, streamed(second) as b:
        want_b = snapshot(b)
        b.sleep(level=1)
        r = swapping.swap(a, b, level=2, release="during")
        assert r.released == "during" and r.why == ""
        assert a.arena.asleep and not b.arena.asleep and r.sleep.level == 2 and r.wake.source == "backup"
        assert snapshot(b) == want_b and r.total_ms >= r.wake.total_ms
        back = swapping.swap(b, a, level=1, release="during", shm_dir=tmp_path / "no-shm")  # a from disk, b keeps a backup
        assert back.released == "during" and back.wake.source == "disk" and back.sleep.level == 1
        assert arena_bytes(a) == image_bytes(image) and b.arena.asleep and b.lifecycle.backup is not None
        out, into = a, b
        for release in ("after", "before"):
            r = swapping.swap(out, into, release=release, shm_dir=tmp_path / "no-shm")
            assert r.released == release and r.why == "" and out.arena.asleep and not into.arena.asleep
            out, into = into, out
        assert arena_bytes(a) == image_bytes(image) and b.arena.asleep
        with pytest.raises(FlashBootError, match="unknown swap release 'never'; known: handover, during, after, before"):
            swapping.swap(a, b, release="never")


def test_swap_by_handover_on_the_host_backend_releases_first_and_says_why(image, tmp_path):
    """The default handover needs CUDA arenas (their segments move without a copy; the GPU tests
    cover it): on the host backend the outgoing image sleeps before the wake, and the report says why."""
    second = shutil.copytree(image, tmp_path / "second")
    with streamed(image) as a, streamed(second) as b:
        b.sleep(level=1)
        r = swapping.swap(a, b)
        assert r.released == "before" and r.why.startswith("the host backend's segments are memfds named after")
        assert a.arena.asleep and not b.arena.asleep and arena_bytes(b) == image_bytes(second)


def test_swap_without_room_releases_first_and_says_why(image, tmp_path, monkeypatch):
    import flashboot.pinning

    second = shutil.copytree(image, tmp_path / "second")
    with streamed(image) as a, streamed(second) as b:
        b.sleep(level=1)
        monkeypatch.setattr(flashboot.pinning, "device_free_bytes", lambda device: 4096)
        r = swapping.swap(a, b, release="after")
        assert r.released == "before" and a.arena.asleep and not b.arena.asleep
        assert r.why == (f"cpu has 4,096 bytes free; the incoming arena needs {b.arena.nbytes:,} beside the outgoing "
                         "one's")


def test_a_level1_backup_copy_failing_at_sleep_leaves_the_image_awake(image, monkeypatch):
    """The host mover's copy into the backup fails (the CUDA copies fail in their wait instead; the
    arena tests cover that): nothing was released, every view still holds its bytes, and the next
    level-1 cycle works from the same backup."""
    from flashboot.movers.host import HostMover

    with streamed(image) as loaded:
        before = snapshot(loaded)

        def broken(self, dst, src, nbytes, path, stream):
            raise FlashBootError("injected D2H failure")

        monkeypatch.setattr(HostMover, "_copy", broken)
        with pytest.raises(FlashBootError, match="injected D2H failure"):
            loaded.sleep(level=1)
        monkeypatch.undo()
        assert not loaded.arena.asleep and snapshot(loaded) == before
        loaded.sleep(level=1)
        assert loaded.wake().source == "backup" and snapshot(loaded) == before


@pytest.mark.parametrize("release", SWAP_RELEASES)
def test_swap_whose_release_fails_leaves_both_as_they_were_and_raises_it(image, tmp_path, release):
    """release="after" had woken the incoming image and then raised the outgoing one's refusal,
    leaving both awake: the refusal comes before anything moves."""
    second = shutil.copytree(image, tmp_path / "second")
    with streamed(image) as a, streamed(second) as b:
        b.sleep(level=1)
        a.arena.share("holder 'engine-0'")
        with pytest.raises(ArenaError, match=r"cannot sleep: 1 other process\(es\) map it \(holder 'engine-0'"):
            swapping.swap(a, b, release=release)
        assert not a.arena.asleep and b.arena.asleep and b.lifecycle.backup is not None
        assert a.lifecycle is None or a.lifecycle.backup is None  # no backup taken for a sleep that cannot run
        a.arena.unshare("holder 'engine-0'")
        assert swapping.swap(a, b).wake.source == "backup" and arena_bytes(b) == image_bytes(image)
