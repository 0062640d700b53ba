"""The preloader: staging rank images into shared memory, .ready semantics, full filesystems,
O_DIRECT fallback, NUMA placement, the background service and served loads across processes
(host backend)."""

import errno
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _io_helpers import CHUNK, image, image_master, refuse_direct_open, shm  # noqa: F401  (fixtures)
from flashboot.layouts import read_image

import flashboot
from flashboot.errors import (
    CapabilityError,
    ChecksumMismatchError,
    FlashBootError,
    LayoutError,
    OutOfMemoryError,
    WaitTimeoutError,
)
from flashboot import fileio
from flashboot.flashload import client, service, stage_copy, staging
from flashboot.flashload import shm as shm_files
from flashboot.memory import Device

from _image_helpers import rewrite_metadata


def _image_bytes(image_dir, rank=0) -> bytes:
    return read_image(image_dir, rank).path.read_bytes()


# ------------------------------------------------------------------------------ staging
def test_stage_copies_the_image_and_writes_ready(image, shm):
    img = read_image(image, 0)
    result = staging.stage_rank(image, 0, shm_dir=shm, threads=4, chunk_bytes=8192)
    paths = shm_files.staged_paths(image, 0, shm)
    assert Path(result.staged) == paths.image
    assert paths.image.read_bytes() == img.path.read_bytes()
    assert not paths.partial.exists()
    info = shm_files.read_ready(paths.ready)
    assert info.nbytes == img.nbytes == result.nbytes
    assert info.rank == 0 and info.threads == 4
    assert info.checksum["chunks"] == len(img.metadata.checksums.digests) > 8
    assert info.checksum["fingerprint"] == shm_files.checksum_fingerprint(img.metadata.checksums.digests)
    assert info.key_digest == img.metadata.key.digest
    assert info.io_mode == result.io_mode
    assert info.numa_node is None and "host backend" in info.numa_reason
    # The rank directory is keyed by the image directory: a second image gets its own.
    assert shm_files.staging_dir(image, shm) != shm_files.staging_dir(image.parent / "other", shm)


def test_ready_is_written_atomically_and_last(image, shm, monkeypatch):
    """No reader can see a .ready without the complete image beside it."""
    seen = []
    real_write = shm_files._write_atomic

    def spy(path, text, *folder):
        paths = shm_files.staged_paths(image, 0, shm)
        seen.append((paths.image.exists(), paths.partial.exists(), path.exists()))
        real_write(path, text, *folder)

    monkeypatch.setattr(staging, "_write_atomic", spy)
    staging.stage_rank(image, 0, shm_dir=shm)
    assert seen == [(True, False, False)]
    assert not [p for p in shm_files.staging_dir(image, shm).iterdir() if p.name.endswith(".tmp")]


def test_restage_is_skipped_unless_forced_and_withdraws_ready_first(image, shm, monkeypatch):
    first = staging.stage_rank(image, 0, shm_dir=shm)
    again = staging.stage_rank(image, 0, shm_dir=shm)
    assert not first.skipped and again.skipped
    paths = shm_files.staged_paths(image, 0, shm)

    def fail(*a, **k):
        assert not paths.ready.exists(), ".ready must be gone before the old image is replaced"
        raise OSError(errno.EIO, "disk error")

    monkeypatch.setattr(staging, "_fallocate", fail)
    with pytest.raises(OSError):
        staging.stage_rank(image, 0, shm_dir=shm, force=True)
    assert not paths.ready.exists() and not paths.partial.exists() and not paths.image.exists()


def test_wait_ready_times_out_naming_the_path(image, shm):
    path = shm_files.staged_paths(image, 0, shm).ready
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError) as e:
        shm_files.wait_ready(image, 0, timeout_s=0.2, shm_dir=shm)
    assert time.monotonic() - t0 >= 0.2
    assert str(path) in str(e.value) and "no preloader is running" in str(e.value)
    # a preloader killed: its pid file stays; the wait names it and its log (it had said only "none runs")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid_path = shm_files.pid_file(image, shm)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    pid_path.write_text(json.dumps({"pid": int(dead.stdout), "start_time": 1}))
    with pytest.raises(WaitTimeoutError, match=rf"no preloader is running \(the one its pid file names, pid "
                                               rf"{int(dead.stdout)}, was killed: its log .*preload.log\)"):
        shm_files.wait_ready(image, 0, timeout_s=0.2, shm_dir=shm)


