"""The served load's hand-over of its arena to the daemon, batch by batch (1 GiB of segments a
message; here one 2 MiB host segment a batch): the arena made as it is handed over, exact copies,
and every way the hand-over can break off (a batch that cannot be made or exported, a refusal, a
client gone silent, the daemon killed) answered by name with nothing leaked."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest

from flashboot.arena import Arena
from flashboot.errors import LayoutError, RendezvousError
from flashboot.fdshare import send_fds
from flashboot.flashload import client
from flashboot.flashload import shm as shm_files

from _preload_helpers import Daemon, daemon_process_of, fds_after_settling, make_image, open_fds  # noqa: E402


@pytest.fixture(scope="module")
def multi_segment_image(tmp_path_factory):
    """An image of ~12 MB: several 2 MiB host segments, so a load hands its arena over in batches."""
    from flashboot.benchmarks.checkpoints import CheckpointSpec

    spec = CheckpointSpec("segments", layers=2, experts=4, expert_rows=512, expert_cols=512, hidden=64, vocab=64,
                          shards=1)
    return make_image(tmp_path_factory.mktemp("service-segments"), spec)


@pytest.fixture
def batches(monkeypatch):
    """One 2 MiB segment per batch; records how many fds each message the engine sends carries."""
    from flashboot import fdshare
    from flashboot.arena.segments import HOST_GRANULARITY

    monkeypatch.setattr(client, "STREAM_BATCH_BYTES", HOST_GRANULARITY)
    sent: list[int] = []
    real = fdshare.send_fds

    def counting(sock, fds, message=b""):
        sent.append(len(fds))
        return real(sock, fds, message)

    monkeypatch.setattr(fdshare, "send_fds", counting)
    return sent


class _MadeSegments:
    """What an arena's host backend was asked to make, call by call (``calls``: the segment
    indices of each); from segment ``fail_from`` on (when set), the call fails with ENOSPC."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.fail_from: int | None = None


@pytest.fixture
def made_segments(monkeypatch):
    import flashboot.arena.backing_host as host_backing

    made, real = _MadeSegments(), host_backing.make_segments

    def recording(backing, indices, *args, **kwargs):
        indices = list(indices)
        made.calls.append(indices)
        if made.fail_from is not None and min(indices) >= made.fail_from:
            raise OSError(28, f"injected: no space for segment {min(indices)}")
        return real(backing, indices, *args, **kwargs)

    monkeypatch.setattr(host_backing, "make_segments", recording)
    return made


def _segmented_arena(nbytes: int) -> Arena:
    from flashboot.arena.segments import HOST_GRANULARITY

    return Arena.create(nbytes, "cpu", segment_bytes=HOST_GRANULARITY)


def test_a_load_hands_its_arena_over_batch_by_batch_and_the_copy_is_exact(multi_segment_image, tmp_path, batches):
    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        with _segmented_arena(src.nbytes) as arena:
            assert arena.segments >= 4
            client.served_load(arena, src, timeout_s=10, shm_dir=d.shm)
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
            assert batches == [1] * arena.segments  # the request with the first fd, then one message each
        d.idle()
        assert fds_after_settling(fds_before) == fds_before
    finally:
        d.close()


def test_an_arena_made_batch_by_batch_is_handed_over_as_it_is_made(multi_segment_image, tmp_path, batches,
                                                                   made_segments):
    """A served load's arena makes only the request's batch at once; each later batch's segments
    are made just before they are sent, while the daemon copies (the copy's first byte no longer
    waits for the whole arena). The copy is exact and nothing leaks."""
    from flashboot.arena.segments import HOST_GRANULARITY

    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        first = client.first_batch_segments()
        assert first == 1  # one 2 MiB segment per batch here (the batches fixture)
        made_segments.calls.clear()  # the daemon's own
        with Arena.create(src.nbytes, "cpu", segment_bytes=HOST_GRANULARITY, segments_now=first) as arena:
            assert arena.segments >= 4 and made_segments.calls == [[0]]
            client.served_load(arena, src, timeout_s=10, shm_dir=d.shm)
            assert made_segments.calls == [[k] for k in range(arena.segments)]  # one batch at a time
            assert batches == [1] * arena.segments
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
        d.idle()
        assert fds_after_settling(fds_before) == fds_before
    finally:
        d.close()


