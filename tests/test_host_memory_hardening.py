"""Host memory and staging as a hostile user meets them: two stagers of one rank, files that
change under a read, odd sizes, full or missing memory, bad fds. Each ends in the right bytes or
a clear error naming the numbers, never a ``.ready`` for partial bytes, and leaves no file or fd."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading

import pytest

from flashboot.errors import FlashBootError, LayoutError, OutOfMemoryError
from flashboot.flashload import shm as shm_files
from flashboot.flashload import stage_copy, staging

from _preload_helpers import make_tiny_image  # noqa: E402
from _python import run_python  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("hostmem"))


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_second_stager_of_one_rank_is_refused_and_the_first_stages_whole_bytes(image, tmp_path, monkeypatch):
    """Two stagers of one rank (two engines staging inline) each withdrew the other's ``.partial``
    by name: the first to finish renamed the other's half-written file into place and wrote a
    ``.ready`` for it (zero pages where the copy had not reached)."""
    shm = tmp_path / "shm"
    paths = shm_files.staged_paths(image, 0, shm)
    want = shm_files.rank_source(image, 0).path.read_bytes()
    real, first_fd, held, release = stage_copy._preadv, [], threading.Event(), threading.Event()

    def preadv(fd, buffers, off):  # the first stager stops after its first chunk until released
        if not first_fd:
            first_fd.append(fd)
        if fd == first_fd[0] and off >= 8192:
            held.set()
            release.wait(60)
        return real(fd, buffers, off)

    monkeypatch.setattr(stage_copy, "_preadv", preadv)
    fds_before, out = _fds(), {}

    def first() -> None:
        try:
            out["first"] = staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=1)
        except BaseException as exc:  # handed to the assertions
            out["first"] = exc

    t = threading.Thread(target=first)
    t.start()
    assert held.wait(60)
    try:
        with pytest.raises(FlashBootError, match=r"is being staged already \(by pid \d+, which holds ") as e:
            staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=1)
        assert f"pid {os.getpid()}" in str(e.value) and str(paths.lock) in str(e.value)
    finally:
        release.set()
        t.join(60)
    assert isinstance(out["first"], staging.StageResult), out["first"]
    assert paths.image.read_bytes() == want
    assert shm_files.read_ready(paths.ready).nbytes == len(want)
    assert sorted(p.name for p in paths.dir.iterdir()) == ["rank-0.img", "rank-0.ready"]
    assert _fds() == fds_before
    staging.unstage(image, shm_dir=shm)


def _mount_tmpfs(where, nbytes: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_a_tmpfs_with_room_for_the_image_but_not_its_ready_fails_by_name_and_leaves_nothing(image, tmp_path):
    """/dev/shm with the image's bytes free and a page or so more: the copy took the last page and
    the ``.ready`` write failed with a bare ENOSPC, leaving its temporary file and a whole
    ``rank-0.img`` (memory held, never loadable) behind."""
    want = shm_files.rank_source(image, 0).path.read_bytes()
    seen = []
    for pages in range(5):
        shm = tmp_path / f"tmpfs{pages}"
        if not _mount_tmpfs(shm, len(want) + pages * 4096):
            pytest.skip("cannot mount a tmpfs here (not root?)")
        try:
            fds_before = _fds()
            try:
                staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=2)
            except OutOfMemoryError as exc:
                seen.append(str(exc))
                assert f"{len(want):,}" in str(exc) or "rank-0.ready" in str(exc)
                left = sorted(os.listdir(shm_files.staging_dir(image, shm)))
                assert left == [], f"left behind: {left}"
            else:
                paths = shm_files.staged_paths(image, 0, shm)
                assert paths.image.read_bytes() == want and shm_files.read_ready(paths.ready).nbytes == len(want)
                assert sorted(p.name for p in paths.dir.iterdir()) == ["rank-0.img", "rank-0.ready"]
            assert _fds() == fds_before
        finally:
            subprocess.run(["umount", "-l", str(shm)], check=False)
    assert any("writing" in s and "rank-0.ready" in s and "staged copy removed" in s for s in seen), seen


def test_an_image_folder_with_a_long_name_is_staged(image, tmp_path):
    """The staging folder's name is the image folder's and a 12-digit tag: a folder name of more
    than 242 bytes (255 is allowed) made it too long to create, and staging failed with a bare
    ENAMETOOLONG from the error path of the folder's creation."""
    want = shm_files.rank_source(image, 0).path.read_bytes()
    for name in ("x" * 250, "€" * 84):  # 252 bytes: a cut inside a character drops it
        long_dir = tmp_path / name
        shutil.copytree(image, long_dir)
        r = staging.stage_rank(long_dir, 0, shm_dir=tmp_path / "shm")
        paths = shm_files.staged_paths(long_dir, 0, tmp_path / "shm")
        assert r.staged == str(paths.image) and paths.image.read_bytes() == want
        assert len(os.fsencode(paths.dir.name)) <= 255 and paths.dir.name.startswith(name[:80])
        assert staging.unstage(long_dir, shm_dir=tmp_path / "shm")