def test_ready_from_another_prepack_is_refused(image, shm):
    staging.stage_rank(image, 0, shm_dir=shm)
    info = shm_files.read_ready(shm_files.staged_paths(image, 0, shm).ready)
    meta_path = read_image(image, 0).dir / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["warnings"] = ["edited"]  # another pre-pack: same sizes, different metadata (digest re-recorded)
    rewrite_metadata(meta_path.parent, meta)
    with pytest.raises(LayoutError, match="another pre-pack"):
        shm_files.check_ready(info, shm_files.rank_source(image, 0))


def test_malformed_ready_is_a_layout_error(tmp_path):
    p = tmp_path / "rank-0.ready"
    p.write_text("{not json")
    with pytest.raises(LayoutError, match=str(p)):
        shm_files.read_ready(p)
    p.write_text(json.dumps({"format": shm_files.READY_FORMAT, "rank": 0}))
    with pytest.raises(LayoutError, match="lacks"):
        shm_files.read_ready(p)


def test_wrong_rank_and_truncated_image(image, shm):
    with pytest.raises(LayoutError, match="rank 3 requested"):
        staging.stage_rank(image, 3, shm_dir=shm)
    img = read_image(image, 0)
    with open(img.path, "r+b") as f:
        f.truncate(img.nbytes - 4096)
    with pytest.raises(LayoutError, match="truncated"):
        staging.stage_rank(image, 0, shm_dir=shm)
    assert not shm_files.staged_paths(image, 0, shm).ready.exists()


def test_verify_names_the_corrupted_chunk_and_leaves_nothing(image, shm):
    img = read_image(image, 0)
    with open(img.path, "r+b") as f:
        f.seek(5 * CHUNK + 100)
        b = f.read(1)
        f.seek(5 * CHUNK + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError) as e:
        staging.stage_rank(image, 0, shm_dir=shm, verify=True)
    assert e.value.chunk == 5 and e.value.offset == 5 * CHUNK
    assert "chunk 5" in str(e.value)
    paths = shm_files.staged_paths(image, 0, shm)
    assert not paths.ready.exists() and not paths.partial.exists() and not paths.image.exists()


# ------------------------------------------------------------------------- full /dev/shm
def test_refuses_before_any_io_when_shm_lacks_space(image, shm, monkeypatch):
    monkeypatch.setattr(staging, "_fs_free_bytes", lambda path: 10_000)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    nbytes = read_image(image, 0).nbytes
    with pytest.raises(OutOfMemoryError) as e:
        staging.stage_rank(image, 0, shm_dir=shm)
    assert e.value.nbytes_needed == nbytes and e.value.nbytes_free == 10_000
    assert f"{nbytes:,}" in str(e.value) and "10,000" in str(e.value)
    assert not [p for p in opened if p.endswith((".img", ".partial"))]
    assert list(shm_files.staging_dir(image, shm).iterdir()) == []


def test_shm_filling_up_mid_copy_removes_the_partial_file(image, shm, monkeypatch):
    from _preload_helpers import enospc_after

    monkeypatch.setattr(stage_copy, "_pwrite", enospc_after(16384))
    with pytest.raises(OutOfMemoryError) as e:
        staging.stage_rank(image, 0, shm_dir=shm, chunk_bytes=4096, threads=2)
    assert "filled up after" in str(e.value) and "partial file removed" in str(e.value)
    assert e.value.nbytes_needed == read_image(image, 0).nbytes
    paths = shm_files.staged_paths(image, 0, shm)
    assert not paths.partial.exists() and not paths.image.exists() and not paths.ready.exists()