def test_a_served_load_and_an_early_call_make_their_arena_as_they_hand_it_over(multi_segment_image, tmp_path,
                                                                               batches, made_segments,
                                                                               monkeypatch):
    """Through flashboot.load(served=True) and flashboot.prepare: the arena makes the request's
    batch, then each later one as it is handed over; the weights are exact."""
    import flashboot
    from flashboot.arena import segments
    from flashboot.layouts import read_image

    monkeypatch.setattr(segments, "SEGMENT_BYTES", segments.HOST_GRANULARITY)  # arenas of several segments here
    d = Daemon(multi_segment_image, tmp_path / "shm")
    want = read_image(multi_segment_image, 0).path.read_bytes()
    try:
        for early in (False, True):
            made_segments.calls.clear()
            if early:
                handle = flashboot.prepare(multi_segment_image, 0, "cpu", shm_dir=d.shm, mode="served", timeout_s=10)
                loaded = flashboot.load(multi_segment_image, 0, "cpu", prepared=handle)
            else:
                loaded = flashboot.load(multi_segment_image, 0, "cpu", shm_dir=d.shm, served=True, timeout_s=10)
            with loaded:
                n = loaded.arena.segments
                assert n >= 4 and made_segments.calls == [[k] for k in range(n)], (early, made_segments.calls)
                # the copy was asked for with the first batch; the later ones were handed over after
                later = handle.phases_ms["handover"] if early else loaded.report.details["handover_ms"]
                assert later > 0
                if early:  # its CPU time on prepare's thread, part of that thread's (the GIL bound's split)
                    cpu = loaded.report.details["prepare_handover_cpu_ms"]
                    assert 0 < cpu <= loaded.report.details["prepare_thread_cpu_ms"]
                    # of that thread's CPU, its fd sends ran with the GIL released, each one timed
                    free = loaded.report.details["prepare_thread_gil_free_cpu_ms"]
                    assert 0 < free <= loaded.report.details["prepare_thread_cpu_ms"]
                assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == want
    finally:
        d.close()


@pytest.mark.parametrize("load_waits", [False, True], ids=["engine-busy", "load-waiting"])
def test_an_early_call_returns_once_the_copy_is_asked_for_and_hands_the_later_batches_over_behind(
        multi_segment_image, tmp_path, batches, monkeypatch, load_waits):
    """prepare() returns once the request with the first batch is out: its background thread
    makes, exports and sends the later batches (and reads the metadata) while the engine goes on.
    Here that thread is held at its first later batch until prepare() has returned (and, with
    ``load_waits``, until the load has been called): the caller has then sent the request alone,
    and the weights still arrive exact. While the engine is busy, the only thread started is that
    background thread: the metadata's files are read in it, not by reader threads of their own
    (each would wait for the engine's GIL to start and to be joined). Once the load waits for
    them, with nothing of the engine's to run, they are read in threads, as a plain load does."""
    import threading

    import flashboot
    from flashboot import fdshare
    from flashboot.arena import segments
    from flashboot.flashload.prepared import PreparedLoad
    from flashboot.layouts import read_image

    monkeypatch.setattr(segments, "SEGMENT_BYTES", segments.HOST_GRANULARITY)  # arenas of several segments here
    returned, senders = threading.Event(), []
    counting = fdshare.send_fds  # the batches fixture's
    if load_waits:
        claim = PreparedLoad.claim

        def claiming(self, who):
            claim(self, who)
            returned.set()

        monkeypatch.setattr(PreparedLoad, "claim", claiming)

    def gated(sock, fds, message=b""):
        senders.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            assert returned.wait(10), "prepare() did not return before its later batches were handed over"
        return counting(sock, fds, message)

    monkeypatch.setattr(fdshare, "send_fds", gated)
    d = Daemon(multi_segment_image, tmp_path / "shm")
    want = read_image(multi_segment_image, 0).path.read_bytes()
    started, start = [], threading.Thread.start  # by this process's loader (the daemon here runs in-process)

    def recording_start(self):
        if threading.current_thread().name in ("MainThread", "flashboot-prepare-rank0"):
            started.append(self.name)
        return start(self)

    try:
        monkeypatch.setattr(threading.Thread, "start", recording_start)
        handle = flashboot.prepare(multi_segment_image, 0, "cpu", shm_dir=d.shm, mode="served", timeout_s=10)
        assert started == ["flashboot-prepare-rank0"]
        assert batches == [1] and senders[0] == threading.main_thread().name  # the request alone, from the caller
        if not load_waits:
            returned.set()
            assert handle.wait_viewable(10)  # the metadata read and validated before the load is called
        with flashboot.load(multi_segment_image, 0, "cpu", prepared=handle) as loaded:
            n = loaded.arena.segments
            assert n >= 4 and batches == [1] * n
            assert set(senders[1:]) == {"flashboot-prepare-rank0"}
            assert handle.phases_ms["handover"] > 0
            assert started[0] == "flashboot-prepare-rank0"
            # the metadata.json read and hashed beside the table's read and decode, and its hash
            assert ("flashboot-beside" in started) == load_waits, started
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == want
    finally:
        returned.set()
        d.close()


