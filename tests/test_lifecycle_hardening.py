"""Weights that stay, as a hostile user drives them (host backend): an engine-wide sleep whose
failure left an arena asleep, and the other edges of sleep, wake, swap and restart found in review."""

from __future__ import annotations

import re

import pytest
import torch

from _engine_helpers import _key, _options, packed  # noqa: F401  (packed: a fixture)
from flashboot.errors import ArenaError, FlashBootError
from flashboot.flashload import lifecycle, swapping
from flashboot.integrations.engine_prepack import load_engine_weights


def test_an_engine_wide_sleep_whose_failed_arena_went_to_sleep_wakes_it_again(packed, tmp_path, monkeypatch):
    """A level-1 copy out that fails in its wait (a CUDA D2H failing on its stream) leaves that
    arena asleep, its backup short: the engine told the pause failed ran on unmapped weights (the
    roll-back woke only the arenas before it). It is woken again too, from the image."""
    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay

    _, out, _ = packed
    first = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    second = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        before = {n: t.clone() for n, t in second.tensors.items()}
        ptrs = {n: t.data_ptr() for n, t in second.tensors.items()}
        stay(first, shm_dir=str(tmp_path / "shm"))
        stay(second, shm_dir=str(tmp_path / "shm"))
        real, calls = lifecycle._drain_into, []

        def failing_wait(backup, nbytes, device):  # the second arena's copy out fails once issued
            drain, settle = real(backup, nbytes, device)
            calls.append(device)
            if len(calls) == 1:
                return drain, settle

            def drain_then_fail(offset, segment):
                drain(offset, segment)

                def wait():
                    raise RuntimeError("injected: the D2H failed on its stream")
                return wait
            return drain_then_fail, settle

        monkeypatch.setattr(lifecycle, "_drain_into", failing_wait)
        with pytest.raises(ArenaError, match="the copy out of segment 0 .* failed: RuntimeError: injected") as failed:
            sleep_engine_weights(1)
        monkeypatch.undo()
        notes = "\n".join(getattr(failed.value, "__notes__", []))
        assert "the 2 arena(s) this sleep had put to sleep before it failed were woken again" in notes, notes
        assert not first.arena.asleep and not second.arena.asleep
        assert {n: t.data_ptr() for n, t in second.tensors.items()} == ptrs
        assert all(torch.equal(second.tensors[n], t) for n, t in before.items())
    finally:
        first.close()
        second.close()


def test_a_refit_version_woken_from_the_backup_with_verify_is_not_checked_against_the_image(tmp_path):
    """The image's checksums are version 0's: verify=True had failed a refit version's backup,
    kept whole, as a ChecksumMismatchError and put it back to sleep. A wake from the image is
    still verified (and says the refit is lost)."""
    from _preload_helpers import make_tiny_image

    import flashboot

    image = make_tiny_image(tmp_path)
    with flashboot.load(image, 0, "cpu", stream=True) as loaded:
        name, tensor = next((n, t) for n, t in loaded.tensors.items() if t.is_floating_point())
        tensor.add_(1.0)  # what a refit leaves: other bytes under the same views, a version > 0
        loaded.version = 3
        refit = {n: t.clone() for n, t in loaded.tensors.items()}
        loaded.sleep(level=1)
        woke = loaded.wake(verify=True)
        assert woke.source == "backup" and not loaded.arena.asleep and loaded.version == 3
        assert woke.details["verify_skipped"] == ("the backup holds refit version 3; the image's checksums describe "
                                                  "version 0") and "not verified: the backup holds refit" in woke.summary()
        assert all(torch.equal(loaded.tensors[n], t) for n, t in refit.items())
        loaded.sleep(level=2)
        woke = loaded.wake(verify=True, shm_dir=tmp_path / "no-shm")
        assert woke.source == "disk" and woke.verify_ms > 0 and "verify_skipped" not in woke.details
        assert woke.details["refit_version_lost"] == 3 and loaded.version == 0