def test_fallocate_enospc_is_a_full_shm(image, shm, monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging, "_fallocate", full)
    with pytest.raises(OutOfMemoryError, match="after 0 of"):
        staging.stage_rank(image, 0, shm_dir=shm)
    assert list(shm_files.staging_dir(image, shm).iterdir()) == []


# ------------------------------------------------------------------------------ O_DIRECT
def test_o_direct_refused_at_open_falls_back_and_says_so(image, shm, monkeypatch):
    refuse_direct_open(monkeypatch)
    r = staging.stage_rank(image, 0, shm_dir=shm)
    assert r.io_mode == "buffered" and "O_DIRECT" in r.io_reason
    assert shm_files.read_ready(shm_files.staged_paths(image, 0, shm).ready).io_mode == "buffered"
    assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == _image_bytes(image)
    with pytest.raises(CapabilityError, match="O_DIRECT"):
        staging.stage_rank(image, 0, shm_dir=shm, io="direct", force=True)


def test_o_direct_refused_at_read_falls_back(image, shm, monkeypatch):
    import fcntl

    tried = []
    real_preadv = os.preadv

    def fake_preadv(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            tried.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", fake_preadv)
    r = staging.stage_rank(image, 0, shm_dir=shm, threads=3, chunk_bytes=8192)
    assert tried, "O_DIRECT was tried first"
    assert r.io_mode == "buffered" and "reads" in r.io_reason
    assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == _image_bytes(image)


def test_buffered_when_asked(image, shm):
    r = staging.stage_rank(image, 0, shm_dir=shm, io="buffered")
    assert r.io_mode == "buffered" and r.io_reason == "asked for buffered reads"


def test_read_rate(image):
    gbps, mode = fileio.read_rate(read_image(image, 0).path, io="buffered")
    assert gbps > 0 and mode == "buffered"


def test_read_rate_with_reads_in_flight_reads_every_block_once(image, monkeypatch):
    """bench stream's ceiling: the loader's reads in flight and read size (O_DIRECT where allowed)."""
    path = read_image(image, 0).path
    size = path.stat().st_size
    real, seen, lock = os.preadv, [], threading.Lock()

    def recording(fd, buffers, offset):
        n = real(fd, buffers, offset)
        with lock:
            seen.append((offset, n))
        return n

    monkeypatch.setattr(os, "preadv", recording)
    gbps, mode = fileio.read_rate(path, block_bytes=8192, in_flight=3)
    assert gbps > 0 and mode in ("o_direct", "buffered")
    offsets = sorted(off for off, _ in seen)
    assert offsets == list(range(0, size, 8192)) and sum(n for _, n in seen) == size
    with pytest.raises(FlashBootError, match="in_flight must be >= 1"):
        fileio.read_rate(path, in_flight=0)


def test_read_rate_reads_into_the_callers_buffers_and_leaves_them_open(image):
    """bench stream's ceiling reads into a ring's slots, as the stream does: every byte of the
    file passes through them, and they are the caller's to close."""
    from flashboot.fileio import io_buffer

    path = read_image(image, 0).path
    size = path.stat().st_size
    bufs = [io_buffer(8192) for _ in range(2)]
    try:
        gbps, _ = fileio.read_rate(path, block_bytes=8192, in_flight=2, buffers=[memoryview(b) for b in bufs])
        assert gbps > 0 and not any(b.closed for b in bufs)
        last = (-(-size // 8192) - 1) * 8192  # the last block landed in one of the two buffers
        tail = path.read_bytes()[last:]
        assert any(bytes(b[:len(tail)]) == tail for b in bufs)
        with pytest.raises(FlashBootError, match=r"wants 2 buffers of 8,192 bytes, got \[8192\]"):
            fileio.read_rate(path, block_bytes=8192, in_flight=2, buffers=[memoryview(bufs[0])])
    finally:
        for b in bufs:
            b.close()


def test_io_buffers_are_private_page_aligned_and_survive_a_refused_huge_page_advice(monkeypatch):
    import ctypes

    from flashboot import fileio

    buf = fileio.io_buffer(3 << 20)
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert len(buf) == 3 << 20 and start % 4096 == 0
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        if thp.exists() and "[never]" not in thp.read_text():  # the kernel took the advice: VmFlags "hg"
            smaps = Path("/proc/self/smaps").read_text().split("\n")
            head = next(i for i, line in enumerate(smaps) if line.startswith(f"{start:x}-"))
            flags = next(line for line in smaps[head:] if line.startswith("VmFlags:")).split()[1:]
            assert "hg" in flags
        buf[:5] = b"bytes"
        child = os.fork()
        if child == 0:  # a private mapping: the child's write is its own
            buf[:5] = b"child"
            os._exit(0)
        os.waitpid(child, 0)
        assert buf[:5] == b"bytes"
    finally:
        buf.close()

    class NoHugePages(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(fileio.mmap, "mmap", NoHugePages)
    small = fileio.io_buffer(0)  # no transparent huge pages: the buffer all the same; a length of 0 still maps a byte
    assert len(small) == 1
    small.close()


# ---------------------------------------------------------------------------------- NUMA
def test_mbind_sets_the_policy_of_a_mapping():
    from flashboot.pinning import bind_to_node

    buf = mmap.mmap(-1, 1 << 20)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    bind_to_node(addr, 1 << 20, 0, "bind")
    line = next(l for l in Path("/proc/self/numa_maps").read_text().splitlines() if l.startswith(f"{addr:x} "))
    assert "bind:0" in line
    with pytest.raises(FlashBootError, match="unknown NUMA policy"):
        bind_to_node(addr, 1 << 20, 0, "interleave")
    buf.close()


def _fake_sys(tmp_path, nodes, bus_id="0000:18:00.0", gpu_node="1"):
    root = tmp_path / "sys"
    for n in nodes:
        (root / f"devices/system/node/node{n}").mkdir(parents=True)
    dev = root / "bus/pci/devices" / bus_id
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(gpu_node + "\n")
    return str(root)


def test_gpu_numa_node_from_sysfs(tmp_path, monkeypatch):
    from flashboot import pinning

    monkeypatch.setattr(pinning, "gpu_pci_bus_id", lambda dev: "0000:18:00.0")
    gpu = Device("cuda", 0)
    node, why = pinning.gpu_numa_node(gpu, _fake_sys(tmp_path / "a", [0, 1], gpu_node="1"))
    assert node == 1 and "node 1 of 2" in why
    node, why = pinning.gpu_numa_node(gpu, _fake_sys(tmp_path / "b", [0]))
    assert node is None and "single NUMA node" in why
    node, why = pinning.gpu_numa_node(gpu, _fake_sys(tmp_path / "c", [0, 1], gpu_node="-1"))
    assert node is None and "no NUMA affinity" in why
    assert pinning.gpu_numa_node(Device("cpu"))[0] is None


def test_staging_binds_pages_to_the_gpu_node(image, shm, monkeypatch):
    from flashboot import pinning

    bound = []
    real_bind = pinning.bind_to_node
    monkeypatch.setattr(pinning, "gpu_numa_node", lambda dev: (0, "cuda:0 is on NUMA node 0 of 2"))
    monkeypatch.setattr(pinning, "bind_to_node", lambda a, n, node, policy="preferred": (bound.append((n, node)),
                                                                                         real_bind(a, n, node, policy)))
    r = staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    nbytes = read_image(image, 0).nbytes
    assert r.numa_node == 0 and "(preferred)" in r.numa_reason
    assert (nbytes, 0) in bound  # the staged file's pages
    assert (8192, 0) in bound  # the read buffers
    assert shm_files.read_ready(shm_files.staged_paths(image, 0, shm).ready).numa_node == 0
    assert shm_files.staged_paths(image, 0, shm).image.read_bytes() == _image_bytes(image)


# --------------------------------------------------------------------------- the service
def test_background_preloader_stages_and_exits(image, shm):
    cfg = staging.PreloadConfig(str(image), shm_dir=str(shm))
    pid = service.start_background(cfg, timeout_s=60)
    info = shm_files.wait_ready(image, 0, timeout_s=60, shm_dir=shm)
    assert info.pid == pid
    deadline = time.monotonic() + 30
    while service.service_status(image, shm).pid is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.service_status(image, shm).pid is None, "the pid file is removed when the preloader exits"
    assert "rank 0: staged" in shm_files.log_file(image, shm).read_text()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_pid_file_is_detected_and_replaced(image, shm):
    path = shm_files.pid_file(image, shm)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": _dead_pid(), "start_time": 1}))
    st = service.service_status(image, shm)
    assert st.stale and not st.running
    assert "stale pid file" in service.stop_service(image, shm)
    assert not path.exists()
    path.write_text(json.dumps({"pid": os.getpid(), "start_time": 1}))  # a live pid, but not the writer
    assert service.service_status(image, shm).stale
    assert service._claim_pid_file(path, serve=False).startswith("removed stale pid file")
    assert json.loads(path.read_text())["pid"] == os.getpid()
    service._release_pid_file(path)
    assert not path.exists()


def test_served_load_is_verified_by_the_daemon_and_a_flipped_staged_byte_is_named(image, shm, monkeypatch):
    """verify=True on a served load: the daemon digests the bytes it copied into the arena and
    replies with them; this process only compares (it runs no checksum itself)."""
    from flashboot.kernels import checksum

    def no_checksum_here(*a, **k):
        raise AssertionError("the engine computed a checksum: the daemon should have")

    monkeypatch.setattr(checksum, "chunk_checksums", no_checksum_here)  # this process only; the daemon is another
    meta = read_image(image, 0).metadata
    chunk = meta.checksums.chunk_bytes
    assert len(meta.checksums.digests) >= 2
    service.start_background(staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True), timeout_s=60)
    try:
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60, verify=True) as ok:
            n = len(meta.checksums.digests)
            assert ok.report.details["verified"] == f"{n} chunks match the pre-pack's checksums (verified by the daemon)"
            assert ok.report.verify_ms > 0
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60) as plain:
            assert "not verified: off by default on the host backend" in plain.report.summary()
        staged = shm_files.staged_paths(image, 0, shm).image
        with open(staged, "r+b") as f:  # one flipped byte in the daemon's staged copy, in chunk 1
            f.seek(chunk + 9)
            b = f.read(1)
            f.seek(chunk + 9)
            f.write(bytes([b[0] ^ 0x01]))
        with pytest.raises(ChecksumMismatchError) as e:
            flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60, verify=True)
        assert e.value.chunk == 1 and e.value.offset == chunk and "rank 0" in str(e.value)
        handle = flashboot.prepare(image, 0, "cpu", mode="served", shm_dir=shm, timeout_s=60, verify=True)
        with pytest.raises(ChecksumMismatchError) as e:
            flashboot.load(image, 0, "cpu", prepared=handle)
        assert e.value.chunk == 1 and "copied into cpu by flashboot.prepare" in str(e.value)
        assert handle.arena.closed
    finally:
        service.stop_service(image, shm)


