"""The early call (flashboot.prepare): one-time costs at start-up, the load is the copy. Host
backend across real processes (a served-load daemon), and CUDA where present (marked gpu)."""

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from _io_helpers import image, image_master, shm  # noqa: F401  (fixtures)
from flashboot.layouts import read_image

import flashboot
from flashboot.errors import FlashBootError, LayoutError, RendezvousError, WaitTimeoutError
from flashboot.flashload import client, service, staging
from flashboot.flashload import shm as shm_files
from flashboot.memory import Device

@pytest.fixture
def daemon(image, shm):
    """A served-load daemon process holding rank 0 of ``image``; its pid."""
    pid = service.start_background(staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True), timeout_s=60)
    _wait_resident(image, shm)
    yield pid
    service.stop_service(image, shm, timeout_s=30)


def _wait_resident(image, shm, device_state=("mapped", "pinned")):
    deadline = time.monotonic() + 60
    while client.serve_status(image, shm, timeout_s=60)["ranks"]["0"]["state"] not in device_state:
        assert time.monotonic() < deadline, "the daemon did not hold rank 0 within 60 s"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _image_bytes(image_dir) -> bytes:
    return read_image(image_dir, 0).path.read_bytes()


def _daemon_maps(image, shm, arena_id: str) -> int:
    """How many mappings of the memfds of arena ``arena_id`` the daemon process holds."""
    pid = service.service_status(image, shm).pid
    with open(f"/proc/{pid}/maps") as f:
        return sum(arena_id in line for line in f)


def test_prepared_served_load_is_the_copy(image, shm, daemon):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    handle.wait()
    assert handle.mode == "served" and f"pid {daemon}" in handle.why
    assert set(handle.phases_ms) >= {"metadata", "arena", "attach"}
    # the views are the load's (made with the GIL held: not in the thread beside the engine's work)
    assert "views" not in handle.phases_ms and handle.tensors is None
    with flashboot.load(image, 0, "cpu", prepared=handle, verify=True) as loaded:
        rep = loaded.report
        assert rep.mode == "served, prepared" and rep.details["daemon_pid"] == daemon
        # nothing one-time left on the critical path but the views: no metadata or arena phase
        assert rep.metadata_ms == rep.alloc_ms == 0 and rep.bind_ms > 0 and rep.h2d_ms > 0
        assert rep.details["prepared_before_load"] is True
        assert list(loaded.tensors) == list(read_image(image, 0).metadata.tensors)
        assert handle.tensors is loaded.tensors
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
        img = read_image(image, 0)
        for name in list(img.tensors)[:10]:
            assert torch.equal(loaded.tensors[name].reshape(-1).view(torch.uint8),
                               img.view(name).reshape(-1).view(torch.uint8))
        with pytest.raises(FlashBootError, match="serves one load"):
            flashboot.load(image, 0, "cpu", prepared=handle)
    # the load without the early call says which one-time costs it paid itself
    with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm) as plain:
        assert {"metadata", "views"} <= set(plain.report.details["one_time_ms"])


def test_a_served_early_call_imports_nothing_the_loaders_warm_up_did_not(image, shm, daemon):
    """An engine imports the loader at start (``import_loader``, as the plugins do); the early
    call then imports nothing on its way to the daemon's request: reading whether a daemon runs
    pulled in the daemon's own modules (service, server, staging), ~4 ms before the first byte
    of a first early call on the 2-core host."""
    from _python import run_python

    code = ("import sys, flashboot\nfrom flashboot.flashload.warm import import_loader\n"
            "import_loader('cpu')\nbefore = set(sys.modules)\n"
            f"h = flashboot.prepare({str(image)!r}, 0, 'cpu', shm_dir={str(shm)!r}, timeout_s=30)\n"
            "h.wait()\nassert h.mode == 'served', h.why\n"
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('flashboot')))")
    assert run_python("-c", code).strip() == "[]"