def test_an_early_call_whose_load_waits_already_reads_the_metadata_beside_the_hand_over(
        multi_segment_image, tmp_path, batches, monkeypatch):
    """A load called before the early call's background thread has run at all (an engine with
    no start-up work of its own): the metadata's files are read in threads started before the
    later batches are handed over, so they are read meanwhile; the weights arrive exact."""
    import threading

    import flashboot
    from flashboot import fdshare
    from flashboot.arena import segments
    from flashboot.flashload.prepared import PreparedLoad
    from flashboot.layouts import read_image

    monkeypatch.setattr(segments, "SEGMENT_BYTES", segments.HOST_GRANULARITY)  # arenas of several segments here
    claimed, events = threading.Event(), []
    claim, run, counting, start = PreparedLoad.claim, PreparedLoad._run, fdshare.send_fds, threading.Thread.start

    def claiming(self, who):
        claim(self, who)
        claimed.set()

    def held_run(self, *args):  # the background thread goes on only once the load has claimed the handle
        assert claimed.wait(10), "the load was not called"
        return run(self, *args)

    def sending(sock, fds, message=b""):
        events.append(("send", threading.current_thread().name))
        return counting(sock, fds, message)

    def recording_start(self):
        events.append(("start", self.name))
        return start(self)

    monkeypatch.setattr(PreparedLoad, "claim", claiming)
    monkeypatch.setattr(PreparedLoad, "_run", held_run)
    monkeypatch.setattr(fdshare, "send_fds", sending)
    d = Daemon(multi_segment_image, tmp_path / "shm")
    want = read_image(multi_segment_image, 0).path.read_bytes()
    try:
        monkeypatch.setattr(threading.Thread, "start", recording_start)
        handle = flashboot.prepare(multi_segment_image, 0, "cpu", shm_dir=d.shm, mode="served", timeout_s=10)
        with flashboot.load(multi_segment_image, 0, "cpu", prepared=handle) as loaded:
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == want
        later = [i for i, e in enumerate(events) if e == ("send", "flashboot-prepare-rank0")]
        readers = [i for i, e in enumerate(events) if e == ("start", "flashboot-beside")]
        assert len(later) >= 3 and readers, events
        assert readers[0] < later[0], events  # the reads started before the first later batch went out
    finally:
        d.close()


