"""The preloader under the faults an audit found: an accept() that fails, two preloaders started at
once, a hand-over that dribbles, a corrupted staged copy, a background start that dies, paths the
kernel refuses, and a daemon too busy to answer at once."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

import pytest

from flashboot.errors import FlashBootError, WaitTimeoutError
from flashboot.flashload import client, service
from flashboot.flashload import shm as shm_files

from _preload_helpers import Daemon, make_tiny_image  # noqa: E402  (tests/ is on the path)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("hardening"))


class _AcceptFails:
    """The daemon's listener, but its next ``failures`` accept() calls fail as a process out of fds does."""

    def __init__(self, real: socket.socket, failures: int):
        self.real, self.failures = real, failures

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self.real.accept()

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def test_the_daemon_keeps_accepting_after_accept_runs_out_of_fds(image, tmp_path):
    d = Daemon(image, tmp_path / "shm")
    try:
        failing = d.server._listener = _AcceptFails(d.server._listener, failures=3)
        deadline = time.monotonic() + 10
        while failing.failures and time.monotonic() < deadline:  # the loop picks it up after its current accept
            time.sleep(0.01)
        reply = client.serve_status(image, d.shm, timeout_s=10)
        assert reply["ranks"]["0"]["state"] == "mapped"
        failed = [line for line in d.log if "accepting a connection" in line]
        assert len(failed) == 3 and "Too many open files" in failed[0], d.log
        d.load_exact()  # and it still copies
    finally:
        d.close()


def _claim_in_child(path, go_r: int, said_w: int, done_r: int) -> int:
    """A forked child that claims ``path`` when told, writes whether it did, and holds it until told."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.read(go_r, 1)
        try:
            service._claim_pid_file(path, True)
            os.write(said_w, b"y")
        except FlashBootError:
            os.write(said_w, b"n")
        os.read(done_r, 1)
        code = 0
    finally:
        os._exit(code)


def test_two_preloaders_claiming_one_pid_file_at_once_one_wins(tmp_path):
    for trial in range(20):
        path = tmp_path / f"t{trial}" / "preload.pid"
        path.parent.mkdir()
        go_r, go_w = os.pipe()
        said_r, said_w = os.pipe()
        done_r, done_w = os.pipe()
        pids = [_claim_in_child(path, go_r, said_w, done_r) for _ in range(2)]
        try:
            os.write(go_w, b"gg")
            said = sorted(os.read(said_r, 1) + os.read(said_r, 1))
            assert said == sorted(b"ny"), f"trial {trial}: both claimed {path}" if said == [ord("y")] * 2 else said
            assert json.loads(path.read_text())["pid"] in pids
        finally:
            os.write(done_w, b"dd")
            for pid in pids:
                os.waitpid(pid, 0)
            for fd in (go_r, go_w, said_r, said_w, done_r, done_w):
                os.close(fd)


def test_an_empty_pid_file_whose_lock_is_held_is_a_preloader_starting(image, tmp_path, monkeypatch):
    monkeypatch.setattr(service, "_LOCK_WAIT_S", 0.2)  # how long a claim waits for it to write its pid
    shm = tmp_path / "shm"
    path = shm_files.pid_file(image, shm)
    path.parent.mkdir(parents=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # created and locked, its JSON not written yet
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = service.service_status(image, shm)
        assert st.running and not st.stale
        with pytest.raises(FlashBootError, match="starting"):
            service._claim_pid_file(path, True)
        with pytest.raises(WaitTimeoutError, match="did not write its pid"):
            service.stop_service(image, shm, timeout_s=0.2)
        assert path.exists(), "a starting preloader's pid file was removed as stale"
    finally:
        os.close(fd)
    assert service.service_status(image, shm).stale  # its lock gone: now it is stale
    service._claim_pid_file(path, True)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    service._release_pid_file(path)
    assert not path.exists()