def test_prepared_load_pins_here_without_a_daemon(image, shm):
    staging.stage_rank(image, 0, shm_dir=shm)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with handle.load(verify=True) as loaded:
        assert handle.mode == "staged" and "no served-load daemon" in handle.why
        assert loaded.report.mode == "host, prepared"
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
        if loaded.release_thread is not None:
            loaded.release_thread.join()


def test_prepared_handle_refuses_another_image_rank_or_device(image, image_master, shm, daemon):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm).wait()
    try:
        with pytest.raises(FlashBootError, match=r"rank 1 \(prepared: 0\)"):
            flashboot.load(image, 1, "cpu", prepared=handle)
        with pytest.raises(FlashBootError, match="prepared: "):
            flashboot.load(image_master, 0, "cpu", prepared=handle)
        with pytest.raises(FlashBootError, match=r"device cuda:1 \(prepared: cpu\)"):
            handle.check_request(image, 0, Device("cuda", 1))  # what load() asks first (no GPU here)
        with pytest.raises(FlashBootError, match="excludes served"):
            flashboot.load(image, 0, "cpu", prepared=handle, served=True)
        with pytest.raises(LayoutError, match="requested tp=2"):
            flashboot.load(image, 0, "cpu", prepared=handle, tp=2)
    finally:
        handle.close()
    # a refused request is not a load: close() releases the arena and the daemon's attachment
    assert handle.arena.closed and handle.session.closed


def test_a_served_prepare_asks_for_the_copy_before_it_parses_the_metadata(image, shm, daemon, monkeypatch):
    """As a plain served load: the daemon's .ready vouches for the metadata bytes, so the copy is
    asked for first and the strict read and the views run beside it; a refusal by that read (here
    injected) waits for the daemon to be done with the arena, releases it, and the daemon serves on."""
    from flashboot.flashload.prepared import PreparedLoad

    open_metadata = PreparedLoad.open_metadata
    seen = []

    def record(handle, *args, **kwargs):
        seen.append(handle.session is not None)  # made once the request, with the arena, went out
        return open_metadata(handle, *args, **kwargs)

    monkeypatch.setattr(PreparedLoad, "open_metadata", record)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    assert handle.session is not None  # prepare returned with the copy asked for
    with flashboot.load(image, 0, "cpu", prepared=handle, verify=True) as li:
        assert bytes(li.arena.bytes()[:li.nbytes].numpy()) == _image_bytes(image)
    assert seen == [True]

    def refuse(handle, *args, **kwargs):
        raise LayoutError("injected: the strict read refuses the metadata")

    monkeypatch.setattr(PreparedLoad, "open_metadata", refuse)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with pytest.raises(LayoutError, match="injected"):
        handle.wait()
    assert handle.arena.closed and handle.session.closed and handle.tensors is None
    monkeypatch.setattr(PreparedLoad, "open_metadata", open_metadata)
    with flashboot.load(image, 0, "cpu", prepared=flashboot.prepare(image, 0, "cpu", shm_dir=shm), verify=True) as li:
        assert bytes(li.arena.bytes()[:li.nbytes].numpy()) == _image_bytes(image)


def test_a_load_called_during_the_early_copy_makes_the_views_meanwhile(image, shm, daemon, monkeypatch):
    """The load makes the views, not the prepare thread; called while the copy still runs (here
    held for 1 s), it makes them then and waits for the copy after; a copy that fails after the
    views were made is raised from the load, and the arena is released."""
    from flashboot.flashload import client as client_mod
    from flashboot.flashload import prepared

    events = []
    wait_copy, make_views = client_mod.ServedCopy.wait, prepared.make_views

    def slow_copy(copy):
        reply = wait_copy(copy)
        time.sleep(1.0)
        events.append("copy ended")
        return reply

    def views(arena, metadata):
        out = make_views(arena, metadata)
        events.append("views made")
        return out

    monkeypatch.setattr(client_mod.ServedCopy, "wait", slow_copy)
    monkeypatch.setattr(prepared, "make_views", views)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with flashboot.load(image, 0, "cpu", prepared=handle, verify=True) as loaded:
        assert events == ["views made", "copy ended"] and loaded.report.bind_ms > 0
        assert loaded.report.details["prepared_before_load"] is False
        assert loaded.tensors is handle.tensors and list(loaded.tensors) == list(loaded.metadata.tensors)
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)

    def failed_copy(copy):
        wait_copy(copy)
        time.sleep(0.5)
        raise RendezvousError("injected: the daemon went away during the copy")

    events.clear()
    monkeypatch.setattr(client_mod.ServedCopy, "wait", failed_copy)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with pytest.raises(RendezvousError, match="injected"):
        flashboot.load(image, 0, "cpu", prepared=handle)
    assert events == ["views made"] and handle.arena.closed and handle.tensors is None


