"""What a cluster does to FlashBoot's processes: they die or freeze at any moment (the OOM killer,
preemption, ``kill -9``, a node drain, a frozen cgroup). Each test kills or stops one process at a
named point (after a marker line, or from a hook) and checks the survivors: they end within their
timeout with an error naming the dead or frozen peer, the next load, hand-over or clone works, and
nothing is left behind."""

from __future__ import annotations

import os
import signal

import pytest

from flashboot.arena import Arena
from flashboot.errors import WaitTimeoutError
from flashboot.flashload import client
from flashboot.flashload import shm as shm_files

from _preload_helpers import daemon_process_of, make_image, make_tiny_image  # noqa: E402


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("chaos-image"))


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (a signal lands asynchronously)."""
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while _state(pid) != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.005)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_served_load_from_a_stopped_daemon_ends_past_its_timeout_naming_the_daemon(image, tmp_path):
    """A daemon frozen (SIGSTOP) with the load's request in its queue: the load's reply is allowed
    a copy's minute past its timeout, and had waited all of it; once its own timeout has passed it
    finds the daemon stopped and says so, naming its pid. Resumed, the daemon serves the next load."""
    src = shm_files.rank_source(image, 0)
    with daemon_process_of(image, tmp_path) as (proc, shm, _log):
        _stop(proc.pid)
        try:
            with Arena.create(src.nbytes, "cpu") as arena:
                with pytest.raises(WaitTimeoutError) as e:
                    client.served_load(arena, src, timeout_s=1, shm_dir=shm)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert f"pid {proc.pid}" in str(e.value) and "stopped" in str(e.value), str(e.value)
        with Arena.create(src.nbytes, "cpu") as arena:
            client.served_load(arena, src, timeout_s=10, shm_dir=shm)
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()


def test_a_clone_whose_seed_stops_mid_clone_keeps_its_verified_weights_and_the_next_clone_works(tmp_path, monkeypatch):
    """The seed hosting the store is stopped (SIGSTOP) as the clone copies its first step. The
    copy goes on (the seed's arena is mapped here) but every store call after it went to a store
    that never answers: the clone hung forever in its first one (only seeds and cross-host
    transports bounded them), and once bounded, the first unanswered call failed a clone that
    held every verified byte. Now it keeps them, the warning naming the store; the seed resumed,
    the next clone copies from it, and the stuck store call's thread ends."""
    import threading

    import flashboot
    from flashboot.flashclone import cloning
    from flashboot.flashclone.rendezvous import free_port

    from _clone_helpers import CHUNK, MiB, TOKEN, spawn_cli, stop, wait_until, write_raw_image

    monkeypatch.setenv("FLASHBOOT_TOKEN", TOKEN)
    before = set(threading.enumerate())  # other tests' stores may have left theirs
    path = tmp_path / "image.bin"
    data = write_raw_image(path, 4 * MiB, 7)
    address = f"127.0.0.1:{free_port()}"
    seed = spawn_cli("seed", path, "--device", "cpu", "--store", address, "--timeout", "15")
    try:
        wait_until(lambda: "seed ready" in (seed.stdout.readline() or ""), 30, "the seed to publish", seed)
        stopped = []

        def stop_the_seed(_step):
            if not stopped:
                _stop(seed.pid)
                stopped.append(seed.pid)

        monkeypatch.setattr(cloning, "_step_hook", lambda _delay: stop_the_seed)
        out = {}

        def run():
            try:
                out["result"] = flashboot.clone(address, "cpu", "star", chunk_bytes=CHUNK, timeout_s=2, verify=True)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                out["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the clone hung on the stopped seed's store"
        assert stopped and "error" not in out, out.get("error")
        result = out["result"]
        try:
            assert result.report.verified
            assert (result.arena.bytes().numpy()[:data.size] == data).all()
            assert any(f"the store at {address} did not answer within 2 s" in w and "kept the weights" in w
                       for w in result.report.warnings), result.report.warnings
        finally:
            result.close()
        os.kill(seed.pid, signal.SIGCONT)
        monkeypatch.setattr(cloning, "_step_hook", lambda _delay: None)
        again = flashboot.clone(address, "cpu", "star", chunk_bytes=CHUNK, timeout_s=10, verify=True)
        try:
            assert not again.report.warnings, again.report.warnings
            assert (again.arena.bytes().numpy()[:data.size] == data).all()
        finally:
            again.close()
        wait_until(lambda: not [th for th in set(threading.enumerate()) - before if th.name == "flashboot-store-calls"],
                   20, "the store-call threads to end")
    finally:
        stop(seed)


def test_a_clone_after_one_that_failed_does_not_call_it_finished(tmp_path, monkeypatch):
    """Clone #1 of a chain of two gives up at the start barrier (#2 was stopped before it came) and
    exits; #2, resumed, copies from the seed past it. Its report had said "clone #1 had finished
    and exited", pointing whoever reads it away from the failure."""
    import flashboot
    from flashboot.errors import WaitTimeoutError as Timeout
    from flashboot.flashclone.rendezvous import Rendezvous, free_port

    from _clone_helpers import CHUNK, MiB, TOKEN, spawn_cli, stop, wait_until, write_raw_image

    monkeypatch.setenv("FLASHBOOT_TOKEN", TOKEN)
    path = tmp_path / "image.bin"
    data = write_raw_image(path, 2 * MiB, 9)
    address = f"127.0.0.1:{free_port()}"
    rdv = Rendezvous.connect(address, TOKEN, host=True, timeout_s=20)
    seed = spawn_cli("seed", path, "--device", "cpu", "--store", address, "--timeout", "15")
    try:
        wait_until(lambda: rdv.try_read("seed"), 30, "the seed to publish", seed)
        with pytest.raises(Timeout, match="start barrier"):
            flashboot.clone(address, "cpu", "chain", chunk_bytes=CHUNK, clones=2, timeout_s=1)
        late = flashboot.clone(address, "cpu", "chain", chunk_bytes=CHUNK, clones=2, timeout_s=10, verify=True)
        try:
            assert (late.arena.bytes().numpy()[:data.size] == data).all()
            assert late.report.source_note == "clone #1 had failed and exited", late.report.source_note
        finally:
            late.close()
    finally:
        stop(seed)
        rdv.close()


def test_a_holder_started_after_one_was_killed_drops_its_stale_records_and_holds_anew(tmp_path):
    """A holder killed (SIGKILL) after adopting an arena leaves its record; the next holder of the
    registry removes it (it had stayed, listed by every ``hold --list``, until removed by hand),
    says so, and a hand-over of the same name is then held and opened with the right bytes."""
    import numpy as np

    from flashboot.flashclone.holder import Holder, hand_over, list_held, open_held

    from _clone_helpers import serving_holder, spawn_cli, stop, wait_until

    registry = tmp_path / "registry"
    first = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: (registry / "holder.lock").exists(), 30, "the first holder", first)
        with Arena.create(1 << 20, "cpu") as arena:
            arena.bytes().numpy()[:1 << 20] = 1
            hand_over(arena, "w", registry=registry, timeout_s=20)
        first.kill()
        first.communicate()
        assert "holder_pid" in list_held(registry)["w"]
        holder = Holder(registry=registry)
        assert list_held(registry) == {}
        assert any(f"w: removed the stale record of a holder before this one (its holder (pid {first.pid}) has exited"
                   in e for e in holder.errors), list(holder.errors)
        with serving_holder(holder):
            with Arena.create(1 << 20, "cpu") as arena:
                want = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
                arena.bytes().numpy()[:1 << 20] = want
                hand_over(arena, "w", registry=registry, timeout_s=20)
            again = open_held("w", "cpu", registry=registry)
            try:
                assert (again.bytes().numpy()[:1 << 20] == want).all()
            finally:
                again.close()
        assert list_held(registry) == {}  # the holder stopped: its records withdrawn
    finally:
        stop(first)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_hand_over_to_a_killed_or_stopped_holder_names_it(tmp_path, how):
    """The registry's holder killed (SIGKILL) or stopped (SIGSTOP) before an engine hands its arena
    over: the hand-over's wait ends at its timeout, naming the holder's pid and what became of it
    (it had asked whether `flashboot hold` ran at all)."""
    from flashboot.flashclone.holder import hand_over

    from _clone_helpers import spawn_cli, stop, wait_until

    registry = tmp_path / "registry"
    holder = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: "holder ready" in (holder.stdout.readline() or ""), 30, "the holder", holder)
        if how == "killed":
            holder.kill()
            holder.communicate()
        else:
            _stop(holder.pid)
        with Arena.create(1 << 20, "cpu") as arena, pytest.raises(WaitTimeoutError) as e:
            hand_over(arena, "w", registry=registry, timeout_s=1)
        want = f"its holder (pid {holder.pid}) has exited" if how == "killed" else f"its holder (pid {holder.pid}) is stopped"
        assert want in str(e.value), str(e.value)
    finally:
        stop(holder)



