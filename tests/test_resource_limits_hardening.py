"""The load path on a machine that runs short, as a cluster node or a container is: an address
space limit (``ulimit -v``), a thread limit, few file descriptors. Each ends in the right bytes
or one clear error naming the resource and the numbers, never a ``.ready`` for bytes that were
not copied, and leaves no file, fd or thread behind; a later load on a healthy machine works.

The limits are set in a fresh process (``run_python``): they stay with the process."""

from __future__ import annotations

import errno
import os
import subprocess
import threading

import pytest

from flashboot.errors import FlashBootError
from flashboot.flashload import shm as shm_files
from flashboot.flashload import stage_copy, staging

from _preload_helpers import make_tiny_image  # noqa: E402
from _python import run_python  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("limits"))


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _refuse_thread_start(monkeypatch, prefix: str, nth: int = 1) -> list:
    """Threads named ``prefix...`` start until the ``nth``, whose start is refused as a pids limit
    refuses it (Python's "can't start new thread"); returns those asked to start, the refused one last."""
    real_start, started = threading.Thread.start, []

    def start(self):
        if self.name.startswith(prefix):
            started.append(self)
            if len(started) == nth:
                raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


_UNDER_AS_LIMIT = """
import resource, sys
import flashboot, flashboot.flashload.staging, flashboot.fileio, numpy, torch
flashboot.load({image!r}, 0, "cpu", stream=True, verify=True).close()  # what a load imports, before the limit
def vm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm() + {extra}, resource.RLIM_INFINITY))
"""
"""A fresh process that has loaded ``image`` once, whose address space may then grow by ``extra``
bytes past what it maps."""


@pytest.fixture(scope="module")
def image_5mb(tmp_path_factory):
    from flashboot.benchmarks.checkpoints import CheckpointSpec

    from _preload_helpers import make_image

    spec = CheckpointSpec("five", layers=2, experts=4, expert_rows=256, expert_cols=256, hidden=256, vocab=1024,
                          shards=1)
    return make_image(tmp_path_factory.mktemp("five"), spec)


def test_a_read_buffer_refused_under_ulimit_v_fails_the_stage_and_stages_no_zeros(image_5mb, tmp_path):
    """A copy thread whose read buffer could not be mapped (ENOMEM under ``ulimit -v``) died with
    a traceback on stderr; the stage went on without its chunks, renamed the file of zeros into
    place and wrote a ``.ready`` for it: every load that did not verify served zeros."""
    image, shm = image_5mb, tmp_path / "shm"
    nbytes = shm_files.rank_source(image, 0).nbytes
    out = run_python("-c", _UNDER_AS_LIMIT.format(image=str(image), extra=4 << 20) + f"""
import threading
from flashboot.errors import OutOfMemoryError
threading.stack_size(1 << 20)  # the copy thread starts; its buffer of the whole rank is what does not fit
try:
    flashboot.flashload.staging.stage_rank({str(image)!r}, 0, shm_dir={str(shm)!r}, threads=1)
except OutOfMemoryError as exc:
    print("refused:", exc)
else:
    print("staged")
""")
    assert out.startswith("refused: "), out
    assert "the read buffer of one of 1 copy threads (stage with fewer, or smaller chunks): this process may map " \
           "at most " in out and "(`ulimit -v`)" in out, out
    assert f"needs {-(-nbytes // 4096) * 4096:,} bytes but only " in out, out
    paths = shm_files.staged_paths(image, 0, shm)
    assert not paths.ready.exists() and not paths.image.exists() and not paths.partial.exists()
    # the same stage on a healthy machine: whole bytes
    staging.stage_rank(image, 0, shm_dir=shm, threads=1)
    assert paths.image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()


def test_a_small_rank_stages_under_ulimit_v_with_a_buffer_of_its_size(image, tmp_path):
    """Each copy thread mapped a buffer of ``chunk_bytes`` (64 MiB by default) whatever the rank's
    size: a 127 KB rank was refused under a ``ulimit -v`` that leaves 32 MiB."""
    shm = tmp_path / "shm"
    out = run_python("-c", _UNDER_AS_LIMIT.format(image=str(image), extra=32 << 20) + f"""
print(flashboot.flashload.staging.stage_rank({str(image)!r}, 0, shm_dir={str(shm)!r}, threads=1).nbytes)
""")
    assert int(out) == shm_files.rank_source(image, 0).nbytes
    assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()


