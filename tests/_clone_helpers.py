"""Shared by the FlashClone tests: processes, images, waiting. Not a conftest (tests import it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

TOKEN = "flashclone-test-token-0123456789abcdef"
KiB, MiB = 1 << 10, 1 << 20
CHUNK = 256 * KiB
"""Below the host mover's 1 MiB parallel threshold: no numba compile in every child process."""


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def write_raw_image(path: Path, nbytes: int, seed: int) -> np.ndarray:
    data = pattern(nbytes, seed)
    path.write_bytes(data.tobytes())
    return data


def make_prepacked_image(root: Path) -> Path:
    """A small pre-packed image (7 tensors, ~3 MB) made by flashboot.prepack from safetensors."""
    import torch
    from safetensors.torch import save_file

    import flashboot

    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.w": torch.randn(256, 1024, generator=g).bfloat16() for i in range(6)}
    tensors["embed"] = torch.randn(100, 64, generator=g)
    save_file(tensors, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "tiny_bag", "_name_or_path": "org/tiny"}))
    flashboot.prepack(ckpt, root / "img", chunk_bytes=MiB, progress=False)
    return root / "img"


def env(token: str = TOKEN, **extra) -> dict:
    e = dict(os.environ)
    e["FLASHBOOT_TOKEN"] = token
    e.update({k: str(v) for k, v in extra.items()})
    return e


def spawn_cli(*args, token: str = TOKEN, **extra_env) -> subprocess.Popen:
    """``python -m flashboot.cli ARGS`` with the token in its environment."""
    return subprocess.Popen([sys.executable, "-m", "flashboot.cli", *map(str, args)], env=env(token, **extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def spawn_python(code: str, token: str = TOKEN, **extra_env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=env(token, **extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, timeout_s: float = 20) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process did not finish within {timeout_s} s:\n{out}\n{err}") from None
    return proc.returncode, out, err


def stop(proc: subprocess.Popen) -> None:
    """End a process this test started (SIGCONT first, in case it was stopped)."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        except ProcessLookupError:
            pass
    proc.communicate()


def arena_maps(arena_id: str = "") -> list[str]:
    """This process's mappings of FlashBoot host arenas (of ``arena_id`` when given)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f"flashboot-arena-{arena_id}" in line]


def arena_fds(arena_id: str = "") -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if f"flashboot-arena-{arena_id}" in target:
            out.append(target)
    return out


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    """Every clone test runs with the shared token set, as a deployment would."""
    monkeypatch.setenv("FLASHBOOT_TOKEN", TOKEN)


@pytest.fixture
def store():
    """A store hosted by the test process (it outlives any seed a test kills)."""
    from flashboot.flashclone.rendezvous import Rendezvous, free_port

    address = f"127.0.0.1:{free_port()}"
    rdv = Rendezvous.connect(address, TOKEN, host=True, timeout_s=20)
    yield address, rdv
    rdv.close()


@contextlib.contextmanager
def store_in_its_own_process(sleep_s: float = 300, address: str | None = None):
    """A store hosted by a process of its own, which a test may stop (:func:`stop_process`: a store
    whose host stops answering, as behind a cut link) or kill; yields ``(address, process)``.
    ``address``: host it there (a store restarted where one was killed), else on a free port."""
    from flashboot.flashclone.rendezvous import free_port

    for _ in range(1 if address else 3):  # the port may be taken between free_port and the bind
        address = address if address else f"127.0.0.1:{free_port()}"
        code = ("import time\nfrom flashboot.flashclone.rendezvous import Rendezvous\n"
                f"r = Rendezvous.connect({address!r}, {TOKEN!r}, host=True, timeout_s=20)\n"
                f"print('ready', r.is_server, flush=True)\ntime.sleep({sleep_s})\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if line.split() == ["ready", "True"]:  # the stopped process must be the store, not a client of one
            break
        proc.kill()
        proc.communicate()
    try:
        assert line.split() == ["ready", "True"], f"no free port to host a store on: {line!r}"
        yield address, proc
    finally:
        stop(proc)  # also one the test killed already


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until /proc says it is stopped (a signal lands asynchronously)."""
    from flashboot.procfs import STOPPED, process_state

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process_state(pid) not in STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def close_endpoints(eps) -> None:
    """Close every participant's flags and arena an executor test made (those still open)."""
    for ep in eps.values():
        for a in (ep.flags, ep.arena):
            if a is not None and not a.closed:
                a.close()


@contextlib.contextmanager
def serving_holder(holder):
    """``holder`` serving in a thread for the block; stopped and joined after it."""
    stop_ev = threading.Event()
    t = threading.Thread(target=holder.serve_forever, args=(stop_ev,), kwargs={"handle_signals": False})
    t.start()
    try:
        yield t
    finally:
        stop_ev.set()
        t.join(10)


def serve_in_thread(seed) -> tuple[threading.Thread, list]:
    """``seed`` serving in a started thread, and the list that receives what its serve loop raised."""
    errors: list = []

    def serve():
        try:
            seed.serve_forever(handle_signals=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    return t, errors


def fake_clone(monkeypatch, schedule: str) -> dict:
    """``flashboot clone`` that clones nothing: its report (as ``to_dict()`` gives it) is returned,
    and its summary reads ``"{schedule} #1 on cpu: 4,096 bytes"``. For tests of how the command
    line hands a report on, not of the clone."""
    import flashboot.flashclone as flashclone

    summary = f"{schedule} #1 on cpu: 4,096 bytes"
    as_dict = {"schedule": schedule, "position": 1, "nbytes": 4096}

    class Report:
        def summary(self):
            return summary

        def to_dict(self):
            return dict(as_dict)

    class Result:
        report = Report()

        def close(self):
            pass

    monkeypatch.setattr(flashclone, "prepare_clone", lambda *a, **k: None)
    monkeypatch.setattr(flashclone, "clone", lambda *a, **k: Result())
    monkeypatch.setattr(flashclone, "linger", lambda *a, **k: None)
    return as_dict


# Scripts of the processes in the network-namespace tests (a host each): argv as each says.
STORE_SCRIPT = """
import sys, time
from flashboot.flashclone.rendezvous import Rendezvous
r = Rendezvous.connect(sys.argv[1], host=True, timeout_s=30)
print("ready", flush=True)
time.sleep(600)
"""
"""``ADDRESS``: a store hosted at ADDRESS, kept for 10 minutes."""

SEED_SCRIPT = """
import sys, numpy as np, flashboot
from flashboot.arena import Arena
a = Arena.create(int(sys.argv[2]), "cpu")
a.bytes().numpy()[:] = np.random.default_rng(int(sys.argv[3])).integers(0, 256, a.nbytes, dtype=np.uint8)
broadcast = len(sys.argv) > 4  # a seed that answers broadcasts (gloo here) instead of NIXL READs
s = flashboot.seed(sys.argv[1], a, nixl=not broadcast, serve_nccl=broadcast,
                   timeout_s=float(sys.argv[4]) if broadcast else 30)
print("ready", flush=True)
s.serve_forever()
"""
"""``ADDRESS NBYTES SEED [BROADCAST_TIMEOUT_S]``: a seed of NBYTES random bytes (SEED), serving NIXL
reads, or with a fourth argument broadcasts (gloo here) with that timeout."""
