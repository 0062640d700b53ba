"""Streaming an image straight from disk (no preloader, nothing staged, no room in /dev/shm):
byte-exact results, host memory bounded by the ring whatever the image's size (measured with
VmHWM in a fresh process), when it streams and why, and bad input (truncated file, read errors,
O_DIRECT refused) refused cleanly with nothing leaked."""

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _io_helpers import CHUNK, TINY, image, image_master, refuse_direct_open, shm  # noqa: F401  (fixtures)
from flashboot.benchmarks.checkpoints import CheckpointSpec, make_checkpoint
from flashboot.layouts import read_image

import flashboot
from flashboot.errors import CapabilityError, FlashBootError, ImageReadError, LayoutError, WaitTimeoutError
from flashboot.flashload import service, staging, stream
from flashboot.flashload import shm as shm_files
from flashboot.procfs import proc_start_time
from flashboot.flashload.sources import disk
from flashboot.flashload.sources.disk import stream_reason
from flashboot.flashload.stream import StreamConfig

SMALL_RING = 4 * 4096  # 4 slots of one page: the ~127 KB image cycles the ring ~8 times


def _file_bytes(image_dir, rank=0) -> np.ndarray:
    return np.frombuffer(read_image(image_dir, rank).path.read_bytes(), np.uint8)


def _arena_bytes(loaded) -> np.ndarray:
    return loaded.arena.bytes().numpy()[: loaded.nbytes]


def _spy(monkeypatch, cls, name="create") -> list:
    """Record every object ``cls.create`` (or ``cls(...)``) makes."""
    made = []
    if name == "create":
        real = cls.create.__func__

        def spy(c, *a, **k):
            made.append(real(c, *a, **k))
            return made[-1]

        monkeypatch.setattr(cls, "create", classmethod(spy))
    else:
        real_init = cls.__init__

        def init(self, *a, **k):
            real_init(self, *a, **k)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    return made


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def _stream_threads() -> list:
    return [t.name for t in threading.enumerate() if t.name.startswith("flashboot-stream")]


def _fake_preloader(image, shm, ranks=None) -> Path:
    """A pid file naming this (live) process as the image's preloader."""
    path = shm_files.pid_file(image, shm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "start_time": proc_start_time(os.getpid()),
                                "serve": False, "ranks": ranks}))
    return path


# ------------------------------------------------------------------------------ the stream
def test_no_preloader_streams_at_once_byte_exact(image, shm):
    with flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes=SMALL_RING, verify=True,
                        timeout_s=3600) as loaded:
        r = loaded.report
        assert r.mode == "streamed from disk"
        assert "no preloader runs" in r.details["stream_reason"] and "rank 0 is not staged" in r.details["stream_reason"]
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))
        assert r.verify_ms > 0 and r.tensors == len(loaded.tensors) == TINY.tensor_count
        d = r.details
        assert d["buffer_bytes"] <= SMALL_RING and d["peak_buffer_bytes"] <= d["buffer_bytes"]
        assert d["slots"] == 4 and d["slot_bytes"] == 4096 and r.chunks == -(-loaded.nbytes // 4096)
        assert d["io_mode"] in ("o_direct", "buffered") and d["read_gbps"] > 0
        assert d["staged_speedup_estimate"] > 0 and d["staged_copy_ms_estimate"] > 0
        assert "streamed from disk" in r.summary() and "flashboot preload" in r.summary()
        for name, t in loaded.tensors.items():  # the views point at the streamed bytes
            entry = loaded.metadata.tensors[name]
            raw = t.contiguous().view(-1).view(torch.uint8).numpy()
            assert np.array_equal(raw, _file_bytes(image)[entry.offset:entry.offset + raw.size]), name
    assert not list(shm.glob("**/rank-*")), "streaming stages nothing"


def test_default_ring_is_capped_by_the_image_and_the_env(image, shm, monkeypatch):
    monkeypatch.setenv(stream.BUFFER_ENV, str(64 << 10))
    cfg = StreamConfig()
    assert cfg.buffer_bytes == 64 << 10 and cfg.ring_bytes == 56 << 10 and cfg.slot_bytes == 12 << 10
    assert cfg.slots_for(1 << 30) == 4 and cfg.slots_for(13 << 10) == 2
    monkeypatch.delenv(stream.BUFFER_ENV)
    cfg = StreamConfig()
    assert cfg.buffer_bytes == stream.DEFAULT_BUFFER_BYTES and cfg.slot_bytes == stream.SLOT_BYTES == 4 << 20
    assert cfg.ring_bytes == cfg.buffer_bytes - stream.MAX_OVERHEAD_BYTES
    assert cfg.slots_for(1 << 40) == stream.RING_SLOTS == 16  # 64 MiB pinned, not the cap's 240 MiB
    assert StreamConfig(buffer_bytes=1 << 30, slot_bytes=32 << 20).slots_for(1 << 40) == 16
    with flashboot.load(image, 0, "cpu", shm_dir=shm) as loaded:  # a 127 KB image gets one slot of its size
        assert loaded.report.details["buffer_bytes"] == -(-loaded.nbytes // 4096) * 4096 < stream.SLOT_BYTES
        assert loaded.report.details["slots"] == 1
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))


