"""Stopping a served-load daemon with loads in flight: ``preload --stop`` (SIGTERM) takes no new
request at once and lets the loads in flight finish; a second SIGTERM, or the stop's own
``--timeout`` running out, cancels them with an error naming the stop. Defect: a stop during a host
copy of more than ~10 s (the close's bound) lost the engine's load, nearly done, to "closed the
connection without answering"."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flashboot.arena import Arena
from flashboot.errors import FlashBootError
from flashboot.flashload import client, server, service, staging
from flashboot.flashload import shm as shm_files

from _preload_helpers import Daemon, fds_after_settling, make_tiny_image, open_fds  # noqa: E402  (tests/ is on the path)

_GATED_DAEMON = r"""
import sys, time
from pathlib import Path
from flashboot.flashload import server
gate = Path(sys.argv[1])
real = server._read_staged

def gated(res, dst, engine=None):
    '''The host copy, held at its start until the test creates the gate file (or the load ends).'''
    (gate.parent / "copying").touch()
    end = time.monotonic() + 120
    while not gate.exists() and not (engine is not None and engine.gone()) and time.monotonic() < end:
        time.sleep(0.01)
    return real(res, dst, engine)

server._read_staged = gated
from flashboot.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("stop"))


def _until(what: str, cond, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.01)


class _GatedDaemon:
    """``flashboot preload IMAGE --serve`` in its own process, each host copy held until :meth:`open_gate`."""

    def __init__(self, image: Path, tmp_path: Path):
        self.image, self.shm, self.dir = image, tmp_path / "shm", tmp_path
        self.gate, self.copying, self.log_path = tmp_path / "gate", tmp_path / "copying", tmp_path / "daemon.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _GATED_DAEMON, str(self.gate), "preload", str(image),
                                      "--serve", "--shm-dir", str(self.shm)],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})  # its log, line by line
        self.sock = shm_files.socket_path(image, self.shm)

        def resident() -> bool:
            assert self.proc.poll() is None, self.log()
            try:
                return client.serve_status(image, self.shm, timeout_s=5)["ranks"]["0"]["state"] == "mapped"
            except FlashBootError:
                return False

        _until("the daemon to hold rank 0", resident)
        self.outcome: dict = {}

    def log(self) -> str:
        return self.log_path.read_text()

    def start_load(self) -> threading.Thread:
        """A served load of rank 0 in a thread, once the daemon's copy holds it; ``outcome`` says how it went."""
        src = shm_files.rank_source(self.image, 0)

        def load():
            with Arena.create(src.nbytes, "cpu") as arena:
                try:
                    self.outcome["reply"] = client.served_load(arena, src, timeout_s=60, shm_dir=self.shm)
                    self.outcome["exact"] = bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
                except FlashBootError as exc:
                    self.outcome["error"] = exc

        t = threading.Thread(target=load, daemon=True)
        t.start()
        _until("the daemon's copy to start", self.copying.exists)
        return t

    def wait_draining(self) -> None:
        """Until the daemon says it waits for the load in flight (or it exited: the defect)."""
        _until("the daemon to say it waits for the load in flight",
               lambda: "stopping: waiting for 1 load in flight" in self.log() or self.proc.poll() is not None)

    def open_gate(self) -> None:
        self.gate.touch()

    def close(self) -> None:
        self.open_gate()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._log.close()