def test_a_read_buffer_refused_fails_the_stage_by_name_and_leaves_nothing(image, tmp_path, monkeypatch):
    """The same in this process (strict overcommit refuses the mapping as ENOMEM, no ``ulimit -v``
    set): one error naming the buffer's bytes, no ``.ready``, no staged file, no fd, no thread."""
    shm = tmp_path / "shm"
    real, calls = stage_copy.io_buffer, []

    def io_buffer(nbytes):
        calls.append(nbytes)
        if len(calls) == 2:  # the second thread's
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(nbytes)

    monkeypatch.setattr(stage_copy, "io_buffer", io_buffer)
    fds_before, threads_before = _fds(), set(threading.enumerate())
    with pytest.raises(FlashBootError, match=r"the read buffer of one of 4 copy threads \(stage with fewer, or smaller "
                                             r"chunks\): mapping 4,096 bytes failed: ENOMEM \(Cannot allocate memory\)"):
        staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=4)
    assert list(shm_files.staging_dir(image, shm).iterdir()) == []
    assert _fds() == fds_before and set(threading.enumerate()) == threads_before


def test_a_copy_thread_that_cannot_start_fails_the_stage_and_ends_the_others(image, tmp_path, monkeypatch):
    """A thread start refused (a container's pids limit, or no room for its stack under ``ulimit
    -v``) raised a bare RuntimeError out of the stage while the threads started before it still
    copied: the stage closed the file under them and removed it, and they wrote on."""
    shm = tmp_path / "shm"
    started = _refuse_thread_start(monkeypatch, "flashboot-preload-", nth=3)
    fds_before = _fds()
    with pytest.raises(FlashBootError, match=r"with 4 threads \(stage with fewer\), copy thread 3: a thread could not be "
                                             r"started \(can't start new thread\): .*`ulimit -u`: "):
        staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=4)
    assert not any(t.is_alive() for t in started[:2])
    assert list(shm_files.staging_dir(image, shm).iterdir()) == []
    assert _fds() == fds_before
    monkeypatch.undo()
    staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=4)
    assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == shm_files.rank_source(image, 0).path.read_bytes()


def test_a_load_under_ulimit_v_reads_small_files_without_mapping_their_limit(image, tmp_path):
    """``read_regular`` asked for ``max_bytes + 1`` at once, and Python allocates what is asked
    for before reading: every load mapped 1 GiB for a metadata.json of a few KB, a MemoryError
    under ``ulimit -v`` (or strict overcommit) before any byte of the image moved."""
    out = run_python("-c", _UNDER_AS_LIMIT.format(image=str(image), extra=256 << 20) + f"""
loaded = flashboot.load({str(image)!r}, 0, "cpu", shm_dir={str(tmp_path / "shm")!r}, verify=True)
print(loaded.report.details["verified"], loaded.report.mode)
loaded.close()
""")
    assert out.split()[0] not in ("False", "0"), out
    assert "streamed from disk" in out, out