def test_config_validates_itself(monkeypatch):
    with pytest.raises(FlashBootError, match="buffer_bytes must be an int >= 8,192, got 100"):
        StreamConfig(buffer_bytes=100)
    with pytest.raises(FlashBootError, match="slot_bytes must be a positive multiple of 4096"):
        StreamConfig(buffer_bytes=1 << 20, slot_bytes=5000)
    with pytest.raises(FlashBootError, match="at most half of the ring's 917,504 bytes"):
        StreamConfig(buffer_bytes=1 << 20, slot_bytes=512 << 10)
    with pytest.raises(FlashBootError, match="threads"):
        StreamConfig(threads=0)
    with pytest.raises(FlashBootError, match="io must be one of"):
        StreamConfig(io="mmap")
    with pytest.raises(FlashBootError, match="unknown stream options \\['bufer_bytes'\\]"):
        StreamConfig.of({"bufer_bytes": 1 << 20})
    assert StreamConfig.of({"buffer_bytes": 1 << 20, "threads": 2}).threads == 2
    monkeypatch.setenv(stream.BUFFER_ENV, "lots")
    with pytest.raises(FlashBootError, match="FLASHBOOT_STREAM_BUFFER_BYTES must be a number"):
        StreamConfig()
    monkeypatch.setenv(stream.BUFFER_ENV, "4096")  # a number, too small: the message names where it came from
    with pytest.raises(FlashBootError, match="^\\$FLASHBOOT_STREAM_BUFFER_BYTES \\(the stream's buffer_bytes\\) "
                                             "must be an int >= 8,192, got 4096"):
        StreamConfig()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -3, "30", True, 1e7])
def test_a_timeout_that_no_wait_can_keep_is_refused_before_anything_starts(image, shm, bad):
    """NaN had spun a staging thread forever (no deadline is ever reached) and inf raised
    OverflowError mid-load, leaving the thread; a served load with inf never returned."""
    threads = set(threading.enumerate())
    for call in (lambda: flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=bad),
                 lambda: flashboot.load(image, 0, "cpu", shm_dir=shm, served=True, timeout_s=bad),
                 lambda: flashboot.prepare(image, 0, "cpu", shm_dir=shm, timeout_s=bad),
                 lambda: flashboot.stage(image, 0, "cpu", shm_dir=shm, timeout_s=bad),
                 lambda: flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes={"stall_timeout_s": bad})):
        with pytest.raises(FlashBootError, match=r"timeout_s must be a finite number of seconds in \(0, 1e\+06\], got"):
            call()
    assert set(threading.enumerate()) == threads


def test_a_slot_larger_than_the_image_is_cut_to_it(image, shm):
    """A 64 GiB slot asked for a 127 KB image had been mapped whole (a raw ENOMEM here)."""
    with flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes={"buffer_bytes": 1 << 40,
                                                                           "slot_bytes": 1 << 36}) as loaded:
        assert loaded.report.details["buffer_bytes"] == -(-loaded.nbytes // 4096) * 4096
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))


def test_options_a_prepared_load_would_ignore_are_refused(image, shm):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    try:
        for kw, what in ((dict(stream=False), "prepared= excludes served=, staged= and stream="),
                         (dict(stream_buffer_bytes=1 << 20), "stream_buffer_bytes=1048576 differs from the stream "
                                                             "options flashboot.prepare.. was given"),
                         (dict(shm_dir=shm / "other"), "differs from the staging root flashboot.prepare.. used")):
            with pytest.raises(FlashBootError, match=what):
                flashboot.load(image, 0, "cpu", prepared=handle, **kw)
        with flashboot.load(image, 0, "cpu", prepared=handle, shm_dir=shm) as loaded:  # the same: taken
            assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))
    finally:
        handle.close()
    with pytest.raises(FlashBootError, match="a served=True load never streams"):  # refused up front, not after a wait
        flashboot.load(image, 0, "cpu", shm_dir=shm, served=True, timeout_s=1, stream_buffer_bytes={"bad": 1})


def test_a_preloader_pid_file_with_bad_ranks_is_named(image, shm):
    from flashboot.flashload.shm import pid_file

    path = pid_file(image, shm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "start_time": proc_start_time(os.getpid()), "ranks": 5}))
    with pytest.raises(LayoutError, match=r"preload.pid: 'ranks' must list ints, found 5"):
        flashboot.load(image, 0, "cpu", shm_dir=shm)


