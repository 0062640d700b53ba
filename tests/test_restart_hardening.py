"""Hostile cases of engine restarts from a holder and of engines sharing one in-process staged
copy (host backend): registries that are not what they should be, stale records and marks,
races between engines, unstage and a load."""

from __future__ import annotations

import json
import os
import threading
import types
import warnings

import pytest

import flashboot
from flashboot.arena import Arena
from flashboot.errors import FlashBootError
from flashboot.flashclone import holder as holders
from flashboot.flashclone import holder_registry
from flashboot.flashclone.holder import REQUESTS, Holder, hand_over, held_record
from flashboot.flashload.restart import HolderOption

from _clone_helpers import serving_holder, wait_until
from _image_helpers import rewrite_metadata
from _preload_helpers import make_tiny_image

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("hardening"))


def test_a_directory_among_the_requests_does_not_stop_the_holder(tmp_path):
    """An IsADirectoryError from reading a request had left poll_once raw, ending the holder's
    loop, which drops every arena it holds."""
    registry = tmp_path / "registry"
    holder = Holder(registry=registry)
    (registry / REQUESTS / "stray.json").mkdir()
    with serving_holder(holder) as t:
        arena = Arena.create(1 << 20, "cpu")
        try:
            desc = hand_over(arena, "weights", registry=registry, timeout_s=10)
            assert desc.pid == os.getpid() and t.is_alive()
        finally:
            arena.close()
    assert "weights" not in " ".join(holder.errors)
    assert any("stray" in e and "not a regular file (a directory)" in e for e in holder.errors), holder.errors


def test_a_named_pipe_for_a_held_record_is_refused_not_waited_on(tmp_path):
    """read_text() of a named pipe waits for a writer forever: every engine's early call hung."""
    registry = tmp_path / "registry"
    Holder(registry=registry).close()
    os.mkfifo(registry / "held" / "weights.json")
    got = []

    def ask():
        try:
            held_record("weights", registry=registry)
        except FlashBootError as exc:
            got.append(str(exc))

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "held_record waited on a named pipe"
    assert got and "weights.json: not a regular file (a named pipe)" in got[0]