def test_a_staged_file_that_cannot_be_mapped_under_ulimit_v_is_named_with_the_limit(image, tmp_path):
    """Mapping a staged image (``flashboot.stage``, the served daemon) under ``ulimit -v`` raised a
    bare ``OSError: [Errno 12] Cannot allocate memory``: no file, no bytes, no limit named."""
    staged = tmp_path / "rank-0.img"
    nbytes = 64 << 20
    staged.touch()
    os.truncate(staged, nbytes)  # sparse: no memory used
    out = run_python("-c", _UNDER_AS_LIMIT.format(image=str(image), extra=nbytes // 2) + f"""
from flashboot.errors import OutOfMemoryError
from flashboot.pinning import MappedFile
try:
    MappedFile({str(staged)!r}, {nbytes})
except OutOfMemoryError as exc:
    print(exc)
""")
    assert out.startswith(f"mapping {staged}: this process may map at most "), out
    assert f"(`ulimit -v`) and maps " in out and f"needs {nbytes:,} bytes but only " in out, out


def _mount_tmpfs(where, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode == 0


@pytest.mark.parametrize("inodes, file", [(2, "rank-0.lock"), (3, "rank-0.img.partial"), (4, "rank-0.ready")])
def test_a_tmpfs_out_of_inodes_is_named_not_taken_for_a_full_one(image, tmp_path, inodes, file):
    """/dev/shm with bytes free but no inode left (full of small files, or a tmpfs's
    ``nr_inodes``): the staged file's creation failed with a bare ``[Errno 28] No space left on
    device``, and the ``.ready``'s was called a full tmpfs ("needs 759 bytes but only 8,257,536
    are free (short by -8,256,777)")."""
    shm = tmp_path / "few-inodes"
    if not _mount_tmpfs(shm, f"size=8m,nr_inodes={inodes}"):
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        paths = shm_files.staged_paths(image, 0, shm)
        fds_before = _fds()
        with pytest.raises(FlashBootError) as got:
            staging.stage_rank(image, 0, shm_dir=shm)
        assert str(got.value).startswith(f"staging rank 0 of {image}: cannot " if inodes > 2 else
                                         f"cannot open the lock file {paths.lock}: ")
        assert f"{paths.dir / file}: {paths.dir} has no free inode: its filesystem holds all the {inodes} files it " \
               "may (a tmpfs's nr_inodes), with " in str(got.value)
        assert list(paths.dir.iterdir()) == [] and _fds() == fds_before
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)


def test_a_stage_out_of_file_descriptors_fails_naming_the_limit_at_every_open(image, tmp_path):
    """A process at its open-file limit (``ulimit -n``; an engine holding many sockets) staged a
    rank into a bare ``OSError: [Errno 24] Too many open files`` naming no limit, or was told to
    "use another --shm-dir", which does not help. Each number of fds left ends in the whole
    bytes or in one error naming the limit, and leaves no file or fd."""
    import resource

    want = shm_files.rank_source(image, 0).path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    outcomes = []
    for left in range(8):
        shm = tmp_path / f"shm{left}"
        shm.mkdir()
        fds_before = _fds()
        limit = max(int(fd) for fd in fds_before) + 64
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        filler = []
        try:
            while True:
                try:
                    filler.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            for fd in filler[len(filler) - left:] if left else []:
                os.close(fd)
            del filler[len(filler) - left:]
            try:
                staging.stage_rank(image, 0, shm_dir=shm, threads=1)
            except FlashBootError as exc:
                outcomes.append("refused")
                assert f"this process has all the {limit:,} files open that it may (`ulimit -n`; the hard limit is " \
                       in str(exc), exc
            else:
                outcomes.append("staged")
                assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == want
                staging.unstage(image, shm_dir=shm)
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert _fds() == fds_before
        assert [p.name for p in shm.rglob("*") if p.is_file()] == []
    assert outcomes[0] == "refused" and outcomes[-1] == "staged", outcomes


def test_a_verification_whose_mapping_is_refused_fails_by_name_and_stages_nothing(image, tmp_path, monkeypatch):
    """``verify=True`` maps the staged copy whole to checksum it: under ``ulimit -v`` (or strict
    overcommit) that mapping's refusal was a bare ``OSError: [Errno 12] Cannot allocate memory``."""
    import mmap

    shm = tmp_path / "shm"
    real = mmap.mmap

    def refuse_file_mappings(fd, *args, **kwargs):
        if fd != -1:  # the staged file's, not the copy threads' anonymous buffers
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refuse_file_mappings)
    nbytes = shm_files.rank_source(image, 0).nbytes
    paths = shm_files.staged_paths(image, 0, shm)
    with pytest.raises(FlashBootError, match=rf"verifying {paths.partial} \(rank 0\): mapping {nbytes:,} bytes failed: "
                                             r"ENOMEM \(Cannot allocate memory\)"):
        staging.stage_rank(image, 0, shm_dir=shm, verify=True)
    assert list(paths.dir.iterdir()) == []


