"""Faults that must not lose work: /dev/shm filling up mid-stage (a real tmpfs where this machine
lets the test mount one, and injected), a disk read error mid-stage (injected), a preloader
restarted or killed while an engine holds or awaits a served load, a holder killed and restarted
while clones map its arena. Each ends in a clear error or a finished job, never a ``.ready`` for
partial bytes. Each prints what the user saw and how long it took (``pytest -s``); no time is
asserted."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import flashboot
from flashboot.arena import Arena
from flashboot.errors import ArenaError, FlashBootError, ImageReadError, OutOfMemoryError, RendezvousError
from flashboot.flashload import client, service, stage_copy, staging
from flashboot.flashload import shm as shm_files
from flashboot.procfs import proc_start_time

from _preload_helpers import Daemon, enospc_after, make_tiny_image  # noqa: E402



@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("faults"))


def _report(fault: str, seconds: float, seen: str) -> None:
    print(f"\nFAULT {fault}: {seconds * 1e3:.0f} ms: {seen}")


def _nothing_staged(image, shm) -> None:
    d = shm_files.staging_dir(image, shm)
    left = sorted(p.name for p in d.iterdir() if p.name.startswith("rank-")) if d.is_dir() else []
    assert left == [], f"left behind: {left}"


def _image_bytes(image) -> bytes:
    return shm_files.rank_source(image, 0).path.read_bytes()


def _loaded_bytes(loaded) -> bytes:
    return bytes(loaded.arena.bytes()[:loaded.nbytes].numpy())


# --------------------------------------------------------------------- /dev/shm filling up
def _mount_tmpfs(where: Path, nbytes: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)], capture_output=True)
    return p.returncode == 0


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_shm_filling_up_mid_stage_fails_the_served_load_at_once(image, tmp_path, monkeypatch, how):
    shm = tmp_path / "shm"
    nbytes = shm_files.rank_source(image, 0).nbytes
    mounted = False
    if how == "tmpfs":
        # room for the image and a little more; another writer takes it once the copy is under way
        if not _mount_tmpfs(shm, nbytes + (256 << 10)):
            pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
        mounted = True
        # as on a filesystem without fallocate: the space is not reserved up front
        monkeypatch.setattr(staging, "_fallocate", lambda fd, off, n: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "")))
        real_pwrite, filled = stage_copy._pwrite, []

        def pwrite(fd, data, off):
            if not filled:  # a concurrent writer fills the filesystem after the first chunk
                n = real_pwrite(fd, data, off)
                filled.append(shm / "filler")
                with open(filled[0], "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                            f.flush()
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC
                return n
            return real_pwrite(fd, data, off)
    else:
        pwrite = enospc_after(16384)

    monkeypatch.setattr(stage_copy, "_pwrite", pwrite)
    try:
        d = Daemon(image, shm, staged=False, chunk_bytes=4096, threads=2)
        try:
            t0 = time.monotonic()
            with pytest.raises(OutOfMemoryError) as e:
                flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60)
            took = time.monotonic() - t0
            msg = str(e.value)
            assert "could not stage rank 0" in msg and "filled up after" in msg and "partial file removed" in msg
            assert e.value.nbytes_needed == nbytes
            _report(f"/dev/shm full mid-stage ({how})", took, msg)
            _nothing_staged(image, shm)
            assert d.server.residents[0].state == "failed" and d.thread.is_alive()
        finally:
            d.close()
        # room again: a restarted preloader finishes the job
        if how == "tmpfs":
            os.unlink(shm / "filler")
        monkeypatch.setattr(stage_copy, "_pwrite", os.pwrite)
        d = Daemon(image, shm)
        try:
            d.load_exact()
        finally:
            d.close()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(shm)], check=False)


# ----------------------------------------------------------------------- a disk read error
def test_a_disk_read_error_mid_stage_names_the_bytes_and_stages_nothing(image, tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    read, real_preadv = [0], stage_copy._preadv

    def preadv(fd, buffers, off):
        if off >= 32768:
            raise OSError(errno.EIO, "Input/output error")
        n = real_preadv(fd, buffers, off)
        read[0] += n
        return n

    monkeypatch.setattr(stage_copy, "_preadv", preadv)
    with pytest.raises(ImageReadError, match=r"reading [\d,]+ bytes at byte 3\d,\d{3} failed: EIO") as e:
        staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=2)
    assert "not staged (partial file removed)" in str(e.value) and read[0] > 0
    _nothing_staged(image, shm)
    # served: the engine hears the daemon's error at once, with its class
    d = Daemon(image, shm, staged=False, chunk_bytes=4096, threads=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(ImageReadError, match="EIO") as e:
            flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60)
        _report("disk read error mid-stage (served load)", time.monotonic() - t0, str(e.value))
        assert "could not stage rank 0" in str(e.value)
        _nothing_staged(image, shm)
    finally:
        d.close()
    # the CLI: exit status 2 and the same words
    from flashboot.cli import main

    assert main(["preload", str(image), "--shm-dir", str(shm), "--chunk-bytes", "4KiB", "--threads", "2"]) == 2
    _nothing_staged(image, shm)


# ------------------------------------------------------------------ the preloader restarted
def test_preloader_restarted_or_killed_while_an_engine_holds_a_served_load(image, tmp_path):
    shm = tmp_path / "shm"
    want = _image_bytes(image)
    cfg = staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True)
    pids = [service.start_background(cfg, timeout_s=60)]
    held = None
    try:
        held = flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60)
        staged_at = shm_files.read_ready(shm_files.staged_paths(image, 0, shm).ready).staged_at
        # a clean restart (SIGTERM, start again) while the engine holds its load
        t0 = time.monotonic()
        service.stop_service(image, shm, timeout_s=30)
        pids.append(service.start_background(cfg, timeout_s=60))
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60) as again:
            took = time.monotonic() - t0
            assert _loaded_bytes(again) == want and again.report.details["daemon_pid"] == pids[1]
        _report("preloader restarted (SIGTERM + start) while an engine holds a served load", took,
                "the held load is untouched; the next served load is answered by the new daemon")
        assert _loaded_bytes(held) == want
        # killed with a request in its queue: the engine is told at once, its arena released
        src = shm_files.rank_source(image, 0)
        os.kill(pids[1], signal.SIGSTOP)
        arena = Arena.create(src.nbytes, "cpu")
        try:
            copy = client.start_served_load(arena, image_dir=str(image), rank=0, nbytes=src.nbytes,
                                            metadata_sha256=src.metadata_sha256, timeout_s=60, shm_dir=shm)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RendezvousError, match="did it exit") as e:
                copy.wait()
            _report("preloader killed (SIGKILL) with a served load in its queue", time.monotonic() - t0, str(e.value))
        finally:
            arena.close()
        _reap(pids[1])
        assert _loaded_bytes(held) == want
        st = service.service_status(image, shm)
        assert st.stale and st.pid == pids[1]
        # started again over its stale pid file and socket; the staged copy was complete: kept
        t0 = time.monotonic()
        pids.append(service.start_background(cfg, timeout_s=60))
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60) as again:
            assert _loaded_bytes(again) == want and again.report.details["daemon_pid"] == pids[2]
        _report("preloader started again after SIGKILL, first served load", time.monotonic() - t0,
                "loaded, byte-exact")
        assert shm_files.read_ready(shm_files.staged_paths(image, 0, shm).ready).staged_at == staged_at
    finally:
        if held is not None:
            held.close()
        service.stop_service(image, shm, timeout_s=30)


def _reap(pid: int) -> None:
    deadline = time.monotonic() + 10
    while proc_start_time(pid) is not None:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        assert time.monotonic() < deadline, f"pid {pid} did not go"
        time.sleep(0.01)


def test_a_preloader_killed_mid_stage_leaves_no_ready_and_the_next_one_restages(image, tmp_path):
    """What a daemon killed mid-copy leaves: a ``.partial`` (and a stale pid file), never a
    ``.ready``. The next preloader removes them and stages the whole image."""
    shm = tmp_path / "shm"
    paths = shm_files.staged_paths(image, 0, shm)
    paths.dir.mkdir(parents=True)
    nbytes = shm_files.rank_source(image, 0).nbytes
    paths.partial.write_bytes(b"\xab" * (nbytes // 3))
    paths.image.write_bytes(b"\xcd" * nbytes)  # a whole-size image without its .ready: not trusted
    assert not paths.ready.exists()
    r = staging.stage_rank(image, 0, shm_dir=shm)
    assert not r.skipped and not paths.partial.exists()
    assert paths.image.read_bytes() == _image_bytes(image)
    assert shm_files.read_ready(paths.ready).nbytes == nbytes


# ----------------------------------------------------------------------- the holder restarted
_CLONE = """
import hashlib, sys
from flashboot.flashclone.holder import open_held
a = open_held("w", registry=sys.argv[1])
print("mapped", flush=True)
sys.stdin.readline()
print(hashlib.sha256(bytes(a.bytes().numpy())).hexdigest(), flush=True)
a.close()
"""


def _holder(registry: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "flashboot.cli", "hold", "--registry", str(registry)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "holder ready" in p.stdout.readline()
    return p


def test_holder_killed_and_restarted_while_clones_map_its_arena(tmp_path):
    from flashboot.flashclone.holder import hand_over, open_held

    registry = tmp_path / "registry"
    data = np.random.default_rng(7).integers(0, 256, 4 << 20, dtype=np.uint8)
    want = hashlib.sha256(data.tobytes()).hexdigest()
    holder = _holder(registry)
    procs = [holder]
    try:
        with Arena.create(data.nbytes, "cpu") as engine:
            engine.bytes().numpy()[:] = data
            hand_over(engine, "w", registry=registry, timeout_s=20)
        mine = open_held("w", registry=registry)  # a clone in this process ...
        other = subprocess.Popen([sys.executable, "-c", _CLONE, str(registry)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)  # ... and one in another
        procs.append(other)
        assert other.stdout.readline().strip() == "mapped"
        holder.kill()
        holder.wait(10)
        # the clones keep every byte: their mappings hold the memory
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == want
        assert hashlib.sha256(bytes(mine.bytes().numpy())).hexdigest() == want
        # a new open of the name says the holder is gone
        t0 = time.monotonic()
        with pytest.raises(FlashBootError) as e:
            open_held("w", registry=registry)
        _report("holder killed (SIGKILL) while clones map its arena; open_held of its name",
                time.monotonic() - t0, f"{type(e.value).__name__}: {e.value}")
        assert str(holder.pid) in str(e.value) and "exited" in str(e.value)
        # restarted. A clone cannot hand over the memory it maps: an opened arena's descriptor still
        # names its exporter, the dead holder (Arena.export), and the new holder says so ...
        t0 = time.monotonic()
        holder = _holder(registry)
        procs.append(holder)
        with pytest.raises(ArenaError, match=f"could not adopt 'w': process {procs[0].pid} has exited"):
            hand_over(mine, "w", registry=registry, timeout_s=20)
        # ... so it hands over a copy (one memcpy of the arena), and the name works again
        with Arena.create(mine.nbytes, "cpu") as fresh:
            fresh.bytes().copy_(mine.bytes())
            d = hand_over(fresh, "w", registry=registry, timeout_s=20)
        with open_held("w", registry=registry) as again:
            assert d.pid == holder.pid and hashlib.sha256(bytes(again.bytes().numpy())).hexdigest() == want
        _report("holder restarted, a surviving clone hands a copy of the arena back, open_held again",
                time.monotonic() - t0, "held by the new holder, byte-exact")
        # a clean stop (SIGTERM) releases the name; the clone still holds its bytes
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(15) == 0
        with pytest.raises(FlashBootError, match="no arena is held as 'w'"):
            open_held("w", registry=registry)
        assert hashlib.sha256(bytes(mine.bytes().numpy())).hexdigest() == want
        mine.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_a_verifying_served_load_of_too_many_checksum_chunks_is_refused_by_name(image, tmp_path, monkeypatch):
    """The daemon's digests travel in one socket message: past its bound the load is refused with
    the numbers (and the arena released), not answered with a reply the socket cannot carry."""
    from flashboot.errors import LayoutError
    from flashboot.flashload import server

    monkeypatch.setattr(server, "MAX_REPLY_DIGESTS", 3)  # the daemon runs in this process (a thread)
    daemon = Daemon(image, tmp_path / "shm")
    try:
        chunks = len(shm_files.rank_source(image, 0).metadata.checksums.digests)
        assert chunks > 3
        with pytest.raises(LayoutError, match=rf"rank 0: {chunks:,} checksum chunks .* at most 3 digests"):
            flashboot.load(image, 0, "cpu", served=True, shm_dir=tmp_path / "shm", timeout_s=30, verify=True)
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=tmp_path / "shm", timeout_s=30) as unchecked:
            assert unchecked.report.details["verify_skipped"].startswith("off by default on the host backend")
    finally:
        daemon.close()


def test_the_daemon_warms_a_ranks_first_copy_at_stage_time_and_leaks_nothing(image, tmp_path):
    """At stage time the daemon opens an arena of its own as it opens an engine's (on the host
    backend that is the whole warm-up): logged as done, no failure, every fd it made closed again,
    and the engine's first served load gets the image's bytes."""
    fds_before = set(os.listdir("/proc/self/fd"))
    daemon = Daemon(image, tmp_path / "shm")
    try:
        assert not any("warming its first copy failed" in line for line in daemon.log), daemon.log
        assert any("first copy warmed" in line for line in daemon.log), daemon.log
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=tmp_path / "shm", timeout_s=30) as li:
            assert _loaded_bytes(li) == _image_bytes(image)
    finally:
        daemon.close()
    assert set(os.listdir("/proc/self/fd")) - fds_before == set()


@pytest.mark.gpu
def test_gpu_a_verifying_served_copy_digests_piece_by_piece_and_names_a_flipped_byte(image, tmp_path, monkeypatch):
    """The daemon digests each copied piece while the next one copies (pieces of 3 checksum chunks
    here, so ~11 of them): the digests it returns are the image's, a byte flipped in a later piece
    is named by its chunk, and the stage-time warm-up ran without a logged failure."""
    from flashboot.errors import ChecksumMismatchError
    from flashboot.flashload import serve_copy

    monkeypatch.setattr(serve_copy, "SERVE_CHUNK_BYTES", 3 * 4096)  # the daemon runs in this process (a thread)
    shm = Path(tempfile.mkdtemp(prefix="flashboot-test-", dir="/dev/shm"))  # pinning needs tmpfs, not tmp_path's disk
    daemon = Daemon(image, shm, devices={0: "cuda:0"})
    try:
        assert not any("warming its first copy failed" in line for line in daemon.log), daemon.log
        assert daemon.server.residents[0].warm_ms > 0
        with flashboot.load(image, 0, "cuda:0", served=True, shm_dir=shm, timeout_s=30, verify=True) as li:
            assert li.report.details["verified"].endswith("(verified by the daemon)")
            assert bytes(li.arena.bytes()[:li.nbytes].cpu().numpy()) == _image_bytes(image)
        staged = shm_files.staged_paths(image, 0, shm).image
        with open(staged, "r+b") as f:  # the daemon's pinned pages: chunk 25, in the 9th piece
            f.seek(25 * 4096 + 7)
            b = f.read(1)
            f.seek(25 * 4096 + 7)
            f.write(bytes([b[0] ^ 0x5A]))
        with pytest.raises(ChecksumMismatchError) as e:
            flashboot.load(image, 0, "cuda:0", served=True, shm_dir=shm, timeout_s=30, verify=True)
        assert e.value.chunk == 25 and e.value.offset == 25 * 4096
    finally:
        daemon.close()
        shutil.rmtree(shm, ignore_errors=True)