_MEASURE = r"""
import json, sys
import numpy as np
import flashboot

def status():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            d[k] = int(v.split()[0]) * 1024
    return d

image, shm = sys.argv[1], sys.argv[2]
out = []
for cap, slot in ((16 << 20, None), (128 << 20, 8 << 20), (16 << 20, None)):
    # the first 16 MiB load warms numba, torch and the allocator; the last one is measured
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    before = status()["VmRSS"]
    with flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes={"buffer_bytes": cap, "slot_bytes": slot}) as li:
        hwm = status()["VmHWM"]
        arena = li.arena.bytes().numpy()[: li.nbytes]
        ok = bool(np.array_equal(arena, np.fromfile(li.source.path, np.uint8)))
        out.append({"cap": cap, "extra_peak": hwm - before - li.nbytes, "ring": li.report.details["buffer_bytes"],
                    "peak_in_use": li.report.details["peak_buffer_bytes"], "nbytes": li.nbytes, "equal": ok,
                    "mode": li.report.mode})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def big_image(tmp_path_factory):
    """A ~266 MB image (8 experts of 2048 x 2176, embeddings, attention)."""
    root = tmp_path_factory.mktemp("stream-big")
    spec = CheckpointSpec("big", layers=2, experts=4, expert_rows=2048, expert_cols=2176, hidden=1024, vocab=8192,
                          shards=2)
    make_checkpoint(str(root / "ckpt"), spec, device="cpu")
    flashboot.prepack(str(root / "ckpt"), str(root / "image"), progress=False)
    shutil.rmtree(root / "ckpt")
    return root / "image"


def test_peak_host_memory_stays_under_the_cap(big_image, tmp_path):
    """Peak RSS beyond the arena's own pages, in a fresh process: under the 16 MiB cap for a
    266 MB image (38 tensors: the views' objects, ~0.4 KB a tensor, come on top of the cap);
    the same measurement sees the slots used of a 112 MiB ring (so it would see a leak or a
    whole-image buffer)."""
    res = subprocess.run([sys.executable, "-c", _MEASURE, str(big_image), str(tmp_path / "shm")], capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    _, large, small = json.loads(res.stdout.strip().splitlines()[-1])  # the first load warmed up
    assert small["cap"] == 16 << 20 and large["cap"] == 128 << 20
    assert small["nbytes"] > 250e6 and small["equal"] and large["equal"]
    assert small["mode"] == "streamed from disk"
    assert small["ring"] <= 16 << 20 and small["peak_in_use"] <= small["ring"]
    assert small["extra_peak"] < 16 << 20, small  # ring, reader threads, views: all of it under the cap
    assert large["ring"] == 112 << 20  # 14 slots of 8 MiB: the cap less its 1/8
    # the measurement sees the ring's slots that were used (on the host backend the ring is not
    # populated up front, and free slots are reused newest first)
    assert large["peak_in_use"] >= 16 << 20 and large["extra_peak"] > large["peak_in_use"] - (8 << 20), large


# ------------------------------------------------------------------------------ when and why
def test_staged_rank_is_copied_from_shm_not_streamed(image, shm):
    staging.stage_rank(image, 0, shm_dir=shm)
    src = shm_files.rank_source(image, 0)
    assert stream_reason(image, 0, src, shm_dir=shm) is None
    with flashboot.load(image, 0, "cpu", shm_dir=shm) as loaded:
        assert loaded.report.mode == "host" and "streamed_from_disk" not in loaded.report.details
    assert stream_reason(image, 0, src, shm_dir=shm, stream=True) == "stream=True was asked"
    with flashboot.load(image, 0, "cpu", shm_dir=shm, stream=True) as loaded:
        assert loaded.report.mode == "streamed from disk"
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))
    with flashboot.stage(image, 0, "cpu", shm_dir=shm) as staged:
        with pytest.raises(FlashBootError, match="stream=True excludes"):
            flashboot.load(image, 0, "cpu", shm_dir=shm, staged=staged, stream=True)


def test_a_preloader_staging_the_rank_is_waited_for(image, shm):
    """Only then: the load waits for .ready (and times out naming it)."""
    _fake_preloader(image, shm, ranks=[0])
    src = shm_files.rank_source(image, 0)
    assert stream_reason(image, 0, src, shm_dir=shm) is None
    ready = shm_files.staged_paths(image, 0, shm).ready
    with pytest.raises(WaitTimeoutError, match=f"{ready}.*a preloader is running \\(pid {os.getpid()}\\)"):
        flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=0.3)
    _fake_preloader(image, shm, ranks=None)  # a preloader of every rank (or an older pid file)
    assert stream_reason(image, 0, src, shm_dir=shm) is None


def test_stream_false_waits_as_before(image, shm):
    with pytest.raises(WaitTimeoutError, match="no preloader is running"):
        flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=0.3, stream=False)


def test_a_preloader_of_other_ranks_is_not_waited_for(image, shm):
    _fake_preloader(image, shm, ranks=[1, 2])
    with flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=3600) as loaded:
        assert loaded.report.details["stream_reason"] == f"the preloader (pid {os.getpid()}) stages ranks [1, 2], not rank 0"
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))


def test_no_room_in_shm_streams_and_says_how_much(image, shm, monkeypatch):
    nbytes = read_image(image, 0).nbytes
    monkeypatch.setattr(disk, "_shm_free_bytes", lambda path: (64 << 10, "/dev/shm"))  # less than the image
    src = shm_files.rank_source(image, 0)
    _fake_preloader(image, shm, ranks=[0])
    why = stream_reason(image, 0, src, shm_dir=shm)
    assert why == f"the preloader (pid {os.getpid()}) cannot stage rank 0: /dev/shm has 65,536 bytes free, " \
                  f"the image needs {nbytes:,}"
    paths = shm_files.staged_paths(image, 0, shm)
    paths.partial.write_bytes(b"")  # it has already reserved the space and is writing: wait
    assert stream_reason(image, 0, src, shm_dir=shm) is None
    paths.partial.unlink()
    shm_files.pid_file(image, shm).unlink()
    with flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=3600) as loaded:
        assert loaded.report.details["stream_reason"].endswith(f"/dev/shm has 65,536 bytes free, the image needs {nbytes:,}")


def test_real_free_space_is_read_from_the_nearest_existing_directory(tmp_path):
    free, where = disk._shm_free_bytes(tmp_path / "not" / "yet")
    st = os.statvfs(tmp_path)
    assert where == str(tmp_path) and abs(free - st.f_bavail * st.f_frsize) < (64 << 20)


def test_a_staged_copy_of_another_prepack_is_streamed_around(image, shm):
    staging.stage_rank(image, 0, shm_dir=shm)
    ready = shm_files.staged_paths(image, 0, shm).ready
    info = json.loads(ready.read_text())
    info["metadata_sha256"] = "0" * 64
    ready.write_text(json.dumps(info))
    with flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=3600) as loaded:
        why = loaded.report.details["stream_reason"]
        assert "its staged copy is unusable" in why and "another pre-pack" in why
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))


def test_preloader_pid_file_records_its_ranks(image, shm):
    path = shm_files.pid_file(image, shm)
    path.parent.mkdir(parents=True)
    service._claim_pid_file(path, serve=False, ranks=[3, 1])
    assert json.loads(path.read_text())["ranks"] == [1, 3]


# ------------------------------------------------------------------------------ bad input
def test_truncated_image_is_refused_before_any_arena_or_view(image, shm, monkeypatch):
    img = read_image(image, 0)
    with open(img.path, "r+b") as f:
        f.truncate(img.nbytes - CHUNK)
    from flashboot.arena import Arena

    created = _spy(monkeypatch, Arena)
    with pytest.raises(LayoutError) as e:
        flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=3600)
    msg = str(e.value)
    assert str(img.path) in msg and "truncated" in msg and f"{img.nbytes:,}" in msg and f"{img.nbytes - CHUNK:,}" in msg
    assert created == []


def test_image_shorter_than_asked_is_refused_before_any_read(image, monkeypatch):
    """The size check of the open file (the file may change after the metadata was read)."""
    from flashboot.arena import Arena

    img = read_image(image, 0)
    reads = []
    monkeypatch.setattr(stream, "_preadv", lambda *a: reads.append(a) or 0)
    started = []
    with Arena.create(img.nbytes + CHUNK, "cpu") as arena:
        with pytest.raises(LayoutError, match=f"{img.path}: truncated: {img.nbytes + CHUNK:,} bytes expected, "
                                              f"the file has {img.nbytes:,}"):
            stream.stream_image(img.path, img.nbytes + CHUNK, arena, SMALL_RING, on_start=lambda: started.append(1))
    assert reads == [] and started == []


def test_an_image_rewritten_while_it_streams_is_refused(image, shm, monkeypatch):
    """Nothing tied the streamed file to the metadata read before: written to mid-stream (same
    size), the load returned a mix of old and new bytes, unverified, without a word."""
    from flashboot.arena import Arena

    created = _spy(monkeypatch, Arena)
    path = read_image(image, 0).path
    real, reads = os.preadv, []

    def rewrite_then_read(fd, bufs, off):
        reads.append(off)
        if len(reads) == 3:
            with open(path, "r+b") as f:
                f.write(b"\xff" * 4096)
        return real(fd, bufs, off)

    monkeypatch.setattr(stream, "_preadv", rewrite_then_read)
    with pytest.raises(LayoutError, match=rf"{path} changed while it was read .*it was written to; its bytes are not "
                                          "the ones its metadata describes, and nothing was loaded"):
        flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes=SMALL_RING, timeout_s=3600)
    assert len(created) == 1 and created[0].closed


def test_a_link_flipped_to_another_image_mid_load_loads_the_first_whole(image, shm, tmp_path, monkeypatch):
    """A blue/green deployment flips ``current`` to a new image while a load is between its
    metadata read and its open: the load had streamed the new image's bytes under the old
    image's metadata. The link is resolved once: the load is the old image, whole."""
    from flashboot.arena import Arena

    other = Path(shutil.copytree(image, tmp_path / "other"))
    other_bin = read_image(other, 0).path
    other_bin.write_bytes(bytes(b ^ 0x5A for b in other_bin.read_bytes()))
    current = tmp_path / "current"
    current.symlink_to(image)
    real_create = Arena.create.__func__

    def create_then_flip(cls, *a, **k):
        current.unlink()
        current.symlink_to(other)
        return real_create(cls, *a, **k)

    monkeypatch.setattr(Arena, "create", classmethod(create_then_flip))
    loaded = flashboot.load(current, 0, "cpu", shm_dir=shm, timeout_s=3600)
    try:
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))
    finally:
        loaded.close()
    monkeypatch.setattr(Arena, "create", classmethod(real_create))
    source = shm_files.rank_source(image, 0)  # then another file in its place: refused at the open
    (source.path.parent / "next.bin").write_bytes(source.path.read_bytes())
    os.replace(source.path.parent / "next.bin", source.path)
    with Arena.create(source.nbytes, "cpu") as arena:
        with pytest.raises(LayoutError, match=rf"{source.path} changed since its metadata was read"):
            stream.stream_image(source.path, source.nbytes, arena, SMALL_RING, identity=source.image.file_identity)


