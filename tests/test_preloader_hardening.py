"""The preloader under the faults an audit found: an accept() that fails, two preloaders started at
once, a hand-over that dribbles, a corrupted staged copy, a background start that dies, paths the
kernel refuses, and a daemon too busy to answer at once."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest

from flashboot.flashload import client

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