def test_the_status_of_a_stopped_daemon_names_it_stopped(image, tmp_path):
    """A served-load daemon stopped (SIGSTOP, a frozen job): its status ask (``preload --status``,
    a load's check of it) waited the whole 10 s and said it "did not answer 'status' for rank
    None". A running daemon answers it at once: a stopped one is named as such."""
    from flashboot.errors import FlashBootError

    with daemon_process_of(image, tmp_path) as (proc, shm, _log):
        _stop(proc.pid)
        try:
            with pytest.raises(FlashBootError) as e:
                client.serve_status(image, shm, timeout_s=10)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert f"(pid {proc.pid}) is stopped" in str(e.value) and "rank None" not in str(e.value), str(e.value)
        assert client.serve_status(image, shm, timeout_s=10)["pid"] == proc.pid


def test_preload_stop_ends_a_stopped_daemon(image, tmp_path):
    """``preload --stop`` of a stopped daemon (SIGSTOP, a frozen job) sent SIGTERM, which a stopped
    process never takes, waited out its timeout and failed, the daemon still stopped with its
    memory. A SIGCONT follows the SIGTERM (as systemd does): it ends, leaving no pid file or socket."""
    from flashboot.flashload.service import stop_service

    with daemon_process_of(image, tmp_path) as (proc, shm, _log):
        _stop(proc.pid)
        try:
            assert stop_service(image, shm, timeout_s=20) == f"stopped preloader pid {proc.pid}"
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(10) is not None
        assert not shm_files.pid_file(image, shm).exists() and not shm_files.socket_path(image, shm).exists()


