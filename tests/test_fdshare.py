"""Taking another process's fds (pidfd_getfd) and making room for them in the fd table ahead of time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flashboot.errors import RendezvousError
from flashboot.fdshare import FD_TABLE_ROOM, grow_fd_table, take_fds

from _python import run_python  # noqa: E402  (tests/ is on the path)


def _fd_table_size() -> int:
    """FDSize: the slots of this process's fd table (the kernel grows it by doubling, never shrinks it)."""
    for line in open("/proc/self/status"):
        if line.startswith("FDSize:"):
            return int(line.split()[1])
    raise AssertionError("no FDSize in /proc/self/status")


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


# An engine-like process (threads: the kernel then waits for an RCU grace period at each growth):
# an exporter child holds N fds; the table is grown first, then the take must not grow it again.
_TAKE_AFTER_GROW = """
import os, subprocess, sys, threading
from flashboot.fdshare import grow_fd_table, take_fds
def size():
    return int(next(l for l in open('/proc/self/status') if l.startswith('FDSize:')).split()[1])
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
n = int(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c",
    "import os, sys; fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(%d)]; "
    "print(' '.join(map(str, fds)), flush=True); sys.stdin.read()" % n], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
theirs = [int(x) for x in child.stdout.readline().split()]
before = size()
slots = grow_fd_table(n)
grown = size()
mine = take_fds(child.pid, theirs)
after = size()
print(before, slots, grown, after, len(mine), len(set(mine)), max(int(f) for f in os.listdir('/proc/self/fd')))
child.stdin.close(); child.wait()
"""


def test_the_table_grown_ahead_holds_a_whole_arenas_fds_without_growing_again():
    before, slots, grown, after, taken, distinct, highest = map(int, run_python("-c", _TAKE_AFTER_GROW, "600").split())
    assert grown >= slots > 600 and grown > before  # 600 fds did not fit the table the process started with
    assert after == grown and taken == distinct == 600 and highest < grown


def test_grow_fd_table_opens_nothing_and_a_second_call_changes_nothing():
    fds = _open_fds()
    slots = grow_fd_table(300)
    assert _fd_table_size() >= slots >= max(fds) + 300
    assert _open_fds() == fds
    size = _fd_table_size()
    assert grow_fd_table(10) <= size and _fd_table_size() == size and _open_fds() == fds


