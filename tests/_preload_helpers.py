"""Shared by the preloader service and fault tests: a served-load daemon in a thread of the test
process (so a test can count its fds and threads) and the bytes of a staged rank. Not a conftest
(tests import it)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import flashboot
from flashboot.arena import Arena
from flashboot.benchmarks.checkpoints import CheckpointSpec, make_checkpoint
from flashboot.errors import FlashBootError
from flashboot.flashload import client, staging
from flashboot.flashload import shm as shm_files
from flashboot.flashload.server import PreloadServer

TINY = CheckpointSpec("tiny", layers=2, experts=4, expert_rows=64, expert_cols=32, hidden=32, vocab=64, shards=2)


def make_image(root: Path, spec: CheckpointSpec, **prepack_options) -> Path:
    """``spec``'s checkpoint made under ``root`` and pre-packed to ``root / "image"``."""
    make_checkpoint(str(root / "ckpt"), spec, device="cpu")
    flashboot.prepack(str(root / "ckpt"), str(root / "image"), progress=False, **prepack_options)
    return root / "image"


def make_tiny_image(root: Path) -> Path:
    """The tiny MoE checkpoint pre-packed with 4 KiB checksum chunks (~127 KB, ~31 chunks)."""
    return make_image(root, TINY, chunk_bytes=4096)


def enospc_after(nbytes: int):
    """A stand-in for ``stage_copy._pwrite`` that writes ``nbytes`` and then finds the filesystem full."""
    written = [0]

    def pwrite(fd, data, off):
        if written[0] >= nbytes:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = staging.os.pwrite(fd, data, off)
        written[0] += n
        return n

    return pwrite


class Daemon:
    """A PreloadServer serving in a thread of this process, and its log."""

    def __init__(self, image, shm, *, staged: bool = True, **config):
        """``staged``: wait until rank 0 is resident and fail unless it is; False: return once
        the socket listens, whatever staging does."""
        self.log: list[str] = []
        cfg = staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True, **config)
        self.server = PreloadServer(cfg, log=self.log.append)
        self.server.request_timeout_s = 1.0
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.path = self.server.sock_path
        self.image, self.shm = image, shm
        deadline = time.monotonic() + 30
        while not staged and not self.path.exists():
            assert time.monotonic() < deadline and self.thread.is_alive(), self.log
            time.sleep(0.005)
        if not staged:
            return
        assert self.server.residents[0].event.wait(60), self.log
        assert self.server.residents[0].error is None, self.log
        while not any("serving" in line for line in self.log):
            assert time.monotonic() < deadline, self.log
            time.sleep(0.01)

    def idle(self, timeout_s: float = 20) -> None:
        """Wait until no connection is being handled."""
        deadline = time.monotonic() + timeout_s
        while any(t.is_alive() for t in self.server._threads):
            assert time.monotonic() < deadline, "a connection handler never finished"
            time.sleep(0.01)

    def load_exact(self) -> dict:
        """One served load into a fresh arena of this process, checked byte for byte."""
        src = shm_files.rank_source(self.image, 0)
        with Arena.create(src.nbytes, "cpu") as arena:
            reply = client.served_load(arena, src, timeout_s=10, shm_dir=self.shm)
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
        return reply

    def close(self) -> None:
        self.server.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def fds_after_settling(want: set[str], timeout_s: float = 10) -> set[str]:
    """This process's fds once the daemon has caught up: a connection the test closed may still sit
    in the listener's backlog when no handler runs (CI saw its fd an instant later). A leak never settles."""
    deadline = time.monotonic() + timeout_s
    while (got := open_fds()) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def daemon_process_of(image, tmp_path):
    """``flashboot preload IMAGE --serve`` in its own process, once it holds rank 0: ``(proc, shm, log path)``."""
    shm = tmp_path / "shm"
    log = open(tmp_path / "daemon.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "flashboot.cli", "preload", str(image), "--serve", "--shm-dir", str(shm)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            try:
                if client.serve_status(image, shm, timeout_s=5)["ranks"]["0"]["state"] in ("mapped", "pinned"):
                    break
            except FlashBootError:
                pass  # not listening yet: asked again until the deadline above
            time.sleep(0.05)
        yield proc, shm, tmp_path / "daemon.log"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