@contextlib.contextmanager
def gated_daemon(image, tmp_path):
    d = _GatedDaemon(image, tmp_path)
    try:
        yield d
    finally:
        d.close()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["said"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_stop_lets_the_load_in_flight_finish_and_takes_no_new_one(image, tmp_path):
    with gated_daemon(image, tmp_path) as d:
        load = d.start_load()
        lines: list[str] = []
        stopper, stopped = _in_thread(lambda: service.stop_service(image, d.shm, timeout_s=120, log=lines.append))
        d.wait_draining()
        assert d.proc.poll() is None, f"the daemon exited with a load in flight:\n{d.log()}"
        assert not d.sock.exists()  # no new request is taken: an engine waits for the next daemon's socket
        src = shm_files.rank_source(image, 0)
        with Arena.create(src.nbytes, "cpu") as arena:
            with pytest.raises(FlashBootError, match=r"waited [\d.]+ s for the preloader's socket .*FileNotFoundError"):
                client.served_load(arena, src, timeout_s=0.3, shm_dir=d.shm)
        d.open_gate()
        load.join(60)
        stopper.join(60)
        assert not load.is_alive() and not stopper.is_alive()
        assert "error" not in d.outcome, d.outcome.get("error")
        assert d.outcome["reply"]["ok"] and d.outcome["exact"]
        assert stopped.get("said") == f"stopped preloader pid {d.proc.pid}", stopped
        assert lines == [f"preloader pid {d.proc.pid}: waiting up to 120 s for 1 load in flight (rank 0, engine pid "
                         f"{os.getpid()}); then it is cancelled"], lines
        assert d.proc.wait(30) == 0
        assert "still busy" not in d.log() and not shm_files.pid_file(image, d.shm).exists()


_CANCELLED = (r"the preloader \(pid \d+\) was stopped while this load was copied \(at byte 0 of [\d,]+\), and "
              "cancelled it")


def test_a_second_sigterm_cancels_the_load_in_flight_with_an_error_naming_the_stop(image, tmp_path):
    with gated_daemon(image, tmp_path) as d:
        load = d.start_load()
        d.proc.terminate()
        d.wait_draining()
        assert d.proc.poll() is None, d.log()
        d.proc.terminate()
        load.join(60)
        assert not load.is_alive()
        assert isinstance(d.outcome.get("error"), FlashBootError), d.outcome
        assert "a second SIGTERM" in str(d.outcome["error"])
        with pytest.raises(FlashBootError, match=_CANCELLED):
            raise d.outcome["error"]
        assert d.proc.wait(30) == 0
        assert "still busy" not in d.log() and not shm_files.pid_file(image, d.shm).exists()


def test_the_stops_timeout_cancels_the_load_in_flight_and_says_so(image, tmp_path):
    with gated_daemon(image, tmp_path) as d:
        load = d.start_load()
        lines: list[str] = []
        said = service.stop_service(image, d.shm, timeout_s=1, log=lines.append)  # the gate stays shut
        assert said == (f"stopped preloader pid {d.proc.pid}; the loads it still had in flight after 1 s were "
                        "cancelled"), said
        assert lines[-1] == f"preloader pid {d.proc.pid} has not exited within 1 s; cancelling what it has in flight"
        load.join(60)
        with pytest.raises(FlashBootError, match=_CANCELLED):
            raise d.outcome["error"]


def test_two_stops_at_once_and_a_stop_of_a_stopping_daemon_let_the_load_finish(image, tmp_path):
    with gated_daemon(image, tmp_path) as d:
        load = d.start_load()
        stops = [_in_thread(lambda: service.stop_service(image, d.shm, timeout_s=120)) for _ in range(2)]
        d.wait_draining()
        lines: list[str] = []  # and a third, once it is stopping: it joins the wait, it does not cancel
        third = _in_thread(lambda: service.stop_service(image, d.shm, timeout_s=120, log=lines.append))
        _until("the third stop to say it waits", lambda: lines)
        assert lines == [f"preloader pid {d.proc.pid} is stopping already (its socket {d.sock} is gone): waiting up "
                         "to 120 s for it to finish what it has in flight; then it is cancelled"], lines
        d.open_gate()
        load.join(60)
        assert "error" not in d.outcome, d.outcome.get("error")
        assert d.outcome["exact"]
        for t, out in [*stops, third]:
            t.join(60)
            assert out.get("said") == f"stopped preloader pid {d.proc.pid}", out


def test_a_connection_idle_at_the_stop_is_answered_at_once_and_nothing_leaks(image, tmp_path):
    before = open_fds()
    d = Daemon(image, tmp_path / "shm")
    try:
        d.server.request_timeout_s = 120.0  # a client that connected and says nothing yet
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(d.path))
            _until("its handler", lambda: any(t.is_alive() for t in d.server._threads))
            d.server.stop.set()
            s.settimeout(30)  # far within the 120 s it would have waited
            reply = s.recv(1 << 16)
        reply = json.loads(reply)
        assert "is stopping and takes no new request" in reply["message"], reply
        assert reply["attrs"]["busy"] is True  # the engine asks again: a restarted preloader serves it
    finally:
        d.close()
    assert not any("still busy" in line for line in d.log), d.log
    assert fds_after_settling(before) == before


def test_cancelled_loads_leave_no_arena_or_fd_behind(image, tmp_path, monkeypatch):
    go = threading.Event()
    real = server._read_staged

    def held(res, dst, engine=None):
        copying.set()
        _until("the gate or the cancel", lambda: go.is_set() or engine.gone(), timeout_s=120)
        return real(res, dst, engine)

    copying = threading.Event()
    monkeypatch.setattr(server, "_read_staged", held)
    before = open_fds()
    d = Daemon(image, tmp_path / "shm")
    outcome: dict = {}
    try:
        src = shm_files.rank_source(image, 0)

        def load():
            with Arena.create(src.nbytes, "cpu") as arena:
                try:
                    outcome["reply"] = client.served_load(arena, src, timeout_s=60, shm_dir=d.shm)
                except FlashBootError as exc:
                    outcome["error"] = exc

        t = threading.Thread(target=load, daemon=True)
        t.start()
        assert copying.wait(60)
        closing = threading.Thread(target=d.close, daemon=True)  # the stop: it waits for the load
        closing.start()
        _until("the daemon to wait for the load", lambda: any("stopping: waiting" in line for line in d.log))
        assert d.server.status()["loads"] == [{"rank": 0, "pid": os.getpid()}]
        d.server.cancel.set()
        t.join(60)
        closing.join(60)
        assert not t.is_alive() and not closing.is_alive()
        assert "was stopped while this load was copied" in str(outcome.get("error")), outcome
    finally:
        go.set()
        d.server.cancel.set()
        d.thread.join(30)
    assert not any("still busy" in line for line in d.log), d.log
    assert fds_after_settling(before) == before
    assert not [t for t in threading.enumerate() if t.name.startswith("flashboot-serve")]