def test_a_request_whose_later_batches_never_follow_is_broken_off_by_settle(multi_segment_image, tmp_path, batches):
    """A copy asked for with ``rest_later`` whose later batches are never handed over (its early
    call given up): settle() breaks the hand-over off, so the daemon stops and answers before the
    arena can go; waiting on it is then an error by name, and nothing leaks."""
    from flashboot.errors import FlashBootError

    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        with _segmented_arena(src.nbytes) as arena:
            copy = client.start_served_load(arena, image_dir=src.image_dir, rank=0, nbytes=src.nbytes,
                                            metadata_sha256=src.metadata_sha256, timeout_s=10, shm_dir=d.shm,
                                            rest_later=True)
            assert batches == [1] and not copy.closed  # the request alone
            copy.settle()
            assert copy.closed and batches == [1]
            with pytest.raises(FlashBootError, match="broken off before its later batches were handed over"):
                copy.wait()
        d.idle()
        assert fds_after_settling(fds_before) == fds_before
    finally:
        d.close()


def test_making_a_later_batch_failing_stops_the_daemon_before_the_error_is_raised(multi_segment_image, tmp_path,
                                                                                  batches, made_segments):
    """The segments of a later batch cannot be made (the device is full, say): handled as a failed
    export, the daemon is told and answers before the error reaches the caller, and the arena's
    release frees what was made."""
    from flashboot.arena.segments import HOST_GRANULARITY
    from flashboot.errors import ArenaError

    made_segments.fail_from = 2
    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        with Arena.create(src.nbytes, "cpu", segment_bytes=HOST_GRANULARITY, segments_now=1) as arena:
            with pytest.raises(ArenaError, match=r"making segment\(s\) \[2\] of host arena .*injected: no space"):
                client.served_load(arena, src, timeout_s=10, shm_dir=d.shm)
            assert batches == [1, 1]
        d.idle()
        assert any("2 of" in line and "fds arrived, then" in line for line in d.log), d.log
        assert fds_after_settling(fds_before) == fds_before
        made_segments.fail_from = None
        d.load_exact()
    finally:
        d.close()


@pytest.mark.parametrize("early", [False, True], ids=["plain", "early"])
def test_a_daemon_killed_mid_hand_over_is_a_clear_error_and_the_arena_is_released(multi_segment_image, tmp_path,
                                                                                   monkeypatch, early):
    """The daemon dies after the request went out with the first batch, while the later batches
    are made and handed over: the load (plain, or an early call's) raises naming the preloader at
    once, its arena is released and no fd is left behind."""
    import flashboot
    from flashboot import fdshare
    from flashboot.arena import segments

    monkeypatch.setattr(segments, "SEGMENT_BYTES", segments.HOST_GRANULARITY)  # arenas of several segments here
    monkeypatch.setattr(client, "STREAM_BATCH_BYTES", segments.HOST_GRANULARITY)  # one segment a batch
    with daemon_process_of(multi_segment_image, tmp_path) as (proc, shm, _log):
        real, sent = fdshare.send_fds, []

        def killed_after_the_request(sock, fds, message=b""):
            sent.append(len(fds))
            if len(sent) == 2:  # the first later batch: the daemon has the request and copies
                proc.kill()
                proc.wait(30)
            return real(sock, fds, message)

        monkeypatch.setattr(fdshare, "send_fds", killed_after_the_request)
        fds_before, handle = open_fds(), None
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=r"the preloader at .* went away while rank 0's arena was handed to "
                                                  r"it \((BrokenPipeError|ConnectionResetError)\)"):
            if early:
                handle = flashboot.prepare(multi_segment_image, 0, "cpu", shm_dir=shm, mode="served", timeout_s=10)
                flashboot.load(multi_segment_image, 0, "cpu", prepared=handle)
            else:
                flashboot.load(multi_segment_image, 0, "cpu", shm_dir=shm, served=True, timeout_s=10)
        assert time.monotonic() - t0 < 10  # at once: no wait for a reply that cannot come
        assert sent == [1, 1]
        if early:
            assert handle.arena.closed and handle.tensors is None
            handle.close()
        assert fds_after_settling(fds_before) == fds_before


