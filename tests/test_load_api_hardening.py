"""The load API as a hostile but realistic caller meets it (host backend): flashboot.load and
prepare's arguments in their plausible wrong forms, bind's refusals, the report and the views
after close."""

import pytest
import torch
from flashboot.layouts.tiny import save_tiny_model, tiny_config

import flashboot
from flashboot.errors import FlashBootError, LayoutError
from flashboot.flashload import staging


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen3-MoE (random weights) pre-packed at tp=1; nothing staged (loads stream)."""
    root = tmp_path_factory.mktemp("api")
    save_tiny_model("qwen3_moe", root / "hf", dtype=torch.bfloat16)
    flashboot.prepack(str(root / "hf"), str(root / "image"), chunk_bytes=16384, progress=False)
    return root / "image"


def _meta_model():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16)


# --------------------------------------------------------------------------------- bind
@pytest.mark.parametrize("value, refused", [
    ({"nope": torch.zeros(8)}, "'nope', which is not a buffer"),
    ({"model.rotary_emb.inv_freq": [1.0] * 8}, "must be a torch.Tensor, got list"),
    ({"model.rotary_emb.inv_freq": torch.zeros(3)}, "has shape [3], the buffer of Qwen3MoeForCausalLM has [8]"),
])
def test_a_bad_buffers_entry_is_refused_before_any_parameter_is_rebound(qwen, value, refused):
    model = _meta_model()
    with flashboot.load(qwen, 0, "cpu") as loaded:
        with pytest.raises(LayoutError) as e:
            flashboot.bind(model, loaded, buffers=value)
        assert refused in str(e.value) and "was not changed" in str(e.value)
        # the module is as it was: every parameter still on the meta device (had all been rebound)
        assert all(p.is_meta for p in model.parameters())
        report = flashboot.bind(model, loaded)  # and binds once the caller drops the bad entry
        assert not report.missing and len(report.bound) == len(list(model.parameters()))


def test_bind_refuses_a_prepare_handle_and_a_closed_image_by_name(qwen):
    model = _meta_model()
    handle = flashboot.prepare(qwen, 0, "cpu")
    try:
        with pytest.raises(FlashBootError, match="got PreparedLoad .*flashboot.load\\(..., prepared=handle\\)"):
            flashboot.bind(model, handle)  # had been a bare TypeError (its tensors are None)
    finally:
        handle.close()
    loaded = flashboot.load(qwen, 0, "cpu")
    loaded.close()
    for strict in (True, False):  # had been "25 missing from the image", or nothing bound without a word
        with pytest.raises(FlashBootError, match="is closed"):
            flashboot.bind(model, loaded, strict=strict)
    assert all(p.is_meta for p in model.parameters())


# --------------------------------------------------------------------------------- load's arguments
def test_the_image_directory_may_be_bytes_and_anything_else_that_is_no_path_is_refused_by_name(qwen):
    with flashboot.load(bytes(qwen), 0, "cpu") as loaded:  # as os functions take it (was a bare TypeError)
        assert loaded.nbytes > 0 and len(loaded.tensors) == loaded.report.tensors
    for bad in (None, 3):
        with pytest.raises(FlashBootError, match=f"must be a path .*got {type(bad).__name__}"):
            flashboot.load(bad, 0, "cpu")


def test_an_empty_image_path_is_refused_not_read_as_the_current_directory(qwen, monkeypatch):
    monkeypatch.chdir(qwen)  # an image is there: '' had loaded it
    for empty in ("", b""):
        with pytest.raises(FlashBootError, match="the image directory is an empty path"):
            flashboot.load(empty, 0, "cpu")


@pytest.mark.parametrize("option, refused", [
    ({"tp": "1"}, "tp must be None or an int >= 1, got '1'"),  # had been "packed for tp=1, requested tp=1"
    ({"tp": True}, "tp must be None or an int >= 1, got True"),  # had been taken for tp=1
    ({"ep": 0}, "ep must be None or an int >= 1, got 0"),
    ({"ep": 1.0}, "ep must be None or an int >= 1, got 1.0"),
    ({"expected_key": "qwen3"}, "expected_key must be None, an ImageKey or a mapping of its fields, got str"),
])
def test_tp_ep_and_expected_key_of_the_wrong_type_are_refused_by_name(qwen, option, refused):
    with pytest.raises(FlashBootError) as e:
        flashboot.load(qwen, 0, "cpu", **option)
    assert refused in str(e.value)


def test_counts_numpy_computed_are_taken_as_the_ints_they_hold(qwen):
    np = pytest.importorskip("numpy")
    with flashboot.load(qwen, np.arange(1)[0], "cpu", tp=np.int32(1), ep=np.int64(1)) as loaded:
        assert loaded.report.rank == 0 and type(loaded.report.rank) is int  # JSON-dumpable


@pytest.mark.parametrize("never", ["served", "staged", "stream=False"])
def test_a_ring_size_for_a_load_that_never_streams_is_refused_not_ignored(qwen, tmp_path, never):
    staged = None
    if never == "staged":
        staging.stage_rank(qwen, 0, shm_dir=tmp_path / "shm")
        staged = flashboot.stage(qwen, 0, "cpu", shm_dir=tmp_path / "shm")
    options, said = {"served": ({"served": True}, "served=True"), "staged": ({"staged": staged}, "staged="),
                     "stream=False": ({"stream": False}, "stream=False")}[never]
    try:
        with pytest.raises(FlashBootError, match=f"sizes a streamed load's ring; a {said} load never streams"):
            flashboot.load(qwen, 0, "cpu", timeout_s=1, stream_buffer_bytes=1 << 20, **options)
    finally:
        if staged is not None:
            staged.close()


def test_a_staged_load_refuses_another_staging_root_than_its_stage(qwen, tmp_path):
    staging.stage_rank(qwen, 0, shm_dir=tmp_path / "shm")
    with flashboot.stage(qwen, 0, "cpu", shm_dir=tmp_path / "shm") as staged:
        with pytest.raises(FlashBootError, match=f"shm_dir='{tmp_path}/elsewhere' differs from the staging root "
                                                 f"flashboot.stage\\(\\) used \\({tmp_path}/shm\\)"):
            flashboot.load(qwen, 0, "cpu", staged=staged, shm_dir=tmp_path / "elsewhere")
        with flashboot.load(qwen, 0, "cpu", staged=staged, shm_dir=f"{tmp_path}/shm/") as loaded:  # the same root
            assert loaded.report.mode.startswith("host")


# --------------------------------------------------------------------------------- the report
def test_a_report_without_a_copy_dumps_as_strict_json(qwen):
    import json

    from flashboot.flashload.report import LoadReport

    # what a restart from a holder reports: views, no copy (h2d_ms 0)
    held = LoadReport(mode="held", device="cpu", rank=0, nbytes=4096, tensors=2, alloc_ms=0.4, bind_ms=0.1,
                      total_ms=0.9)
    d = json.loads(json.dumps(held.to_dict(), allow_nan=False))  # had held inf: written as 'Infinity'
    assert d["h2d_gbps"] is None and d["gbps"] == 4096 / 0.9e-3 / 1e9
    assert "H2D - B/s" in held.summary()
    with flashboot.load(qwen, 0, "cpu") as loaded:  # a load's rates are the numbers they were
        d = json.loads(json.dumps(loaded.report.to_dict(), allow_nan=False))
        assert d["h2d_gbps"] == loaded.report.nbytes / (loaded.report.h2d_ms * 1e-3) / 1e9 > 0


# --------------------------------------------------------------------------------- prepare, then load
def test_a_prepared_load_takes_its_staging_root_however_it_is_spelled(qwen, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLASHBOOT_SHM", raising=False)
    for prepared_with, loaded_with in (("shm", "shm/"), ("shm", tmp_path / "shm"), (None, "/dev/shm/flashboot")):
        handle = flashboot.prepare(qwen, 0, "cpu", shm_dir=prepared_with)
        try:  # each had been refused as another root than prepare's
            with flashboot.load(qwen, 0, "cpu", prepared=handle, shm_dir=loaded_with) as loaded:
                assert loaded.report.mode == "streamed from disk, prepared"
        finally:
            handle.close()
    handle = flashboot.prepare(qwen, 0, "cpu", shm_dir="shm")
    try:
        with pytest.raises(FlashBootError, match=f"shm_dir='other' differs from the staging root flashboot.prepare"
                                                 f"\\(\\) used \\(shm\\)"):
            flashboot.load(qwen, 0, "cpu", prepared=handle, shm_dir="other")
        with flashboot.load(qwen, 0, "cpu", prepared=handle) as loaded:  # the refusal left the handle usable
            assert len(loaded.tensors) == loaded.report.tensors > 0
    finally:
        handle.close()


def test_the_report_names_the_source_of_the_bytes_and_why(qwen, tmp_path):
    with flashboot.load(qwen, 0, "cpu", shm_dir=tmp_path / "shm") as loaded:  # nothing staged, no preloader
        d = loaded.report.details
        assert d["source"] == "disk" and d["source_why"].startswith("no preloader runs for")
    staging.stage_rank(qwen, 0, shm_dir=tmp_path / "shm")
    with flashboot.load(qwen, 0, "cpu", shm_dir=tmp_path / "shm") as loaded:
        d = loaded.report.details  # the mode says "host" on the host backend, whatever the source
        assert loaded.report.mode == "host" and d["source"] == "pinned" and "staged copy" in d["source_why"]
    handle = flashboot.prepare(qwen, 0, "cpu", shm_dir=tmp_path / "shm")
    with flashboot.load(qwen, 0, "cpu", prepared=handle) as loaded:
        assert loaded.report.details["source"] == "pinned" and loaded.report.details["source_why"] == handle.why


def test_a_rank_directory_loads_as_its_job_finding_the_staged_copy_and_the_daemon(qwen, tmp_path):
    from _preload_helpers import Daemon

    rank_dir, shm = qwen / "rank-0", tmp_path / "shm"
    daemon = Daemon(qwen, shm)
    try:  # had waited out its timeout for a .ready keyed by the rank directory, then "no preloader is running"
        with flashboot.load(rank_dir, 0, "cpu", shm_dir=shm, served=True, timeout_s=5) as loaded:
            assert loaded.report.details["source"] == "served"
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == (rank_dir / "image.bin").read_bytes()
        with flashboot.load(rank_dir, 0, "cpu", shm_dir=shm) as loaded:  # had streamed from disk beside the copy
            assert loaded.report.details["source"] == "pinned"
    finally:
        daemon.close()
    with pytest.raises(LayoutError, match="holds rank 0 of 1, rank 1 was requested|rank 1 requested"):
        flashboot.load(rank_dir, 1, "cpu", shm_dir=shm)  # another rank than the directory's: still refused


def test_the_public_names_are_listed_before_first_use():
    import subprocess
    import sys

    # a fresh process: nothing of the load API imported yet, as in a notebook's first cell
    code = ("import sys, flashboot; names = dir(flashboot); "
            "assert {'load', 'prepare', 'bind', 'LoadedImage', 'StreamConfig'} <= set(names), names; "
            "assert 'flashboot.flashload.pipeline' not in sys.modules  # listing them imports nothing")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_restart_from_a_holder_checks_the_options_before_it_maps_the_held_arena(qwen, tmp_path):
    import warnings

    from _clone_helpers import serving_holder
    from flashboot.flashclone.holder import Holder

    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with flashboot.load(qwen, 0, "cpu", holder=registry) as first:  # loads, hands the arena over
                assert "handed_over_as" in first.report.details
        with flashboot.load(qwen, 0, "cpu", holder=registry) as again:
            assert again.report.mode == "held"
        # the last three had restarted from the held arena, the option taken unchecked
        for bad, refused in (({"rank": True}, "rank must be a non-negative int, got True"),
                             ({"tp": "1"}, "tp must be None or an int >= 1, got '1'"),
                             ({"stream_buffer_bytes": 0}, "buffer_bytes must be an int >= 8,192, got 0"),
                             ({"served": True, "stream": True}, "stream=True excludes served=True"),
                             ({"timeout_s": float("nan")}, "load timeout_s must be a finite number")):
            options = {"rank": 0, **bad}
            with pytest.raises(FlashBootError, match=refused.replace("(", "\\(")):
                flashboot.load(qwen, options.pop("rank"), "cpu", holder=registry, **options)


def test_every_plain_load_lists_the_one_time_costs_prepare_would_have_paid(qwen, tmp_path):
    with flashboot.load(qwen, 0, "cpu", shm_dir=tmp_path / "shm") as loaded:  # streamed: had listed none
        r = loaded.report
        assert r.details["source"] == "disk"
        assert r.details["one_time_ms"] == {k: round(v, 3) for k, v in
                                            (("metadata", r.metadata_ms), ("arena", r.alloc_ms), ("views", r.bind_ms))}
    handle = flashboot.prepare(qwen, 0, "cpu", shm_dir=tmp_path / "shm")
    with flashboot.load(qwen, 0, "cpu", prepared=handle) as loaded:  # prepare paid them
        assert "one_time_ms" not in loaded.report.details


def test_a_misspelt_expected_key_field_leaves_the_prepared_handle_usable(qwen):
    handle = flashboot.prepare(qwen, 0, "cpu")
    try:
        with pytest.raises(LayoutError, match="expected key names unknown fields \\['tp'\\]; known: model_id"):
            flashboot.load(qwen, 0, "cpu", prepared=handle, expected_key={"tp": 1})
        # refused before the handle was claimed: its early copy is still there for the load that follows
        with flashboot.load(qwen, 0, "cpu", prepared=handle, expected_key={"tp_size": 1}) as loaded:
            assert loaded.report.details["source"] == "disk" and len(loaded.tensors) == loaded.report.tensors
    finally:
        handle.close()


def test_prepare_checks_its_arguments_as_a_load_does(qwen):
    """prepare() had looked for a bytes path as "b'/path'", refused a rank numpy computed, taken a
    tp of "1" or an expected_key string only to fail at the load, and kept a rank's directory
    that the load, given it too, then refused as another image."""
    import numpy as np

    handle = flashboot.prepare(bytes(qwen), np.int64(0), "cpu")  # as os takes paths; a numpy rank
    try:
        assert handle.image_dir == str(qwen) and handle.rank == 0 and type(handle.rank) is int
    finally:
        handle.close()
    for options, refused in (({"tp": "1"}, "tp must be None or an int >= 1, got '1'"),
                             ({"ep": True}, "ep must be None or an int >= 1, got True"),
                             ({"expected_key": "qwen"}, "expected_key must be None, an ImageKey or a mapping")):
        with pytest.raises(FlashBootError, match=refused):
            flashboot.prepare(qwen, 0, "cpu", **options)
    handle = flashboot.prepare(qwen / "rank-0", 0, "cpu")
    try:
        with flashboot.load(qwen / "rank-0", 0, "cpu", prepared=handle) as loaded:
            assert len(loaded.tensors) == loaded.report.tensors
    finally:
        handle.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "5", True])
def test_a_prepared_handles_wait_and_close_refuse_a_bad_bound(qwen, bad):
    handle = flashboot.prepare(qwen, 0, "cpu")
    try:
        with pytest.raises(FlashBootError, match=r"wait timeout_s must be a finite number of seconds in \[0, "):
            handle.wait(bad)
        with pytest.raises(FlashBootError, match=r"close timeout_s must be a finite number of seconds in \[0, "):
            handle.close(bad)
        assert handle.wait(30) is handle and handle.wait(0) is handle  # 0: do not wait
    finally:
        handle.close()
    assert "closed)" in repr(handle)


def test_a_prepared_load_reports_what_prepare_verified_whatever_the_load_asked(qwen):
    """prepare(verify=True) checked the copy; a load then called with verify=False reported it
    "not verified"."""
    handle = flashboot.prepare(qwen, 0, "cpu", verify=True)
    try:
        with flashboot.load(qwen, 0, "cpu", prepared=handle, verify=False) as loaded:
            assert "checked by flashboot.prepare" in loaded.report.details["verified"], loaded.report.details
            assert "not verified" not in loaded.report.summary()
    finally:
        handle.close()


def test_a_closed_prepared_load_leaves_its_handle_no_views_into_freed_memory(qwen):
    """After a prepared load was closed, ``handle.tensors`` still held every view into the freed
    arena (the image's dict had been replaced, the handle's kept)."""
    handle = flashboot.prepare(qwen, 0, "cpu")
    loaded = flashboot.load(qwen, 0, "cpu", prepared=handle)
    held = loaded.tensors
    assert handle.tensors is held and len(held) == loaded.report.tensors > 0
    loaded.close()
    # lengths only: printing a dangling view reads freed memory (the test process had died on it)
    assert (len(handle.tensors), len(held), len(loaded.tensors)) == (0, 0, 0)


def test_a_prepared_load_waits_at_most_its_own_timeout(qwen, tmp_path):
    """``load(prepared=h, timeout_s=1)`` while the preparation still waits for a preloader's
    ``.ready`` had waited the handle's bound instead (its timeout_s + 120 s), whatever the load
    was told. Without a timeout of its own it still waits the handle's bound."""
    import json
    import os

    from flashboot.errors import WaitTimeoutError
    from flashboot.flashload import shm as shm_files
    from flashboot.procfs import proc_start_time

    shm = tmp_path / "shm"
    pid_file = shm_files.pid_file(qwen, shm)  # a live preloader (this process) that never stages rank 0
    pid_file.parent.mkdir(parents=True)
    pid_file.write_text(json.dumps({"pid": os.getpid(), "start_time": proc_start_time(os.getpid()), "serve": False,
                                    "ranks": None}))
    handle = flashboot.prepare(qwen, 0, "cpu", shm_dir=shm, mode="staged", timeout_s=4)
    assert handle.wait_bound_s == 4 + 120
    with pytest.raises(WaitTimeoutError,
                       match=r"waited its timeout_s of 1 s for flashboot.prepare\(\) to end; it still runs"):
        flashboot.load(qwen, 0, "cpu", prepared=handle, timeout_s=1)
    assert not handle.done, "the load waited for the preparation's own end, not its timeout"
    with pytest.raises(FlashBootError, match="is closed"):  # the timed-out load released it (once it ends)
        flashboot.load(qwen, 0, "cpu", prepared=handle)
    with pytest.raises(WaitTimeoutError, match=r"rank-0.ready"):  # ended by its own timeout, and released
        handle.wait(30)
    assert handle.arena is None or handle.arena.closed


