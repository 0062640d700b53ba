"""flashboot.gil_time: a thread's CPU time inside calls that release the GIL, counted per thread."""

import os
import socket
import threading
import time

from flashboot import gil_time


def _spin_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_cpu_inside_a_counted_call_is_added_to_this_thread_only():
    before = gil_time.gil_free_cpu_s()
    with gil_time.gil_free(driver=False):
        _spin_cpu(0.02)
    _spin_cpu(0.02)  # outside: not counted
    counted = gil_time.gil_free_cpu_s() - before
    assert 0.02 <= counted < 0.04

    other: list[float] = []
    t = threading.Thread(target=lambda: other.append(gil_time.gil_free_cpu_s()))
    t.start()
    t.join()
    assert other == [0.0]  # a thread's total is its own


def test_a_failing_call_is_counted_and_its_error_goes_on():
    before = gil_time.gil_free_cpu_s()
    try:
        with gil_time.gil_free(driver=False):
            _spin_cpu(0.01)
            raise OSError("the send failed")
    except OSError as exc:
        assert str(exc) == "the send failed"
    else:
        raise AssertionError("the error was swallowed")
    assert gil_time.gil_free_cpu_s() - before >= 0.01


def test_driver_calls_count_only_where_the_bindings_release_the_gil(monkeypatch):
    gil_time.driver_releases_gil.cache_clear()
    try:
        import cuda.bindings

        for version, releases in (("12.8.0", False), ("12.9.0", False), ("12.9.1", True), ("13.0.0", True),
                                  ("13.5.0", True), ("dev", False)):
            monkeypatch.setattr(cuda.bindings, "__version__", version)
            gil_time.driver_releases_gil.cache_clear()
            assert gil_time.driver_releases_gil() is releases, version
            before = gil_time.gil_free_cpu_s()
            with gil_time.gil_free():
                _spin_cpu(0.005)
            assert (gil_time.gil_free_cpu_s() > before) is releases, version
    finally:
        gil_time.driver_releases_gil.cache_clear()


def test_fd_sends_are_counted():
    from flashboot.fdshare import recv_fds, send_fds

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        before = gil_time.gil_free_cpu_s()
        send_fds(a, [r], b"x")
        assert gil_time.gil_free_cpu_s() > before
        fds, msg = recv_fds(b, 1, timeout_s=5)
        assert msg == b"x" and len(fds) == 1
        os.close(fds[0])
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
