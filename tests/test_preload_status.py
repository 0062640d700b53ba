"""What ``preload --status`` says, what ``--unstage`` and a failed preload leave behind, the warning
for a staging root on disk, and a served load of a re-packed image (host backend)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from _io_helpers import CHUNK, image, image_master, shm  # noqa: F401  (fixtures)

import flashboot
from flashboot.cli import main
from flashboot.errors import LayoutError
from flashboot.flashload import staging
from flashboot.flashload import shm as shm_files
from flashboot.flashload.status import STATES, rank_states
from flashboot.procfs import proc_start_time


def _repack(image: Path, image_master: Path) -> str:
    """Pre-pack the checkpoint again into ``image`` (other chunk size: another pre-pack); returns
    the new metadata sha256."""
    flashboot.prepack(str(image_master.parent / "ckpt"), str(image), chunk_bytes=CHUNK * 2, progress=False)
    return shm_files.rank_source(image, 0).metadata_sha256


def _status_lines(image, shm, capsys) -> list[str]:
    assert main(["preload", str(image), "--shm-dir", str(shm), "--status"]) == 0
    return [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank ")]


def _wait_for_state(image, shm, capsys, state: str, timeout_s: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = _status_lines(image, shm, capsys)
        assert len(lines) == 1, lines  # one state per rank, never two
        if lines[0].startswith(f"rank 0: {state}"):
            return lines
        assert lines[0].split(":")[1].strip() in ("staging", state), lines
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)


def test_status_of_a_served_image_is_one_state_per_rank_and_a_repack_is_refused_at_once(image, image_master, shm,
                                                                                       capsys):
    old_sha = shm_files.rank_source(image, 0).metadata_sha256
    assert main(["preload", str(image), "--shm-dir", str(shm), "--serve", "--background", "--timeout", "120"]) == 0
    try:
        first = _status_lines(image, shm, capsys)  # right after the start: staging or served, never both
        assert len(first) == 1 and first[0].split(":")[1].strip() in ("staging", "served"), first
        served = _wait_for_state(image, shm, capsys, "served")
        assert f"{shm_files.rank_source(image, 0).nbytes:,} bytes" in served[0]

        new_sha = _repack(image, image_master)
        (line,) = _status_lines(image, shm, capsys)
        assert line.startswith("rank 0: stale") and old_sha[:12] in line and new_sha[:12] in line, line
        # The daemon holds the old pre-pack and never re-stages while it serves: refused at once,
        # naming both digests, rather than after the load's timeout.
        with pytest.raises(LayoutError) as e:
            flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=30)
        assert "re-packed" in str(e.value) and old_sha[:12] in str(e.value) and new_sha[:12] in str(e.value)
    finally:
        assert main(["preload", str(image), "--shm-dir", str(shm), "--stop", "--timeout", "60"]) == 0
    where = shm_files.staging_dir(image, shm)
    assert shm_files.log_file(image, shm).exists()
    assert main(["preload", str(image), "--shm-dir", str(shm), "--unstage"]) == 0
    assert "preload.log" in capsys.readouterr().out
    assert not where.exists(), sorted(p.name for p in where.iterdir())


def test_status_names_a_stale_or_truncated_staged_copy_with_the_numbers(image, image_master, shm, capsys):
    (line,) = _status_lines(image, shm, capsys)
    assert line.startswith("rank 0: not staged")
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    nbytes = shm_files.rank_source(image, 0).nbytes
    (line,) = _status_lines(image, shm, capsys)
    assert line.startswith(f"rank 0: staged: {nbytes:,} bytes")

    paths = shm_files.staged_paths(image, 0, shm)
    os.truncate(paths.image, 1000)
    (line,) = _status_lines(image, shm, capsys)
    assert line.startswith("rank 0: truncated") and "1,000 bytes" in line and f"{nbytes:,} bytes" in line, line

    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)  # a whole copy again
    old_sha = shm_files.rank_source(image, 0).metadata_sha256
    new_sha = _repack(image, image_master)
    (state,) = rank_states(image, [0], shm)
    assert state.state == "stale" and state.state in STATES
    assert old_sha[:12] in state.detail and new_sha[:12] in state.detail and str(paths.image) in state.detail


def test_a_failed_preload_leaves_no_empty_folder(image, shm, capsys):
    (image / "rank-0" / "image.bin").unlink()
    assert main(["preload", str(image), "--shm-dir", str(shm), "--threads", "2"]) == 2
    assert "image.bin" in capsys.readouterr().err
    assert not shm_files.staging_dir(image, shm).exists()


def test_a_staging_root_on_disk_is_warned_about(image, shm, capsys, monkeypatch):
    assert shm_files.filesystem_magic(shm.parent) not in shm_files._MEMORY_FILESYSTEMS  # the tests' tmp is a disk
    monkeypatch.setenv(shm_files.SHM_ENV, str(shm))
    assert main(["preload", str(image), "--threads", "2", "--chunk-bytes", "8KiB"]) == 0
    out = capsys.readouterr().out
    assert "is not shared memory" in out and str(shm) in out and f"${shm_files.SHM_ENV}" in out
    assert main(["preload", str(image), "--status"]) == 0
    assert "is not shared memory" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_a_staging_root_in_shared_memory_is_not_warned_about():
    assert shm_files.not_shared_memory_warning("/dev/shm/flashboot-test-absent/x") is None


def test_status_lists_leftover_folders_of_failed_preloads(image, shm, capsys):
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    left = shm / "other-0123456789ab"  # what a failed preload of another image left before the clean-up
    left.mkdir(parents=True)
    (left / "preload.log").write_text("rank 0: failed\n")
    assert main(["preload", str(image), "--shm-dir", str(shm), "--status"]) == 0
    out = capsys.readouterr().out
    leftovers = [line for line in out.splitlines() if line.startswith("  leftover: ")]
    assert len(leftovers) == 1 and str(left) in leftovers[0] and "preload.log" in leftovers[0]  # not the staged one


def test_status_names_what_killed_stagers_and_engines_left_taking_memory(image, shm):
    """A preloader killed mid-stage leaves its ``.partial`` reserved whole: status said only
    "not staged: .ready absent". A copy engines staged for their own loads, all of them killed
    before they let it go, stays: status said the last engine to load it removes it."""
    paths = shm_files.staged_paths(image, 0, shm)
    paths.dir.mkdir(parents=True)
    paths.partial.write_bytes(bytes(12_288))  # as a killed stager leaves it: no lock held, no .ready
    (line,) = rank_states(image, [0], shm)
    assert line.state == "not staged" and f"{paths.partial} (12,288 bytes), left by a stager that died" in line.detail
    assert f"`flashboot preload {image} --unstage` removes it" in line.detail
    staging.unstage(image, shm_dir=shm)
    assert not paths.partial.exists()

    copy = staging.stage_for_load(image, 0, timeout_s=10, shm_dir=shm)
    try:
        (line,) = rank_states(image, [0], shm)
        assert line.state == "staged" and "the last engine to load it removes it" in line.detail, line
        os.close(copy._fd)  # the engine killed: the kernel drops its lock, nothing removes the copy
        copy._fd = None
        (line,) = rank_states(image, [0], shm)
        assert line.state == "staged" and "no engine holds it now" in line.detail, line
        assert f"`flashboot preload {image} --unstage` removes it" in line.detail
    finally:
        staging.unstage(image, shm_dir=shm)


def test_status_of_an_image_moved_away_names_the_staged_copies_that_still_take_memory(image, shm, capsys, tmp_path):
    """Defect: with the image folder moved away (or deleted, or re-packed with fewer ranks),
    `preload --status` printed its header and failed (rc 2, "no such image directory"); with
    --ranks it said only that the image is refused. Nothing named the staged copies that still took
    their memory, nor how to free them."""
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    paths = shm_files.staged_paths(image, 0, shm)
    nbytes = paths.image.stat().st_size
    other = shm_files.staged_paths(image, 3, shm)  # a rank an earlier pre-pack had, left staged
    other.image.write_bytes(bytes(8192))
    image.rename(tmp_path / "moved")
    assert main(["preload", str(image), "--shm-dir", str(shm), "--status"]) == 0
    out = capsys.readouterr().out
    assert f"the image {image} is refused" in out and "no such image directory" in out, out
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("rank ")]
    assert len(lines) == 2, out
    assert lines[0].startswith("rank 0: unreadable") and f"{paths.image} ({nbytes:,} bytes) is still staged" in lines[0]
    assert lines[1].startswith("rank 3: unreadable") and f"{other.image} (8,192 bytes) is still staged" in lines[1]
    assert f"`flashboot preload {image} --unstage` removes it" in lines[0]
    assert main(["preload", str(image), "--shm-dir", str(shm), "--unstage"]) == 0
    assert not paths.dir.exists()


def test_stop_and_status_of_a_symlink_re_pointed_since_the_start_find_the_preloader_started_for_it(
        image, shm, tmp_path, capsys):
    """Defect: `preload models/current --serve --background`, then `current` re-pointed to the next
    version: `preload models/current --stop` said "no preloader runs" (the staging folder is keyed
    by the path's real path, now another) and --status "not running", while the preloader started
    for that very path kept running, holding its copies; nothing named it."""
    current = tmp_path / "current"
    current.symlink_to(image)
    assert main(["preload", str(current), "--shm-dir", str(shm), "--serve", "--background", "--timeout", "120"]) == 0
    pid = shm_files.service_status(current, shm).pid
    capsys.readouterr()
    try:
        current.unlink()
        current.symlink_to(tmp_path)  # the next version, not staged yet
        assert main(["preload", str(current), "--shm-dir", str(shm), "--status"]) == 0
        out = capsys.readouterr().out
        assert f"a preloader started for {current} (pid {pid}, serving) still runs" in out and str(image) in out, out
        assert main(["preload", str(current), "--shm-dir", str(shm), "--stop", "--timeout", "60"]) == 0
        out = capsys.readouterr().out
        assert f"stopped preloader pid {pid}" in out and str(image) in out, out
    finally:
        if proc_start_time(pid) is not None:
            os.kill(pid, 15)
    assert not shm_files.service_status(image, shm).running