def test_an_export_failing_mid_hand_over_stops_the_daemon_before_the_error_is_raised(multi_segment_image, tmp_path,
                                                                                       batches, monkeypatch):
    """The engine's export of a later batch fails: the daemon, waiting for those fds, is told (the
    socket's write side shut), stops and answers; only then does the error reach the caller, so
    the daemon no longer writes into the arena the caller releases. It keeps serving."""
    from flashboot.errors import ArenaError

    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        real = Arena.export_segments

        def failing(arena, first, last):
            if first >= 2:
                raise ArenaError(f"injected: exporting segment {first} failed")
            return real(arena, first, last)

        monkeypatch.setattr(Arena, "export_segments", failing)
        with _segmented_arena(src.nbytes) as arena:
            with pytest.raises(ArenaError, match="injected: exporting segment 2"):
                client.served_load(arena, src, timeout_s=10, shm_dir=d.shm)
            assert batches == [1, 1]
        d.idle()  # the daemon had answered before the error was raised: nothing of it still runs
        assert any("2 of" in line and "fds arrived, then" in line for line in d.log), d.log
        assert fds_after_settling(fds_before) == fds_before
        monkeypatch.setattr(Arena, "export_segments", real)
        with _segmented_arena(src.nbytes) as arena:
            client.served_load(arena, src, timeout_s=10, shm_dir=d.shm)
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
    finally:
        d.close()


def test_a_daemon_that_refuses_a_batched_load_is_heard_by_name(multi_segment_image, tmp_path, batches):
    """A request the daemon refuses at once (another pre-pack's sha256): it answers and hangs up
    while the engine may still be sending fds; the engine raises the daemon's reason, not a broken pipe."""
    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        src = shm_files.rank_source(multi_segment_image, 0)
        with _segmented_arena(src.nbytes) as arena:
            with pytest.raises(LayoutError, match="holds rank 0 of another pre-pack"):
                client.start_served_load(arena, image_dir=multi_segment_image, rank=0, nbytes=src.nbytes,
                                         metadata_sha256="0" * 64, timeout_s=10, shm_dir=d.shm).wait()
        d.idle()
        d.load_exact()
    finally:
        d.close()


def test_a_load_whose_fds_stop_coming_times_out_by_name_and_nothing_leaks(multi_segment_image, tmp_path):
    """A client announces its arena's fds in batches, sends the first and goes silent: the daemon
    waits for the next at most its request timeout, answers naming how many arrived, and keeps serving."""
    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        with _segmented_arena(src.nbytes) as arena:
            req = {"op": "load", "rank": 0, "descriptor": arena.socket_descriptor().to_dict(), "nbytes": src.nbytes,
                   "metadata_sha256": src.metadata_sha256, "timeout_s": 5, "pci_bus_id": None, "fds_follow": True}
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(str(d.path))
                send_fds(s, arena.export_segments(0, 1), json.dumps(req).encode())
                s.settimeout(30)
                reply = json.loads(s.recv(1 << 20))
        assert reply["ok"] is False and reply["error"] == "WaitTimeoutError", reply
        assert f"1 of {arena.segments} fds arrived, then none within 1 s" in reply["message"], reply
        d.idle()
        assert fds_after_settling(fds_before) == fds_before
        d.load_exact()
    finally:
        d.close()


_LATER_BATCHES = {
    "pipe": r"ArenaError: fd \d+ is not segment 1 of arena \w+: it is 'pipe:\[\d+\]', expected '/memfd:flashboot-arena-",
    "short memfd": r"ArenaError: segment 1 of arena \w+ holds 4,096 bytes; the descriptor says 2,097,152",
    "another arena's segment": r"ArenaError: fd \d+ is not segment 1 of arena (\w+): it is '/memfd:flashboot-arena-"
                               r"(?!\1)\w+\.1",
    "segment 0 again": r"ArenaError: fd \d+ is not segment 1 of arena (\w+): it is '/memfd:flashboot-arena-\1\.0",
    "no fd": r"RendezvousError: the arena of rank 0's load: 1 of \d+ fds arrived, then: a message of more than 1 "
             r"byte\(s\) arrived without an fd",
    "too many fds": r"RendezvousError: the arena of rank 0's load: 1 of \d+ fds arrived, then: fds sent with a "
                    r"message were dropped and all closed: the peer sent more than \d+, or this process had no free fd",
    "hang-up": r"RendezvousError: the arena of rank 0's load: 1 of \d+ fds arrived, then: the peer closed the Unix "
               r"socket before sending an fd",
}