def test_stage_whose_thread_cannot_start_names_the_limits(image, tmp_path, monkeypatch):
    """``flashboot.stage`` in a process that may start no more threads (a container's pids limit)
    raised Python's bare ``RuntimeError: can't start new thread``."""
    import flashboot

    _refuse_thread_start(monkeypatch, "flashboot-stage-rank")
    with pytest.raises(FlashBootError, match=rf"staging rank 0 of {image}: a thread could not be started \(can't start "
                                             r"new thread\): this process may start no more \(`ulimit -u`: "):
        flashboot.stage(image, 0, "cpu", shm_dir=tmp_path / "shm")


def test_a_load_beside_a_serving_preloader_that_failed_its_rank_streams_at_once(image, tmp_path, monkeypatch):
    """A serving preloader that failed to stage a rank (an error other than too few bytes free: no
    inode left, fds, threads, a disk error) keeps serving: a plain load waited its whole timeout
    for the ``.ready`` that never came, then said only that a preloader is running."""
    import flashboot

    from _preload_helpers import Daemon

    from flashboot.flashload.service import _claim_pid_file, _release_pid_file

    shm = tmp_path / "shm"

    def pwrite(fd, data, off):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(stage_copy, "_pwrite", pwrite)
    pid_file = shm_files.pid_file(image, shm)
    shm_files.make_dir(pid_file.parent)
    _claim_pid_file(pid_file, True)  # as `flashboot preload --serve` does, around the server in a thread here
    daemon = Daemon(image, shm, staged=False)
    try:
        assert daemon.server.residents[0].event.wait(60), daemon.log
        assert daemon.server.residents[0].state == "failed", daemon.log
        monkeypatch.undo()
        loaded = flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=10, verify=True)
        try:
            why = loaded.report.details["stream_reason"]
            assert why.startswith(f"the preloader (pid {os.getpid()}) failed to stage rank 0: ") and "EIO" in why, why
            assert loaded.report.details["verified"]
        finally:
            loaded.close()
    finally:
        daemon.close()
        _release_pid_file(pid_file)


def test_populate_whose_thread_cannot_start_ends_the_others_and_names_the_limits(monkeypatch):
    """``populate`` (before a pin: the stream's ring, a sleep's host backup) whose thread start was
    refused raised Python's bare RuntimeError while the threads started before it still wrote
    into the buffer that the caller then closed."""
    import mmap

    from flashboot import pinning

    monkeypatch.setattr(pinning, "POPULATE_SHARE_BYTES", 4096)
    started = _refuse_thread_start(monkeypatch, "flashboot-populate-", nth=2)
    buf = mmap.mmap(-1, 1 << 20)
    try:
        with pytest.raises(FlashBootError, match=r"faulting in 1,048,576 bytes with 4 threads: a thread could not be "
                                                 r"started \(can't start new thread\): .*`ulimit -u`: "):
            pinning.populate(buf, threads=4)
        assert not started[0].is_alive()
    finally:
        buf.close()  # nothing holds it any more


def test_a_source_rewritten_in_place_while_staged_is_refused_not_staged_as_a_mix(tmp_path, monkeypatch):
    """The image file rewritten in place (same size) while the preloader copied it: the copy took
    the old bytes before and the new ones after, renamed the mix into place under a ``.ready``,
    and a load (the host backend does not verify by default) returned it without a word. A
    streamed load checks the file's identity before and after its reads; the stager now does."""
    import flashboot

    from flashboot.errors import LayoutError

    image, shm = make_tiny_image(tmp_path / "own"), tmp_path / "shm"
    path = shm_files.rank_source(image, 0).path
    want = path.read_bytes()
    real, rewritten = stage_copy._preadv, []

    def preadv(fd, buffers, off):
        if off >= 16384 and not rewritten:
            rewritten.append(off)
            with open(path, "r+b") as f:
                f.write(bytes(len(want)))  # another pre-pack's bytes, same size
        return real(fd, buffers, off)

    monkeypatch.setattr(stage_copy, "_preadv", preadv)
    with pytest.raises(LayoutError, match=rf"{path} changed while it was staged \(the rank is not staged\) \(device, "
                                          r"inode, size, mtime_ns "):
        staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=1)
    assert rewritten and list(shm_files.staging_dir(image, shm).iterdir()) == []
    monkeypatch.undo()
    path.write_bytes(want)  # the pre-pack's own bytes back: staged, and loaded, whole
    staging.stage_rank(image, 0, shm_dir=shm)
    loaded = flashboot.load(image, 0, "cpu", shm_dir=shm)
    try:
        assert bytes(loaded.arena.bytes()[:len(want)].numpy()) == want
    finally:
        loaded.close()


