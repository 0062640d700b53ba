"""Engines that stage their image themselves (no preloader), several on one node with one image
(data-parallel replicas): one stages each rank, the others wait for it and load the same copy,
and the last to load it gives the shared memory back. Before, a second engine's staging was
refused by the rank's lock (and, before that lock, overwrote the first's half-written copy)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from flashboot.errors import FlashBootError
from flashboot.flashload import shm as shm_files
from flashboot.flashload import staging

from _preload_helpers import make_tiny_image  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ENGINES = 4

_ENGINE = r"""
import json, os, sys, time
from pathlib import Path
from flashboot.flashload import shm as shm_files
from flashboot.flashload.staging import stage_for_load

image, shm, barrier, i, n = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def meet(name):  # every engine reaches this point before any goes on
    (barrier / f"{name}-{i}").touch()
    deadline = time.monotonic() + 60
    while sum(1 for p in barrier.iterdir() if p.name.startswith(name + "-")) < n:
        assert time.monotonic() < deadline, name
        time.sleep(0.01)

meet("start")
logged = []
copy = stage_for_load(image, 0, timeout_s=60, shm_dir=shm, log=logged.append)
staged = shm_files.staged_paths(image, 0, shm).image.read_bytes()  # the engine's load
meet("loaded")  # nobody lets go before everyone has read: the copy must still be there
removed = copy.release()
print(json.dumps({"staged_here": copy.staged_here, "removed": removed, "logged": len(logged),
                  "bytes": staged == shm_files.rank_source(image, 0).path.read_bytes()}))
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("inline"))


def _another_stager(image, shm):
    """Rank 0's staging folder and its lock, held here as another process staging it would."""
    paths = shm_files.staged_paths(image, 0, shm)
    paths.dir.mkdir(parents=True)
    return paths, staging._lock_rank(paths, 0, image)


def _rank_files(shm, image) -> list[str]:
    d = shm_files.staging_dir(image, shm)
    return sorted(p.name for p in d.iterdir() if p.name.startswith("rank-")) if d.is_dir() else []


def test_engines_staging_one_rank_at_once_share_one_copy_and_the_last_removes_it(image, tmp_path):
    shm, barrier = tmp_path / "shm", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _ENGINE, str(image), str(shm), str(barrier), str(i),
                               str(ENGINES)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(ENGINES)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["bytes"] for o in outs), outs
    assert sum(o["staged_here"] for o in outs) == 1, outs  # one staged; the others waited for it or found it
    assert sum(o["logged"] for o in outs) == 1, outs  # and only it says so
    assert sum(o["removed"] for o in outs) == 1, outs  # the last one out gave the memory back
    assert _rank_files(shm, image) == []


def test_a_copy_the_preloader_staged_stays_after_the_engines_load_it(image, tmp_path):
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)  # `flashboot preload DIR`, one shot
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    assert not copy.staged_here
    assert copy.release() is False
    assert _rank_files(shm, image) == ["rank-0.img", "rank-0.ready"]  # the engines' .users went with the last
    staging.unstage(image, shm_dir=shm)


def test_a_copy_an_engine_staged_that_the_preloader_then_keeps_stays(image, tmp_path):
    """`flashboot preload DIR` run while an engine loads the copy it staged itself finds the rank
    staged and keeps it: the engine's release had removed it anyway (.ready and image gone under
    the preloader that reported the rank staged)."""
    shm = tmp_path / "shm"
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    assert copy.staged_here
    assert staging.stage_rank(image, 0, shm_dir=shm).skipped  # the preloader's one shot, meanwhile
    assert copy.release() is False
    paths = shm_files.staged_paths(image, 0, shm)
    assert paths.image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()
    assert shm_files.read_ready(paths.ready).nbytes == paths.image.stat().st_size
    staging.unstage(image, shm_dir=shm)