@pytest.mark.parametrize("later", list(_LATER_BATCHES))
def test_a_hostile_later_batch_is_refused_by_name_and_nothing_leaks(multi_segment_image, tmp_path, later):
    """After a good request and its first fd, the next batch carries the wrong thing (a pipe, a
    memfd named like the segment but too short to map, another arena's segment, the first segment
    again, a message without an fd, more fds than announced, or nothing: the client hangs up).
    The daemon answers naming it, closes every fd it took, and serves the next load exactly."""
    from flashboot.arena import _memfd_name

    d = Daemon(multi_segment_image, tmp_path / "shm")
    try:
        fds_before = open_fds()
        src = shm_files.rank_source(multi_segment_image, 0)
        with _segmented_arena(src.nbytes) as arena, _segmented_arena(src.nbytes) as other:
            desc = arena.socket_descriptor()
            req = {"op": "load", "rank": 0, "descriptor": desc.to_dict(), "nbytes": src.nbytes,
                   "metadata_sha256": src.metadata_sha256, "timeout_s": 5, "pci_bus_id": None, "fds_follow": True}
            ours: list[int] = []  # fds this test opened, closed after the answer
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(str(d.path))
                send_fds(s, arena.export_segments(0, 1), json.dumps(req).encode())
                if later == "pipe":
                    ours += os.pipe()
                    send_fds(s, ours[:1])
                elif later == "short memfd":
                    ours.append(os.memfd_create(_memfd_name(desc.arena_id, 1), os.MFD_CLOEXEC))
                    os.ftruncate(ours[0], 4096)
                    send_fds(s, ours)
                elif later == "another arena's segment":
                    send_fds(s, other.export_segments(1, 2))
                elif later == "segment 0 again":
                    send_fds(s, arena.export_segments(0, 1))
                elif later == "no fd":
                    s.send(b"garbage")
                elif later == "too many fds":
                    ours.append(os.open(os.devnull, os.O_RDONLY))
                    send_fds(s, ours * (arena.segments + 2))
                else:
                    s.shutdown(socket.SHUT_WR)
                s.settimeout(30)
                reply = json.loads(s.recv(1 << 20))
            for fd in ours:
                os.close(fd)
        assert reply["ok"] is False, reply
        assert re.match(_LATER_BATCHES[later], f"{reply['error']}: {reply['message']}"), reply
        d.idle()
        assert fds_after_settling(fds_before) == fds_before
        d.load_exact()
    finally:
        d.close()


def test_a_daemon_that_accepts_no_connection_ends_the_wait_by_name(tmp_path):
    """A stopped or hung preloader still listens, but accepts nothing: once its queue of
    connections is full a blocking connect() would wait forever. The engine's connect is timed."""
    import threading

    from flashboot.errors import WaitTimeoutError

    path = tmp_path / "preload.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(0)
    queued = []
    try:
        for _ in range(512):  # fill the queue, as engines waiting on a stopped daemon would (backlog 0: one or two)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            queued.append(s)
            try:
                s.connect(str(path))
            except BlockingIOError:
                break
        else:
            raise AssertionError("the listener's queue never filled in 512 connections")
        outcome = []

        def connect() -> None:
            try:
                outcome.append(client._connect(path, 0.5))
            except Exception as exc:  # handed to the assertions below
                outcome.append(exc)

        t0 = time.monotonic()
        waiter = threading.Thread(target=connect, daemon=True)
        waiter.start()
        waiter.join(10)
        assert outcome, "the connect to a daemon that accepts nothing did not end within 10 s"
        assert isinstance(outcome[0], WaitTimeoutError), outcome[0]
        assert re.search(rf"the preloader at {re.escape(str(path))} accepted no connection within 0.5 s: its queue "
                         "of connections is full", str(outcome[0]))
        assert time.monotonic() - t0 < 5
    finally:
        for s in queued:
            s.close()
        listener.close()