@pytest.mark.parametrize("crowded", [False, True], ids=["few_fds", "fds_past_1024"])
def test_a_load_waiting_for_the_early_copy_takes_the_daemons_reply_on_its_own_thread(image, shm, monkeypatch,
                                                                                   crowded):
    """A load that waits for the early copy's end blocks on the daemon's socket itself: the
    background thread hands its last steps over, so the reply wakes the engine's thread, not a
    thread that would then wake it. Where the reply came first, the background thread took it.
    ``crowded``: the process holds over 1,024 fds, as an engine can (select() fails there)."""
    import resource

    from _preload_helpers import Daemon

    fillers, limit = [], resource.getrlimit(resource.RLIMIT_NOFILE)
    if crowded:
        soft, hard = limit
        if soft != resource.RLIM_INFINITY and soft < 1400:
            if hard != resource.RLIM_INFINITY and hard < 1400:
                pytest.skip(f"the open-file limit ({hard}) leaves no room past fd 1,024")
            resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
        # the lowest free numbers taken: every fd opened from here on (socket, eventfd) is past 1,100
        fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100 - len(os.listdir("/proc/self/fd")))]
    # in this process, so its copy can be held back; a host daemon (a GPU machine's would pin the
    # test's staged file, which a tmp dir on disk refuses)
    daemon = Daemon(image, shm, devices={0: "cpu"}, pin=False)
    gate = threading.Event()
    copy = daemon.server._copy

    def gated(attached, *rest):
        assert gate.wait(30)
        return copy(attached, *rest)

    waited_on = []
    wait = client.ServedCopy.wait

    def recording(served_copy):
        waited_on.append(threading.current_thread().name)
        return wait(served_copy)

    monkeypatch.setattr(daemon.server, "_copy", gated)
    monkeypatch.setattr(client.ServedCopy, "wait", recording)
    try:
        handle = flashboot.prepare(image, 0, "cpu", mode="served", shm_dir=shm)
        threading.Timer(0.3, gate.set).start()
        with flashboot.load(image, 0, "cpu", prepared=handle, verify=True) as loaded:
            assert loaded.report.details["prepared_before_load"] is False
            assert loaded.report.details["copy_end_awaited_on"] == "load"
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
        assert waited_on == [threading.current_thread().name]
        handle._thread.join(5)
        assert not handle._thread.is_alive()

        waited_on.clear()
        handle = flashboot.prepare(image, 0, "cpu", mode="served", shm_dir=shm).wait()
        assert waited_on == ["flashboot-prepare-rank0"]
        with flashboot.load(image, 0, "cpu", prepared=handle, verify=True) as loaded:
            assert loaded.report.details["prepared_before_load"] is True
            assert loaded.report.details["copy_end_awaited_on"] == "prepare's thread"
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
        assert waited_on == ["flashboot-prepare-rank0"]
    finally:
        gate.set()
        daemon.close()
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limit)