def _failing_preadv(monkeypatch, *, at: int, error: OSError | None):
    """Reads at offsets >= ``at`` raise ``error`` (None: return 0, end of file)."""
    real = os.preadv

    def fake(fd, bufs, off):
        if off >= at:
            if error is None:
                return 0
            raise error
        return real(fd, bufs, off)

    monkeypatch.setattr(stream, "_preadv", fake)


@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), None], ids=["EIO", "shrank"])
def test_a_failure_mid_stream_releases_everything(image, shm, monkeypatch, error):
    from flashboot.arena import Arena

    created = _spy(monkeypatch, Arena)
    rings = _spy(monkeypatch, stream.Ring, "__init__")
    fds = _open_fds()
    at = 5 * 4096
    _failing_preadv(monkeypatch, at=at, error=error)
    with pytest.raises(FlashBootError) as e:
        flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes=SMALL_RING, timeout_s=3600)
    path = str(read_image(image, 0).path)
    if error is not None:
        assert isinstance(e.value, ImageReadError) and e.value.path == path and e.value.offset >= at
        assert "Input/output error" in str(e.value) and f"at byte {e.value.offset:,}" in str(e.value)
    else:
        assert isinstance(e.value, LayoutError) and path in str(e.value) and "shrank" in str(e.value)
        assert f"{read_image(image, 0).nbytes:,} bytes were expected" in str(e.value)
    assert len(created) == 1 and created[0].closed, "the arena is released"
    assert len(rings) == 1 and rings[0].closed, "the ring is unmapped"
    assert _open_fds() == fds, "no file descriptor left open"
    assert _stream_threads() == [], "every reader stopped"


def test_a_stalled_read_times_out(image, monkeypatch):
    from flashboot.arena import Arena

    gate = threading.Event()
    real = os.preadv

    def slow(fd, bufs, off):
        if off >= 4096:
            gate.wait(10)
        return real(fd, bufs, off)

    monkeypatch.setattr(stream, "_preadv", slow)
    img = read_image(image, 0)
    cfg = StreamConfig(buffer_bytes=SMALL_RING, stall_timeout_s=0.2)
    threading.Timer(2.0, gate.set).start()  # the stuck reads return later; cleanup waits for them
    with Arena.create(img.nbytes, "cpu") as arena:
        with pytest.raises(WaitTimeoutError, match="no read completed within 0.2 s"):
            stream.stream_image(img.path, img.nbytes, arena, cfg)
    assert _stream_threads() == []