def test_a_prepared_streamed_load_lists_the_rings_pin_as_paid_early_not_by_the_load(qwen, monkeypatch):
    """The ring of a prepared stream is pinned (CUDA) by prepare's thread; the load's report had
    listed that pin among its own phases (``pin_ms``), beside the wait that already held whatever
    of the preparation was left. A plain streamed load pins on its critical path and says so."""
    from flashboot.flashload import stream

    real_init = stream.Ring.__init__

    def pinned_ring(self, *args, **kwargs):  # as a CUDA ring's cuMemHostRegister would take
        real_init(self, *args, **kwargs)
        self.pin_ms = 40.0

    monkeypatch.setattr(stream.Ring, "__init__", pinned_ring)
    handle = flashboot.prepare(qwen, 0, "cpu", mode="stream")
    with flashboot.load(qwen, 0, "cpu", prepared=handle) as loaded:
        r = loaded.report
        assert (r.pin_ms, r.pinned_early_ms) == (0.0, 40.0) and "pin" not in r.phases(), r
    with flashboot.load(qwen, 0, "cpu", stream=True) as loaded:
        assert (loaded.report.pin_ms, loaded.report.pinned_early_ms) == (40.0, 0.0)
        assert loaded.report.details["one_time_ms"]["pin"] == 40.0