def test_a_load_refused_during_the_early_copy_releases_the_arena_after_the_copy(image, shm, daemon, monkeypatch):
    """The load checks the caller's tp before it makes the views, possibly while the copy still
    runs (here held for 1 s): the refusal waits for the copy to end before the arena goes."""
    from flashboot.flashload import client as client_mod

    wait_copy = client_mod.ServedCopy.wait
    arena_open_at_copy_end = []

    def slow_copy(copy):
        reply = wait_copy(copy)
        time.sleep(1.0)
        arena_open_at_copy_end.append(not handle.arena.closed)
        return reply

    monkeypatch.setattr(client_mod.ServedCopy, "wait", slow_copy)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with pytest.raises(LayoutError, match="requested tp=2"):
        flashboot.load(image, 0, "cpu", prepared=handle, tp=2)
    assert arena_open_at_copy_end == [True] and handle.done
    assert handle.arena.closed and handle.session.closed and handle.tensors is None


def test_waiting_for_the_views_is_bounded(image, shm, daemon, monkeypatch):
    from flashboot.flashload import client as client_mod
    from flashboot.flashload.prepared import PreparedLoad

    open_metadata = PreparedLoad.open_metadata

    def slow(handle, *args, **kwargs):
        time.sleep(1.0)
        return open_metadata(handle, *args, **kwargs)

    monkeypatch.setattr(PreparedLoad, "open_metadata", slow)
    # as if the preloader were still staging: the background thread takes the steps over
    monkeypatch.setattr(client_mod, "served_ready_now", lambda *a, **k: None)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with pytest.raises(WaitTimeoutError, match=r"rank 0 of .* had not its arena and metadata within 0.05 s \(phases"):
        handle.wait_viewable(0.05)
    assert handle.wait_viewable() is True and handle.wait().tensors is None
    handle.close()


def test_prepared_handle_refuses_a_repacked_image(image, shm, daemon):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm).wait()
    meta = image / "rank-0" / "metadata.json"
    os.utime(meta, ns=(time.time_ns(), time.time_ns() + 10**9))  # what a re-pack leaves behind
    with pytest.raises(LayoutError, match="re-packed"):
        flashboot.load(image, 0, "cpu", prepared=handle)
    assert handle.arena.closed  # a failed load releases what the handle held


def test_prepared_copy_of_a_stale_staged_image_is_discarded(image, shm, daemon):
    """The daemon's copy starts from the .ready before the metadata is read; metadata.json
    rewritten after staging (as a re-pack would) is not the .ready's bytes: that copy is
    discarded with its arena and the preparation refuses by name, holding nothing."""
    import json

    from _image_helpers import rewrite_metadata

    meta_path = image / "rank-0" / "metadata.json"
    rewrite_metadata(meta_path.parent, json.loads(meta_path.read_text()))
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm, timeout_s=0.5)
    with pytest.raises(LayoutError, match="of another pre-pack"):
        handle.wait()
    assert handle.arena is not None and handle.arena.closed and handle.session is None  # copied, then discarded
    deadline = time.monotonic() + 10  # the daemon lets go of the discarded arena (host arenas are memfds)
    while _daemon_maps(image, shm, "flashboot-arena-"):
        assert time.monotonic() < deadline, "the daemon kept the discarded arena mapped"
        time.sleep(0.05)


def test_prepared_handle_refuses_a_wrong_tp_before_allocating(image, shm, daemon):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm, tp=4)
    with pytest.raises(LayoutError, match="requested tp=4"):
        handle.wait()
    assert handle.arena is None  # refused from the metadata, before any arena existed


def test_daemon_dying_during_the_early_copy_is_a_clear_error(image, shm, daemon, monkeypatch):
    connect = client._connect

    def connect_then_die(path, timeout_s):  # the daemon dies as the early copy is asked for
        sock = connect(path, timeout_s)
        os.kill(daemon, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.01)
        return sock

    monkeypatch.setattr(client, "_connect", connect_then_die)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="preloader at .* (went away|closed the connection|dropped the connection)"):
        flashboot.load(image, 0, "cpu", prepared=handle)
    assert time.monotonic() - t0 < 30  # no hang: the dead daemon's socket closes at once
    assert handle.arena.closed and handle.tensors is None