def test_a_host_arena_refused_under_ulimit_v_says_the_limit(image):
    """A host arena's reservation refused under ``ulimit -v`` was an ArenaError saying only
    "[Errno 12] Cannot allocate memory": now an OutOfMemoryError (an ArenaError) with the limit
    and what is left under it."""
    out = run_python("-c", _UNDER_AS_LIMIT.format(image=str(image), extra=64 << 20) + """
from flashboot.arena import Arena
from flashboot.errors import OutOfMemoryError
try:
    Arena.create(1 << 30, "cpu")
except OutOfMemoryError as exc:
    print("refused:", exc)
""")
    assert out.startswith("refused: a 1,073,741,824-byte host arena: this process may map at most "), out
    assert "(`ulimit -v`)" in out and "needs 1,073,741,824 bytes but only " in out, out


def test_a_host_arena_over_the_hard_fd_limit_counts_the_headroom_it_keeps():
    """The refusal read "needs 1 fds (one per segment) and 14 are open; the hard limit on open
    files is 24": the 64 fds kept free for what follows were in the sum but not in the message."""
    out = run_python("-c", """
import os, resource
from flashboot.arena import Arena
from flashboot.errors import ArenaError
open_now = len(os.listdir("/proc/self/fd")) - 1
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 10, open_now + 10))
try:
    Arena.create(4 << 20, "cpu", segment_bytes=2 << 20)
except ArenaError as exc:
    print(open_now, exc)
""")
    import re

    limit, message = out.split(" ", 1)
    m = re.search(r"needs 2 fds \(one per segment\) and (\d+) are open, with 64 kept free for the sockets and "
                  r"files that follow: (\d+) in all; the hard limit on open files is (\d+):", message)
    assert m and int(m[2]) == int(m[1]) + 2 + 64 and int(m[3]) == int(limit) + 10, message


def test_reading_an_image_whose_hashing_thread_cannot_start_names_the_limits_and_closes_its_file(image, monkeypatch):
    """Reading an image's metadata hashes it in a thread beside the table: a refused start was
    Python's bare RuntimeError, and the metadata file it had opened for that thread stayed open."""
    from flashboot.layouts import read_image

    _refuse_thread_start(monkeypatch, "flashboot-beside")
    before = _fds()
    with pytest.raises(FlashBootError, match=r"metadata.json: reading and hashing [\d,]+ bytes: a thread could not be "
                                             r"started \(can't start new thread\): this process may start no more"):
        read_image(image, 0).close()
    assert _fds() == before


