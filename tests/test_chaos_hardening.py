"""What a cluster does to FlashBoot's processes: they die or freeze at any moment (the OOM killer,
preemption, ``kill -9``, a node drain, a frozen cgroup). Each test kills or stops one process at a
named point (after a marker line, or from a hook) and checks the survivors: they end within their
timeout with an error naming the dead or frozen peer, the next load, hand-over or clone works, and
nothing is left behind."""

from __future__ import annotations

import os
import signal

import pytest

from flashboot.arena import Arena
from flashboot.errors import WaitTimeoutError
from flashboot.flashload import client
from flashboot.flashload import shm as shm_files

from _preload_helpers import daemon_process_of, make_tiny_image  # noqa: E402


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("chaos-image"))


def test_a_served_load_from_a_stopped_daemon_ends_past_its_timeout_naming_the_daemon(image, tmp_path):
    """A daemon frozen (SIGSTOP) with the load's request in its queue: the load's reply is allowed
    a copy's minute past its timeout, and had waited all of it; once its own timeout has passed it
    finds the daemon stopped and says so, naming its pid. Resumed, the daemon serves the next load."""
    src = shm_files.rank_source(image, 0)
    with daemon_process_of(image, tmp_path) as (proc, shm, _log):
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with Arena.create(src.nbytes, "cpu") as arena:
                with pytest.raises(WaitTimeoutError) as e:
                    client.served_load(arena, src, timeout_s=1, shm_dir=shm)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert f"pid {proc.pid}" in str(e.value) and "stopped" in str(e.value), str(e.value)
        with Arena.create(src.nbytes, "cpu") as arena:
            client.served_load(arena, src, timeout_s=10, shm_dir=shm)
            assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