def test_a_served_load_after_the_daemon_was_killed_names_it(image, tmp_path):
    """The daemon killed (SIGKILL) leaves its socket and pid file: a served load waits its timeout
    for a daemon to listen again (one may be restarting), then says that the one named in the pid
    file has exited (it had asked whether one ran at all). A daemon started again serves the next."""
    src = shm_files.rank_source(image, 0)
    with daemon_process_of(image, tmp_path) as (proc, shm, _log):
        proc.kill()
        proc.wait()
        with Arena.create(src.nbytes, "cpu") as arena, pytest.raises(WaitTimeoutError) as e:
            client.served_load(arena, src, timeout_s=1, shm_dir=shm)
        assert f"its preloader (pid {proc.pid}) has exited" in str(e.value), str(e.value)
    with daemon_process_of(image, tmp_path) as (proc, shm, _log):  # on the same staging root
        with Arena.create(src.nbytes, "cpu") as arena:
            client.served_load(arena, src, timeout_s=10, shm_dir=shm)
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()


_DEAD_ENGINE = r"""
import os, sys, time
from flashboot.arena import Arena
from flashboot.flashclone.holder import REQUESTS, _kv
a = Arena.create(1 << 20, "cpu")
_kv(sys.argv[1]).put(REQUESTS, sys.argv[2], {"descriptor": a.export().to_dict(), "request": "r", "pid": os.getpid()})
print("asked", flush=True)
time.sleep(60)
"""