def test_the_last_engine_out_leaves_a_copy_being_restaged(image, tmp_path):
    """The removal holds the rank's lock: a stager at work keeps the copy (and its files)."""
    shm = tmp_path / "shm"
    paths = shm_files.staged_paths(image, 0, shm)
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    lock = staging._lock_rank(paths, 0, image)  # a restage under way
    try:
        assert copy.release() is False
        assert paths.ready.exists() and paths.image.exists()
    finally:
        staging._unlock_rank(paths, lock)
    staging.unstage(image, shm_dir=shm)


def test_an_engine_waits_for_a_stager_that_fails_then_stages_the_rank_itself(image, tmp_path):
    shm = tmp_path / "shm"
    paths, lock = _another_stager(image, shm)  # another engine staging, which then dies without .ready

    def die_later():
        time.sleep(0.3)
        staging._unlock_rank(paths, lock)

    t = threading.Thread(target=die_later)
    t.start()
    copy = staging.stage_for_load(image, 0, timeout_s=30, shm_dir=shm)
    t.join()
    try:
        assert copy.staged_here
        assert paths.image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()
        with pytest.raises(FlashBootError, match=r"rank-0 of .* is being loaded by an engine \(it holds .*rank-0\.users\)"):
            staging.unstage(image, [0], shm_dir=shm)  # not under an engine that loads it
    finally:
        assert copy.release() is True
    assert _rank_files(shm, image) == []


def test_an_engine_waiting_for_a_stager_that_never_finishes_times_out_naming_it(image, tmp_path):
    shm = tmp_path / "shm"
    paths, lock = _another_stager(image, shm)
    fds = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(FlashBootError, match=rf"is being staged already \(by pid {os.getpid()}, .*: still "
                                                 r"staging after 0.3 s"):
            staging.stage_for_load(image, 0, timeout_s=0.3, shm_dir=shm)
        assert set(os.listdir("/proc/self/fd")) == fds  # its hold on rank-0.users let go
    finally:
        staging._unlock_rank(paths, lock)
    staging.unstage(image, shm_dir=shm)


def test_a_preloader_started_while_an_engine_stages_the_rank_waits_for_it_and_serves(image, tmp_path):
    """It had marked the rank failed (StagingBusy) and served nothing."""
    from _preload_helpers import Daemon

    shm = tmp_path / "shm"
    paths, lock = _another_stager(image, shm)  # an engine staging rank 0, which then dies without .ready
    threading.Timer(0.5, staging._unlock_rank, (paths, lock)).start()
    d = Daemon(image, shm)  # waits until rank 0 is resident, and fails unless it is
    try:
        assert any("is being staged already" in line and "waiting for it" in line for line in d.log), d.log
        d.load_exact()
    finally:
        d.server.stop.set()
        d.thread.join(30)
    staging.unstage(image, shm_dir=shm)