def test_readers_stuck_in_their_reads_are_waited_for_once_not_each_in_turn(image, monkeypatch):
    """Cleanup waited ``_JOIN_S`` for each stuck reader in turn (4 readers: 4 x 30 s past the
    stall, while the error said 'within 30 s'); one bound covers them all, and the ring they
    still write into is left mapped."""
    from flashboot.arena import Arena

    gate = threading.Event()
    real = os.preadv

    def stuck(fd, bufs, off):
        if off >= 4096:
            gate.wait(30)
        return real(fd, bufs, off)

    waits = []
    real_join = threading.Thread.join

    def join(self, timeout=None):
        if self.name.startswith("flashboot-stream"):
            waits.append(timeout)
        return real_join(self, timeout)

    monkeypatch.setattr(stream, "_preadv", stuck)
    monkeypatch.setattr(stream, "_JOIN_S", 0.3)
    monkeypatch.setattr(threading.Thread, "join", join)
    img = read_image(image, 0)
    cfg = StreamConfig(buffer_bytes=SMALL_RING * 2, slot_bytes=4096, threads=4, stall_timeout_s=0.2,
                       adapt_reads=False)
    try:
        with Arena.create(img.nbytes, "cpu") as arena:
            with pytest.raises(ImageReadError, match=r"did not finish within 0.3 s; the .* ring buffer is left mapped"):
                stream.stream_image(img.path, img.nbytes, arena, cfg)
        assert len(waits) == 4 and sum(waits) <= 0.3, f"the readers were waited for in turn: {waits}"
    finally:
        gate.set()
        monkeypatch.undo()
        for t in threading.enumerate():
            if t.name.startswith("flashboot-stream"):
                t.join(30)
    assert _stream_threads() == []


def test_o_direct_refused_at_open_reads_buffered_and_says_so(image, shm, monkeypatch):
    refuse_direct_open(monkeypatch)
    with flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes=SMALL_RING) as loaded:
        d = loaded.report.details
        assert d["io_mode"] == "buffered" and "O_DIRECT" in d["io_reason"] and "(buffered)" in loaded.report.summary()
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))
    with pytest.raises(CapabilityError, match="O_DIRECT"):
        flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes={"buffer_bytes": SMALL_RING, "io": "direct"})


