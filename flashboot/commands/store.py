"""``flashboot store HOST:PORT``: host the rendezvous store in a process of its own."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from flashboot.units import timeout_arg


def register(subparsers) -> None:
    p = subparsers.add_parser("store", help="host the rendezvous store for seeds and clones; runs until stopped")
    p.add_argument("address", metavar="HOST:PORT", help="where to listen (port 0: the kernel picks one)")
    p.add_argument("--background", action="store_true",
                   help="detach: print where it listens and its pid, then return (stop it with SIGTERM)")
    p.add_argument("--timeout", type=timeout_arg, default=60.0, metavar="S",
                   help="--background: how long to wait for it to listen (default 60 s)")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_store)


def _print(text: str) -> None:
    print(text, flush=True)


def run_store(args: argparse.Namespace) -> int:
    if args.background:
        return _start_in_background(args.address, args.timeout)
    from flashboot.flashclone.store import StoreServer
    from flashboot.service_loop import announce_and_serve

    server = StoreServer(args.address)

    def announce() -> None:
        _print(f"store listening at {server.address} (pid {server.pid}); seeds and clones join it with "
               f"--store {server.address}; serving until SIGTERM")
        if args.ready_fd is not None:  # the parent of --background waits for this line, then returns
            os.write(args.ready_fd, f"{server.address}\n".encode())
            os.close(args.ready_fd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):  # the parent has returned: nobody reads our output any more
                os.dup2(devnull, fd)
            os.close(devnull)

    announce_and_serve(server, announce)
    _print("store stopped")
    return 0


def _start_in_background(address: str, timeout_s: float) -> int:
    from flashboot.errors import RendezvousError, WaitTimeoutError
    from flashboot.fdshare import readable

    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "flashboot.cli", "store", address, "--ready-fd", str(write_fd)],
                                pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    finally:
        os.close(write_fd)
    try:
        line = b""
        deadline = time.monotonic() + timeout_s
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait()
                raise WaitTimeoutError(f"the store for {address} did not listen within {timeout_s:g} s")
            if readable([read_fd], left):
                chunk = os.read(read_fd, 256)
                if not chunk:  # it exited before listening: say why
                    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
                    proc.wait()
                    raise RendezvousError(f"the store for {address} exited ({proc.returncode}) before listening: "
                                          f"{err[-1].removeprefix('flashboot store: error: ') if err else 'no message'}")
                line += chunk
    except BaseException:
        # Ctrl-C (or any failure) before it listened: the store runs detached, in its own session, and
        # had stayed up with no one told its pid
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    finally:
        os.close(read_fd)
    proc.stderr.close()  # it sent its output to /dev/null before writing the ready line
    where = line.decode().strip()
    _print(f"store listening at {where} (pid {proc.pid}, in the background); seeds and clones join it with "
           f"--store {where}; stop it with `kill -TERM {proc.pid}`")
    return 0