def test_weights_copied_early_survive_the_daemons_exit(image, shm, daemon):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm).wait()  # the copy has ended here
    assert handle.copy["h2d_ms"] > 0
    os.kill(daemon, signal.SIGKILL)
    with flashboot.load(image, 0, "cpu", prepared=handle, verify=True) as loaded:
        assert loaded.report.mode == "served, prepared" and loaded.report.wait_ms < 1e3
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)


def test_unused_handle_releases_the_daemons_attachment(image, shm, daemon):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm).wait()
    arena = handle.arena.export().arena_id
    # the daemon copied early, then hung up: it keeps no mapping of an engine's arena
    deadline = time.monotonic() + 10
    while _daemon_maps(image, shm, arena):
        assert time.monotonic() < deadline, "the daemon kept the arena after its early copy"
        time.sleep(0.05)
    handle.close()
    assert handle.arena.closed and handle.tensors is None
    with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm) as loaded:  # and still serves
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)


# ---------------------------------------------------------------------------------- GPU
@pytest.fixture
def gpu_shm():
    root = Path(tempfile.mkdtemp(prefix="flashboot-test-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.gpu
def test_gpu_prepared_served_and_pinned_here(image, gpu_shm):
    cfg = staging.PreloadConfig(str(image), shm_dir=str(gpu_shm), serve=True, devices={0: "cuda:0"})
    service.start_background(cfg, timeout_s=120)
    try:
        _wait_resident(image, gpu_shm, ("pinned",))
        current = torch.cuda.current_device()
        handle = flashboot.prepare(image, 0, "cuda:0", shm_dir=gpu_shm)
        with flashboot.load(image, 0, "cuda:0", prepared=handle) as li:  # served: verified by the daemon by default
            assert li.report.mode == "served, prepared" and li.report.details["daemon_pinned"] is True
            assert "(verified by the daemon)" in li.report.details["verified"]
            assert bytes(li.arena.bytes()[:li.nbytes].cpu().numpy()) == _image_bytes(image)
            img = read_image(image, 0)  # the views the load made, on the device, at their offsets
            assert list(li.tensors) == list(img.tensors) and li.report.bind_ms > 0
            for name, t in li.tensors.items():
                e = img.tensors[name]
                assert t.device == torch.device("cuda:0") and (tuple(t.shape), t.stride()) == (e.shape, e.stride)
                assert t.numel() == 0 or t.data_ptr() == li.arena.ptr + e.offset, name
                assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), img.view(name).reshape(-1).view(torch.uint8))
        assert torch.cuda.current_device() == current
    finally:
        service.stop_service(image, gpu_shm)
    handle = flashboot.prepare(image, 0, "cuda:0", shm_dir=gpu_shm)
    with flashboot.load(image, 0, "cuda:0", prepared=handle, verify=True) as li:
        assert li.report.mode == "pinned early, prepared" and li.report.pinned_early_ms > 0
        assert bytes(li.arena.bytes()[:li.nbytes].cpu().numpy()) == _image_bytes(image)
        if li.release_thread is not None:
            li.release_thread.join()


def test_prepared_load_streams_from_disk_when_nothing_is_staged(image, shm):
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm, stream_buffer_bytes=64 << 10).wait()
    assert handle.mode == "stream" and "no preloader runs" in handle.why
    with handle.load(verify=True) as loaded:
        rep = loaded.report
        assert rep.mode == "streamed from disk, prepared" and rep.details["streamed_from_disk"] is True
        assert rep.details["peak_buffer_bytes"] <= 64 << 10 and rep.metadata_ms == 0 < rep.bind_ms
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)


def test_prepare_refuses_a_truncated_image_before_any_view(image, shm):
    path = read_image(image, 0).path
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with pytest.raises(LayoutError, match="truncated: metadata expects"):
        handle.wait()
    assert handle.arena is None and handle.tensors is None


