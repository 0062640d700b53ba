"""A long-lived process stops on SIGTERM/SIGINT whatever its main thread is doing
(service_loop.stop_on_signals, used by the store, seeds, holders, clones and the preloader)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from flashboot.service_loop import serve_until_stopped, stop_on_signals

pytestmark = pytest.mark.timeout(60)

# The main thread spins on stop.wait(0), so most of its bytecodes run holding the Event's own
# lock. A handler that calls stop.set() then waits for that lock forever: before the fix this
# child hung on the first signal, every time.
_SPINNING_CHILD = r"""
import os, signal, sys, threading, time
from flashboot.service_loop import stop_on_signals
stop = threading.Event()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a second thread, as a store has
with stop_on_signals(stop, (signal.SIGUSR1,)):
    os.write(1, b"r")
    while True:
        while not stop.wait(0):
            pass
        stop.clear()
        os.write(1, b"x")
"""


def _read_byte(fd: int, timeout_s: float) -> bytes:
    if not select.select([fd], [], [], timeout_s)[0]:
        return b""
    return os.read(fd, 1)


def test_a_signal_stops_a_main_thread_that_holds_the_events_lock():
    proc = subprocess.Popen([sys.executable, "-c", _SPINNING_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        fd = proc.stdout.fileno()
        assert _read_byte(fd, 30) == b"r", proc.stderr.read().decode()
        for i in range(200):
            os.kill(proc.pid, signal.SIGUSR1)
            assert _read_byte(fd, 5) == b"x", f"signal {i + 1} of 200 did not set the event within 5 s"
    finally:
        proc.kill()
        proc.wait()


def test_the_previous_handlers_and_wakeup_fd_come_back_and_other_signals_do_not_stop():
    before = signal.getsignal(signal.SIGUSR1)
    before_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before_fd)
    other = []
    previous_other = signal.signal(signal.SIGUSR2, lambda *_: other.append(1))
    stop = threading.Event()
    try:
        with stop_on_signals(stop, (signal.SIGUSR1,)):
            assert signal.getsignal(signal.SIGUSR1) is not before
            os.kill(os.getpid(), signal.SIGUSR2)  # has its own handler, and is not a stop signal
            time.sleep(0.2)
            assert other == [1] and not stop.is_set()
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.wait(5)
        assert signal.getsignal(signal.SIGUSR1) is before
        after_fd = signal.set_wakeup_fd(before_fd)
        assert after_fd == before_fd  # ours was taken back
        assert not [t for t in threading.enumerate() if t.name == "flashboot-stop-signals"]
    finally:
        signal.signal(signal.SIGUSR2, previous_other)


def test_outside_the_main_thread_it_installs_nothing():
    seen = {}

    def worker():
        with stop_on_signals(threading.Event(), (signal.SIGUSR1,)):
            seen["handler"] = signal.getsignal(signal.SIGUSR1)

    before = signal.getsignal(signal.SIGUSR1)
    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert seen["handler"] is before


def test_serve_until_stopped_ends_on_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    ticks = []
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    t0 = time.monotonic()
    serve_until_stopped(threading.Event(), None, handle_signals=True, tick=lambda: ticks.append(1), period_s=0.05)
    assert time.monotonic() - t0 < 10 and ticks
    assert signal.getsignal(signal.SIGTERM) is before
    timer.join()


@pytest.mark.parametrize("command", ["store", "hold", "seed", "clone"])
def test_sigterm_the_moment_ready_is_said_stops_the_service_cleanly(command, tmp_path, monkeypatch, capsys):
    """A supervisor signals as soon as it reads the ready line. The signal lands here inside that
    line's own print: before the fix the CLI's interrupt handler was still in place, and the
    command ended with 143, "interrupted before it finished", its service never closed."""
    from _clone_helpers import TOKEN, make_prepacked_image

    from flashboot.cli import main
    from flashboot.commands import clone as clone_command, store as store_command
    from flashboot.flashclone.rendezvous import free_port

    monkeypatch.setenv("FLASHBOOT_TOKEN", TOKEN)
    module = store_command if command == "store" else clone_command
    say = module._print

    def say_then_signal(text: str) -> None:
        say(text)
        if text.startswith(("store listening", "seed ready", "holder ready", "serving as a source")):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(module, "_print", say_then_signal)
    address = f"127.0.0.1:{free_port()}"
    image = str(make_prepacked_image(tmp_path / "image")) if command in ("seed", "clone") else None
    argv = {"store": ["store", address],
            "hold": ["hold", "--registry", str(tmp_path / "held")],
            "seed": ["seed", str(image), "--device", "cpu", "--store", address]}
    argv["clone"] = ["clone", "--store", address, "--device", "cpu", "--serve", "--timeout", "20"]
    before = signal.getsignal(signal.SIGTERM)
    if command == "clone":  # `clone --serve`: it serves as a source once cloned (no line after the stop)
        import flashboot

        with flashboot.seed(address, image, "cpu"):
            assert main(argv[command]) == 0
    else:
        assert main(argv[command]) == 0
    out, err = capsys.readouterr()
    stopped = {"hold": "holder stopped", "clone": "serving as a source until SIGTERM"}.get(command, command + " stopped")
    assert out.splitlines()[-1] == stopped, (out, err)
    assert "interrupted" not in err, err
    assert signal.getsignal(signal.SIGTERM) is before
    if command in ("store", "seed"):  # the store the command hosted is closed: its port takes a new listener
        from flashboot.flashclone.store import StoreServer

        StoreServer(address).close()