@pytest.mark.parametrize("options, error", [
    ({"shmdir": "/tmp/x"}, r"unknown swap option\(s\) \['shmdir'\]; known: level, release, source, keep_backup, "
                           r"shm_dir, served_timeout_s, stream_config, verify"),
    ({"meanwhile": print}, r"unknown swap option\(s\) \['meanwhile'\]"),
    ({"source": "gpu"}, "unknown wake source 'gpu'"),
    ({"served_timeout_s": float("nan")}, r"wake served_timeout_s must be a finite number of seconds .*, got nan"),
])
def test_a_swap_with_a_bad_wake_option_moves_nothing(tmp_path, options, error):
    """The incoming wake had refused these (a raw TypeError for a misspelt keyword) after the
    outgoing image, the one serving, had gone to sleep (release="before", the host's handover)."""
    import shutil

    from _preload_helpers import make_tiny_image

    import flashboot
    from flashboot.errors import FlashBootError

    image = make_tiny_image(tmp_path)
    second = shutil.copytree(image, tmp_path / "second")
    with flashboot.load(image, 0, "cpu", stream=True) as a, flashboot.load(second, 0, "cpu", stream=True) as b:
        want = {n: (t.data_ptr(), t.clone()) for n, t in a.tensors.items()}
        b.sleep(level=1)
        for release in swapping.SWAP_RELEASES:
            with pytest.raises(FlashBootError, match=error):
                swapping.swap(a, b, release=release, **options)
            assert not a.arena.asleep and b.arena.asleep and b.lifecycle.backup is not None
        assert all(t.data_ptr() == p and torch.equal(t, v) for (n, t), (p, v) in zip(a.tensors.items(), want.values()))


@pytest.mark.parametrize("level, source", [(1, "backup"), (2, "disk")])
def test_a_swap_whose_incoming_wake_fails_wakes_the_outgoing_image_again(tmp_path, level, source):
    """The incoming image's file is gone: the swap had left the outgoing image, the one serving,
    asleep too (and at level 2 its bytes discarded). It is woken again at its addresses, and the
    error says so; where that fails too, the error says why and it stays asleep."""
    import os
    import shutil

    from _preload_helpers import make_tiny_image

    import flashboot
    from flashboot.errors import FlashBootError

    image = make_tiny_image(tmp_path)
    second = shutil.copytree(image, tmp_path / "second")
    with flashboot.load(image, 0, "cpu", stream=True) as a, flashboot.load(second, 0, "cpu", stream=True) as b:
        want = {n: (t.data_ptr(), t.clone()) for n, t in a.tensors.items()}
        b.sleep(level=2)
        os.rename(b.source.path, tmp_path / "away")
        with pytest.raises(FlashBootError, match="no source has the bytes") as failed:
            swapping.swap(a, b, level=level, shm_dir=tmp_path / "no-shm")
        notes = "\n".join(getattr(failed.value, "__notes__", []))
        assert f"the outgoing image {a!r} was woken again, from {source}" == notes
        assert not a.arena.asleep and b.arena.asleep
        assert all(t.data_ptr() == want[n][0] and torch.equal(t, want[n][1]) for n, t in a.tensors.items())
        if level == 2:  # neither can be woken: the error says why, both stay asleep
            os.rename(a.source.path, tmp_path / "away-too")
            with pytest.raises(FlashBootError, match="no source has the bytes") as failed:
                swapping.swap(a, b, level=level, shm_dir=tmp_path / "no-shm")
            assert re.fullmatch(rf"the outgoing image {re.escape(repr(a))} could not be woken again and stays asleep: "
                                r"FlashBootError: waking rank 0 of .*: no source has the bytes; .*disk: the image file "
                                r".* is gone", "\n".join(failed.value.__notes__))
            assert a.arena.asleep and b.arena.asleep