def test_a_full_registry_at_the_hand_over_warns_and_keeps_the_load(image, tmp_path, monkeypatch):
    """ENOSPC writing the request had escaped flashboot.load as a bare OSError after the load
    had finished (its arena left to the garbage collector) and left a temporary behind."""
    registry = tmp_path / "registry"
    Holder(registry=registry).close()

    def full(body, f):
        f.write("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(holder_registry, "json", types.SimpleNamespace(dump=full, loads=json.loads))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = flashboot.load(image, 0, "cpu", holder=registry)
    with loaded:
        name = loaded.report.details["not_restored"].split("'")[1]
        assert f"cannot write {REQUESTS}/{name}.json: No space left on device" in loaded.report.details["hand_over_error"]
        assert loaded.tensors
    assert any("could not hand it to the holder" in str(w.message) for w in caught)
    assert os.listdir(registry / REQUESTS) == []


def test_a_held_record_whose_holder_pid_now_names_another_process_is_not_held(image, tmp_path):
    """A killed holder's record names its pid; once that pid is reused (a holder restarted in a
    fresh container gets the same one), the record passed for held: the early call and the
    staging were skipped, and the load took the fds of whatever process had the pid now."""
    import subprocess

    from flashboot.errors import ArenaError
    from flashboot.flashclone.holder import held_descriptor
    from flashboot.flashload.restart import held_here

    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        with pytest.warns(RuntimeWarning, match="nothing is held"):
            flashboot.load(image, 0, "cpu", holder=registry).close()
        assert held_here(registry, image, 0, "cpu")
        name = HolderOption(registry=registry).name_for(image, 0, "cpu")
        record = json.loads((registry / "held" / f"{name}.json").read_text())
    other = subprocess.Popen(["sleep", "60"])  # the pid the killed holder had, reused by another process
    try:
        record["holder_pid"] = record["descriptor"]["pid"] = other.pid
        (registry / "held" / f"{name}.json").write_text(json.dumps(record))
        assert not held_here(registry, image, 0, "cpu")
        with pytest.raises(ArenaError, match=rf"is gone: its holder \(pid {other.pid}\) has exited; pid {other.pid} "
                                             "now names another process"):
            held_descriptor(name, registry=registry)
        with warnings.catch_warnings(record=True) as caught:  # and the hand-over finds no holder
            warnings.simplefilter("always")
            loaded = flashboot.load(image, 0, "cpu", holder={"registry": registry, "handover_timeout_s": 0.2})
        assert any(f"pid {other.pid} now names another process" in str(w.message) for w in caught)
        with loaded:
            assert loaded.report.mode != "held"
            assert "now names another process" in loaded.report.details["not_restored"]
    finally:
        other.kill()
        other.wait()


def test_a_restart_refuses_an_arena_a_holder_of_an_older_protocol_keeps(image, tmp_path):
    """A held record that names no protocol is an older FlashBoot's holder's (it takes no lock, and
    does not see this FlashBoot's requests): a restart had bound its arena unsaid. It is refused
    naming both protocols, not mapped, and the load goes on normally."""
    from flashboot.flashload.restart import held_here

    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        with pytest.warns(RuntimeWarning, match="nothing is held"):
            flashboot.load(image, 0, "cpu", holder=registry).close()
        name = HolderOption(registry=registry).name_for(image, 0, "cpu")
        path = registry / "held" / f"{name}.json"
        record = json.loads(path.read_text())
        del record["protocol"]  # its fds still the live holder's: only the protocol tells
        path.write_text(json.dumps(record))
        assert not held_here(registry, image, 0, "cpu")
        with pytest.warns(RuntimeWarning, match=rf"the arena held as '{name}' in registry .* is refused: its holder "
                                                rf"\(pid {os.getpid()}\) speaks holder protocol 1 \(an older "
                                                r"FlashBoot's\); this FlashBoot speaks holder protocol 2"):
            loaded = flashboot.load(image, 0, "cpu", holder=registry)
        with loaded:
            assert loaded.report.mode != "held" and "protocol 1" in loaded.report.details["not_restored"]
            assert loaded.report.details["handed_over_as"] == name


def test_two_images_in_folders_of_one_name_each_restart_from_their_own_arena(image, tmp_path):
    """Images packed into folders of one name (``a/image``, ``b/image``) were held under one
    default name: each engine's hand-over replaced the other's arena, and neither ever restarted
    from the holder. A folder name of 250 characters made every hand-over fail (ENAMETOOLONG)."""
    import shutil

    other = tmp_path / "b" / image.name
    shutil.copytree(image, other)
    meta = json.loads((other / "rank-0" / "metadata.json").read_text())
    meta["note"] = "another pack"
    rewrite_metadata(other / "rank-0", meta)
    long_named = tmp_path / ("x" * 250)
    shutil.copytree(image, long_named)
    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for img in (image, other, long_named):
                with flashboot.load(img, 0, "cpu", holder=registry) as first:
                    assert "handed_over_as" in first.report.details, first.report.details
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for img in (image, other, long_named):
                with flashboot.load(img, 0, "cpu", holder=registry) as again:
                    assert again.report.mode == "held"
                    assert again.report.details["holder_name"].startswith(img.name[:64] + "-")

    with pytest.raises(FlashBootError, match="held-arena name is 250 characters, more than 200"):
        HolderOption(registry=registry, name="n" * 250)  # refused when the options are made, not at each hand-over


def test_a_lock_file_that_cannot_be_opened_is_named_not_a_bare_oserror(image, tmp_path):
    """A staging folder this process cannot write (read-only, another user's) made an engine's
    load fail with a bare OSError from the open of ``rank-R.users``/``rank-R.lock``; a directory
    in the lock file's place takes the same path here (root writes anywhere)."""
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload import staging

    shm = tmp_path / "shm"
    paths = shm_files.staged_paths(image, 0, shm)
    paths.users.mkdir(parents=True)
    with pytest.raises(FlashBootError, match=rf"cannot open the lock file {paths.users}: Is a directory; .*shm-dir"):
        staging.stage_for_load(image, 0, timeout_s=5, shm_dir=shm)
    paths.users.rmdir()
    paths.lock.mkdir()
    with pytest.raises(FlashBootError, match=rf"cannot open the lock file {paths.lock}: Is a directory"):
        staging.stage_rank(image, 0, shm_dir=shm)
    paths.lock.rmdir()
    assert sorted(p.name for p in paths.dir.iterdir()) == []  # nothing staged, no .users left


def test_unstage_as_an_engine_takes_the_copy_does_not_remove_it_under_the_engine(image, tmp_path, monkeypatch):
    """unstage checked that no engine held ``rank-R.users`` and then removed the rank's files: an
    engine that took the copy in between (here: at unstage's listing of the folder) had it, and
    its ``.users``, removed under its load."""
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload import staging

    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)  # `flashboot preload DIR`
    paths = shm_files.staged_paths(image, 0, shm)
    want = shm_files.rank_source(image, 0).path.read_bytes()
    real_listdir, engine = os.listdir, []

    def listdir(where="."):  # unstage lists the folder it opened (its fd)
        if isinstance(where, int) and os.readlink(f"/proc/self/fd/{where}") == str(paths.dir) and not engine:
            engine.append(staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm))  # an engine arrives then
        return real_listdir(where)

    monkeypatch.setattr(os, "listdir", listdir)
    try:
        with pytest.raises(FlashBootError, match=r"rank-0 of .* is being loaded by an engine"):
            staging.unstage(image, shm_dir=shm)
        assert engine and paths.image.read_bytes() == want and paths.ready.exists()
        assert staging._same_file(paths.users, engine[0]._fd)  # the engine's hold is the file others see
    finally:
        monkeypatch.undo()
        if engine:
            engine[0].release()
    assert paths.ready in staging.unstage(image, shm_dir=shm)
    assert not paths.dir.exists()