def _cgroup_files(root, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("proc,files,want", [
    # v2, in a container: its own root; page cache (file less shmem) counts as reclaimable
    ("0::/\n", {"cgroup.controllers": "memory", "memory.max": "1000000", "memory.current": "600000",
                "memory.stat": "anon 300000\nfile 250000\nshmem 50000\n"}, (600000, "memory.max = 1,000,000")),
    # v2 below a tighter parent; no limit ("max") at the leaf
    ("0::/a/b\n", {"cgroup.controllers": "", "a/b/memory.max": "max", "a/b/memory.current": "10",
                   "a/memory.max": "5000", "a/memory.current": "4000", "a/memory.stat": "file 0\nshmem 0\n"},
     (1000, "a/memory.max = 5,000")),
    # v2 beside v1 controllers (hybrid): the unified hierarchy
    ("1:cpu:/\n0::/x\n", {"unified/x/memory.max": "8192", "unified/x/memory.current": "0"}, (8192, "")),
    # v1: the memory controller's hierarchy, the kernel's ~2**63 for no limit at the root
    ("4:memory:/job\n0::/\n", {"memory/memory.limit_in_bytes": str(2**63 - 4096),
                               "memory/job/memory.limit_in_bytes": "3000", "memory/job/memory.usage_in_bytes": "2500",
                               "memory/job/memory.stat": "cache 700\nshmem 600\nrss 1800\n"},
     (600, "job/memory.limit_in_bytes = 3,000, 2,500 charged")),
    # no limit anywhere
    ("4:memory:/\n0::/\n", {"memory/memory.limit_in_bytes": str(2**63 - 4096)}, None),
])
def test_cgroup_memory_room_reads_v1_and_v2_and_the_tightest_level(tmp_path, proc, files, want):
    from flashboot.memory import cgroup_memory_room

    root = tmp_path / "cgroup"
    _cgroup_files(root, files)
    (tmp_path / "proc").write_text(proc)
    got = cgroup_memory_room(root=str(root), proc=str(tmp_path / "proc"))
    if want is None:
        assert got is None
    else:
        assert got[0] == want[0] and want[1] in got[1], got
    assert cgroup_memory_room(root=str(root), proc=str(tmp_path / "no-such-file")) is None


def test_staging_into_tmpfs_past_the_memory_cgroup_is_refused_before_a_byte_is_written(image, tmp_path, monkeypatch):
    """A container's /dev/shm is charged to its memory cgroup: the stage checked only the tmpfs's
    free bytes (half the host's RAM) and was OOM-killed halfway. Disk-backed staging is not
    charged (its page cache can be reclaimed), so it is not checked."""
    import flashboot.pinning

    shm = tmp_path / "shm"
    nbytes = shm_files.rank_source(image, 0).nbytes
    monkeypatch.setattr(staging, "cgroup_memory_room", lambda: (nbytes - 1, "/sys/fs/cgroup/memory.max = 8,000"))
    monkeypatch.setattr(flashboot.pinning, "fs_type", lambda path: "tmpfs")
    with pytest.raises(FlashBootError, match=rf"its pages are charged to this process's memory cgroup: /sys/fs/cgroup/"
                                             rf"memory.max = 8,000\): needs {nbytes:,} bytes but only {nbytes - 1:,}"):
        staging.stage_rank(image, 0, shm_dir=shm)
    paths = shm_files.staged_paths(image, 0, shm)
    assert not paths.partial.exists() and not paths.ready.exists() and not paths.image.exists()
    monkeypatch.setattr(flashboot.pinning, "fs_type", lambda path: "ext4")
    assert staging.stage_rank(image, 0, shm_dir=shm).nbytes == nbytes


def test_cgroup_memory_room_in_a_real_v1_memory_cgroup():
    """What the stage's check reads, in a memory cgroup this test makes with a limit 64 MiB above
    what its process has charged (root and a cgroup v1 memory hierarchy; otherwise skipped, as the
    capability is absent)."""
    import secrets

    base = "/sys/fs/cgroup/memory"
    if os.geteuid() != 0 or not os.path.isfile(f"{base}/memory.limit_in_bytes"):
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    group = f"{base}/flashboot-test-{secrets.token_hex(4)}"
    try:
        os.mkdir(group)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc.strerror}")
    try:
        out = run_python("-c", f"""
import os
from flashboot.memory import cgroup_memory_room
with open({group!r} + "/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
with open({group!r} + "/memory.usage_in_bytes") as f:
    used = int(f.read())
with open({group!r} + "/memory.limit_in_bytes", "w") as f:
    f.write(str(used + (64 << 20)))
room, where = cgroup_memory_room()
print(used, room, where)
""")
        used, room, where = out.split(" ", 2)
        assert 32 << 20 < int(room) <= (64 << 20) + (8 << 20), out  # the limit less what it charged since, page cache back
        assert where.startswith(f"{group}/memory.limit_in_bytes = {int(used) + (64 << 20):,}, "), out
    finally:
        os.rmdir(group)