def test_a_shm_dir_with_a_name_too_long_is_refused_by_name(image, tmp_path):
    """The error path of the staging folder's creation looked for what stood in the way with
    ``Path.exists``, which raises for a name past NAME_MAX: a bare ENAMETOOLONG instead."""
    shm = tmp_path / ("y" * 300) / "sub"
    with pytest.raises(FlashBootError, match=r"cannot create the staging folder .*\(File name too long\); use another "
                                             r"--shm-dir"):
        staging.stage_rank(image, 0, shm_dir=shm)


def test_closing_a_stage_that_waits_for_its_ready_ends_the_wait(image, tmp_path):
    """``close()`` of a :func:`flashboot.stage` still waiting for the preloader's ``.ready`` (an
    engine giving up on it) waited out the whole ``.ready`` timeout, 60 s by default."""
    from flashboot.flashload.stage import stage

    shm = tmp_path / "shm"
    s = stage(image, 0, "cpu", timeout_s=600, shm_dir=shm)
    assert s.wait_source(60).nbytes > 0 and not s.done
    closer = threading.Thread(target=s.close, daemon=True)
    closer.start()
    closer.join(60)  # not a time asserted: without the fix the close waits 600 s
    assert not closer.is_alive() and s.done
    with pytest.raises(FlashBootError, match=r"the wait for .*rank-0\.ready .* was stopped"):
        s.wait(0)
    assert not [t for t in threading.enumerate() if t.name == "flashboot-stage-rank0"]


def test_a_write_into_the_staged_file_that_fails_names_the_file_and_the_bytes(image, tmp_path, monkeypatch):
    """A file size limit (``ulimit -f``) smaller than the image, or a write error into shared
    memory other than a full one: a bare ``OSError: [Errno 27] File too large`` (no file, no
    bytes) came out of the staging."""
    import resource

    shm = tmp_path / "shm"
    nbytes = shm_files.rank_source(image, 0).nbytes
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))
    try:
        with pytest.raises(FlashBootError, match=rf"rank-0\.img\.partial: sizing it to {nbytes:,} bytes failed: EFBIG "
                                                 r".* at most 65,536 bytes \(`ulimit -f`\); the rank is not staged"):
            staging.stage_rank(image, 0, shm_dir=shm)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(shm_files.staging_dir(image, shm).iterdir()) == []

    real = stage_copy._pwrite

    def pwrite(fd, data, off):
        if off >= 8192:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, off)

    monkeypatch.setattr(stage_copy, "_pwrite", pwrite)
    with pytest.raises(FlashBootError, match=r"rank-0\.img\.partial: writing 4,096 bytes at byte \d{1,2},\d{3} failed: "
                                             r"EIO \(Input/output error\); the rank is not staged"):
        staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=2)
    assert list(shm_files.staging_dir(image, shm).iterdir()) == []


def test_a_full_tmpfs_refuses_the_stage_by_name_and_leaves_no_lock_or_fd(image, tmp_path):
    """/dev/shm full to the last page: the stager's lock file could not take its pid (ENOSPC), and
    that bare error left the lock file and its fd behind."""
    shm = tmp_path / "full"
    if not _mount_tmpfs(shm, 64 << 10):
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        with open(shm / "filler", "wb") as f:
            try:
                f.write(b"\1" * (64 << 10))
                f.flush()
            except OSError:
                pass
        fds_before, nbytes = _fds(), shm_files.rank_source(image, 0).nbytes
        with pytest.raises(OutOfMemoryError, match=rf"needs {nbytes:,} bytes but only 0 are free"):
            staging.stage_rank(image, 0, shm_dir=shm)
        assert list(shm_files.staging_dir(image, shm).iterdir()) == []
        assert _fds() == fds_before
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)