def test_image_larger_than_the_device_is_refused_before_any_allocation(image, shm, monkeypatch):
    from flashboot.errors import OutOfMemoryError
    from flashboot.flashload import landing

    monkeypatch.setattr(landing, "device_free_bytes", lambda device: 4096)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    nbytes = read_image(image, 0).nbytes
    with pytest.raises(OutOfMemoryError, match=f"loading a {nbytes:,}-byte image into cpu") as info:
        handle.wait()
    assert info.value.nbytes_free == 4096 and info.value.nbytes_needed >= nbytes
    assert handle.arena is None  # refused from the metadata, nothing allocated


def test_two_live_handles_for_one_rank_and_device_both_load(image, shm, daemon):
    first = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    second = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    with first.load(verify=True) as a, second.load(verify=True) as b:
        assert a.arena.ptr != b.arena.ptr
        for loaded in (a, b):
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)


def test_close_waits_for_a_running_copy_and_never_unmaps_under_it(image, shm, daemon, monkeypatch):
    wait_copy = client.ServedCopy.wait
    copying = threading.Event()

    def slow_wait(copy):  # the daemon's copy takes a second
        copying.set()
        time.sleep(1.0)
        return wait_copy(copy)

    monkeypatch.setattr(client.ServedCopy, "wait", slow_wait)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    assert copying.wait(30)
    with pytest.raises(WaitTimeoutError, match="its copy still ran after 0.1 s"):
        handle.close(timeout_s=0.1)
    assert not handle.arena.closed  # the copy may still write into it
    handle._done.wait(30)
    assert handle.arena.closed  # released by the background thread once the copy ended
    with pytest.raises(FlashBootError, match="closed"):
        flashboot.load(image, 0, "cpu", prepared=handle)

    copying.clear()
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)
    assert copying.wait(30)
    handle.close()  # within the default bound: waits for the copy, then releases
    assert handle.done and handle.arena.closed


_EXIT_SCRIPT = """
import sys, flashboot
image, shm = sys.argv[1], sys.argv[2]
handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm)   # nothing staged: it streams from disk
try:
    flashboot.load(image, 1, "cpu", prepared=handle)       # refused: the handle is for rank 0
except flashboot.FlashBootError as exc:
    print("refused:", exc)
dropped = flashboot.prepare(image, 0, "cpu", shm_dir=shm)  # never used
"""


def test_interpreter_exit_settles_handles_whose_load_failed_or_never_came(tmp_path):
    """Issue 21: a refused load, then a normal exit, aborted ("terminate called without an active
    exception", exit 134, 4 of 6 runs before the fix) while the handle's thread still ran inside
    torch. 3,170 small tensors: the views take long enough for the exit to meet the thread."""
    import subprocess
    import sys

    from flashboot.benchmarks.checkpoints import CheckpointSpec, make_checkpoint

    many = CheckpointSpec("many", layers=16, experts=64, expert_rows=8, expert_cols=8, hidden=16, vocab=32, shards=1)
    make_checkpoint(str(tmp_path / "ckpt"), many, device="cpu")
    flashboot.prepack(str(tmp_path / "ckpt"), str(tmp_path / "image"), progress=False)
    for _ in range(6):
        p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "image"), str(tmp_path / "shm")],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-2000:])
        assert "refused: this prepared load cannot serve rank 1 (prepared: 0)" in p.stdout


def test_prepare_verifies_its_early_copy_and_a_flipped_byte_surfaces_from_the_load(image, shm):
    from flashboot.errors import ChecksumMismatchError

    staging.stage_rank(image, 0, shm_dir=shm)
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm, verify=True)
    with handle.load(verify=True) as loaded:
        assert "checked by flashboot.prepare once its copy ended" in loaded.report.summary()
        assert loaded.report.verify_ms == 0 and handle.phases_ms["verify"] > 0
    staged = shm_files.staged_paths(image, 0, shm).image
    with open(staged, "r+b") as f:  # one flipped byte in the staged copy
        f.seek(4099)
        b = f.read(1)
        f.seek(4099)
        f.write(bytes([b[0] ^ 0x01]))
    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm, verify=True)
    with pytest.raises(ChecksumMismatchError) as e:
        flashboot.load(image, 0, "cpu", prepared=handle)
    assert e.value.chunk == 1 and "copied into cpu by flashboot.prepare" in str(e.value)
    assert handle.arena.closed and handle.tensors is None