def test_a_close_that_gives_up_as_the_preparation_ends_still_releases_its_arena(qwen, monkeypatch):
    """close(timeout_s=0) (or a timed-out prepared load) between the preparation's last check of
    whether it was closed and its end: close said the thread would release the arena, the thread
    had already decided not to, and the arena stayed mapped under a closed handle for good."""
    import os
    import threading

    from flashboot.flashload import stream

    gate, real = threading.Event(), os.preadv
    monkeypatch.setattr(stream, "_preadv", lambda fd, bufs, off: gate.wait(30) and real(fd, bufs, off))
    handle = flashboot.prepare(qwen, 0, "cpu", mode="stream")
    said = []

    class CloseAsItEnds(threading.Event):
        def set(self):  # the thread has just decided whether its end releases
            try:
                handle.close(timeout_s=0)
            except FlashBootError as exc:
                said.append(exc)
            super().set()

    handle._done = CloseAsItEnds()
    gate.set()
    handle._thread.join(30)
    assert not handle._thread.is_alive() and handle.done
    assert said == [] and handle.arena.closed, (said, handle.arena)
    with pytest.raises(FlashBootError, match="is closed"):
        handle.wait(1)


def _flip_staged_byte(image, shm, at: int) -> str:
    from flashboot.flashload import shm as shm_files

    staged = shm_files.staged_paths(image, 0, shm).image
    with open(staged, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    return str(staged)


def test_a_checksum_mismatch_in_the_staged_copy_names_that_copy_not_the_image_file(qwen, tmp_path):
    """A byte flipped in the staged copy in shared memory was reported as a mismatch of the image
    file on disk ('.../rank-0/image.bin (rank 0) loaded into cpu: chunk 0 ...'), which then
    checked clean: the message names the copy the bytes came from, pinned here or served."""
    import re

    from flashboot.errors import ChecksumMismatchError
    from flashboot.flashload import service

    shm = tmp_path / "shm"
    staging.stage_rank(qwen, 0, shm_dir=shm)
    staged = _flip_staged_byte(qwen, shm, 9)
    image_file = str(qwen / "rank-0" / "image.bin")
    named = f"the staged copy {staged} of {image_file} (rank 0)"
    named_re = re.escape(named)
    with pytest.raises(ChecksumMismatchError, match="chunk 0") as e:
        flashboot.load(qwen, 0, "cpu", shm_dir=shm, verify=True)
    assert str(e.value).startswith(f"{named} loaded into cpu: "), e.value
    with flashboot.stage(qwen, 0, "cpu", shm_dir=shm) as early:
        with pytest.raises(ChecksumMismatchError, match=f"^{named_re} loaded into cpu: chunk 0"):
            flashboot.load(qwen, 0, "cpu", staged=early, verify=True)  # the load's shm_dir left out
    for asked in ({"verify": True}, {}):  # checked by prepare, or by the load
        handle = flashboot.prepare(qwen, 0, "cpu", shm_dir=shm, mode="staged", **asked)
        with pytest.raises(ChecksumMismatchError, match=f"^{named_re} (copied into cpu by flashboot.prepare|loaded "
                                                        "into cpu): chunk 0"):
            flashboot.load(qwen, 0, "cpu", prepared=handle, verify=True)
    service.start_background(staging.PreloadConfig(str(qwen), shm_dir=str(shm), serve=True), timeout_s=60)
    try:
        with pytest.raises(ChecksumMismatchError, match=f"^{named_re} loaded into cpu: chunk 0"):
            flashboot.load(qwen, 0, "cpu", served=True, shm_dir=shm, verify=True)
    finally:
        service.stop_service(qwen, shm, timeout_s=30)


def test_a_prepared_load_whose_image_link_was_moved_says_where_it_points_then_and_now(qwen, tmp_path):
    """A deployment's ``current`` link moved to another image between prepare() and the load was
    refused as 'cannot serve image .../current (prepared: .../current)': the same path twice."""
    import os
    import shutil

    other = tmp_path / "other"
    shutil.copytree(qwen, other)
    link = tmp_path / "current"
    link.symlink_to(qwen)
    handle = flashboot.prepare(link, 0, "cpu")
    try:
        link.unlink()
        link.symlink_to(other)
        with pytest.raises(FlashBootError) as e:
            flashboot.load(link, 0, "cpu", prepared=handle)
        assert f"which resolved to {os.path.realpath(qwen)} then and resolves to {os.path.realpath(other)} now" \
            in str(e.value), e.value
        with pytest.raises(FlashBootError, match=r"cannot serve image .*other \(prepared: .*current\)$"):
            flashboot.load(other, 0, "cpu", prepared=handle)  # another path: named as it was
        link.unlink()
        link.symlink_to(qwen)  # back: the handle serves it
        with flashboot.load(link, 0, "cpu", prepared=handle) as loaded:
            assert len(loaded.tensors) == loaded.report.tensors
    finally:
        handle.close()


def test_an_image_named_by_a_relative_path_wakes_from_disk_after_the_engine_changed_directory(qwen, tmp_path,
                                                                                                monkeypatch):
    """load('image') kept the relative path: after the engine changed directory its wake from disk
    looked for '<new cwd>/image' ('no such image directory'); the path is anchored where it was named."""
    monkeypatch.chdir(qwen.parent)
    with flashboot.load(qwen.name, 0, "cpu") as loaded:
        expected = bytes(loaded.arena.bytes()[:loaded.nbytes].numpy())
        monkeypatch.chdir(tmp_path)
        loaded.sleep(level=2)  # no backup: the bytes come back from the image on disk
        assert loaded.wake().source == "disk"
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == expected
        assert loaded.source.image_dir == str(qwen)
    monkeypatch.chdir(qwen.parent)
    handle = flashboot.prepare(qwen.name, 0, "cpu")
    try:
        assert handle.image_dir == str(qwen)
    finally:
        handle.close()


_EXIT_WITH_TWO_UNUSED = """
import os, sys, time, weakref
import torch
import flashboot
from flashboot.flashload import prepared, stream
from flashboot.flashload.sources.disk import DiskSource

class InOrder:  # _live in the order the handles were made (a WeakSet's order is its hashes')
    def __init__(self):
        self.refs = []
    def add(self, h):
        self.refs.append(weakref.ref(h))
    def discard(self, h):
        self.refs = [r for r in self.refs if r() is not None and r() is not h]
    def __iter__(self):
        return iter([h for h in (r() for r in self.refs) if h is not None])

prepared._live = InOrder()
slow_file = os.path.realpath(sys.argv[1])
real = os.preadv

def read(fd, bufs, off):  # the first image's read takes longer than the second's
    time.sleep(0.8 if os.path.realpath(f"/proc/self/fd/{fd}").startswith(slow_file) else 0.1)
    return real(fd, bufs, off)

stream._preadv = read
DiskSource.verify_prepared = lambda self, handle, where, checked: print("verified at exit", handle.image_dir)
first = flashboot.prepare(sys.argv[1], 0, "cpu", mode="stream", verify=True)
second = flashboot.prepare(sys.argv[2], 0, "cpu", mode="stream", verify=True)
print("exiting")
"""


def test_at_exit_every_unused_handle_stops_at_once_none_goes_on_into_its_verify(qwen, tmp_path):
    """The exit hook closed the unused handles one at a time: while it waited for the first one's
    copy, a later one finished its own and went on into its verify (a checksum of the whole image,
    ~2x the copy on the host), which the exit then waited for too."""
    import shutil

    from _python import run_python

    second = tmp_path / "second"
    shutil.copytree(qwen, second)
    out = run_python("-c", _EXIT_WITH_TWO_UNUSED, str(qwen), str(second))
    assert out.splitlines() == ["exiting"], out


class _PositionIds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0), persistent=False)


