"""Misuse of the preloader and its benchmarks: a run interrupted midway leaves nothing behind, a
non-finite scale or timeout is refused by name, a --json FIFO gets the report, options that mean
nothing without --serve are refused, and --status says how far a rank's staging really is."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashboot
from flashboot.benchmarks import load as bench_load
from flashboot.benchmarks import stream as bench_stream
from flashboot.benchmarks.checkpoints import CheckpointSpec
from flashboot.errors import FlashBootError
from flashboot.flashload import service, staging

from _preload_helpers import make_tiny_image  # noqa: E402  (tests/ is on the path)

TINY = CheckpointSpec("T", layers=1, experts=2, expert_rows=16, expert_cols=16, hidden=16, vocab=16, shards=1)


def _interrupt(*_a, **_k):
    raise KeyboardInterrupt


def test_bench_load_interrupted_midway_removes_its_checkpoint_and_image(tmp_path, monkeypatch):
    ckpt_root, image_root = tmp_path / "ckpt", tmp_path / "images"
    monkeypatch.setattr(flashboot, "prepack", _interrupt)  # Ctrl-C once the checkpoint is written
    with pytest.raises(KeyboardInterrupt):
        bench_load.run(checkpoints=[TINY], device="cpu", ckpt_root=str(ckpt_root), image_root=str(image_root),
                       log=lambda _line: None)
    assert not (ckpt_root / "ckpt-T").exists(), "the generated checkpoint is removed however the run ends"
    assert not (image_root / "image-T").exists()
    # and the folders it made for them (an empty DIR/staged had stayed)
    assert not ckpt_root.exists() and not image_root.exists()


def test_bench_stream_interrupted_midway_removes_its_checkpoint_and_image(tmp_path, monkeypatch):
    ckpt_root, image_root = tmp_path / "ckpt", tmp_path / "images"
    monkeypatch.setattr(bench_stream, "measure_stream", _interrupt)  # Ctrl-C after the pre-pack
    with pytest.raises(KeyboardInterrupt):
        bench_stream.run(scale=1e-4, device="cpu", image_root=str(image_root), ckpt_root=str(ckpt_root),
                         log=lambda _line: None)
    assert list(image_root.iterdir()) == [], "the generated image is removed however the run ends"
    assert not ckpt_root.exists() or list(ckpt_root.iterdir()) == []


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, 0.0, -1.0])
def test_bench_scales_that_are_not_finite_and_positive_are_refused_by_name(tmp_path, scale):
    with pytest.raises(FlashBootError, match="scale must be a finite number > 0"):
        bench_stream.run(scale=scale, device="cpu", image_root=str(tmp_path / "i"), ckpt_root=str(tmp_path / "c"),
                         log=lambda _line: None)
    with pytest.raises(FlashBootError, match="scale must be a finite number > 0"):
        bench_load.run(scale=scale, checkpoints=["A"], device="cpu", ckpt_root=str(tmp_path / "c"),
                       image_root=str(tmp_path / "i"), log=lambda _line: None)


def test_json_report_into_a_fifo_reaches_a_reader_that_stops_at_eof(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    # the writer as the bench commands run: check the path first, the work (a pause here: it lets a
    # reader woken by the check see its EOF; with the fix nothing wakes it), then the report
    code = ("import sys, time; from flashboot.benchmarks.timing import check_json_path, dump_json; "
            "check_json_path(sys.argv[1]); time.sleep(0.5); dump_json({'ok': 1}, sys.argv[1])")
    writer = subprocess.Popen([sys.executable, "-c", code, str(fifo)])
    try:
        with open(fifo) as f:  # as `cat`: reads until the first EOF
            got = f.read()
        assert json.loads(got) == {"ok": 1}, "the check's open-and-close had sent the reader its EOF"
        assert writer.wait(60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_json_path_check_still_refuses_what_cannot_be_written(tmp_path):
    from flashboot.benchmarks.timing import check_json_path

    with pytest.raises(FlashBootError, match="cannot write the JSON report to .*missing"):
        check_json_path(str(tmp_path / "missing" / "r.json"))
    with pytest.raises(FlashBootError, match="cannot write the JSON report to"):
        check_json_path(str(tmp_path))
    old = tmp_path / "old.json"
    old.write_text("an earlier run's report")
    check_json_path(str(old))
    assert old.read_text() == "", "a regular file is still emptied"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("misuse"))


@pytest.mark.parametrize("timeout", [math.nan, -1.0, 0.0, math.inf])
def test_service_timeouts_are_checked_by_name(image, tmp_path, timeout):
    cfg = staging.PreloadConfig(str(image), shm_dir=str(tmp_path / "shm"), serve=True)
    with pytest.raises(FlashBootError, match="start_background timeout_s must be a finite number"):
        service.start_background(cfg, timeout_s=timeout)
    assert service.service_status(image, tmp_path / "shm").pid is None, "nothing was started"
    with pytest.raises(FlashBootError, match="stop_service timeout_s must be a finite number"):
        service.stop_service(image, tmp_path / "shm", timeout_s=timeout)


def test_ctrl_c_while_start_background_waits_stops_the_daemon(image, tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*a, **k):
        started.append(real_popen(*a, **k))
        return started[-1]

    monkeypatch.setattr(service.subprocess, "Popen", popen)
    monkeypatch.setattr(service, "_running_pid", _interrupt)  # Ctrl-C in the wait for its pid file
    cfg = staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            service.start_background(cfg, timeout_s=60)
        assert len(started) == 1
        assert started[0].poll() is not None, f"the daemon (pid {started[0].pid}) it started is still up"
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
        monkeypatch.undo()
        staging.unstage(str(image), shm_dir=str(shm))


def test_serve_only_options_without_serve_are_refused_by_name(image, tmp_path):
    with pytest.raises(FlashBootError, match=r"--no-pin\) applies only to a serving preloader"):
        staging.PreloadConfig(str(image), shm_dir=str(tmp_path), pin=False)
    with pytest.raises(FlashBootError, match=r"--allow-group\) applies only to a serving preloader"):
        staging.PreloadConfig(str(image), shm_dir=str(tmp_path), allow_group="0")
    with pytest.raises(FlashBootError, match="applies only to a serving preloader"):
        staging.PreloadConfig.from_dict({"image_dir": str(image), "allow_group": 0})
    # with serve both stand, and the background child's command line rebuilds the same config
    cfg = staging.PreloadConfig(str(image), shm_dir=str(tmp_path), serve=True, pin=False, allow_group="0")
    argv = service.config_argv(cfg)
    assert "--no-pin" in argv and argv[-2:] == ["--allow-group", "0"] and "--serve" in argv


def test_preload_cli_refuses_no_pin_without_serve(image, tmp_path):
    p = subprocess.run([sys.executable, "-m", "flashboot.commands.preload", str(image), "--shm-dir", str(tmp_path),
                        "--no-pin"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--no-pin) applies only to a serving preloader" in p.stderr + p.stdout
    assert "Traceback" not in p.stderr
    assert not any(tmp_path.iterdir()), "nothing was staged"


def test_status_of_a_rank_being_staged_does_not_claim_it_is_all_written(image, tmp_path):
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload.status import rank_states

    shm = tmp_path / "shm"
    paths = shm_files.staged_paths(image, 0, shm)
    paths.partial.parent.mkdir(parents=True, exist_ok=True)
    nbytes = shm_files.rank_source(image, 0).nbytes
    with open(paths.partial, "wb") as f:  # as the stager leaves it before its first byte: sized and reserved whole
        os.posix_fallocate(f.fileno(), 0, nbytes)
    (state,) = rank_states(image, [0], shm, preloader_pid=os.getpid())
    assert state.state == "staging", state
    assert f"{nbytes:,} of {nbytes:,} bytes so far" not in state.detail, state.detail
    assert f"{nbytes:,} bytes to stage" in state.detail and "copied so far unknown" in state.detail, state.detail


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_prepack_at_ep_2_with_a_family_that_finds_no_expert_is_refused_by_name(tmp_path, family):
    from flashboot.benchmarks.checkpoints import make_checkpoint
    from flashboot.errors import LayoutError

    make_checkpoint(str(tmp_path / "ckpt"), TINY, device="cpu")  # experts named ...experts.N.w1: mixtral's, not these
    with pytest.raises(LayoutError, match=rf"ep=2 splits experts, but family {family} finds no expert tensor.*"
                                          r"experts\.0\.w1\.weight"):
        flashboot.prepack(str(tmp_path / "ckpt"), str(tmp_path / "img"), ep=2, family=family, progress=False)
    assert not (tmp_path / "img").exists() or not any((tmp_path / "img").iterdir()), "nothing was written"
    rep = flashboot.prepack(str(tmp_path / "ckpt"), str(tmp_path / "img"), ep=1, family=family, progress=False)
    assert len(rep.ranks) == 1, "at ep=1 the same family still pre-packs (one full rank is what was asked)"


def test_prepack_of_a_dense_model_at_ep_2_is_not_refused(tmp_path):
    """No tensor looks like an expert: the ep ranks each hold the same shard, as an engine started
    with that ep size expects (the refusal above is for experts a family missed)."""
    from _engine_helpers import make_tiny_model

    ckpt = make_tiny_model("llama", tmp_path / "llama")
    rep = flashboot.prepack(str(ckpt), str(tmp_path / "img"), ep=2, progress=False)
    assert len(rep.ranks) == 2
    first, second = (flashboot.layouts.read_image(tmp_path / "img", r) for r in (0, 1))
    assert first.path.read_bytes() == second.path.read_bytes()  # the same shard on both ep ranks


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "0"])
def test_bench_serve_refuses_a_timeout_that_is_no_deadline_before_it_makes_anything(tmp_path, bad):
    """`bench serve --timeout nan` was refused only once the daemon started, after the checkpoint
    and image were made."""
    p = subprocess.run([sys.executable, "-m", "flashboot.cli", "bench", "serve", "--timeout", bad, "--dir",
                        str(tmp_path / "work")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "--timeout" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "work").exists()


def test_a_background_preloader_of_a_folder_named_like_an_option_stages_it(tmp_path):
    """``preload --background -- -dash``: the daemon's own command line put the folder before the
    options, so its child read ``-dash`` as an option ("DIR required") and left a staging folder
    holding only ``preload.log``."""
    import shutil
    import time

    from flashboot.flashload import shm as shm_files

    image = make_tiny_image(tmp_path / "made")
    dashed = tmp_path / "-dash"
    shutil.move(str(image), dashed)
    shm = tmp_path / "shm"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # named relatively, as a script would: "-dash"
    try:
        cfg = staging.PreloadConfig("-dash", shm_dir=str(shm))
        service.start_background(cfg, timeout_s=60)
        shm_files.wait_ready("-dash", 0, timeout_s=60, shm_dir=shm)
        deadline = time.monotonic() + 30
        while service.service_status("-dash", shm).pid is not None:
            assert time.monotonic() < deadline, shm_files.log_file("-dash", shm).read_text()
            time.sleep(0.05)
        assert "rank 0: staged" in shm_files.log_file("-dash", shm).read_text()
    finally:
        os.chdir(cwd)


def test_a_preloader_of_a_folder_whose_name_is_not_utf8_stages_it(tmp_path):
    """A folder name that is not UTF-8 (bytes from another locale) crashed ``preload``, its
    ``--status`` and ``--unstage`` with a UnicodeEncodeError in the staging folder's tag."""
    import shutil

    from flashboot.flashload import shm as shm_files

    image = make_tiny_image(tmp_path / "made")
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9")
    shutil.move(str(image), odd)
    shm = tmp_path / "shm"
    staging.stage_rank(odd, 0, shm_dir=shm)
    assert shm_files.staged_paths(odd, 0, shm).image.read_bytes() == shm_files.rank_source(odd, 0).path.read_bytes()
    assert staging.unstage(odd, None, shm_dir=shm)


def test_a_preloader_whose_first_log_line_fails_releases_its_pid_file(tmp_path, monkeypatch):
    """The first log lines (a warning that the staging root is not shared memory) were written
    before the clean-up's ``try``: a log that failed there left the pid file naming a process that
    no longer preloads."""
    from flashboot.flashload import shm as shm_files

    image = make_tiny_image(tmp_path / "made")
    shm = tmp_path / "shm"  # not tmpfs: the warning is logged first

    def failing_log(line):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        service.run_service(staging.PreloadConfig(str(image), shm_dir=str(shm)), log=failing_log)
    assert not shm_files.pid_file(image, shm).exists()