def test_engine_log_line_says_how_long_the_weights_waited_for_the_engine(image, shm, daemon):
    from flashboot.integrations.engine_prepack import EngineWeights

    handle = flashboot.prepare(image, 0, "cpu", shm_dir=shm).wait()
    time.sleep(0.2)  # the engine builds its model
    with flashboot.load(image, 0, "cpu", prepared=handle) as loaded:
        note = EngineWeights(loaded.tensors, None, loaded, "load", loaded.report).early_call()
        ready_ms = float(note.split("weights ready ")[1].split(" ms")[0])
        assert note.endswith("ms before the engine asked") and ready_ms >= 200
    with flashboot.load(image, 0, "cpu", served=True, shm_dir=shm) as plain:
        assert EngineWeights(plain.tensors, None, plain, "load", plain.report).early_call() == "no early call"


def test_the_early_call_hands_the_gil_over_promptly_while_it_works_and_restores_the_interval(image, shm, daemon,
                                                                                            monkeypatch):
    """Beside an engine's GIL-bound Python every driver call of the prepare thread would wait the
    5 ms switch interval to get the GIL back: the interval is lowered while a prepare's background
    thread works towards the copy or hands the arena over (shared by concurrent prepares) and
    restored after (served: the steps to the copy's request run on the caller's thread), and a
    value the engine set meanwhile is kept."""
    import sys
    import threading

    from flashboot.flashload import prepared as boot

    seen, real = [], boot.PreparedLoad.create_arena

    def recording(self, *args, **kw):
        seen.append((sys.getswitchinterval(), threading.current_thread().name))
        return real(self, *args, **kw)

    monkeypatch.setattr(boot.PreparedLoad, "create_arena", recording)
    strict, real_open = [], boot.PreparedLoad.open_metadata

    def recording_open(self, *args, **kw):
        strict.append((sys.getswitchinterval(), threading.current_thread().name))
        return real_open(self, *args, **kw)

    monkeypatch.setattr(boot.PreparedLoad, "open_metadata", recording_open)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        handles = [flashboot.prepare(image, 0, "cpu", mode="stream", shm_dir=shm, stream_buffer_bytes=64 << 10)
                   for _ in range(2)]
        for h in handles:
            h.wait()
        # a streamed prepare makes its arena in the background thread, at the lowered interval
        assert seen == [(boot.PREPARE_SWITCH_INTERVAL_S, "flashboot-prepare-rank0")] * 2
        assert sys.getswitchinterval() == 0.005  # the last prepare out restored it
        for h in handles:
            with h.load() as loaded:
                assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
        # served: the interval is back once the background thread has handed the arena over and
        # read and validated the metadata (then only the wait in C), before the load's views;
        # the strict read ran at the lowered one (its numpy passes release the GIL too)
        strict.clear()
        served = flashboot.prepare(image, 0, "cpu", mode="served", shm_dir=shm)
        assert served.wait_viewable(60) and sys.getswitchinterval() == 0.005
        assert strict == [(boot.PREPARE_SWITCH_INTERVAL_S, "flashboot-prepare-rank0")]
        assert seen[-1] == (0.005, threading.current_thread().name)  # served: the caller's thread made it
        with served.load() as loaded:
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == _image_bytes(image)
        with boot._PromptHandover():
            sys.setswitchinterval(0.002)  # the engine's own choice, made meanwhile, stays
        assert sys.getswitchinterval() == 0.002
        sys.setswitchinterval(0.005)
        with boot._PromptHandover() as early:
            assert sys.getswitchinterval() == boot.PREPARE_SWITCH_INTERVAL_S
            early.release()  # the thread only waits in C from here: the interval is back at once
            assert sys.getswitchinterval() == 0.005
            early.release()  # idempotent; the exit does not release twice either
        assert sys.getswitchinterval() == 0.005
    finally:
        sys.setswitchinterval(before)