def test_a_stager_whose_folder_is_removed_before_its_lock_makes_it_again(image, tmp_path, monkeypatch):
    """The last engine out (or an unstage) removes the emptied staging folder: a stager between
    its mkdir and its lock's open failed with a bare FileNotFoundError."""
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload import staging

    shm = tmp_path / "shm"
    real, removed = staging.make_dir, []

    def make_dir(path):
        real(path)
        if not removed:  # removed by another process right after it was made
            removed.append(os.rmdir(path))
        return path

    monkeypatch.setattr(staging, "make_dir", make_dir)
    result = staging.stage_rank(image, 0, shm_dir=shm)
    assert removed and not result.skipped
    paths = shm_files.staged_paths(image, 0, shm)
    assert paths.image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()
    staging.unstage(image, shm_dir=shm)


def test_a_failed_re_adoption_keeps_the_arena_held_before_it(tmp_path, monkeypatch):
    """A hand-over under a name already held whose record could not be written (a full disk) had
    dropped the arena held before it from the holder's books without closing it: neither a
    release nor the holder's close ever gave its memory back."""
    holder = Holder(registry=tmp_path / "registry")
    a, b = Arena.create(1 << 20, "cpu"), Arena.create(1 << 20, "cpu")
    try:
        first = holder.adopt("w", a.export())
        monkeypatch.setattr(holder.kv, "put", lambda *args: (_ for _ in ()).throw(FlashBootError("disk full")))
        with pytest.raises(FlashBootError, match="disk full"):
            holder.adopt("w", b.export())
        monkeypatch.undo()
        assert holder.held["w"] is first and not first.arena.closed
        assert held_record("w", registry=tmp_path / "registry")["descriptor"]["arena_id"] == a.arena_id
        assert holder.release("w") and first.arena.closed and first.fds == []
    finally:
        holder.close()
        a.close()
        b.close()


def test_an_engine_whose_hand_over_fails_leaves_the_arena_held_before_it_listed_and_restartable(tmp_path):
    """A hand-over under a held name that failed (the engine killed before the holder took its
    arena) answered the engine by replacing the held arena's record with the error: the arena
    stayed mapped by the holder, but no restart found it ('no arena is held') and `hold --list`
    showed only the error. The record stays, the answer on it."""
    import dataclasses

    from flashboot.errors import ArenaError
    from flashboot.flashclone.holder import open_held

    registry = tmp_path / "registry"
    a, b = Arena.create(1 << 20, "cpu"), Arena.create(1 << 20, "cpu")
    a.bytes().numpy()[:] = 7
    dead = dataclasses.replace(b.export(), pid=2**22 - 3)  # its engine is gone
    try:
        with serving_holder(Holder(registry=registry)):
            hand_over(a, "w", registry=registry, timeout_s=10)
            with pytest.raises(ArenaError, match=r"could not adopt 'w': process 4194301 has exited .*\(it keeps the "
                                                 r"arena it held as 'w' before\)"):
                hand_over(types.SimpleNamespace(export=lambda: dead, share=lambda who: None), "w", registry=registry,
                          timeout_s=10)
            with open_held("w", registry=registry) as held:
                assert held.arena_id == a.arena_id and int(held.bytes().numpy().min()) == 7
    finally:
        a.close()
        b.close()