def test_served_load_across_processes(image, shm):
    """A daemon process holds the staged image; this process (the engine) loads from it."""
    cfg = staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True)
    pid = service.start_background(cfg, timeout_s=60)
    try:
        st = service.service_status(image, shm)
        assert st.running and st.serve and st.pid == pid
        with pytest.raises(FlashBootError, match="already runs"):
            service.start_background(cfg, timeout_s=10)
        loaded = flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=60)
        with loaded:
            assert loaded.report.mode == "served"
            assert loaded.report.details["daemon_pid"] == pid != os.getpid()
            # the strict read of the metadata and the views ran while the daemon copied
            assert loaded.report.overlapped == ["metadata", "bind"] and loaded.report.metadata_ms > 0
            assert loaded.source.metadata_sha256 == shm_files.rank_source(image, 0).metadata_sha256
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
            img = read_image(image, 0)
            for name in list(img.tensors)[:20]:
                assert torch.equal(loaded.tensors[name].reshape(-1).view(torch.uint8),
                                   img.view(name).reshape(-1).view(torch.uint8))
        status = client.serve_status(image, shm)
        assert status["ranks"]["0"]["state"] == "mapped"
        # A rank the daemon does not serve: the daemon's error comes back with its class.
        src = shm_files.rank_source(image, 0)
        from dataclasses import replace

        from flashboot.arena import Arena

        with Arena.create(src.nbytes, "cpu") as arena:
            with pytest.raises(LayoutError, match="rank 7"):
                client.served_load(arena, replace(src, rank=7), timeout_s=10, shm_dir=shm)
        # A key the caller does not expect is refused from prepack.json before any arena exists.
        created = []
        real_create = Arena.create.__func__

        def spy(cls, *a, **k):
            created.append(real_create(cls, *a, **k))
            return created[-1]

        import unittest.mock

        with unittest.mock.patch.object(Arena, "create", classmethod(spy)):
            with pytest.raises(LayoutError, match="not the expected model"):
                flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=30,
                               expected_key={"model_id": "someone/else"})
        assert not created
        with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=30) as again:
            assert bytes(again.arena.bytes()[:again.nbytes].numpy()) == _image_bytes(image)
        # metadata.json rewritten after staging: not the bytes the daemon holds. The copy starts
        # before the metadata is read (sized from .ready); the bytes read then differ from the
        # .ready's, so that copy is discarded with its arena, and the load is refused by name.
        meta_path = image / "rank-0" / "metadata.json"
        rewrite_metadata(meta_path.parent, json.loads(meta_path.read_text()))  # as a re-pre-pack would
        created.clear()
        with unittest.mock.patch.object(Arena, "create", classmethod(spy)):
            with pytest.raises(LayoutError, match="of another pre-pack"):
                flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=0.5)
        assert len(created) == 1 and created[0].closed
    finally:
        msg = service.stop_service(image, shm, timeout_s=30)
    assert msg == f"stopped preloader pid {pid}"
    assert not shm_files.pid_file(image, shm).exists()
    assert not shm_files.socket_path(image, shm).exists()
    assert "stale" not in service.stop_service(image, shm) and "no preloader" in service.stop_service(image, shm)


