"""Passing file descriptors between processes on one host.

Two transports, both used to hand an arena's shareable handle (a CUDA POSIX-fd handle or a memfd)
to another process:

* :func:`pidfd_getfd`: the importer takes the fd straight out of the exporter with
  ``pidfd_open`` + ``pidfd_getfd`` (Linux >= 5.6). Only ``(pid, fd number)`` has to cross the
  rendezvous (a TCP store), which is what makes a one-round-trip exchange possible.
* :func:`send_fd` / :func:`recv_fd` (and the plural forms): ``SCM_RIGHTS`` over a Unix socket, for
  hosts where ``pidfd_getfd`` is not permitted (it needs ptrace rights over the exporter).

Errors are :class:`flashboot.RendezvousError` naming the pid, fd and errno, or
:class:`flashboot.WaitTimeoutError` when a receive runs past its timeout.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import resource
import select
import socket
import threading
import time

from .errors import RendezvousError, WaitTimeoutError
from .gil_time import gil_free
from .procfs import STOPPED, process_state
from .units import limit_text

SYS_PIDFD_GETFD = 438
"""``pidfd_getfd`` in the unified syscall table (x86_64 and aarch64 alike); Python has no wrapper."""


@functools.cache
def _libc() -> ctypes.PyDLL:
    # PyDLL: the call keeps the GIL. A pidfd_getfd takes microseconds, and a thread that gives the
    # GIL away for each of an arena's 52 fds waits to get it back behind any GIL-bound thread
    # (an engine's start-up, a warm-up's imports): up to a switch interval (5 ms) per fd.
    libc = ctypes.PyDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def pidfd_getfd(pid: int, fd: int) -> int:
    """Duplicate file descriptor ``fd`` of process ``pid`` into this process; returns the new fd.

    The new fd is close-on-exec and owned by the caller. Raises RendezvousError when the process
    has exited (ESRCH), has no such fd (EBADF), or the caller may not take it (EPERM).
    """
    return take_fds(pid, [fd])[0]


def _pidfd_open(pid: int, fds) -> int:
    if not isinstance(pid, int) or pid <= 0 or not all(isinstance(fd, int) and fd >= 0 for fd in fds):
        raise RendezvousError(f"pidfd_getfd needs a positive pid and non-negative fds, got pid {pid!r}, "
                              f"fds {list(fds)!r}")
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise RendezvousError(f"process {pid} has exited (pidfd_open: ESRCH); {_fds_gone(fds)}") from None
    except OSError as exc:
        raise RendezvousError(f"pidfd_open({pid}) failed: {errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror})") from None


def _fds_gone(fds) -> str:
    if len(fds) == 1:
        return f"the fd {fds[0]} it shared is gone"
    return f"the {len(fds)} fds it shared ({fds[0]}..{fds[-1]}) are gone"


def _getfd_message(pid: int, fd: int, err: int) -> str:
    name = errno.errorcode.get(err, str(err))
    if err == errno.EBADF:
        return f"process {pid} has no open fd {fd} (pidfd_getfd: EBADF)"
    if err == errno.ESRCH:
        return f"process {pid} has exited (pidfd_getfd: ESRCH); its fd {fd} is gone"
    if err == errno.EPERM:
        return (
            f"not permitted to take fd {fd} from process {pid} (pidfd_getfd: EPERM): it needs the same user "
            "and ptrace rights over the exporter (Yama ptrace_scope); pass the fd over a Unix socket with "
            "flashboot.fdshare.send_fd/recv_fd instead"
        )
    if err == errno.ENOSYS:
        return "this kernel has no pidfd_getfd (Linux >= 5.6 is needed); use flashboot.fdshare.send_fd/recv_fd"
    return f"pidfd_getfd(pid {pid}, fd {fd}) failed: {name} ({os.strerror(err)})"


def take_fds(pid: int, fds: "list[int] | tuple[int, ...]") -> list[int]:
    """:func:`pidfd_getfd` for each of ``fds`` of process ``pid`` (this process included), through
    one pidfd, holding the GIL (see :func:`_libc`); on a failure the fds already taken are closed
    and the RendezvousError raised. Callers make room in the fd table first (an arena's
    ``_make_fd_room``, a daemon's or holder's :func:`grow_fd_table` at start), so no take waits
    for the kernel to grow it while holding the GIL."""
    fds = list(fds)
    if not fds:
        return []
    pidfd = _pidfd_open(pid, fds)
    own: list[int] = []
    getfd, syscall = ctypes.c_long(SYS_PIDFD_GETFD), _libc().syscall
    try:
        for fd in fds:
            new_fd = syscall(getfd, ctypes.c_long(pidfd), ctypes.c_long(fd), ctypes.c_long(0))
            if new_fd < 0:
                raise RendezvousError(_getfd_message(pid, fd, ctypes.get_errno()))
            own.append(int(new_fd))
    except BaseException:
        for fd in own:
            os.close(fd)
        raise
    finally:
        os.close(pidfd)
    return own


FD_TABLE_ROOM = 1024
"""Fds :func:`grow_fd_table` makes room for by default: one per segment of the arenas a process
takes at once (a 140 GB arena is 522 segments of 256 MiB), with room to spare. The table costs 8
bytes a slot."""


def grow_fd_table(count: int = FD_TABLE_ROOM, *, highest: int | None = None) -> int:
    """Grow this process's fd table now so that ``count`` more fds than its highest open one fit;
    returns the table's slots (at least that many). To be called early, off the critical path.

    Why: the kernel doubles the table when an fd past its end is opened, and in a process with
    threads (every CUDA process) each doubling waits for an RCU grace period: 8-21 ms measured on
    a 2-core host at the 256th fd, paid by whichever call took the fd that crossed (an arena's
    import of 52 segment fds, a daemon's first hand-over). The table never shrinks, so this is
    paid once per process. Bounded by the soft open-file limit (the table never needs to be
    larger); raising that limit is :func:`~flashboot.arena.segments._make_fd_room`'s job. Best
    effort: where the kernel refuses (no fd left under the limit), the table grows when the fds
    arrive, as without this call, and the slots known to exist are returned (0 where not even the
    open fds could be listed). ``highest``: the highest open fd, where the caller has just listed
    them (otherwise they are listed here).
    """
    if not isinstance(count, int) or count < 0:
        raise RendezvousError(f"grow_fd_table needs a non-negative fd count, got {count!r}")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if highest is None:
        try:
            highest = max((int(name) for name in os.listdir("/proc/self/fd")), default=2)
        except OSError:  # no fd left to list them with: the caller's own open fails next, naming it
            return 0
    target = highest + count
    if soft != resource.RLIM_INFINITY:
        target = min(target, soft - 1)
    try:
        base = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no fd left at all: the caller's own open fails next, naming it
        return highest + 1
    try:
        if target <= base:
            return base + 1
        # F_DUPFD takes the lowest free fd >= target: it never replaces an open one (dup2 would)
        os.close(fcntl.fcntl(base, fcntl.F_DUPFD_CLOEXEC, target))
    except OSError:
        return highest + 1
    finally:
        os.close(base)
    return target + 1


SCM_MAX_FD = 253
"""Most fds Linux carries in one ``SCM_RIGHTS`` message; :func:`send_fds` sends more in batches."""


def send_fds(sock: socket.socket, fds: list[int], message: bytes = b"") -> None:
    """Send ``fds`` (SCM_RIGHTS) and a short ``message`` over the connected Unix socket ``sock``.

    More than :data:`SCM_MAX_FD` fds go in several messages, the first carrying ``message``; the
    receiver collects them with :func:`recv_fds` and then :func:`recv_more_fds`. The sender keeps
    its fds open; the receiver gets duplicates.
    """
    if not fds:
        raise RendezvousError("send_fds needs at least one fd")
    fds = list(fds)
    for i in range(0, len(fds), SCM_MAX_FD):
        # An empty payload would read as end-of-stream on the other side.
        with gil_free(driver=False):
            socket.send_fds(sock, [(message or b"\0") if i == 0 else b"\0"], fds[i:i + SCM_MAX_FD])


def recv_fds(sock: socket.socket, max_fds: int = 1, *, timeout_s: float = 30.0,
             bufsize: int = 65536) -> tuple[list[int], bytes]:
    """Receive up to ``max_fds`` fds and the message sent with them; the caller owns the fds.

    Raises WaitTimeoutError after ``timeout_s`` seconds, RendezvousError when the peer closes the
    socket first or sends more fds than ``max_fds`` (the extra ones are closed).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < float("inf"):
        raise RendezvousError(f"recv_fds timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}")
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        msg, fds, flags, _ = socket.recv_fds(sock, bufsize, max_fds)
    except (socket.timeout, BlockingIOError):  # BlockingIOError: nothing queued for a timeout of 0
        raise WaitTimeoutError(f"no fd arrived on the Unix socket within {timeout_s:g} s") from None
    finally:
        sock.settimeout(previous)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        # the kernel also truncates when this process has no free fd to install them in
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise RendezvousError(f"fds sent with a message were dropped and all closed: the peer sent more than "
                              f"{max_fds}, or this process had no free fd for them (`ulimit -n` {limit_text(soft)})")
    if fds and flags & socket.MSG_TRUNC:  # the rest of the message is gone: refused, not read as a shorter one
        for fd in fds:
            os.close(fd)
        raise RendezvousError(f"a message of more than {bufsize:,} bytes arrived with {len(fds)} fd(s); it was cut "
                              "short, so it and its fds were refused")
    if not fds:
        if not msg:
            raise RendezvousError("the peer closed the Unix socket before sending an fd")
        size = f"more than {len(msg)}" if flags & socket.MSG_TRUNC else f"{len(msg)}"  # a batch reads 1 byte
        raise RendezvousError(f"a message of {size} byte(s) arrived without an fd")
    return list(fds), (b"" if msg == b"\0" else msg)


def recv_more_fds(sock: socket.socket, have: list[int], count: int, *, timeout_s: float = 30.0) -> list[int]:
    """Receive the batches :func:`send_fds` sent after the first until ``have`` holds ``count``
    fds; returns ``have`` (the caller owns every fd in it, also when this raises)."""
    return FdStream(sock, have, count, timeout_s=timeout_s, what="the fds sent in batches").receive_all()


class FdStream:
    """The fds of a hand-over whose sender sends them in batches after its first message (each
    batch as :func:`send_fds` sends more than :data:`SCM_MAX_FD`), taken from the socket in order
    as they are asked for: ``stream[i]`` blocks until fd ``i`` has arrived, at most ``timeout_s``
    per batch and ``within_s`` for them all (None: no bound; :meth:`due_within` restarts that
    clock); it stops waiting once ``stop`` is set, or once the process ``sender_pid`` has been
    stopped (SIGSTOP, a debugger, a frozen cgroup) for :data:`SENDER_STOPPED_S`: a receiver holding
    a shared resource meanwhile (the daemon: the device's copy lock) then keeps it no longer for a
    sender that cannot send. ``len()`` is the count announced; :attr:`received` the fds that
    arrived so far, which the caller owns (and closes, also when a receive raised). ``what`` names
    the hand-over in errors."""

    STOP_POLL_S = 0.2
    """How often a wait looks at ``stop`` and at the sender's state."""

    SENDER_STOPPED_S = 1.0
    """How long a stopped sender is waited for before the hand-over is broken off."""

    def __init__(self, sock: socket.socket, first: list[int], count: int, *, timeout_s: float, what: str,
                 within_s: float | None = None, stop: threading.Event | None = None,
                 sender_pid: int | None = None):
        self.sock, self.count, self.timeout_s, self.what = sock, count, timeout_s, what
        self.received = first
        self.stop = stop
        self.sender_pid = sender_pid
        self._sender_stopped_at: float | None = None
        self.deadline: float | None = None
        self._began = time.monotonic()
        if within_s is not None:
            self.due_within(within_s)

    def due_within(self, seconds: float) -> None:
        """Every fd still to come is due within ``seconds`` from now."""
        self._began = time.monotonic()
        self.deadline = self._began + seconds

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(f"{self.what}: fd {i} of {self.count}")
        while len(self.received) <= i:
            self.received.extend(self._next_batch())
        return self.received[i]

    def _next_batch(self) -> list[int]:
        batch_due = time.monotonic() + self.timeout_s
        while True:
            if self.stop is not None and self.stop.is_set():
                raise RendezvousError(f"{self.what}: broken off after {len(self.received)} of {self.count} fds: the "
                                      "receiver is stopping")
            now = time.monotonic()
            due = batch_due if self.deadline is None else min(batch_due, self.deadline)
            if now >= due:
                wait_s = 0.0  # past a deadline, fds queued already are still taken: the sender was in time
            elif self.stop is None and self.sender_pid is None:
                wait_s = due - now
            else:
                wait_s = min(due - now, self.STOP_POLL_S)
            try:
                return self._recv(wait_s)
            except WaitTimeoutError:
                pass
            self._raise_if_sender_stopped(time.monotonic())  # only a wait that found nothing asks /proc
            if now < due:
                continue  # the deadlines and stop are looked at again above
            if due == batch_due:
                raise WaitTimeoutError(f"{self.what}: {len(self.received)} of {self.count} fds arrived, then none "
                                       f"within {self.timeout_s:g} s")
            # a sender trickling fds just within the per-batch timeout held the receiver without end
            raise WaitTimeoutError(f"{self.what}: {len(self.received)} of {self.count} fds arrived in "
                                   f"{now - self._began:.1f} s; the whole hand-over is due within "
                                   f"{self.deadline - self._began:.1f} s")

    def _raise_if_sender_stopped(self, now: float) -> None:
        if self.sender_pid is None:
            return
        state = process_state(self.sender_pid)
        if state not in STOPPED:
            self._sender_stopped_at = None
            return
        if self._sender_stopped_at is None:
            self._sender_stopped_at = now
        elif now - self._sender_stopped_at >= self.SENDER_STOPPED_S:
            raise RendezvousError(f"{self.what}: broken off after {len(self.received)} of {self.count} fds: the "
                                  f"sender (pid {self.sender_pid}) has been stopped (process state {state}: "
                                  f"SIGSTOP, a debugger or a frozen cgroup) for {self.SENDER_STOPPED_S:g} s")

    def _recv(self, wait_s: float) -> list[int]:
        """The next batch within ``wait_s`` (0: only one queued already); WaitTimeoutError otherwise."""
        try:
            return recv_fds(self.sock, min(SCM_MAX_FD, self.count - len(self.received)), timeout_s=wait_s,
                            bufsize=1)[0]
        except RendezvousError as exc:
            raise RendezvousError(f"{self.what}: {len(self.received)} of {self.count} fds arrived, then: "
                                  f"{exc}") from None

    DRAIN_S = 1.0
    """How long :meth:`drain` waits for fds still in flight, beyond those queued already."""

    def drain(self, within_s: float | None = None) -> None:
        """Take the fds still to come, ignoring a sender that stopped sending: a Unix socket closed
        with messages unread resets the connection, and an answer sent just before is lost. Takes
        every fd queued already, and waits at most ``within_s`` (:data:`DRAIN_S`) for more,
        whatever the hand-over's deadline and ``stop`` say (both may be why it is drained)."""
        until = time.monotonic() + (self.DRAIN_S if within_s is None else within_s)
        try:
            while len(self.received) < self.count:
                self.received.extend(self._recv(max(0.0, until - time.monotonic())))
        except (RendezvousError, WaitTimeoutError, OSError):
            pass

    def receive_all(self) -> list[int]:
        """Every fd (waits for those still to come); returns :attr:`received`."""
        if self.count:
            self[self.count - 1]
        return self.received


def readable(fds, timeout_s: float | None) -> list[int]:
    """Those of ``fds`` that are readable (or hung up) within ``timeout_s`` (0: now; None: no
    bound), waited for in ``poll`` with the GIL released. Not ``select``: it refuses fd numbers
    past 1,024, which an engine's process reaches (arena exports, NCCL, the engine's own)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(None if timeout_s is None else max(0.0, timeout_s) * 1e3)]


def send_fd(sock: socket.socket, fd: int, message: bytes = b"") -> None:
    """Send one fd and a short message over a connected Unix socket (see :func:`send_fds`)."""
    send_fds(sock, [fd], message)


def recv_fd(sock: socket.socket, *, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """Receive one fd and its message; the caller owns (and must close) the fd."""
    fds, msg = recv_fds(sock, 1, timeout_s=timeout_s)
    return fds[0], msg


__all__ = ["pidfd_getfd", "readable", "take_fds", "grow_fd_table", "FD_TABLE_ROOM", "FdStream", "send_fd", "recv_fd", "send_fds", "recv_fds", "recv_more_fds", "SCM_MAX_FD", "SYS_PIDFD_GETFD"]