def test_grow_fd_table_stays_within_the_soft_open_file_limit():
    code = ("import resource; from flashboot.fdshare import grow_fd_table\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            f"print(grow_fd_table({FD_TABLE_ROOM}))")
    assert int(run_python("-c", code, timeout=60)) <= 200  # no fd past the limit: an fd the process could not open anyway


def test_grow_fd_table_refuses_a_negative_count():
    with pytest.raises(RendezvousError, match="non-negative fd count, got -1"):
        grow_fd_table(-1)


def test_a_take_that_fails_midway_closes_what_it_took_and_names_the_fd():
    r, w = os.pipe()
    try:
        fds = _open_fds()
        with pytest.raises(RendezvousError, match=rf"process {os.getpid()} has no open fd 99999 \(pidfd_getfd: EBADF\)"):
            take_fds(os.getpid(), [r, w, 99999, r])
        assert _open_fds() == fds
        assert take_fds(os.getpid(), []) == []
    finally:
        os.close(r)
        os.close(w)


def test_a_take_from_an_exited_process_names_its_fds():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(RendezvousError, match=rf"process {child.pid} has exited .*the 3 fds it shared \(5\.\.7\) are gone"):
        take_fds(child.pid, [5, 6, 7])


def test_grow_fd_table_with_no_fd_left_returns_instead_of_raising():
    code = ("import os, resource; from flashboot.fdshare import grow_fd_table\n"
            "highest = max(int(n) for n in os.listdir('/proc/self/fd'))\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "held = []\n"
            "try:\n"
            "    while True:\n"
            "        held.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError as exc:\n"
            "    print('full', exc.errno)\n"
            "print('slots', grow_fd_table(100) >= 0)")
    assert run_python("-c", code, timeout=60).split() == ["full", "24", "slots", "True"]  # EMFILE, then no exception


# A process holding more than 1,024 fds, as an engine can (arena exports, NCCL): select() refuses
# such fd numbers; readable() and the clone's PeerWatch must still answer.
_PAST_1024 = """
import os, resource, subprocess, sys
from flashboot.fdshare import readable
from flashboot.flashclone.executor import PeerWatch
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft != resource.RLIM_INFINITY and soft < 1400:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100 - len(os.listdir('/proc/self/fd')))]
r, w = os.pipe()
before = readable([r], 0)
os.write(w, b"x")
after = readable([r], 1.0)
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
watch = PeerWatch(child.pid)
alive = watch.exited()
child.stdin.close(); child.wait()
print(r, before == [], after == [r], watch._fd > 1024, alive, watch.exited())
"""


def test_readable_and_peer_watch_answer_for_fd_numbers_past_1024():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room past fd 1,024")
    fd, nothing_yet, written, watch_past_1024, alive_exited, dead_exited = run_python("-c", _PAST_1024).split()
    assert int(fd) > 1024 and watch_past_1024 == "True"
    assert (nothing_yet, written) == ("True", "True")
    assert (alive_exited, dead_exited) == ("False", "True")


def _stream_with_queued_batches(batches: int, **options):
    """A receiver's FdStream whose first fd came with the request and whose ``batches`` more are
    queued in the socket already (one fd each), and the two socket ends to close."""
    import socket

    from flashboot.fdshare import FdStream, send_fds

    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for _ in range(batches):
        send_fds(sender, [0])
    first = [os.dup(0)]
    return FdStream(receiver, first, 1 + batches, timeout_s=5, what="test hand-over", **options), sender, receiver


def test_fds_queued_before_the_hand_over_deadline_are_taken_after_it():
    stream, sender, receiver = _stream_with_queued_batches(2, within_s=0)  # the deadline has passed
    try:
        assert len(stream.receive_all()) == 3
    finally:
        for fd in stream.received:
            os.close(fd)
        sender.close()
        receiver.close()


def test_drain_takes_the_queued_fds_when_stopping_so_the_answer_is_not_reset():
    import threading

    stop = threading.Event()
    stop.set()
    stream, sender, receiver = _stream_with_queued_batches(3, within_s=0, stop=stop)
    try:
        with pytest.raises(RendezvousError, match="the receiver is stopping"):
            stream.receive_all()
        stream.drain()
        assert len(stream.received) == 4, "drain left fds queued: closing the socket then resets the sender's"
        receiver.send(b"answer")
        receiver.close()  # nothing unread: the sender reads the answer instead of ECONNRESET
        assert sender.recv(64) == b"answer"
    finally:
        for fd in stream.received:
            os.close(fd)
        sender.close()
        receiver.close()


def test_a_message_cut_short_with_its_fds_is_refused_and_the_fds_closed():
    """A message longer than the receiver's buffer had been read as a shorter one, silently."""
    import socket

    from flashboot.fdshare import recv_fds, send_fds

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        send_fds(a, [r], b"x" * 100)
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(RendezvousError, match="a message of more than 10 bytes arrived with 1 fd.s.; it was cut "
                                                  "short, so it and its fds were refused"):
            recv_fds(b, 1, bufsize=10)
        assert set(os.listdir("/proc/self/fd")) <= before  # the received duplicate was closed
        for bad in (float("nan"), -1, float("inf")):
            with pytest.raises(RendezvousError, match="timeout_s must be a finite number of seconds >= 0"):
                recv_fds(b, 1, timeout_s=bad)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_fds_dropped_on_receipt_name_both_causes_and_this_processs_limit():
    """MSG_CTRUNC was reported as "the peer sent more than N fd(s)"; the kernel also sets it when
    the receiver has no free fd to install them in (at its ``ulimit -n``), which it did not say."""
    out = run_python("-c", """
import os, resource, socket
from flashboot.errors import RendezvousError
from flashboot.fdshare import recv_fds
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
r, w = os.pipe()
socket.send_fds(a, [b"x"], [r, w])
try:
    recv_fds(b, 1, timeout_s=5)            # two sent, one taken
except RendezvousError as exc:
    print("more:", exc)
socket.send_fds(a, [b"x"], [r])
taken = 0
for fd in range(3, 64):                   # no free fd below the soft limit
    try:
        os.fstat(fd)
    except OSError:
        os.dup2(r, fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    recv_fds(b, 1, timeout_s=5)
except RendezvousError as exc:
    print("full:", exc)
""")
    more, full = out.splitlines()
    assert more.startswith("more: fds sent with a message were dropped and all closed: the peer sent more than 1, "
                           "or this process had no free fd for them"), more
    assert full.startswith("full: fds sent with a message were dropped") and "`ulimit -n` 64)" in full, full