def test_a_request_queued_for_accept_at_the_stop_is_answered_not_reset(image, tmp_path):
    """Defect: a load whose connection waited in the listener's queue when the stop closed it (up
    to a poll of the accept loop) got ECONNRESET, "dropped the connection ...; did it exit?". It
    is answered now, as busy: the engine asks again and waits for a restarted preloader."""
    srv = server.PreloadServer(staging.PreloadConfig(str(image), shm_dir=str(tmp_path / "shm"), serve=True),
                               log=lambda line: None)
    srv._listen()  # listening, and nothing accepts: a connection waits in the queue
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(srv.sock_path))
            s.send(json.dumps({"op": "status"}).encode())
            srv.stop.set()
            srv._stop_listening()
            s.settimeout(30)
            reply = json.loads(s.recv(1 << 16))
        assert "is stopping and takes no new request" in reply["message"] and reply["attrs"]["busy"] is True, reply
        assert not srv.sock_path.exists()
    finally:
        srv.close()


def test_a_load_asked_during_a_restart_is_served_by_the_next_preloader(image, tmp_path):
    with gated_daemon(image, tmp_path) as d:
        first = d.start_load()
        stopper, stopped = _in_thread(lambda: service.stop_service(image, d.shm, timeout_s=120))
        d.wait_draining()
        src = shm_files.rank_source(image, 0)
        second: dict = {}

        def load():  # an engine of the rollout, while the old preloader finishes the first
            with Arena.create(src.nbytes, "cpu") as arena:
                second["reply"] = client.served_load(arena, src, timeout_s=60, shm_dir=d.shm)
                second["exact"] = bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()

        t = threading.Thread(target=load, daemon=True)
        t.start()
        d.open_gate()
        first.join(60)
        stopper.join(60)
        assert d.outcome["exact"] and stopped.get("said") == f"stopped preloader pid {d.proc.pid}", (d.outcome, stopped)
        assert t.is_alive()  # waiting for a preloader's socket
        with open(tmp_path / "next.log", "w") as log:
            nxt = subprocess.Popen([sys.executable, "-m", "flashboot.cli", "preload", str(image), "--serve",
                                    "--shm-dir", str(d.shm)], stdout=log, stderr=subprocess.STDOUT)
            try:
                t.join(60)
                assert not t.is_alive() and second["exact"], second
                assert second["reply"]["pid"] == nxt.pid
            finally:
                nxt.terminate()
                nxt.wait(30)


def test_the_daemon_says_it_serves_only_the_ranks_it_holds(image, tmp_path, monkeypatch):
    """Defect: "serving 1 rank(s)" was logged for a rank whose staging had failed, and by a
    daemon stopped while staging, on its way out."""
    import errno

    from flashboot.flashload import stage_copy

    def pwrite(fd, data, off):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(stage_copy, "_pwrite", pwrite)
    d = Daemon(image, tmp_path / "shm", staged=False)
    try:
        _until("the serving line", lambda: any(line.startswith("serving") for line in d.log))
        said = next(line for line in d.log if line.startswith("serving"))
        assert said.startswith("serving 0 rank(s) on ") and "rank(s) [0] failed" in said, said
    finally:
        d.close()


def test_a_stop_of_a_daemon_stopping_but_frozen_resumes_it_and_its_load_finishes(image, tmp_path):
    """The daemon was told to stop (a `kill`), then frozen (SIGSTOP, a suspended job): ``--stop``
    takes it for stopping already and sends no second SIGTERM, but a SIGCONT, or the load it
    finishes would wait, frozen, for the stop's timeout and its cancel."""
    import signal

    with gated_daemon(image, tmp_path) as d:
        load = d.start_load()
        d.proc.terminate()
        d.wait_draining()
        os.kill(d.proc.pid, signal.SIGSTOP)
        stopper, stopped = _in_thread(lambda: service.stop_service(image, d.shm, timeout_s=30))
        d.open_gate()
        load.join(60)
        stopper.join(60)
        assert "error" not in d.outcome, d.outcome.get("error")
        assert d.outcome["exact"] and stopped.get("said") == f"stopped preloader pid {d.proc.pid}", stopped


def test_status_of_a_daemon_finishing_its_loads_says_it_stops(image, tmp_path):
    """Defect: ``preload --status`` of a daemon that stopped listening to finish its loads waited
    10 s for its socket, then said it "did not answer ... is `flashboot preload DIR --serve` running?"."""
    with gated_daemon(image, tmp_path) as d:
        load = d.start_load()
        d.proc.terminate()
        d.wait_draining()
        out = subprocess.run([sys.executable, "-m", "flashboot.cli", "preload", str(image), "--shm-dir", str(d.shm),
                              "--status"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert (f"the serving daemon (pid {d.proc.pid}) takes no request: its socket {d.sock} is gone (it is "
                "stopping, finishing the loads in flight") in out.stdout, out.stdout
        assert "did not answer" not in out.stdout
        d.open_gate()
        load.join(60)
        assert d.outcome["exact"]
