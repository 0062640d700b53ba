"""The rendezvous store misbehaving as a cluster meets it: a store that goes silent mid-run, a store
name whose lookup hangs, ... . Each test checks what the caller gets (the error, its words) and
what its process still holds afterwards; none asserts a time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from flashboot.flashclone.rendezvous import Rendezvous, StoreSilentError, free_port

from _clone_helpers import TOKEN

pytestmark = pytest.mark.timeout(120)


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10  # a signal lands asynchronously
    while _state(pid) != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def _sockets_to(port: int) -> list[int]:
    """This process's fds of TCP sockets connected to ``port``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            try:
                if s.getpeername()[1] == port:
                    out.append(int(fd))
            except OSError:
                pass
    return out


def _store_threads(before=()) -> list[str]:
    """Store threads of this process that were not there ``before`` (other tests' may linger)."""
    return [t.name for t in threading.enumerate() if t.name == "flashboot-store-calls" and t not in before]


@pytest.fixture
def store_process():
    """A store hosted by a process of its own (which a test may stop); yields (address, process)."""
    for _ in range(3):  # the port may be taken between free_port and the bind
        address = f"127.0.0.1:{free_port()}"
        code = ("import time\nfrom flashboot.flashclone.rendezvous import Rendezvous\n"
                f"r = Rendezvous.connect({address!r}, {TOKEN!r}, host=True, timeout_s=20)\n"
                "print('ready', r.is_server, flush=True)\ntime.sleep(300)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if line.split() == ["ready", "True"]:
            break
        proc.kill()
        proc.communicate()
    assert line.split() == ["ready", "True"], f"no free port to host a store on: {line!r}"
    try:
        yield address, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate()


def test_a_store_gone_silent_leaves_no_thread_or_socket_behind_after_close(store_process, monkeypatch):
    """The store stops answering mid-call (its process stopped; a cut link alike): the call ends
    with StoreSilentError by the timeout. Its store thread stayed blocked in the TCPStore call and
    kept the connection open for good (close() could only queue its end), so an engine that
    retries gathered a thread and a socket per try. Now the connection is shut down: after
    close() nothing of it is left, try after try."""
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    address, proc = store_process
    port = int(address.rsplit(":", 1)[1])
    before = set(threading.enumerate())
    assert _sockets_to(port) == []
    for attempt in range(3):
        r = Rendezvous.connect(address, TOKEN, timeout_s=1.0)
        assert r.add("k", 1) == attempt + 1
        assert _store_threads(before) == ["flashboot-store-calls"] and len(_sockets_to(port)) >= 1
        _stop(proc.pid)
        with pytest.raises(StoreSilentError, match=f"the store at {address} did not answer within 1 s while "
                                                   "checking 'x'"):
            r.has("x")
        r.close()
        del r
        # checked while the store is still stopped: a store that answers again unblocks the call
        assert _store_threads(before) == [], f"attempt {attempt}"
        assert _sockets_to(port) == [], f"attempt {attempt}"
        os.kill(proc.pid, signal.SIGCONT)
