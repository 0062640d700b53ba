"""FlashClone faults with real processes on the host backend: a seed or a clone killed (or
stopped) mid-transfer, wrong tokens and mismatched manifests. Nothing may hang: every test is
bounded, and every wait inside FlashClone has its own deadline.

Transfers are slowed with the test-only step delay (``FLASHBOOT_TEST_STEP_DELAY_S`` in a child,
``step_delay_s=`` in process) so a peer can be killed mid-way."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import flashboot
from flashboot.flashclone import CloneError
from flashboot.errors import RendezvousError, WaitTimeoutError
from flashboot.flashclone.rendezvous import free_port

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import (
    CHUNK, MiB, arena_fds, arena_maps, finish, make_prepacked_image, spawn_cli, stop, wait_until,
    write_raw_image,
)

pytestmark = pytest.mark.timeout(30)
NBYTES = 4 * MiB  # 16 chunks of 256 KiB


@pytest.fixture
def raw(tmp_path):
    path = tmp_path / "image.bin"
    return path, write_raw_image(path, NBYTES, 21)


def _start_seed(address, rdv, source):
    proc = spawn_cli("seed", source, "--device", "cpu", "--store", address, "--timeout", "15")
    rec = wait_until(lambda: rdv.try_read("seed"), 20, "the seed to publish", proc)
    return proc, rec.body["generation"], rec.sealed["arena"]["arena_id"]


class _Background:
    """flashboot.clone in a thread of this process (so the test can inspect what it left mapped)."""

    def __init__(self, address, schedule="star", **kw):
        self.result = self.error = None
        self.elapsed = None

        def run():
            t0 = time.monotonic()
            try:
                self.result = flashboot.clone(address, "cpu", schedule, chunk_bytes=CHUNK, **kw)
            except BaseException as exc:
                self.error = exc
            self.elapsed = time.monotonic() - t0

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self, timeout_s=25):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "clone thread hung"
        return self


def _member(rdv, gen, schedule, position):
    return rdv.has(f"g/{gen}/{schedule}/member/{position}")


# ------------------------------------------------------------------------------ refused up front


def test_wrong_token_is_refused_before_any_byte_moves(store, raw):
    address, rdv = store
    path, _ = raw
    seed, gen, _ = _start_seed(address, rdv, path)
    cli = spawn_cli("clone", "--store", address, "--device", "cpu", "--timeout", 5, token="somebody-else-entirely-0000")
    try:
        maps_before = arena_maps()
        with pytest.raises(RendezvousError, match="seed' in the store at .* fails authentication"):
            flashboot.clone(address, "cpu", token="somebody-else-entirely-0000", timeout_s=5)
        rc, _out, err = finish(cli, 20)
        assert rc == 2 and "fails authentication" in err
        assert rdv.add(f"g/{gen}/chain/join", 0) == 0  # neither took a position
        assert arena_maps() == maps_before  # nor made or mapped an arena
        # the seed itself stops cleanly on SIGTERM and withdraws its record
        seed.send_signal(signal.SIGTERM)
        rc, out, err = finish(seed, 15)
        assert rc == 0 and "seed stopped" in out, err
        assert not rdv.has("seed")
    finally:
        stop(cli)
        stop(seed)


def test_mismatched_manifests_are_refused_before_any_byte_moves(store, tmp_path):
    address, rdv = store
    image = make_prepacked_image(tmp_path)
    seed = flashboot.seed(address, image, "cpu")
    try:
        maps_before = arena_maps()
        with pytest.raises(RendezvousError, match=r"model_id: expected 'org/other', the seed at .* has 'org/tiny'"):
            flashboot.clone(address, "cpu", expect={"model_id": "org/other", "tp_size": 1}, timeout_s=5)
        with pytest.raises(RendezvousError, match=r"tp_size: expected 2, .* has 1"):
            flashboot.clone(address, "cpu", expect={"tp_size": 2}, timeout_s=5)
        with pytest.raises(RendezvousError, match=r"nbytes: expected 1024, the seed at .* has 3174400"):
            flashboot.clone(address, "cpu", expect={"nbytes": 1024}, timeout_s=5)
        assert rdv.add(f"g/{seed.generation}/chain/join", 0) == 0
        assert arena_maps() == maps_before
    finally:
        seed.close()


def test_no_seed_means_a_timeout_naming_the_store(store):
    address, _ = store
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=r"waited 0.5 s for the seed's manifest and descriptor"):
        flashboot.clone(address, "cpu", timeout_s=0.5)
    unused = f"127.0.0.1:{free_port()}"
    with pytest.raises(WaitTimeoutError, match=f"no rendezvous store answered at {unused}"):
        flashboot.clone(unused, "cpu", timeout_s=0.5)
    assert time.monotonic() - t0 < 10


# ------------------------------------------------------------------------------ the seed dies


def test_seed_killed_mid_clone_fails_clearly_and_releases_its_mappings(store, raw):
    address, rdv = store
    path, _ = raw
    seed, gen, seed_arena = _start_seed(address, rdv, path)
    try:
        maps_before, fds_before = arena_maps(), arena_fds()
        bg = _Background(address, "star", timeout_s=10, step_delay_s=0.05)
        wait_until(lambda: _member(rdv, gen, "star", 1), 15, "the clone to join")
        time.sleep(0.3)
        seed.kill()
        bg.join()
        assert isinstance(bg.error, CloneError), bg.error
        msg = str(bg.error)
        assert f"seed (pid {seed.pid}) exited at step" in msg and "no other holds the bytes" in msg
        assert bg.elapsed < 10
        assert arena_maps(seed_arena) == [] and arena_fds(seed_arena) == []
        assert arena_maps() == maps_before and arena_fds() == fds_before  # its own arena and flags too
        status = rdv.read(f"g/{gen}/star/status/1", what="the failed clone's status", timeout_s=1)
        assert status.body["state"] == "failed" and f"seed (pid {seed.pid}) exited" in status.body["error"]
    finally:
        stop(seed)


def test_seed_killed_mid_clone_retries_from_a_finished_clone(store, raw):
    address, rdv = store
    path, data = raw
    seed, gen, _ = _start_seed(address, rdv, path)
    holder = spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "star", "--chunk-bytes",
                       "256KiB", "--serve", "--timeout", 15)
    try:
        wait_until(lambda: rdv.has(f"g/{gen}/star/status/1"), 20, "the first clone to finish", holder)
        bg = _Background(address, "star", timeout_s=10, step_delay_s=0.05, verify=True)
        wait_until(lambda: _member(rdv, gen, "star", 2), 15, "the second clone to join")
        time.sleep(0.3)
        seed.kill()
        bg.join()
        assert bg.error is None, bg.error
        r = bg.result
        try:
            assert r.report.verified and np.array_equal(r.arena.bytes().numpy()[:data.size], data)
            assert any(f"seed (pid {seed.pid}) exited at step" in e for e in r.report.recovered)
            assert any("re-attached to star clone #1" in e for e in r.report.recovered)
            assert "star clone #1" in r.report.source
        finally:
            r.close()
    finally:
        stop(seed)
        stop(holder)


def test_seed_killed_mid_clone_retries_from_the_host_image(store, raw):
    address, rdv = store
    path, data = raw
    seed, gen, _ = _start_seed(address, rdv, path)
    try:
        bg = _Background(address, "chain", timeout_s=10, step_delay_s=0.05, verify=True, image=path)
        wait_until(lambda: _member(rdv, gen, "chain", 1), 15, "the clone to join")
        time.sleep(0.3)
        seed.kill()
        bg.join()
        assert bg.error is None, bg.error
        with bg.result as r:
            assert r.report.verified and np.array_equal(r.arena.bytes().numpy()[:data.size], data)
            assert any(f"loading the rest from the host image {path}" in e for e in r.report.recovered)
            assert "the host image" in r.report.source and "seed" in r.report.source
    finally:
        stop(seed)


# ------------------------------------------------------------------------------ a clone dies


def _chain_with_slow_first_clone(address, rdv, path):
    """The seed in this process (only the clone is killed here), clone #1 a slow child process."""
    seed = flashboot.seed(address, path, "cpu")
    first = spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "chain", "--chunk-bytes",
                      "256KiB", "--timeout", 15, FLASHBOOT_TEST_STEP_DELAY_S=0.08)
    try:
        wait_until(lambda: _member(rdv, seed.generation, "chain", 1), 20, "clone #1 to join", first)
    except BaseException:
        stop(first)
        seed.close()
        raise
    return seed, first, seed.generation