def test_o_direct_refused_at_read_restarts_buffered(image, shm, monkeypatch):
    import fcntl

    tried = []
    real = os.preadv

    def fake(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and off >= 3 * 4096:
            tried.append(off)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    path = read_image(image, 0).path
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT at open (covered by the test above)")
    monkeypatch.setattr(stream, "_preadv", fake)
    with flashboot.load(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes=SMALL_RING) as loaded:
        d = loaded.report.details
        assert tried, "O_DIRECT was tried first"
        assert d["io_mode"] == "buffered" and "refuses O_DIRECT reads" in d["io_reason"]
        assert np.array_equal(_arena_bytes(loaded), _file_bytes(image))


def test_an_image_gone_when_o_direct_is_refused_is_named_not_a_bare_oserror(image, tmp_path, monkeypatch):
    """The image file removed (a re-pack) between O_DIRECT's refusal and the buffered retry: its
    reopen raised a bare FileNotFoundError out of flashboot.load."""
    import fcntl

    copy = tmp_path / "copy"
    shutil.copytree(image, copy)
    path = read_image(copy, 0).path
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT at open")

    once = threading.Lock()

    def refused_then_gone(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            with once:  # the readers in flight: one moves it
                if path.exists():
                    path.rename(path.with_name("moved-away"))
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.preadv(fd, bufs, off)

    monkeypatch.setattr(stream, "_preadv", refused_then_gone)
    fds = _open_fds()
    with pytest.raises(ImageReadError, match="reopening it for buffered reads after O_DIRECT was refused failed: "
                                             "No such file or directory") as e:
        flashboot.load(copy, 0, "cpu", stream=True, stream_buffer_bytes=SMALL_RING)
    assert e.value.path == str(path)
    assert _open_fds() == fds and _stream_threads() == []


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_gpu_streamed_load_reuses_the_pinned_ring_byte_exact(image, shm):
    """27+ chunks through a ring of 4 pinned pages: every slot reused many times while copies run."""
    with flashboot.load(image, 0, "cuda:0", shm_dir=shm, stream_buffer_bytes=SMALL_RING, verify=True) as loaded:
        r = loaded.report
        assert r.mode == "streamed from disk" and r.pin_ms > 0 and r.verify_ms > 0
        got = loaded.arena.bytes()[: loaded.nbytes].cpu().numpy()
        assert np.array_equal(got, _file_bytes(image))
        for name, t in loaded.tensors.items():  # views made in a helper thread point at the right bytes
            entry = loaded.metadata.tensors[name]
            assert t.device.type == "cuda"
            raw = t.contiguous().view(-1).view(torch.uint8).cpu().numpy()
            assert np.array_equal(raw, got[entry.offset:entry.offset + raw.size]), name


@pytest.mark.gpu
def test_gpu_streamed_load_of_a_large_image(big_image, tmp_path):
    with flashboot.load(big_image, 0, "cuda:0", shm_dir=tmp_path / "shm", stream_buffer_bytes=16 << 20,
                        verify=True) as loaded:
        r = loaded.report
        assert r.mode == "streamed from disk" and r.details["buffer_bytes"] <= 16 << 20
        got = loaded.arena.bytes()[: loaded.nbytes].cpu().numpy()
        assert np.array_equal(got, np.fromfile(loaded.source.path, np.uint8))


def test_cli_load_streams_and_says_why(image, shm, capsys):
    from flashboot.cli import main

    assert main(["load", str(image), "--device", "cpu", "--shm-dir", str(shm), "--stream-buffer", "16KiB",
                 "--verify"]) == 0
    out = capsys.readouterr().out
    assert "streamed from disk" in out and "no preloader runs" in out and "16 KiB ring" in out
    assert main(["load", str(image), "--device", "cpu", "--shm-dir", str(shm), "--no-stream", "--timeout",
                 "0.2"]) != 0
    assert "no preloader is running" in capsys.readouterr().err


def test_bench_stream_measures_against_the_disk(tmp_path, capsys):
    from flashboot.benchmarks.checkpoints import CHECKPOINT_A
    from flashboot.flashload.read_depth import single_read_bytes
    from flashboot.benchmarks.stream import run

    out = run(scale=2e-4, device="cpu", buffer_bytes=1 << 20, image_root=str(tmp_path / "img"),
              ckpt_root=str(tmp_path / "ckpt"), log=lambda s: None)
    s = out["stream"]
    assert s["verified"] and s["nbytes"] >= CHECKPOINT_A.scaled(2e-4).nbytes and s["tensors"] == 3170
    assert s["disk_gbps"] > 0 and s["stream_gbps"] > 0 and s["x_disk"] == s["stream_gbps"] / s["disk_gbps"]
    # the ceiling is the disk's best rate, sampled between the loads, alternately at the loader's own
    # reads in flight and size and as one stream; each load is also put against the two samples beside it
    kinds = [k for k, _ in s["disk_samples"]]
    assert kinds == ["in flight", "one stream", "in flight", "one stream"]
    g = [x for _, x in s["disk_samples"]]
    assert s["disk_gbps"] == max(g) == max(s["disk_in_flight_before_gbps"], s["disk_in_flight_after_gbps"],
                                           s["disk_single_gbps"])
    assert s["x_adjacent"] == s["stream_gbps"] / max(g[1], g[2])
    assert s["first"]["x_adjacent"] == s["first"]["stream_gbps"] / max(g[0], g[1])
    assert s["fixed_x_adjacent"] == s["fixed_gbps"] / max(g[2], g[3])
    assert s["disk_in_flight_gbps"] == max(s["disk_in_flight_before_gbps"], s["disk_in_flight_after_gbps"]) > 0
    assert s["disk_in_flight"] == s["report"]["details"]["threads"]
    assert s["disk_read_bytes"] == s["report"]["details"]["slot_bytes"]
    # the one-stream samples read the size the loader reads at one read in flight (its slot here)
    assert s["disk_single_read_bytes"] == s["disk_read_bytes"] == single_read_bytes(s["disk_read_bytes"])
    assert s["ring_bytes"] <= 1 << 20 and s["buffer_cap_bytes"] == 1 << 20
    assert out["prepack"]["gbps"] > 0 and s["report"]["mode"] == "streamed from disk"
    # the first load ran in a fresh process, on the same bytes, against the same ceiling
    first = s["first"]
    assert first["stream_gbps"] > 0 and first["x_disk"] == first["stream_gbps"] / s["disk_gbps"]
    assert first["total_ms"] >= first["stream_s"] * 1e3 and first["verify_ms"] > 0
    assert (first["threads"], first["slot_bytes"]) == (s["disk_in_flight"], s["disk_read_bytes"])
    assert first["report"]["total_ms"] == first["total_ms"] and first["report"]["mode"] == "streamed from disk"
    # the reads in flight each load kept, and the same stream at the fixed depth beside them
    assert first["reads"]["kept"] and s["reads"]["kept"] and s["reads"]["settings"]["A"] == s["fixed_reads"]
    assert s["fixed_gbps"] > 0 and s["fixed_x_disk"] == s["fixed_gbps"] / s["disk_gbps"]
    # each load's disk idle time between its reads is reported
    for reads in (first["reads"], s["reads"], s["fixed_reads_detail"]):
        assert reads["idle_ms"] >= 0 and reads["idle_gaps"] >= 0
    from flashboot.benchmarks.stream import print_results

    print_results(out)
    assert "disk idle between reads (no read in flight): 1st load" in capsys.readouterr().out


def test_a_preloader_that_exits_ends_the_wait_with_a_clear_error(image, shm):
    """Waiting for .ready only while that preloader runs: its exit ends the wait, not the timeout."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        path = shm_files.pid_file(image, shm)
        path.parent.mkdir(parents=True, exist_ok=True)
        start = proc_start_time(child.pid)
        path.write_text(json.dumps({"pid": child.pid, "start_time": start, "serve": False, "ranks": [0]}))
        assert stream_reason(image, 0, shm_files.rank_source(image, 0), shm_dir=shm) is None  # it stages rank 0: wait
        with pytest.raises(shm_files.PreloaderExitedError) as e:
            flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=120)
        msg = str(e.value)
        assert f"the preloader (pid {child.pid}) exited before" in msg and "rank-0.ready" in msg
        assert isinstance(e.value, WaitTimeoutError) and child.poll() is not None
        # with it gone, the next load does not wait: it streams
        with flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=120) as loaded:
            assert "no preloader runs" in loaded.report.details["stream_reason"]
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------------ reads in flight, chosen on the disk
def _emulated_disk(monkeypatch, *, contended: bool, base_s: float = 0.002) -> list:
    """A disk as ``preadv`` sees it: each read takes ``base_s``; ``contended`` makes it take
    ``base_s`` x (reads in flight)^2, a disk that loses throughput to reads side by side (as the
    lent VMs' virtio disk did against one 16 MiB stream). Records (offset, bytes, reads in flight)."""
    import time

    real = os.preadv
    lock = threading.Lock()
    state = {"in": 0}
    seen = []

    def fake(fd, bufs, off):
        with lock:
            state["in"] += 1
            k = state["in"]
            seen.append((off, sum(len(b) for b in bufs), k))
        try:
            time.sleep(base_s * (k * k if contended else 1))
            return real(fd, bufs, off)
        finally:
            with lock:
                state["in"] -= 1

    monkeypatch.setattr(stream, "_preadv", fake)
    return seen


@pytest.mark.parametrize("contended", [True, False], ids=["side-by-side-slower", "side-by-side-faster"])
def test_a_long_stream_keeps_the_faster_reads_in_flight(tmp_path, monkeypatch, contended):
    """A disk that reads one stream faster gets one read at a time, in file order, in pieces; a
    disk that wants reads in flight keeps them. The bytes are exact either way."""
    from flashboot.arena import Arena
    from flashboot.flashload import read_depth

    monkeypatch.setattr(read_depth, "SINGLE_READ_BYTES", 4096)  # B reads each 8 KiB slot as 2 pieces
    data = np.random.default_rng(7).integers(0, 256, 160 * 8192, dtype=np.uint8)
    path = tmp_path / "disk.bin"
    path.write_bytes(data.tobytes())
    seen = _emulated_disk(monkeypatch, contended=contended)
    cfg = StreamConfig(buffer_bytes=10 * 8192, slot_bytes=8192, threads=4, io="buffered", probe_window_bytes=8 * 8192)
    with Arena.create(data.size, "cpu") as arena:
        stats = stream.stream_image(path, data.size, arena, cfg)
        assert np.array_equal(arena.bytes().numpy()[: data.size], data)
    reads = stats.reads
    assert reads["settings"] == {"A": "4 x 8 KiB", "B": "1 x 4 KiB"}
    probe = reads["probe"]
    assert probe["order"] == "ABBA" and probe["window_bytes"] == 8 * 8192 and len(probe["windows_gbps"]) == 4
    assert probe["lead_in_gbps"] > 0  # a lead-in at A, not measured, came first
    assert max(k for _, _, k in seen[:8]) > 1 and {n for _, n, _ in seen[:8]} == {8192}
    # B's two windows (8 chunks in 2 pieces each, after the lead-in and A's window) ran alone: A's
    # reads had drained before them, and B keeps one read at a time, in file order
    b_windows = seen[16:48]
    assert {k for _, _, k in b_windows} == {1} and {n for _, n, _ in b_windows} == {4096}
    assert [off for off, _, _ in b_windows] == sorted(off for off, _, _ in b_windows)
    a, b = probe["gbps"]["A"], probe["gbps"]["B"]
    # The emulated disk makes one setting 2x (contended) or 8x (not) faster than the other.
    assert (b > a) if contended else (a > b), probe
    assert reads["kept"] == ("1 x 4 KiB" if contended else "4 x 8 KiB")
    after = seen[8 + 8 + 16 + 16 + 8:]  # the lead-in, then A B B A of 8 chunks each, B's in 2 pieces each
    if contended:
        tail = seen[-64:]  # well after the switch: one read at a time, 4 KiB pieces, in file order
        assert max(k for _, _, k in tail) == 1 and {n for _, n, _ in tail} == {4096}
        offsets = [off for off, _, _ in tail]
        assert offsets == sorted(offsets) and offsets == list(range(offsets[0], offsets[0] + 4096 * 64, 4096))
    else:
        assert max(k for _, _, k in after) > 1 and {n for _, n, _ in after} == {8192}


def test_reads_in_flight_are_not_probed_when_asked_or_when_the_stream_is_short(tmp_path, monkeypatch):
    from flashboot.arena import Arena

    data = np.random.default_rng(8).integers(0, 256, 40 * 8192, dtype=np.uint8)
    path = tmp_path / "disk.bin"
    path.write_bytes(data.tobytes())
    seen = _emulated_disk(monkeypatch, contended=True, base_s=0.0)
    for adapt, window in ((False, 1 << 30), (True, 8 * 8192)):  # 40 chunks < 3 x 5 windows of 8
        cfg = StreamConfig(buffer_bytes=10 * 8192, slot_bytes=8192, threads=4, io="buffered", adapt_reads=adapt,
                           probe_window_bytes=window)
        seen.clear()
        with Arena.create(data.size, "cpu") as arena:
            stats = stream.stream_image(path, data.size, arena, cfg)
            assert np.array_equal(arena.bytes().numpy()[: data.size], data)
        assert stats.reads["kept"] == "4 x 8 KiB" and "probe" not in stats.reads
        assert {n for _, n, _ in seen} == {8192} and len(seen) == 40
    with pytest.raises(FlashBootError, match="adapt_reads must be True or False"):
        StreamConfig(adapt_reads="yes")
    with pytest.raises(FlashBootError, match="probe_window_bytes must be a positive int"):
        StreamConfig(probe_window_bytes=0)


def test_the_disk_idle_time_between_reads_is_counted(tmp_path, monkeypatch):
    """A hand-off between two reads that keeps the disk idle (here: each reader waits 20 ms for
    its slot) is counted as idle time, once per gap; reads side by side leave no gap to count."""
    import time

    from flashboot.arena import Arena

    data = np.random.default_rng(9).integers(0, 256, 12 * 8192, dtype=np.uint8)
    path = tmp_path / "disk.bin"
    path.write_bytes(data.tobytes())
    real_take = stream._FreeSlots.take
    gap_s = 0.02

    def slow_take(free, stop):
        time.sleep(gap_s)
        return real_take(free, stop)

    monkeypatch.setattr(stream._FreeSlots, "take", slow_take)
    seen = _emulated_disk(monkeypatch, contended=False, base_s=0.0)
    cfg = StreamConfig(buffer_bytes=10 * 8192, slot_bytes=8192, threads=1, io="buffered", adapt_reads=False)
    with Arena.create(data.size, "cpu") as arena:
        stats = stream.stream_image(path, data.size, arena, cfg)
        assert np.array_equal(arena.bytes().numpy()[: data.size], data)
    assert len(seen) == 12 and {k for _, _, k in seen} == {1}
    # one gap before each read but the first; each at least the slot wait
    assert stats.reads["idle_gaps"] == 11 and stats.reads["idle_ms"] >= 11 * gap_s * 1e3

    # four readers, each chunk's read held until all four are in flight: no read starts on an idle
    # disk but the first, so no gap is counted
    barrier = threading.Barrier(4)
    monkeypatch.setattr(stream._FreeSlots, "take", real_take)
    real_read = stream.read_exactly

    def together(*args, **kwargs):
        barrier.wait(5)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(stream, "read_exactly", together)
    data = data[: 8 * 8192]
    path.write_bytes(data.tobytes())
    cfg = StreamConfig(buffer_bytes=10 * 8192, slot_bytes=8192, threads=4, io="buffered", adapt_reads=False)
    with Arena.create(data.size, "cpu") as arena:
        stats = stream.stream_image(path, data.size, arena, cfg)
        assert np.array_equal(arena.bytes().numpy()[: data.size], data)
    assert stats.reads["kept"] == "4 x 8 KiB"
    assert stats.reads["idle_gaps"] <= 1  # only where the second four started after the first four all returned


def test_a_reader_reads_into_the_most_recently_freed_slot(tmp_path, monkeypatch):
    """Free slots are taken newest first, so reads go to a slot still warm from its last use: at
    one read in flight (host copies end before the slot is freed) every chunk goes to the same
    slot, not round the whole ring; the bytes are exact."""
    from flashboot.arena import Arena

    data = np.random.default_rng(10).integers(0, 256, 24 * 8192, dtype=np.uint8)
    path = tmp_path / "disk.bin"
    path.write_bytes(data.tobytes())
    used = []
    real = stream._read_chunk
    monkeypatch.setattr(stream, "_read_chunk", lambda fd, slot, *a, **k: used.append(slot.index) or real(fd, slot, *a, **k))
    real_take = stream._FreeSlots.take

    def take_once_all_are_back(free, stop):  # as on a disk slower than the copies: the last slot is back
        # (bounded: with a FIFO the test fails on the slots used, not on a hang)
        import time

        deadline = time.monotonic() + 2
        while len(free._slots) < total and time.monotonic() < deadline:
            time.sleep(0.001)
        return real_take(free, stop)

    monkeypatch.setattr(stream._FreeSlots, "take", take_once_all_are_back)
    cfg = StreamConfig(buffer_bytes=10 * 8192, slot_bytes=8192, threads=1, io="buffered", adapt_reads=False)
    total = cfg.slots_for(data.size)
    with Arena.create(data.size, "cpu") as arena:
        stats = stream.stream_image(path, data.size, arena, cfg)
        assert np.array_equal(arena.bytes().numpy()[: data.size], data)
    assert stats.slots == total >= 8 and len(used) == 24
    assert set(used) == {used[0]}, used  # a FIFO would have gone round all of the slots


def test_free_slots_pass_over_one_whose_copy_still_runs():
    """The newest free slot whose copy to the device has ended is taken; only when every free
    slot's copy still runs is the newest taken (its reader then waits for that copy)."""
    class Copy:  # as flashboot.cuda_streams.Event: ``done`` polls whether the copy has run
        def __init__(self, ended):
            self.done = ended

    slots = [stream._Slot(i, 0, memoryview(b"")) for i in range(3)]
    slots[0].copied, slots[1].copied, slots[2].copied = Copy(True), None, Copy(False)
    free = stream._FreeSlots(slots)
    stop = threading.Event()
    assert free.take(stop).index == 1  # 2 is newer but its copy runs
    assert free.take(stop).index == 0
    assert free.take(stop).index == 2  # the only one left
    stop.set()
    assert free.take(stop) is None  # empty and stopped: no wait without end


def test_at_one_read_in_flight_the_reader_that_leaves_keeps_the_gate(monkeypatch):
    """With one read in flight, a read's end wakes no other reader: the one that leaves comes
    back for the next read itself (a woken reader would first have to be scheduled and take the
    GIL while the disk waits). The others still end when the stream stops."""
    import time

    from flashboot.flashload import read_depth

    monkeypatch.setattr(read_depth, "_WAIT_S", 5.0)  # no poll within the test: only a wake hands the gate over
    depth = read_depth.ReadDepth(4, 1000, 8192, window_bytes=8192, probe=False)
    depth.chosen = "B"  # one read at a time
    stop = threading.Event()
    assert depth.enter(stop) is not None
    got: list = []
    waiters = [threading.Thread(target=lambda: got.append(depth.enter(stop))) for _ in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.1)
    depth.leave()
    time.sleep(0.3)
    assert got == []  # no waiting reader took the gate
    assert depth.enter(stop) is not None  # the one that left has it back at once
    depth.leave()
    stop.set()
    depth.wake()
    for t in waiters:
        t.join(2)
    assert got == [None, None, None]


@pytest.mark.parametrize("a_over_b, kept", [(1.02, "1 x 4 MiB"), (1.05, "4 x 4 MiB"), (0.9, "1 x 4 MiB")])
def test_a_tie_keeps_one_read_at_a_time(a_over_b, kept):
    """The probe keeps reads in flight only when they read 3 % faster than one read at a time."""
    from flashboot.flashload import read_depth

    slot = 4 << 20
    depth = read_depth.ReadDepth(4, 10_000, slot, window_bytes=8 * slot)
    assert [w.setting for w in depth.windows] == ["A", "A", "B", "B", "A"] and depth.windows[0].measured is False
    t = 0.0
    for w, win in enumerate(depth.windows):
        span = 0.1 if win.setting == "B" else 0.1 / a_over_b  # the same bytes, A a_over_b times faster
        for k in range(win.reads):
            depth.completed((w, depth.settings[win.setting], t), slot, t + span * (k + 1) / win.reads)
        t += span
    assert depth.rates_gbps["A"] == pytest.approx(a_over_b * depth.rates_gbps["B"])
    assert depth.steady.label(slot) == kept


def test_one_read_at_a_time_reads_a_slot_in_pieces_of_about_16_mib():
    from flashboot.flashload.read_depth import single_read_bytes

    assert single_read_bytes(4 << 20) == 4 << 20  # the default slot: one read
    assert single_read_bytes(32 << 20) == 16 << 20 and single_read_bytes(40 << 20) == 20 << 20
    assert single_read_bytes(12 << 10) == 12 << 10