def test_served_ready_refuses_a_ready_of_other_metadata(image, shm):
    staging.stage_rank(image, 0, shm_dir=shm)
    src = shm_files.rank_source(image, 0)
    assert client.served_ready(image, 0, src.metadata_sha256, "here", timeout_s=1, shm_dir=shm).nbytes == src.nbytes
    t0 = time.monotonic()
    with pytest.raises(LayoutError, match="staged rank 0 is of another pre-pack .* than here \\(000000000000\\)"):
        client.served_ready(image, 0, "0" * 64, "here", timeout_s=30, shm_dir=shm)
    assert time.monotonic() - t0 < 10, "no preloader runs: nothing can re-stage it, so no waiting"


def test_served_load_without_a_daemon_times_out_naming_the_socket(image, shm):
    with pytest.raises(WaitTimeoutError) as e:
        flashboot.load(image, 0, "cpu", served=True, shm_dir=shm, timeout_s=0.3)
    assert str(shm_files.socket_path(image, shm)) in str(e.value)


# ---------------------------------------------------------------------------------- CLI
def test_cli_preload_status_unstage(image, shm, capsys):
    from flashboot.cli import main

    assert main(["preload", str(image), "--shm-dir", str(shm), "--threads", "2", "--chunk-bytes", "8KiB"]) == 0
    assert shm_files.staged_paths(image, 0, shm).ready.exists()
    assert main(["preload", str(image), "--shm-dir", str(shm), "--status"]) == 0
    out = capsys.readouterr().out
    assert "not running" in out and "rank 0: staged" in out
    assert main(["preload", str(image), "--shm-dir", str(shm), "--unstage"]) == 0
    assert not shm_files.staged_paths(image, 0, shm).ready.exists()
    assert main(["preload", str(image), "--shm-dir", str(shm), "--stop"]) == 0
    assert "no preloader runs" in capsys.readouterr().out
    assert main(["preload", str(image), "--shm-dir", str(shm), "--device", "zero"]) == 2
    assert main(["preload", str(tmp := image.parent / "nope"), "--shm-dir", str(shm)]) == 2
    assert str(tmp) in capsys.readouterr().err