def test_a_copy_from_a_closed_staged_image_is_refused_not_a_segfault(image, tmp_path):
    """A span of a :func:`flashboot.stage` kept past its ``close()``: the movers refuse spans of a
    closed owner, but the staged image had no ``closed`` to look at, and the copy read the
    unmapped pages (a segfault; in a fresh process, so a regression fails this test alone)."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    out = run_python("-c", f"""
import numpy as np
from flashboot.errors import ArenaError
from flashboot.flashload.stage import stage
from flashboot.movers import create_mover
s = stage({str(image)!r}, 0, "cpu", timeout_s=60, shm_dir={str(shm)!r}).wait()
span = s.span()
s.close()
try:
    create_mover("host").copy(np.zeros(span.nbytes, np.uint8), span, stream=None)
except ArenaError as exc:
    print(exc)
""")
    assert "the source" in out and "which is closed" in out and "StagedImage(rank 0" in out, out


def test_unstage_refuses_a_rank_being_staged(image, tmp_path, monkeypatch):
    """``unstage`` beside a bare ``stage_rank`` (no preloader's pid file to refuse on) removed the
    stager's ``.partial`` and lock, and the stager then failed at its rename with a bare
    FileNotFoundError."""
    shm = tmp_path / "shm"
    want = shm_files.rank_source(image, 0).path.read_bytes()
    real, held, release = stage_copy._preadv, threading.Event(), threading.Event()

    def preadv(fd, buffers, off):
        if off >= 8192:
            held.set()
            release.wait(60)
        return real(fd, buffers, off)

    monkeypatch.setattr(stage_copy, "_preadv", preadv)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096,
                                                                       threads=1)))
    t.start()
    assert held.wait(60)
    try:
        with pytest.raises(FlashBootError, match=r"rank-0 of .* is being staged \(its lock .*rank-0\.lock is held\)"):
            staging.unstage(image, shm_dir=shm)
        assert staging.unstage(image, [1], shm_dir=shm) == []  # another rank: nothing of rank 0 touched
    finally:
        release.set()
        t.join(60)
    paths = shm_files.staged_paths(image, 0, shm)
    assert out["r"].nbytes == len(want) and paths.image.read_bytes() == want
    assert paths.ready in staging.unstage(image, shm_dir=shm)


def test_a_ready_file_replaced_by_a_named_pipe_is_refused_not_waited_on(image, tmp_path):
    """``read_ready`` read the ``.ready`` with a plain open: a named pipe in its place blocked every
    wait for the rank (``flashboot.stage``, a staged load) past its timeout, for as long as no
    writer came."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    paths = shm_files.staged_paths(image, 0, shm)
    paths.ready.unlink()
    os.mkfifo(paths.ready)
    out = []

    def wait() -> None:
        try:
            out.append(shm_files.wait_ready(image, 0, timeout_s=1, shm_dir=shm))
        except Exception as exc:  # handed to the assertions
            out.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(30)  # not a time asserted: without the fix the wait never ends
    assert out and isinstance(out[0], LayoutError), out
    assert str(out[0]) == f"{paths.ready}: not a regular file (a named pipe)"


def test_a_pid_file_replaced_by_a_named_pipe_reads_as_stale_not_a_hang(image, tmp_path):
    """The preloader's pid file was read with a plain open (and its lock looked at with a blocking
    one): a named pipe in its place hung the status check every load makes, and ``unstage``."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    pid_file = shm_files.pid_file(image, shm)
    os.mkfifo(pid_file)
    out = []
    for call in (lambda: shm_files.service_status(image, shm), lambda: staging.unstage(image, shm_dir=shm)):
        t = threading.Thread(target=lambda: out.append(call()), daemon=True)
        t.start()
        t.join(30)  # not a time asserted: without the fix neither call ends
        assert t.is_alive() is False, f"hung on the named pipe after {len(out)} call(s)"
    status, removed = out
    assert status.pid == -1 and status.stale and not status.running
    assert pid_file in removed and not shm_files.staging_dir(image, shm).exists()
