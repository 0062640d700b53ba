"""The rendezvous store in a process of its own (``flashboot store``, StoreServer), and seeds and
clones joining a store someone else hosts (a plain TCPStore, as torchrun's)."""

from __future__ import annotations

import datetime
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

import flashboot
from flashboot.errors import RendezvousError, WaitTimeoutError
from flashboot.flashclone import StoreServer, serve_store
from flashboot.flashclone.rendezvous import Rendezvous, StoreLostError, free_port

from _clone_helpers import _token  # noqa: F401  (fixture)
from _clone_helpers import CHUNK, MiB, TOKEN, env, finish, spawn_cli, stop, wait_until, write_raw_image

pytestmark = pytest.mark.timeout(60)


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def test_store_server_serves_clients_until_closed_and_refuses_a_taken_port():
    server = serve_store("127.0.0.1:0")  # port 0: the kernel picks one, .address says which
    try:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", server.address) and server.port > 0
        a = Rendezvous.connect(server.address, TOKEN, namespace="n", timeout_s=5)
        b = Rendezvous.connect(server.address, TOKEN, namespace="n", timeout_s=5)
        assert not a.is_server and not b.is_server
        a.publish("k", {"x": 1})
        assert b.read("k", what="a's record", timeout_s=2).body == {"x": 1}
        with pytest.raises(RendezvousError, match=f"cannot host a store at {server.address}: .*address already in use"):
            StoreServer(server.address)
    finally:
        server.close()
    assert server.closed and not _listening(server.address)
    with pytest.raises(StoreLostError, match=f"lost the rendezvous store at {server.address} while counting 'c'"):
        a.add("c", 1)
    with pytest.raises(StoreLostError, match="stopped answering earlier .*counting 'c'.*; not publishing 'k'"):
        a.publish("k", {"x": 2})  # at once: a dead store is not asked again
    with pytest.raises(StoreLostError, match=f"lost the rendezvous store at {server.address} while waiting for x"):
        b.wait_keys(["never"], what="x", timeout_s=5)


def test_store_server_refuses_a_bad_address():
    with pytest.raises(RendezvousError, match="must be HOST:PORT"):
        StoreServer("localhost")
    with pytest.raises(RendezvousError, match="port 70000 is outside 0..65535"):
        StoreServer("127.0.0.1:70000")


def test_flashboot_store_serves_seeds_and_clones_until_sigterm(tmp_path):
    path = tmp_path / "image.bin"
    data = write_raw_image(path, 2 * MiB, 5)
    proc = spawn_cli("store", "127.0.0.1:0")
    try:
        line = proc.stdout.readline()
        m = re.match(r"store listening at (127\.0\.0\.1:\d+) \(pid (\d+)\)", line)
        assert m, line + proc.stderr.read()
        address = m.group(1)
        assert int(m.group(2)) == proc.pid
        # host_store=False: the seed joins (and would wait for) the store, never hosts one
        seed = flashboot.seed(address, path, "cpu", host_store=False, timeout_s=10)
        try:
            assert not seed.rendezvous.is_server
            with flashboot.clone(address, "cpu", "chain", chunk_bytes=CHUNK, verify=True, timeout_s=10) as r:
                assert np.array_equal(r.arena.bytes().numpy()[:data.size], data)
                assert r.report.warnings == []
        finally:
            seed.close()
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, 20)
        assert rc == 0 and "store stopped" in out, err
        assert not _listening(address)
    finally:
        stop(proc)


def test_flashboot_store_in_the_background_returns_once_it_listens():
    address = f"127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, "-m", "flashboot.cli", "store", address, "--background"], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    m = re.match(rf"store listening at {re.escape(address)} \(pid (\d+), in the background\)", run.stdout)
    assert m, run.stdout
    pid = int(m.group(1))
    try:
        rdv = Rendezvous.connect(address, TOKEN, timeout_s=5)  # listening when the command returned
        assert rdv.add("n", 3) == 3
        rdv.close()
        # a second one on the same port fails before returning, saying why
        again = subprocess.run([sys.executable, "-m", "flashboot.cli", "store", address, "--background"], env=env(),
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 2
        assert f"the store for {address} exited (2) before listening: cannot host a store at {address}" in again.stderr
    finally:
        import os

        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not _listening(address), 20, "the background store to stop on SIGTERM")


def test_seed_and_clone_join_a_plain_tcpstore_the_caller_hosts(tmp_path):
    """Any TCPStore works as the rendezvous store (torchrun's MASTER_ADDR:MASTER_PORT one, say)."""
    from torch.distributed import TCPStore

    path = tmp_path / "image.bin"
    data = write_raw_image(path, 2 * MiB, 6)
    host_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    address = f"127.0.0.1:{host_store.port}"
    seed = flashboot.seed(address, path, "cpu", timeout_s=10)  # host_store=True, but one already listens
    try:
        assert not seed.rendezvous.is_server
        clone = spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "star", "--verify",
                          "--chunk-bytes", "256KiB", "--timeout", 10)
        rc, out, err = finish(clone, 40)
        assert rc == 0 and "verified byte-exact" in out, err
        with flashboot.clone(address, "cpu", "star", chunk_bytes=CHUNK, timeout_s=10) as r:
            assert np.array_equal(r.arena.bytes().numpy()[:data.size], data)
        # FlashBoot's keys sit under its own prefix, beside the caller's
        assert host_store.check(["flashboot/v1/default/seed"])
    finally:
        seed.close()


def test_a_seed_that_must_not_host_waits_for_the_store_then_names_it():
    address = f"127.0.0.1:{free_port()}"
    with flashboot.Arena.create(1 << 20, "cpu") as arena:
        with pytest.raises(WaitTimeoutError, match=f"no rendezvous store answered at {address}.*flashboot store"):
            flashboot.seed(address, arena, "cpu", host_store=False, timeout_s=0.5)


def test_a_wait_sees_a_key_within_a_twentieth_of_its_length(monkeypatch):
    """A key published 100 ms into a wait is seen by 105 ms (doubling sleeps saw it at 127 ms,
    16 ms into a 30 ms wait for a seed's handle), without a check every millisecond all along."""
    import flashboot.flashclone.rendezvous as rdv

    clock = {"t": 0.0}
    checks = []

    class Store:  # a key that appears at 100 ms of a virtual clock
        def check(self, keys):
            checks.append(clock["t"])
            return clock["t"] >= 0.1

    monkeypatch.setattr(rdv.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(rdv.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    r = Rendezvous(Store(), "127.0.0.1:1", None, "n", False, 10.0)
    r.wait_keys(["k"], what="the seed's handle")
    assert 0.1 <= checks[-1] <= 0.1 * (1 + rdv.WAIT_POLL_SHARE) + 1e-9
    assert len(checks) < 100 + 1  # 1 ms apart at most for the first 20 ms, then farther
    for waited in (0.0, 0.01, 0.1, 1.0, 100.0):
        assert 0.001 <= rdv.wait_poll_delay(waited) <= max(0.001, rdv.WAIT_POLL_SHARE * waited)


def test_closing_a_bounded_connection_ends_its_store_thread_and_lets_go_of_the_store():
    """close() only queued the thread's end: the thread (and the store connection its last call's
    bound method held) outlived it, and a soak of seed -> clone -> close counted 9 fds too many."""
    import weakref

    class Store:
        def check(self, keys):
            return True

    store = Store()
    gone = weakref.ref(store)
    r = Rendezvous(store, "127.0.0.1:1", None, "n", False, 10.0)
    r.bounded = True
    assert r.has("k")
    thread = r._calls_thread
    del store
    r.close()
    assert not thread.is_alive()
    assert gone() is None