class _CustomNet(torch.nn.Module):
    """A research model: an ``_init_weights`` for the layers it knows, an int non-persistent buffer."""

    sets_positions = False

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.pos = _PositionIds()

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight)
        if isinstance(module, _PositionIds) and self.sets_positions:
            module.position_ids.copy_(torch.arange(16).unsqueeze(0))


def test_an_int_buffer_the_models_init_skips_is_refused_not_reported_recomputed(tmp_path):
    """bind() recomputes a non-persistent buffer by the model's ``_init_weights``; an int buffer it
    skipped (position_ids) was reported 'recomputed' holding whatever torch.empty found (a NaN
    marks a skipped float one; no int value is free for that)."""
    import json

    from safetensors.torch import save_file

    ckpt = tmp_path / "net"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in _CustomNet().state_dict().items()}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "custom_net"}))
    flashboot.prepack(str(ckpt), str(tmp_path / "image"), progress=False)
    with flashboot.load(tmp_path / "image", 0, "cpu") as loaded:
        with torch.device("meta"):
            model = _CustomNet()
        with pytest.raises(LayoutError, match=r"cannot recompute non-persistent buffer\(s\) pos.position_ids of "
                                              "_CustomNet on cpu"):
            flashboot.bind(model, loaded)
        with torch.device("meta"):
            model = _CustomNet()
        report = flashboot.bind(model, loaded, strict=False)
        assert report.missing == ["pos.position_ids"] and report.recomputed == []
        with torch.device("meta"):
            model = _CustomNet()
        model.sets_positions = True
        report = flashboot.bind(model, loaded)
        assert report.recomputed == ["pos.position_ids"]
        assert torch.equal(model.pos.position_ids, torch.arange(16).unsqueeze(0))