def test_config_validates_itself(image):
    with pytest.raises(FlashBootError, match="io must be"):
        staging.PreloadConfig(str(image), io="fast")
    with pytest.raises(FlashBootError, match="unknown preload options"):
        staging.PreloadConfig.from_dict({"image_dir": str(image), "thread": 3})
    with pytest.raises(LayoutError, match=r"ranks \[2\] requested"):
        staging.PreloadConfig(str(image), ranks=[0, 2]).resolved_ranks()
    cfg = staging.PreloadConfig.from_dict({"image_dir": str(image), "threads": 3, "devices": {"0": "cpu"}})
    assert cfg.device_for(0) == Device("cpu")
    assert "--threads" in service.config_argv(cfg) and "0=cpu" in service.config_argv(cfg)


@pytest.mark.parametrize("serve_chunk_bytes", [1 << 12, 10_000, 1 << 16])
def test_served_copy_pieces_cover_the_image_in_whole_checksum_chunks(monkeypatch, serve_chunk_bytes):
    """A verifying CUDA served copy digests each piece while the next one copies: the pieces cover
    the image once, in order, each (but the last) a whole number of checksum chunks, so the pieces'
    digests, concatenated, are the image's."""
    import numpy as np

    from flashboot.flashload import serve_copy
    from flashboot.kernels.checksum import chunk_checksums_host

    monkeypatch.setattr(serve_copy, "SERVE_CHUNK_BYTES", serve_chunk_bytes)
    raw = np.random.default_rng(1).integers(0, 256, 50_003, dtype=np.uint8)
    for chunk_bytes in (1024, 4096, 3000, 1 << 15, 1 << 17):
        pieces = serve_copy.serve_pieces(raw.size, chunk_bytes)
        assert [off for off, _ in pieces] == list(np.cumsum([0] + [n for _, n in pieces[:-1]]))
        assert sum(n for _, n in pieces) == raw.size
        assert all(n % chunk_bytes == 0 and n <= max(serve_chunk_bytes, chunk_bytes) for _, n in pieces[:-1])
        digests = [d for off, n in pieces for d in chunk_checksums_host(raw[off:off + n], chunk_bytes)]
        assert digests == chunk_checksums_host(raw, chunk_bytes)