def test_a_release_whose_record_cannot_be_removed_keeps_the_arena_releasable(tmp_path, monkeypatch):
    """release() took the arena off the holder's books before removing its record: a removal that
    failed (EIO, a lost store) left the arena mapped and held by no one, never to be released."""
    holder = Holder(registry=tmp_path / "registry")
    a = Arena.create(1 << 20, "cpu")
    try:
        item = holder.adopt("x", a.export())
        real = holder.kv.delete
        monkeypatch.setattr(holder.kv, "delete", lambda *args: (_ for _ in ()).throw(FlashBootError("EIO")))
        with pytest.raises(FlashBootError, match="EIO"):
            holder.release("x")
        assert holder.held["x"] is item and not item.arena.closed  # still held, as its record says
        monkeypatch.setattr(holder.kv, "delete", real)
        assert holder.release("x") and item.arena.closed and item.fds == []
        assert held_record("x", registry=tmp_path / "registry") is None
    finally:
        holder.close()
        a.close()


@pytest.mark.parametrize("value", ["", {"registry": ""}, {"registry": 123}, {"store": ""}, {"store": 5}])
def test_an_empty_or_mistyped_registry_or_store_is_refused_by_name(value):
    """holder="" was the current directory as the registry (its requests/ and held/ made there),
    a number a bare TypeError, and a store of 5 or "" failed only at every engine start."""
    with pytest.raises(FlashBootError, match=r"holder (registry|store) must be a non-empty .* string, got "):
        HolderOption.of(value)


def test_the_last_engine_out_whose_rank_lock_cannot_be_opened_keeps_the_copy_and_returns(image, tmp_path):
    """The last engine's release takes the rank's lock to remove the copy; a lock that cannot be
    opened (here a directory in its place) must leave the copy, not fail the finished load."""
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload import staging

    shm = tmp_path / "shm"
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    paths = shm_files.staged_paths(image, 0, shm)
    assert copy.staged_here
    paths.lock.mkdir()
    assert copy.release() is False
    assert paths.ready.exists() and paths.image.exists()
    paths.lock.rmdir()
    staging.unstage(image, shm_dir=shm)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1])
def test_hand_over_and_release_refuse_a_timeout_that_is_no_deadline(bad, tmp_path):
    """hand_over(timeout_s=nan) with no holder running waited forever (no deadline is ever
    reached), as did release() of a held name; a negative one timed out saying "within -1 s"."""
    registry = tmp_path / "registry"
    holder = Holder(registry=registry)
    arena = Arena.create(1 << 20, "cpu")
    try:
        holder.adopt("w", arena.export())
        with pytest.raises(FlashBootError, match="hand_over timeout_s must be a finite number of seconds"):
            hand_over(arena, "x", registry=registry, timeout_s=bad)
        with pytest.raises(FlashBootError, match="release timeout_s must be a finite number of seconds"):
            holders.release("w", registry=registry, timeout_s=bad)
        assert os.listdir(registry / REQUESTS) == []  # refused before any request was written
    finally:
        holder.close()
        arena.close()


def test_unstage_refused_by_a_users_file_it_cannot_open_lets_go_of_the_rank_lock(image, tmp_path):
    """An unstage whose rank-R.users could not be opened kept the rank's lock fd open (leaked):
    every later stager of the rank in that process was refused as busy."""
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload import staging

    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    paths = shm_files.staged_paths(image, 0, shm)
    paths.users.mkdir()
    with pytest.raises(FlashBootError, match=rf"cannot open the lock file {paths.users}: Is a directory"):
        staging.unstage(image, shm_dir=shm)
    assert not paths.lock.exists()  # let go and removed: a stager is not refused by an unstage that ended
    assert staging.stage_rank(image, 0, shm_dir=shm).skipped
    paths.users.rmdir()
    assert paths.ready in staging.unstage(image, shm_dir=shm)