CLOSE_DURING = r'''
import sys, threading
import flashboot
from flashboot.movers.host import HostMover

image, mode = sys.argv[1], sys.argv[2]
loaded = flashboot.load(image, 0, "cpu", stream=True)
want = {n: t.clone() for n, t in loaded.tensors.items()}
if mode == "wake":
    loaded.sleep(level=1)
closer = threading.Thread(target=loaded.close)
real = HostMover._copy

def copy_while_closing(self, *args):  # the close runs while the backup is copied into or out of
    closer.start()
    closer.join(0.5)  # ended: it freed the backup under this copy; still waiting: it waits for the copy
    return real(self, *args)

HostMover._copy = copy_while_closing
report = loaded.wake() if mode == "wake" else loaded.sleep(level=1)
HostMover._copy = real
closer.join()
print(type(report).__name__, loaded.arena.closed, loaded.lifecycle.backup is None)
try:
    loaded.wake()
except flashboot.errors.FlashBootError as exc:
    print(exc)
'''


@pytest.mark.parametrize("mode", ["wake", "sleep"])
def test_a_close_from_another_thread_waits_for_the_copy_through_the_backup(tmp_path, mode):
    """close() in another thread during a level-1 wake or sleep had unmapped the host backup under
    the copy into or out of it: a segfault. It waits for the copy, then releases everything."""
    import subprocess
    import sys

    from _preload_helpers import make_tiny_image

    image = make_tiny_image(tmp_path)
    run = subprocess.run([sys.executable, "-c", CLOSE_DURING, str(image), mode], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    report = "WakeReport" if mode == "wake" else "SleepReport"
    assert run.stdout.splitlines() == [f"{report} True True",
                                       f"LoadedImage(rank 0, 0 tensors, {126976:,} bytes on cpu) is closed; there is "
                                       "nothing to wake"]


def test_a_level2_sleep_of_an_image_asleep_at_level1_frees_its_backup(tmp_path):
    """Level 2 keeps nothing: on an image asleep at level 1 it had been a no-op that kept the
    pinned host copy (vLLM's discard of the weights after its sleep freed nothing)."""
    from _preload_helpers import make_tiny_image

    import flashboot

    image = make_tiny_image(tmp_path)
    with flashboot.load(image, 0, "cpu", stream=True) as loaded:
        want = {n: (t.data_ptr(), t.clone()) for n, t in loaded.tensors.items()}
        loaded.sleep(level=1)
        assert loaded.lifecycle.backup is not None
        report = loaded.sleep(level=2)
        assert report.level == 2 and report.backup_ms == 0 and loaded.lifecycle.backup is None
        assert loaded.arena.asleep and loaded.sleep(level=2).level == 0 and loaded.sleep(level=1).level == 0
        woke = loaded.wake(shm_dir=tmp_path / "no-shm")
        assert woke.source == "disk" and woke.not_used["backup"] == "sleep(level=2) kept no backup"
        assert all(t.data_ptr() == want[n][0] and torch.equal(t, want[n][1]) for n, t in loaded.tensors.items())


def test_an_engine_wide_sleep_that_fails_leaves_an_arena_asleep_before_it_asleep(packed, tmp_path):
    """The roll-back restores what was before the call: an arena asleep at level 1 whose backup
    the level-2 sleep freed stays asleep (it was counted as put to sleep and woken from the disk)."""
    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay

    _, out, _ = packed
    first = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    second = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        stay(first, shm_dir=str(tmp_path / "shm"))
        stay(second, shm_dir=str(tmp_path / "shm"))
        first.handle.sleep(level=1)
        second.arena.share("holder pid 42")
        with pytest.raises(ArenaError, match="other process.* map it .holder pid 42") as refused:
            sleep_engine_weights(2)
        assert "woken again" not in "\n".join(getattr(refused.value, "__notes__", []))
        assert first.arena.asleep and first.handle.lifecycle.backup is None and not second.arena.asleep
        second.arena.unshare("holder pid 42")
    finally:
        first.close()
        second.close()


def _memfds() -> int:
    import os

    fds = os.listdir("/proc/self/fd")
    return sum(os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
               for fd in fds)


def test_a_model_still_bound_keeps_its_weights_past_close_unless_its_load_failed(packed, tmp_path):
    """A parameter still bound to a closed image read unmapped memory (a segfault; on CUDA an illegal
    address ending the context): the image now keeps its memory while its views are held. A failed
    load's half-bound model is discarded, so there the memory goes at once, for a fallback load."""
    import gc
    import warnings

    _, out, _ = packed
    gc.collect()
    base = _memfds()
    weights = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    name = next(iter(weights.tensors))
    param = weights.tensors[name]  # as a bound model holds it
    want = param.clone()
    with pytest.warns(ResourceWarning, match="closed while views of it are still held"):
        weights.close()
    assert _memfds() > base and torch.equal(param, want)  # still mapped, still the image's bytes
    del param
    assert _memfds() == base
    failed = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    param = failed.tensors[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        failed.close(failed=True)
    assert _memfds() == base  # released at once: the half-bound model is not read again


def test_a_backup_that_fails_verify_passes_to_the_disk_and_is_not_kept(tmp_path):
    """The level-1 backup's bytes changed while asleep (a stray write into host memory): a verified
    wake had raised the mismatch and kept the backup, so the next wake without verify returned its
    damaged bytes as the image's. It passes to the disk, names the chunk, and drops the backup."""
    import ctypes

    import numpy as np

    from _preload_helpers import make_tiny_image

    import flashboot

    image = make_tiny_image(tmp_path)
    want = np.fromfile(flashboot.layouts.read_image(image, 0).path, dtype=np.uint8)
    with flashboot.load(image, 0, "cpu", stream=True) as loaded:
        ptrs = {n: t.data_ptr() for n, t in loaded.tensors.items()}
        loaded.sleep(level=1)
        ctypes.memset(loaded.lifecycle.backup.ptr + 5000, 0xAB, 16)
        woke = loaded.wake(verify=True, shm_dir=tmp_path / "no-shm")
        assert woke.source == "disk" and woke.verify_ms > 0 and loaded.lifecycle.backup is None
        assert re.fullmatch(r"failed verify: waking rank 0 of .*, from backup: chunk 1 \(bytes 4,096\.\.8,192\) has "
                            r"checksum 0x[0-9a-f]+, expected 0x[0-9a-f]+", woke.not_used["backup"])
        assert np.array_equal(loaded.arena.bytes()[:loaded.nbytes].numpy(), want)
        assert {n: t.data_ptr() for n, t in loaded.tensors.items()} == ptrs
        loaded.sleep(level=1)  # only the backup has the bytes: a damaged one fails, asleep, and is not kept
        ctypes.memset(loaded.lifecycle.backup.ptr + 5000, 0xAB, 16)
        with pytest.raises(FlashBootError, match=r"every source failed; backup: failed verify: .* chunk 1 \(bytes "
                                                 r"4,096\.\.8,192\)"):
            loaded.wake(source="backup", verify=True)
        assert loaded.arena.asleep and loaded.lifecycle.backup is None
        assert loaded.wake(shm_dir=tmp_path / "no-shm").source == "disk"
        assert np.array_equal(loaded.arena.bytes()[:loaded.nbytes].numpy(), want)


def test_a_wake_from_disk_reads_the_image_loaded_through_a_link_flipped_since(tmp_path):
    """An engine loads `current` (a link to v1) and sleeps at level 2; the deployment then flips
    `current` to v2. The wake had read v2's metadata through the link and refused the disk as
    "re-packed since the load", though v1, the image loaded, is whole where the load found it."""
    import os

    import numpy as np

    from _preload_helpers import TINY, make_image

    import flashboot
    from flashboot.benchmarks.checkpoints import make_checkpoint

    v1 = make_image(tmp_path / "v1", TINY, chunk_bytes=4096)
    make_checkpoint(str(tmp_path / "v2" / "ckpt"), TINY, seed=1, device="cpu")
    v2 = tmp_path / "v2" / "image"
    flashboot.prepack(str(tmp_path / "v2" / "ckpt"), str(v2), progress=False, chunk_bytes=4096)
    current = tmp_path / "current"
    os.symlink(v1, current)
    want = np.fromfile(flashboot.layouts.read_image(v1, 0).path, dtype=np.uint8)
    assert not np.array_equal(want, np.fromfile(flashboot.layouts.read_image(v2, 0).path, dtype=np.uint8))
    with flashboot.load(current, 0, "cpu", stream=True) as loaded:
        loaded.sleep(level=2)
        os.unlink(current)
        os.symlink(v2, current)
        woke = loaded.wake(shm_dir=tmp_path / "no-shm", verify=True)
        assert woke.source == "disk" and "disk" not in woke.not_used
        assert np.array_equal(loaded.arena.bytes()[:loaded.nbytes].numpy(), want)
        loaded.sleep(level=2)  # v1 itself re-packed: still refused by name
        os.unlink(current)
        shutil_rmtree_and_repack(tmp_path / "v1")
        with pytest.raises(FlashBootError, match=r"disk: .*v1/image/rank-0 was re-packed since the load"):
            loaded.wake(shm_dir=tmp_path / "no-shm")
        assert loaded.arena.asleep


def shutil_rmtree_and_repack(root):
    """``root``'s image pre-packed again from its checkpoint (a new job id: another metadata.json)."""
    import shutil

    import flashboot

    shutil.rmtree(root / "image")
    flashboot.prepack(str(root / "ckpt"), str(root / "image"), progress=False, chunk_bytes=4096)


def test_a_level1_sleep_refused_for_a_held_arena_takes_no_backup(tmp_path):
    """A holder maps the arena: sleep(level=1) had allocated (and on CUDA pinned) a backup of the
    image's whole size before the arena refused, and the awake image kept it until its next sleep
    or close. It is refused before anything moves."""
    from _preload_helpers import make_tiny_image

    import flashboot

    image = make_tiny_image(tmp_path)
    with flashboot.load(image, 0, "cpu", stream=True) as loaded:
        want = {n: t.clone() for n, t in loaded.tensors.items()}
        loaded.arena.share("holder 'engine-0'")
        for level in (1, 2):
            with pytest.raises(ArenaError, match=r"cannot sleep: 1 other process\(es\) map it \(holder 'engine-0'\)"):
                loaded.sleep(level=level)
            assert loaded.lifecycle is None or loaded.lifecycle.backup is None
        assert not loaded.arena.asleep and all(torch.equal(loaded.tensors[n], t) for n, t in want.items())
        loaded.arena.unshare("holder 'engine-0'")
        assert loaded.sleep(level=1).level == 1 and loaded.wake().source == "backup"
        assert all(torch.equal(loaded.tensors[n], t) for n, t in want.items())


def test_a_swap_by_handover_whose_wake_fails_before_the_handover_keeps_no_backup(tmp_path, monkeypatch):
    """A level-1 swap by handover (two CUDA arenas: forced here on the host backend) takes the
    outgoing image's backup before the incoming wake takes its segments. A wake that failed before
    that (no source has the incoming bytes) left the outgoing image serving, and holding a backup
    of its whole size (pinned on CUDA) for a sleep that never came."""
    import os
    import shutil

    from _preload_helpers import make_tiny_image

    import flashboot

    a_dir = make_tiny_image(tmp_path / "a")
    b_dir = shutil.copytree(a_dir, tmp_path / "b")
    monkeypatch.setattr(swapping, "_why_no_handover", lambda outgoing, incoming: "")
    with flashboot.load(a_dir, 0, "cpu", stream=True) as a, flashboot.load(b_dir, 0, "cpu", stream=True) as b:
        want = {n: t.clone() for n, t in a.tensors.items()}
        b.sleep(level=2)
        os.rename(b.source.path, tmp_path / "away")
        with pytest.raises(FlashBootError, match="no source has the bytes"):
            swapping.swap(a, b, level=1, shm_dir=tmp_path / "no-shm")
        assert not a.arena.asleep and b.arena.asleep
        assert a.lifecycle.backup is None and a.lifecycle.level == 0
        assert all(torch.equal(a.tensors[n], t) for n, t in want.items())