def _resident_bytes(start: int) -> int:
    """Rss of the mapping that begins at ``start``, from /proc/self/smaps."""
    smaps = Path("/proc/self/smaps").read_text().split("\n")
    head = next(i for i, line in enumerate(smaps) if line.startswith(f"{start:x}-"))
    return int(next(line for line in smaps[head:] if line.startswith("Rss:")).split()[1]) * 1024


@pytest.mark.parametrize("threads", [1, 3])
def test_populate_faults_in_every_page_of_a_buffer_on_its_threads(monkeypatch, threads):
    """What a buffer about to be pinned gets first (cuMemHostRegister then pins pages that exist):
    every page resident, the bytes zero, shared out over the threads asked for."""
    import ctypes
    import threading

    from flashboot import fileio, pinning

    monkeypatch.setattr(pinning, "POPULATE_SHARE_BYTES", 1 << 20)
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self))[1])
    nbytes = (3 << 20) + 4096 * 5  # not a multiple of a share: the last thread's share is short
    buf = fileio.io_buffer(nbytes)
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        before = _resident_bytes(start)
        assert before < nbytes
        pinning.populate(buf, threads=threads)
        assert _resident_bytes(start) >= nbytes
        assert buf[:] == bytes(nbytes)
        assert len([n for n in started if n.startswith("flashboot-populate-")]) == threads - 1
    finally:
        buf.close()