def test_clone_killed_mid_chain_successor_reattaches_upstream(store, raw):
    address, rdv = store
    path, data = raw
    seed, first, gen = _chain_with_slow_first_clone(address, rdv, path)
    try:
        bg = _Background(address, "chain", timeout_s=10, verify=True)
        wait_until(lambda: _member(rdv, gen, "chain", 2), 15, "clone #2 to join")
        time.sleep(0.3)
        first.kill()
        bg.join()
        assert bg.error is None, bg.error
        with bg.result as r:
            assert r.report.position == 2 and r.report.verified
            assert np.array_equal(r.arena.bytes().numpy()[:data.size], data)
            assert any("clone #1 (pid" in e and "exited" in e for e in r.report.recovered)
            assert any("re-attached to seed" in e for e in r.report.recovered)
            assert r.report.source == "seed, clone #1"  # the first chunks came from clone #1, the rest from the seed
    finally:
        stop(first)
        seed.close()


def test_clone_killed_mid_chain_successor_fails_cleanly_without_retry(store, raw):
    address, rdv = store
    path, _ = raw
    seed, first, gen = _chain_with_slow_first_clone(address, rdv, path)
    try:
        maps_before = arena_maps()
        bg = _Background(address, "chain", timeout_s=10, retry=False)
        wait_until(lambda: _member(rdv, gen, "chain", 2), 15, "clone #2 to join")
        time.sleep(0.3)
        first.kill()
        bg.join()
        assert isinstance(bg.error, CloneError), bg.error
        assert f"clone #1 (pid {first.pid}), which exited before raising it" in str(bg.error)
        assert bg.elapsed < 10
        assert arena_maps() == maps_before
    finally:
        stop(first)
        seed.close()