@pytest.mark.parametrize("option, value", [("stream", 0), ("stream", "false"), ("served", "no"), ("verify", "false"),
                                           ("verify", 1)])
def test_a_flag_that_is_no_bool_is_refused_by_name_not_read_as_truthy_or_ignored(qwen, option, value):
    """stream=0 (never stream) streamed all the same, read as None (decide); served="no" asked the
    daemon; verify="false" verified."""
    with pytest.raises(FlashBootError, match=f"{option} must be .*True or False, got {type(value).__name__} "
                                             f"{value!r}"):
        flashboot.load(qwen, 0, "cpu", timeout_s=1, **{option: value})
    if option == "verify":
        with pytest.raises(FlashBootError, match=f"verify must be None, True or False, got {type(value).__name__}"):
            flashboot.prepare(qwen, 0, "cpu", verify=value)


def test_numpy_bools_are_the_flags_they_hold(qwen, tmp_path):
    import numpy as np

    from flashboot.errors import WaitTimeoutError

    with flashboot.load(qwen, 0, "cpu", verify=np.bool_(True), stream=np.bool_(True)) as loaded:
        assert "verified" in loaded.report.details and loaded.report.details["source"] == "disk"
    with pytest.raises(WaitTimeoutError, match="rank-0.ready"):  # never streams: waits for the staged copy
        flashboot.load(qwen, 0, "cpu", stream=np.bool_(False), shm_dir=tmp_path / "shm", timeout_s=0.5)