def test_an_engine_in_auto_mode_takes_a_staged_copy_without_reading_its_metadata(image, tmp_path, monkeypatch):
    """The load checks the copy against the metadata; reading it here too cost the first call ~13 ms."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    monkeypatch.setattr(staging, "stage_rank", lambda *a, **k: pytest.fail("read the staged rank's metadata"))
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm, check_staged=False)
    assert not copy.staged_here and copy.release() is False
    monkeypatch.undo()
    staging.unstage(image, shm_dir=shm)


def test_the_last_engine_out_leaves_no_folder_behind_nor_a_failed_one_its_users_file(image, tmp_path, monkeypatch):
    """The engines' own unstage had removed the emptied staging folder; the release left it (listed
    by `preload --status` as a leftover to `rm -r`), and a failed stage left rank-R.users in it
    (the folder then hidden from that list)."""
    from flashboot.errors import OutOfMemoryError
    from flashboot.flashload.status import leftover_staging_dirs

    shm = tmp_path / "shm"
    folder = shm_files.staging_dir(image, shm)
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    assert copy.release() is True
    assert not folder.exists()
    monkeypatch.setattr(staging, "_fs_free_bytes", lambda path: 10)  # a full /dev/shm
    with pytest.raises(OutOfMemoryError):
        staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    assert not folder.exists() and leftover_staging_dirs(shm) == []


def test_an_engine_whose_folder_the_last_engine_out_removes_meanwhile_makes_it_again(image, tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    real = staging.make_dir
    calls = []

    def make_then_lose(path):  # the last engine out of another copy removes the folder right after
        real(path)
        if not calls:
            path.rmdir()
        calls.append(path)
        return path

    monkeypatch.setattr(staging, "make_dir", make_then_lose)
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    assert copy.staged_here and len(calls) >= 2
    assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()
    assert copy.release() is True


def test_a_preloader_stopped_while_waiting_for_an_engine_stager_says_it_stopped(image, tmp_path):
    """It had said the rank was still staging after 600 s, whenever `preload --stop` came."""
    from flashboot.flashload.server import PreloadServer

    shm = tmp_path / "shm"
    paths, lock = _another_stager(image, shm)  # an engine staging rank 0
    stop = threading.Event()
    server = PreloadServer(staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True), stop=stop, log=[].append)
    threading.Timer(0.3, stop.set).start()
    try:
        with pytest.raises(FlashBootError, match=r"is stopping; rank 0 was not staged while waiting for another "
                                                 rf"stager: .*being staged already \(by pid {os.getpid()}") as err:
            server._stage(0, None)
        assert not re.search(r"\b600\b", str(err.value))  # not the 600 s wait (a pid such as 14600 may be named)
    finally:
        staging._unlock_rank(paths, lock)
    staging.unstage(image, shm_dir=shm)


def test_status_says_an_engine_stages_the_rank_and_that_its_copy_goes_with_the_last_engine(image, tmp_path, capsys):
    """`preload --status` had said "not staged" while an engine staged the rank (a preload then
    refused as busy), and nothing of the copy going with the last engine out."""
    from flashboot.cli import main

    shm = tmp_path / "shm"
    paths = shm_files.staged_paths(image, 0, shm)
    paths.dir.mkdir(parents=True)

    def status() -> str:
        assert main(["preload", str(image), "--shm-dir", str(shm), "--status"]) == 0
        (line,) = [s.strip() for s in capsys.readouterr().out.splitlines() if s.strip().startswith("rank 0")]
        return line

    lock = staging._lock_rank(paths, 0, image)  # an engine staging rank 0
    try:
        assert status().startswith(f"rank 0: staging: by pid {os.getpid()} (no preloader: an engine staging")
    finally:
        staging._unlock_rank(paths, lock)
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    assert "staged by an engine for its own load" in status() and status().startswith("rank 0: staged: ")
    staging.stage_rank(image, 0, shm_dir=shm)  # `flashboot preload DIR`: the copy is its own now
    assert status().startswith("rank 0: staged: ") and "by an engine" not in status()
    assert copy.release() is False
    staging.unstage(image, shm_dir=shm)


def test_unstage_under_engines_loading_a_preloaded_copy_does_not_promise_they_remove_it(image, tmp_path):
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)  # `flashboot preload DIR`: it stays after the engines
    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    try:
        with pytest.raises(FlashBootError, match=r"is being loaded by an engine \(it holds .*rank-0\.users\); unstage "
                                                 r"it once they have loaded$"):
            staging.unstage(image, shm_dir=shm)
    finally:
        assert copy.release() is False
    staging.unstage(image, shm_dir=shm)


def test_a_one_shot_preload_waits_for_an_engine_staging_the_rank_and_keeps_its_copy(image, tmp_path):
    """`flashboot preload DIR` (no --serve) failed the rank with StagingBusy where --serve waited."""
    shm = tmp_path / "shm"
    paths, lock = _another_stager(image, shm)  # an engine staging rank 0, which then gives up
    threading.Timer(0.4, staging._unlock_rank, (paths, lock)).start()
    said = []
    results = staging.preload(staging.PreloadConfig(str(image), shm_dir=str(shm)), log=said.append)
    assert [r.rank for r in results] == [0] and not results[0].skipped
    assert any("is being staged already" in line and "waiting for it" in line for line in said), said
    assert paths.image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()
    staging.unstage(image, shm_dir=shm)
