"""The preloader as a service: pid file, background start, stop, and the run loop."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..errors import (
    FlashBootError,
    WaitTimeoutError,
)
from ..service_loop import stop_on_signals
from ..units import check_timeout
from ..procfs import proc_start_time
from .server import PreloadServer, _describe_loads, _describe_stage
from .shm import (
    _read_pid_file,
    _running_pid,
    _same_file,
    _unlink_quietly,
    check_socket_path,
    StagingFolder,
    log_file,
    make_dir,
    not_shared_memory_warning,
    pid_file,
    remove_if_empty,
    service_status,
    socket_path,
    started_elsewhere,
)
from .staging import PreloadConfig, StageResult, preload


_HELD_PID_FILES: dict[str, int] = {}
"""The pid files this process claimed: path -> the fd holding its lock (closed at release)."""
_LOCK_WAIT_S = 10.0
"""How long a claim retries a lock held by no live preloader: a reader
(:func:`~flashboot.flashload.shm._pid_file_held`) holds it for microseconds, a starting preloader
until it writes its pid, and a killed one until the kernel has torn down its memory (seconds for
large pinned images); a live preloader's lock is refused at once."""


def _claim_pid_file(path: Path, serve: bool, ranks: list[int] | None = None, image_dir=None) -> str:
    """Write this process's pid file (with the ranks it stages, None: all of them, and the image
    folder as given and as it resolves now: :func:`~flashboot.flashload.shm.started_elsewhere`),
    holding its lock until :func:`_release_pid_file`; returns a note about a stale one it replaced.

    Raises FlashBootError when a live preloader holds it, or is starting and holds its lock."""
    make_dir(path.parent)
    reclaim = str(path) in _HELD_PID_FILES
    # in the folder as checked (ours, no link): a folder another user made first at the image's hash,
    # with a preload.pid symlink in it, had this truncate and write whatever file the link named
    with StagingFolder(path.parent) as folder:
        fd = _lock_pid_file(path, folder)
    try:
        running = _running_pid(path)  # a preloader of a version that took no lock
        if running and running != os.getpid():
            raise FlashBootError(f"a preloader already runs for this image (pid {running}, pid file {path}); "
                                 "stop it with --stop")
        d = _read_pid_file(path) if os.fstat(fd).st_size else None
        note = f"removed stale pid file {path} (pid {d.get('pid')} is gone)" if d and not reclaim else ""
        data = json.dumps({"pid": os.getpid(), "start_time": proc_start_time(os.getpid()), "serve": serve,
                           "ranks": None if ranks is None else sorted(ranks), "argv": sys.argv,
                           **({} if image_dir is None else {"image_dir": os.path.abspath(image_dir),
                                                            "real_image_dir": os.path.realpath(image_dir)})}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except BaseException:
        _HELD_PID_FILES.pop(str(path), None)
        os.close(fd)
        raise
    _HELD_PID_FILES[str(path)] = fd
    return note


def _lock_pid_file(path: Path, folder: StagingFolder) -> int:
    """An fd of ``path`` (created where absent, in ``folder``: its folder opened and checked, never
    through a link) holding its exclusive lock: the file at ``path`` now, not one a releasing
    preloader unlinked while this waited for its lock."""
    held = _HELD_PID_FILES.get(str(path))
    if held is not None:
        if _same_file(path, held):
            return held  # claimed again by this process: flock would refuse its own second fd
        os.close(_HELD_PID_FILES.pop(str(path)))
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        fd = folder.open(path.name, os.O_RDWR | os.O_CREAT, 0o644, regular=False)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            running = _running_pid(path)
            if not running and time.monotonic() < deadline:  # a reader's probe, or a preloader writing its pid
                time.sleep(0.01)
                continue
            who = f"pid {running}" if running else "starting or exiting: no live pid is written"
            raise FlashBootError(f"a preloader already runs for this image ({who}; pid file {path} is locked); "
                                 "stop it with --stop") from None
        if folder.same_file(path.name, fd):
            return fd
        os.close(fd)  # unlinked by its releasing owner as this locked it: lock the one there now


_STALE_LOCK_WAIT_S = 0.1
"""How long :func:`_remove_if_stale` retries a held lock: a reader's probe
(:func:`~flashboot.flashload.shm._pid_file_held`, ``preload --status``) holds it for
microseconds; an exiting preloader holds it for seconds, and its file is kept."""


def _lock_within(fd: int, wait_s: float, poll_s: float) -> bool:
    """Take ``fd``'s exclusive flock within ``wait_s``; whether it was taken."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def _remove_if_stale(path: Path) -> bool:
    """Remove the pid file at ``path`` when no preloader holds it (its lock free, its pid gone);
    returns whether it did. The check and the unlink happen under the lock, so a preloader
    starting meanwhile keeps its file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not _lock_within(fd, _STALE_LOCK_WAIT_S, 0.002):
            return False
        if not _same_file(path, fd) or _running_pid(path) is not None:
            return False
        _unlink_quietly(path)
        return True
    finally:
        os.close(fd)


def _release_pid_file(path: Path) -> None:
    fd = _HELD_PID_FILES.pop(str(path), None)
    try:
        d = _read_pid_file(path)
        if d and d.get("pid") == os.getpid():
            _unlink_quietly(path)  # still under the lock: a claim waiting for it then finds the file gone
    finally:
        if fd is not None:
            os.close(fd)


def start_background(config: PreloadConfig, *, timeout_s: float = 30.0, extra_argv: list[str] | None = None) -> int:
    """Start ``flashboot preload`` for ``config`` as a detached service; returns its pid.

    Waits (up to ``timeout_s``) until the service has claimed its pid file, and with
    ``config.serve`` until it answers on its socket; its output goes to the ``preload.log``
    beside it. Raises FlashBootError when one already runs, when the socket's path is too long
    (before starting anything), or with the log's tail when the service dies at start;
    WaitTimeoutError when it is not up within ``timeout_s`` (the service is stopped then).
    """
    # NaN: no deadline is ever reached (the wait never ended); before anything starts
    timeout_s = check_timeout(timeout_s, "start_background timeout_s")
    status = service_status(config.image_dir, config.shm_dir)
    if status.running:
        raise FlashBootError(f"a preloader already runs for {config.image_dir} (pid {status.pid}); stop it with --stop")
    sock = socket_path(config.image_dir, config.shm_dir)
    if config.serve:
        check_socket_path(sock)  # the service would only die of it, after this had reported it started
    log = log_file(config.image_dir, config.shm_dir)
    make_dir(log.parent)
    # The preload command's own entry point: the service needs no other command to import.
    argv = [sys.executable, "-m", "flashboot.commands.preload", *config_argv(config), *(extra_argv or []),
            "--", config.image_dir]  # after "--": a folder named "-x" is not read as an option
    with StagingFolder(log.parent) as folder:  # checked, no link: the log had been appended to any file a planted link named
        fd = folder.open(log.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with open(fd, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout_s
    waiting_for = f"claim {status.path}"
    try:
        while time.monotonic() < deadline:
            if _running_pid(status.path) == proc.pid:
                if not config.serve:
                    return proc.pid
                waiting_for = f"answer on {sock}"
                if _answers(config, sock, proc.pid, deadline):
                    return proc.pid
            code = proc.poll()
            if code is not None:
                if code == 0 and not config.serve:
                    return proc.pid  # it staged everything and exited already
                raise FlashBootError(f"background preloader exited with status {code} at start; the end of {log}: "
                                     + " | ".join(_tail(log).splitlines()))
            time.sleep(0.02)
    except BaseException:
        # Ctrl-C (or any error) in this wait: the child, in its own session, had stayed up with
        # its pid told to no one
        _stop_child(proc)
        raise
    _stop_child(proc)
    raise WaitTimeoutError(f"background preloader (pid {proc.pid}) did not {waiting_for} within {timeout_s:g} s, and "
                           f"was stopped (exit status {proc.returncode}); see {log}")


def _answers(config: PreloadConfig, sock: Path, pid: int, deadline: float) -> bool:
    """Whether daemon ``pid`` answers a status request on ``sock`` now (briefly: the caller retries)."""
    from .client import serve_status

    if not sock.exists():
        return False
    try:
        reply = serve_status(config.image_dir, config.shm_dir,
                             timeout_s=max(0.05, min(1.0, deadline - time.monotonic())))
    except FlashBootError:
        return False
    return reply.get("pid") == pid  # not a dead daemon's socket file


def _stop_child(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM (it then releases its pid file), SIGKILL after ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, nbytes: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-nbytes:].decode(errors="replace")


def config_argv(config: PreloadConfig) -> list[str]:
    """Command-line options that rebuild ``config`` (for the background service)."""
    argv = ["--threads", str(config.threads), "--io", config.io, "--chunk-bytes", str(config.chunk_bytes),
            "--numa-policy", config.numa_policy]
    if config.ranks is not None:
        argv += ["--ranks", *map(str, config.ranks)]
    if config.shm_dir:
        argv += ["--shm-dir", str(config.shm_dir)]
    for rank, dev in sorted(config.devices.items()):
        argv += ["--device", f"{rank}={dev}"]
    if config.verify:
        argv.append("--verify")
    if config.force:
        argv.append("--force")
    if config.serve:
        argv.append("--serve")
    if not config.pin:
        argv.append("--no-pin")
    if config.allow_group is not None:
        argv += ["--allow-group", str(config.allow_group)]
    return argv


CANCEL_WAIT_S = 15.0
"""How long ``preload --stop`` waits, once its timeout has run out and a second SIGTERM cancelled
the loads still in flight, for the daemon to exit: each copy looks at the cancel between pieces
(64 MiB on the host, 1 GB on CUDA), and the daemon's close then joins within ``CLOSE_TIMEOUT_S``."""


def stop_service(image_dir, shm_dir=None, *, timeout_s: float = 30.0,
                 log: Callable[[str], None] | None = None) -> str:
    """Stop the preloader of ``image_dir`` (SIGTERM, then wait); returns what happened.

    A served daemon takes no new request from the SIGTERM on, and finishes the loads in flight
    (an engine's rollout is not lost to a restart) within ``timeout_s``; ``log`` is told which
    it waits for. Past ``timeout_s`` a second SIGTERM cancels them (each engine is answered that
    the preloader was stopped) and the daemon is waited for :data:`CANCEL_WAIT_S` more. A daemon
    already stopping (its socket gone: another ``--stop``, a ``kill``) is not signalled again
    before the timeout: that would cancel the loads it finishes. A stale pid file (its process
    gone) is removed and reported. Raises WaitTimeoutError when the process does not exit.
    """
    from .client import _daemon_status

    timeout_s = check_timeout(timeout_s, "stop_service timeout_s")  # NaN: the waits below never ended
    status, moved = service_status(image_dir, shm_dir), ""
    if status.pid is None:
        elsewhere = started_elsewhere(image_dir, shm_dir)
        if len(elsewhere) != 1:
            return f"no preloader runs for {image_dir} (no pid file {status.path})" + "".join(
                f"; one started for it when it led to {real} runs (pid {st.pid}): stop it with `flashboot preload "
                f"{real} --stop`" for st, real in elsewhere)
        status, real = elsewhere[0]
        moved = f" (started for {image_dir} when it led to {real}; it leads to {os.path.realpath(image_dir)} now)"
    if status.stale:
        return _remove_stale(image_dir, status)
    deadline = time.monotonic() + timeout_s
    while status.running and status.pid is not None and status.pid <= 0:  # starting: its pid is written next
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(f"the preloader holding {status.path} did not write its pid within {timeout_s:g} s")
        time.sleep(0.02)
        status = service_status(image_dir, shm_dir, path=status.path)
    if status.pid is None:  # the starting one gave up and released its file
        return f"no preloader runs for {image_dir}: the one starting exited before writing its pid"
    if not status.running:
        return _remove_stale(image_dir, status)
    pid = status.pid
    start = proc_start_time(pid)
    sock = status.path.with_name(socket_path(image_dir, shm_dir).name)  # beside its pid file, wherever that is
    signalled = False

    def signal_it() -> bool:
        """SIGTERM (and SIGCONT); False when the process is gone."""
        try:
            os.kill(pid, signal.SIGTERM)
            # as systemd does: a stopped preloader (SIGSTOP, a frozen job) runs to take it, where
            # --stop had waited out its timeout and failed, the daemon stopped still, its memory kept
            os.kill(pid, signal.SIGCONT)
        except PermissionError:
            raise FlashBootError(f"not permitted to stop preloader pid {pid} (pid file {status.path}): another "
                                 "user's") from None
        except ProcessLookupError:
            return False
        return True

    def exited() -> bool:
        try:  # reap it if it is our child (tests start it from this process)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return proc_start_time(pid) != start

    with _one_stopper(status.path.parent, timeout_s):  # two --stop at once: the second finds it stopping
        # asked before the signal, after which it answers no more: what the wait below is for
        said = _daemon_status(sock) if status.serve and sock.exists() else {}
        loads = said.get("loads") if isinstance(said.get("loads"), list) else []
        # a served daemon without its socket is stopping already (a second SIGTERM would cancel its
        # loads in flight), or starting before it listens: signalled once its socket is there
        stopping = status.serve and (said.get("stopping") is True or not sock.exists())
        if stopping:
            with contextlib.suppress(OSError):  # one stopping but frozen (SIGSTOP) finishes nothing
                os.kill(pid, signal.SIGCONT)
        else:
            if not signal_it():
                return f"preloader pid {pid} exited on its own"
            signalled = True
            seen = time.monotonic() + _STOP_SEEN_S  # its socket goes at once, whatever it finishes
            while status.serve and sock.exists() and not exited() and time.monotonic() < seen:
                time.sleep(0.01)
    if log is not None and (loads or stopping):
        what = _describe_loads(loads) if loads else "it to finish what it has in flight"
        log(f"preloader pid {pid}{f' is stopping already (its socket {sock} is gone)' if stopping else ''}: waiting "
            f"up to {timeout_s:g} s for {what}; then {'they are' if len(loads) > 1 else 'it is'} cancelled")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exited():
            _remove_if_stale(status.path)  # it died without cleaning up (kept if a new one holds it)
            return f"stopped preloader pid {pid}{moved}"
        if not signalled and sock.exists():  # it was starting: it listens now
            if not signal_it():
                continue
            signalled = True
        time.sleep(0.02)
    if not status.serve:
        raise WaitTimeoutError(f"preloader pid {pid} did not exit within {timeout_s:g} s of SIGTERM")
    # the loads it still finishes are cancelled: each engine is answered that the preloader was stopped
    if log is not None:
        log(f"preloader pid {pid} has not exited within {timeout_s:g} s; cancelling what it has in flight")
    signal_it()  # its second (or, where one starting never listened, its first: nothing is in flight then)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        if exited():
            _remove_if_stale(status.path)
            return (f"stopped preloader pid {pid}{moved}; the loads it still had in flight after {timeout_s:g} s "
                    "were cancelled")
        time.sleep(0.02)
    raise WaitTimeoutError(f"preloader pid {pid} did not exit within {timeout_s:g} s of SIGTERM, nor "
                           f"{CANCEL_WAIT_S:g} s after a second SIGTERM cancelled its loads in flight")


_STOP_SEEN_S = 5.0
"""How long a ``--stop`` that signalled a served daemon keeps other ``--stop``s of it waiting for
its socket to go (:func:`_one_stopper`): its accept loop removes it within a poll of the SIGTERM."""


@contextlib.contextmanager
def _one_stopper(folder: Path, timeout_s: float):
    """Hold an exclusive flock on the preloader's staging folder (within ``timeout_s``) while a
    ``--stop`` looks whether the daemon is stopping already and signals it: two at once had
    both found it serving and both sent SIGTERM, the second cancelling the loads in flight
    that the first lets finish. Not held where the folder is gone or the wait runs out."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        _lock_within(fd, min(timeout_s, _STOP_SEEN_S + 1), 0.01)  # not held when the wait runs out
        yield
    finally:
        os.close(fd)


def _remove_stale(image_dir, status) -> str:
    """Remove a stale pid file (:func:`_remove_if_stale`); says what it found."""
    who = f"pid {status.pid} is gone" if status.pid > 0 else "the preloader exited before writing its pid"
    if _remove_if_stale(status.path):
        return f"no preloader runs for {image_dir}: removed stale pid file {status.path} ({who})"
    return (f"no preloader runs for {image_dir}: {who} (its pid file {status.path} is kept while its lock is held: "
            "the process is still exiting)")


def run_service(config: PreloadConfig, *, log: Callable[[str], None] = print,
                progress: Callable[[int, int, int], None] | None = None) -> list[StageResult] | None:
    """Run a preloader in this process: claim the pid file, stage (and with ``config.serve``,
    serve until SIGTERM), release the pid file. SIGTERM stops it cleanly: a staging copy in
    flight is abandoned and its partial file removed; a served daemon takes no new request and
    lets the loads in flight finish, which a second SIGTERM cancels. Returns the staging
    results (None when serving)."""
    path = pid_file(config.image_dir, config.shm_dir)
    note = _claim_pid_file(path, config.serve, config.ranks, config.image_dir)
    stop, cancel = threading.Event(), threading.Event()
    try:
        for line in (note, not_shared_memory_warning(config.shm_dir)):  # a log that fails still releases the pid file
            if line:
                log(line)
        with stop_on_signals(stop, (signal.SIGTERM,), again=cancel):
            if config.serve:
                PreloadServer(config, stop=stop, cancel=cancel, log=log).run(progress)
                return None
            try:
                results = preload(config, progress=progress, stop=stop, log=log)
            except FlashBootError as exc:
                if stop.is_set():  # set by SIGTERM alone: a stop, as the command line tells it (143), not a failure
                    raise KeyboardInterrupt("SIGTERM") from exc
                raise
        for r in results:
            log(_describe_stage(r))
        return results
    finally:
        _release_pid_file(path)
        remove_if_empty(path.parent)  # a preload that failed before staging anything leaves no folder