def test_stalled_clone_times_out_naming_the_step_and_peer(store, raw):
    address, rdv = store
    path, _ = raw
    seed, first, gen = _chain_with_slow_first_clone(address, rdv, path)
    try:
        bg = _Background(address, "chain", timeout_s=1.0, retry=False)
        wait_until(lambda: _member(rdv, gen, "chain", 2), 15, "clone #2 to join")
        time.sleep(0.3)
        first.send_signal(signal.SIGSTOP)  # alive but frozen: only the deadline can tell
        bg.join()
        assert isinstance(bg.error, CloneError) and isinstance(bg.error.__cause__, WaitTimeoutError), bg.error
        assert "waited 1 s for step" in str(bg.error) and f"of clone #1 (pid {first.pid})" in str(bg.error)
        assert bg.elapsed < 8
    finally:
        stop(first)
        seed.close()


def test_ring_member_killed_mid_gather_the_rest_comes_from_the_host_image(store, raw):
    address, rdv = store
    path, data = raw
    members = [_Background(address, "ring", image=path, clones=3, timeout_s=10, verify=True) for _ in range(2)]
    wait_until(lambda: rdv.has("ring/member/0") and rdv.has("ring/member/1"), 15, "two ring members")
    slow = spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "ring", "--clones", 3, "--image",
                     path, "--chunk-bytes", "256KiB", "--timeout", 10, FLASHBOOT_TEST_STEP_DELAY_S=0.1)
    try:
        wait_until(lambda: rdv.has("barrier/ring/start/go"), 20, "the ring to start", slow)
        time.sleep(0.5)
        slow.kill()
        for m in members:
            m.join()
        for m in members:
            assert m.error is None, m.error
        recovered = [e for m in members for e in m.result.report.recovered]
        assert any("member 2 exited" in e for e in recovered)
        assert any("loaded the rest from the host image" in e for e in recovered)
        for m in members:
            assert m.result.report.verified and np.array_equal(m.result.arena.bytes().numpy()[:data.size], data)
            m.result.close()
    finally:
        stop(slow)


def test_a_finished_source_that_exits_still_vouches_for_its_bytes(store, raw):
    address, rdv = store
    path, data = raw
    seed = flashboot.seed(address, path, "cpu")
    gen = seed.generation
    first = spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "chain", "--chunk-bytes",
                      "256KiB", "--serve", "--timeout", 15)
    try:
        wait_until(lambda: _member(rdv, gen, "chain", 1), 20, "clone #1 to join", first)
        bg = _Background(address, "chain", timeout_s=10, step_delay_s=0.05, verify=True)
        wait_until(lambda: _member(rdv, gen, "chain", 2), 15, "clone #2 to join")
        wait_until(lambda: rdv.has(f"g/{gen}/chain/status/1"), 15, "clone #1 to finish", first)
        first.kill()  # every flag clone #2 waits on is raised: its mapping keeps the bytes
        bg.join()
        assert bg.error is None, bg.error
        with bg.result as r:
            assert r.report.recovered == [] and r.report.source == "clone #1" and r.report.verified
            assert np.array_equal(r.arena.bytes().numpy()[:data.size], data)
    finally:
        stop(first)
        seed.close()