def _engine_killed_after_asking(registry, name: str) -> None:
    """An engine that asks the holder to keep its arena, then is killed (SIGKILL) before it is taken."""
    import subprocess
    import sys

    engine = subprocess.Popen([sys.executable, "-c", _DEAD_ENGINE, str(registry), name], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert engine.stdout.readline().strip() == "asked"
    finally:
        engine.kill()
        engine.communicate()


def test_the_answers_to_engines_killed_before_their_hand_over_go_with_the_holder(tmp_path):
    """An engine killed after asking, before the holder took its arena: the holder answers with an
    error record, which had stayed after that holder stopped (or was killed), listed by every
    ``hold --list``. A holder stopping removes its own; one starting removes a killed one's."""
    from flashboot.flashclone.holder import Holder, list_held

    from _clone_helpers import spawn_cli, stop, wait_until

    registry = tmp_path / "registry"
    first = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: "holder ready" in (first.stdout.readline() or ""), 30, "the first holder", first)
        _engine_killed_after_asking(registry, "a")
        wait_until(lambda: "error" in (list_held(registry).get("a") or {}), 30, "the holder's answer", first)
        first.kill()
        first.communicate()
    finally:
        stop(first)
    holder = Holder(registry=registry)
    try:
        assert list_held(registry) == {}
        _engine_killed_after_asking(registry, "b")
        assert holder.poll_once() == 1 and "has exited" in list_held(registry)["b"]["error"]
    finally:
        holder.close()
    assert list_held(registry) == {}


_STOPS_MID_HAND_OVER = r"""
import os, signal, sys
from flashboot.arena import HOST_GRANULARITY, Arena
from flashboot.flashload import client
from flashboot.flashload import shm as shm_files
import flashboot.fdshare as fdshare

src = shm_files.rank_source(sys.argv[1], 0)
client.STREAM_BATCH_BYTES = HOST_GRANULARITY  # one segment a batch: the rest follow the request
sends = [0]
real_send = fdshare.send_fds

def send_then_stop(sock, fds, message=b""):
    sends[0] += 1
    if sends[0] == 2:  # the request went with the first batch: stop before the second
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return real_send(sock, fds, message)

fdshare.send_fds = send_then_stop
with Arena.create(max(src.nbytes, 3 * HOST_GRANULARITY), "cpu", segment_bytes=HOST_GRANULARITY) as arena:
    assert arena.segments > 1, arena.segments
    client.served_load(arena, src, timeout_s=60, shm_dir=sys.argv[2])
"""


def test_an_engine_stopped_mid_hand_over_does_not_hold_the_device_from_the_next_load(tmp_path):
    """An engine stopped (SIGSTOP) after sending its load request with the first batch of its
    arena's fds, before the rest: the daemon held the device's copy lock waiting for fds the stopped
    engine could not send, for the request's timeout (30 s) plus 1 s/GB, and every other engine's
    load into that device queued behind it. The daemon now breaks that hand-over off once the
    sender has been stopped for a second, and the next load is served within its short timeout."""
    import subprocess
    import sys
    import time

    from flashboot.benchmarks.checkpoints import CheckpointSpec

    # past one 2 MiB segment: the copy, holding the device, needs the fds that never come
    image = make_image(tmp_path, CheckpointSpec("6mb", layers=2, experts=4, expert_rows=256, expert_cols=512,
                                                hidden=64, vocab=64, shards=1))
    src = shm_files.rank_source(image, 0)
    assert src.nbytes > 2 * (2 << 20), src.nbytes
    with daemon_process_of(image, tmp_path) as (_proc, shm, log):
        engine = subprocess.Popen([sys.executable, "-c", _STOPS_MID_HAND_OVER, str(image), str(shm)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert engine.stdout.readline().strip() == "stopping", engine.stderr.read()
            deadline = time.monotonic() + 10
            while _state(engine.pid) != "T":
                assert time.monotonic() < deadline, "the engine did not stop"
                time.sleep(0.005)
            with Arena.create(src.nbytes, "cpu") as arena:
                client.served_load(arena, src, timeout_s=8, shm_dir=shm)
                assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
            said = f"the sender (pid {engine.pid}) has been stopped"
            deadline = time.monotonic() + 10  # the daemon logs it in the stopped engine's own thread
            while said not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
        finally:
            os.kill(engine.pid, signal.SIGCONT)
            engine.kill()
            engine.wait(30)