def test_numba_that_cannot_be_imported_is_named_with_the_address_space_limit_every_time():
    """Under ``ulimit -v`` numba's import fails as ``OSError: Could not find/load shared object
    file 'libllvmlite.so'`` (the library is there; its mapping was refused), then as ``SystemError``
    or ``MemoryError``: a user reinstalled llvmlite. Each host checksum and host copy that needs it
    now says numba's import failed, why, and the limit, on every call (here the import is refused
    by a ``None`` in ``sys.modules``, as reproducibly as a limit is not)."""
    out = run_python("-c", """
import sys
import numpy as np
sys.modules["numba"] = None
from flashboot.errors import FlashBootError
from flashboot.kernels.checksum import checksum
from flashboot.movers.host import host_copy
src, dst = np.ones(4 << 20, np.uint8), np.zeros(4 << 20, np.uint8)
def copy():
    host_copy(dst.ctypes.data, src.ctypes.data, src.nbytes)
for call in (lambda: checksum(src), lambda: checksum(src), copy, copy):
    try:
        call()
        print("no error")
    except FlashBootError as exc:
        print(str(exc).replace(chr(10), " "))
""")
    lines = out.strip().splitlines()
    assert len(lines) == 4, out
    for line, what in zip(lines, ["host checksum"] * 2 + ["host mover's parallel copy"] * 2):
        assert what in line and "needs numba, whose import failed in this process (ModuleNotFoundError" in line, line
        assert "address-space limit (`ulimit -v`) is unlimited: numba and LLVM" in line, line


def test_the_host_loops_work_where_numba_finds_no_cache_directory(tmp_path):
    """A container with a read-only file system and no ``HOME``: numba can cache neither beside
    the package nor under ``~/.cache``, and ``cache=True`` raised "no locator available" at the
    import of the checksum and copy loops, so every verify and host copy failed. They now cache
    under the temporary directory. (Here numba's two usual locations are taken away by leaving
    it only the locators that find nothing: the root this runs as may write anywhere.)"""
    out = run_python("-c", """
import numpy as np
from numba.core import caching
caching.CacheImpl._locator_classes = [caching.UserProvidedCacheLocator, caching.ZipCacheLocator]
from flashboot.kernels.checksum import checksum
from flashboot.movers.host import host_copy
src, dst = np.arange(4 << 20, dtype=np.uint32).view(np.uint8), np.zeros(16 << 20, np.uint8)
host_copy(dst.ctypes.data, src.ctypes.data, src.nbytes)
print(checksum(dst) == checksum(src), (dst == src).all())
""", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.split() == ["True", "True"], out
    cached = list((tmp_path / f"flashboot-numba-cache-{os.getuid()}").rglob("*.nbi"))
    assert {p.name.split(".")[0] for p in cached} >= {"checksum_host", "host_copy"}, cached


_PARALLEL_UNDER_AS_LIMIT = """
import resource, threading, warnings
import numba, numpy as np
from flashboot.kernels.checksum_host import checksum_host
from flashboot.movers.host import host_copy
src = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8)
def once():  # compiled (or loaded from the cache) and the answers taken on one thread, before the limit
    numba.set_num_threads(1)
    out.append(checksum_host(src))
out = []
t = threading.Thread(target=once)
t.start()
t.join()
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (80 << 20), resource.RLIM_INFINITY))  # room for ~7 stacks, not 15
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dst = np.zeros_like(src)
    host_copy(dst.ctypes.data, src.ctypes.data, src.nbytes)
    digest = checksum_host(src)
print(digest == out[0], bool((dst == src).all()), numba.get_num_threads(), "|", *{str(w.message) for w in caught})
"""


def test_parallel_host_loops_under_ulimit_v_start_only_the_threads_it_leaves_room_for():
    """16 threads' stacks did not fit: GNU OpenMP ended the process at the first parallel loop
    ("libgomp: Thread creation failed"), no exception, so a verify under `ulimit -v` killed the engine."""
    out = run_python("-c", _PARALLEL_UNDER_AS_LIMIT, env={**os.environ, "NUMBA_NUM_THREADS": "16"})
    same, copied, threads, _, *warned = out.split()
    assert (same, copied) == ("True", "True"), out
    assert 1 <= int(threads) < 16, out
    assert f"runs on {threads} of 16 threads" in " ".join(warned) and "ulimit -v" in " ".join(warned), out