def test_a_held_record_that_is_not_a_json_object_is_refused_by_name(image, tmp_path):
    """A record holding a JSON list (a damaged or hand-edited file) made every engine's early call
    and restart fail with a bare AttributeError; it is now the holder's error, and a normal load."""
    from flashboot.flashload.restart import held_here

    registry = tmp_path / "registry"
    Holder(registry=registry).close()
    name = HolderOption(registry=registry).name_for(image, 0, "cpu")
    (registry / "held" / f"{name}.json").write_text("[1]")
    assert not held_here(registry, image, 0, "cpu")
    with pytest.raises(FlashBootError, match=rf"held/{name}\.json is a JSON list, not an object"):
        held_record(name, registry=registry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = flashboot.load(image, 0, "cpu", holder={"registry": registry, "handover_timeout_s": 0.2})
    with loaded:
        assert loaded.report.mode != "held"
        assert loaded.report.details["not_restored"].startswith(f"the holder cannot be asked for {name!r} (registry ")
        assert "not an object" in loaded.report.details["not_restored"]
    assert any("not an object" in str(w.message) for w in caught)


def test_engines_on_different_gpus_that_each_call_theirs_cuda0_keep_their_held_arenas_apart(image, monkeypatch):
    """Engines of one image on different GPUs, each started with its own CUDA_VISIBLE_DEVICES (one
    per GPU, a common data-parallel set-up), each call their GPU cuda:0. Named and identified by
    cuda:0, each hand-over replaced the others' held arena, and a restart on GPU 1 passed the
    identity of the arena held on GPU 0. The name and the identity now carry the GPU's PCI address."""
    from flashboot import _cuda, pinning
    from flashboot.flashload import restart
    from flashboot.integrations.engine_bind import _rank_holder

    gpu = {"now": "0000:18:00.0"}
    monkeypatch.setattr(pinning, "gpu_pci_bus_id", lambda dev: gpu["now"])
    monkeypatch.setattr(_cuda, "cuda_available", lambda: True)  # names and records only: no GPU is touched
    monkeypatch.setattr(_cuda, "device_count", lambda: 1)
    option = HolderOption(registry="-")
    on_first = option.name_for(image, 0, "cuda:0")
    named_first = _rank_holder(types.SimpleNamespace(holder={"registry": "-", "name": "llama"}), 0,
                               restart.Device.parse("cuda:0")).name
    record = {"descriptor": {}, "holder_pid": os.getpid(), "protocol": holders.HOLDER_PROTOCOL,
              "image": {"image_dir": os.path.realpath(image), "rank": 0, "device": "cuda:0", "gpu": gpu["now"],
                        "metadata_sha256": flashboot.layouts.image.read_job(image).metadata_sha256[0]}}
    monkeypatch.setattr(holders, "held_record", lambda name, **where: record)
    assert restart.held_here(option, image, 0, "cuda:0")
    gpu["now"] = "0000:2a:00.0"  # the other engine: its cuda:0 is another GPU
    assert on_first.endswith(".rank0.gpu0000-18-00.0")
    assert option.name_for(image, 0, "cuda:0") == on_first.replace("gpu0000-18-00.0", "gpu0000-2a-00.0")
    assert named_first == "llama.rank0.gpu0000-18-00.0"
    assert _rank_holder(types.SimpleNamespace(holder={"registry": "-", "name": "llama"}), 0,
                        restart.Device.parse("cuda:0")).name == "llama.rank0.gpu0000-2a-00.0"
    assert not restart.held_here(option, image, 0, "cuda:0")  # held on the other GPU
    assert option.name_for(image, 0, "cpu").endswith(".rank0.cpu")  # the host backend as before


def test_an_image_re_packed_while_held_is_not_held_here(tmp_path):
    """held_here compared the record's folder, rank and device alone: an image re-packed since the
    hand-over passed for held, so the engine's early call and its staging were skipped and the load
    (refusing the old arena by its metadata digest) then streamed from disk."""
    from flashboot.flashload.restart import held_here

    image = make_tiny_image(tmp_path / "img")
    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        with pytest.warns(RuntimeWarning, match="nothing is held"):
            flashboot.load(image, 0, "cpu", holder=registry).close()
        assert held_here(registry, image, 0, "cpu")
        flashboot.prepack(str(tmp_path / "img" / "ckpt"), str(image), progress=False, chunk_bytes=8192)  # re-packed
        assert not held_here(registry, image, 0, "cpu")
        with pytest.warns(RuntimeWarning, match="another image or version"):
            flashboot.load(image, 0, "cpu", holder=registry).close()  # loads normally, hands the new one over
        assert held_here(registry, image, 0, "cpu")
