"""FlashClone over NIXL across a real link: network namespaces joined by veths (CPU, root).

Each test creates its namespaces (a bridge in a hub namespace, one veth per namespace, addresses
10.213.0.x) and deletes them after; processes in them get their own hostname, so FlashBoot sees
other hosts. ``UCX_TLS=tcp``: by default UCX sees one machine and copies through ``cma``,
never touching the link. That the bytes did cross it is read from the veths' byte counters.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import pytest

from flashboot.benchmarks.netns import Hosts, cannot_create

from _clone_helpers import SEED_SCRIPT, STORE_SCRIPT, TOKEN, MiB, finish, stop, wait_until

NBYTES = 24 * MiB
CHUNK = 2 * MiB
STORE_PORT = 29671

_WHY = cannot_create()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"cannot create network namespaces here: {_WHY}")


_CLONE = """
import hashlib, json, os, sys, flashboot
from flashboot.flashclone.transports import nixl
store, schedule, transport, clones = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
timeout_s = float(os.environ.get("T_TIMEOUT", "30"))
try:
    r = flashboot.clone(store, "cpu", schedule, transport=transport, verify=True, timeout_s=timeout_s,
                        chunk_bytes=int(os.environ.get("T_CHUNK", 2 << 20)), clones=clones or None,
                        retry=os.environ.get("T_RETRY", "1") == "1")
except flashboot.FlashBootError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "stats": nixl.stats}), flush=True)
    sys.exit(3)
rep = r.report.to_dict()
rep["sha256"] = hashlib.sha256(r.arena.bytes().numpy()[:rep["nbytes"]].tobytes()).hexdigest()
rep["stats"] = nixl.stats
print(json.dumps(rep), flush=True)
from flashboot.flashclone import linger
linger(r, timeout_s=timeout_s)
r.close()
"""


def _env(token: str = TOKEN, **extra) -> dict:
    e = dict(os.environ)
    # A native crash shows where: Python's frames (faulthandler) and the crashing thread's native
    # frames (UCX's handler; a crash in NIXL's or UCX's own threads shows no Python frame at all).
    e.update({"FLASHBOOT_TOKEN": token, "UCX_TLS": "tcp", "PYTHONFAULTHANDLER": "1", "UCX_HANDLE_ERRORS": "bt"})
    e.update({k: str(v) for k, v in extra.items()})
    return e


def _expected_sha(nbytes: int, seed: int) -> str:
    import numpy as np

    return hashlib.sha256(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()).hexdigest()


def _ready(proc, what: str) -> None:
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{what} did not start: {line!r}{out}\n{err[-3000:]}")


def _report(proc, timeout_s: float = 90, who: str = "") -> tuple[int, dict, str]:
    rc, out, err = finish(proc, timeout_s)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no report from {who or 'the process'} (rc {rc}):\n{out}\n{err[-10000:]}"
    return rc, json.loads(lines[0]), err


@pytest.fixture
def hosts():
    h = Hosts(3)
    procs: list = []
    h.procs = procs
    try:
        yield h
    finally:
        for p in procs:
            stop(p)
        h.close()


def _start(hosts, i: int, code: str, *args, env=None):
    p = hosts.popen(i, [sys.executable, "-c", code, *map(str, args)], env=env or _env())
    hosts.procs.append(p)
    return p


def _store_and_seed(hosts, nbytes: int = NBYTES, data_seed: int = 5, own_store: bool = False) -> str:
    store = f"{hosts.address(0)}:{STORE_PORT}"
    if own_store:  # a store that outlives the seed (a test that kills the seed)
        _ready(_start(hosts, 0, STORE_SCRIPT, store), "store")
    seed = _start(hosts, 0, SEED_SCRIPT, store, nbytes, data_seed)
    _ready(seed, "seed")
    hosts.seed = seed
    return store


def test_nixl_chain_across_three_namespaces_is_byte_exact_and_crosses_the_links(hosts):
    store = _store_and_seed(hosts)
    tx0, rx1, rx2 = hosts.tx_bytes(0), hosts.rx_bytes(1), hosts.rx_bytes(2)
    c1 = _start(hosts, 1, _CLONE, store, "chain", "nixl", 2)
    c2 = _start(hosts, 2, _CLONE, store, "chain", "nixl", 2)
    rc1, r1, err1 = _report(c1)
    rc2, r2, err2 = _report(c2)
    assert rc1 == 0 and rc2 == 0, (r1, r2, err1[-2000:], err2[-2000:])
    want = _expected_sha(NBYTES, 5)
    for r in (r1, r2):
        assert r["transport"] == "nixl" and r["verified"] and r["sha256"] == want
        assert r["stats"]["registrations"] == 1 and r["stats"]["reads_posted"] >= NBYTES // CHUNK
    assert {r1["position"], r2["position"]} == {1, 2}
    first, second = sorted((r1, r2), key=lambda r: r["position"])
    assert first["source"] == "the seed" and second["source"] == "clone #1"
    # every byte came in over each clone's veth; the seed sent the image once, not twice (a chain)
    assert hosts.rx_bytes(1) - rx1 >= NBYTES and hosts.rx_bytes(2) - rx2 >= NBYTES
    assert NBYTES <= hosts.tx_bytes(0) - tx0 < 1.5 * NBYTES


def test_nixl_star_across_namespaces_auto_picks_nixl_for_another_host(hosts):
    store = _store_and_seed(hosts, data_seed=6)
    tx0 = hosts.tx_bytes(0)
    c1 = _start(hosts, 1, _CLONE, store, "star", "auto", 2)
    c2 = _start(hosts, 2, _CLONE, store, "star", "auto", 2)
    reports = [_report(c) for c in (c1, c2)]
    want = _expected_sha(NBYTES, 6)
    for rc, r, err in reports:
        assert rc == 0, (r, err[-2000:])
        assert r["transport"] == "nixl" and r["sha256"] == want and r["source"] == "the seed"
        # auto says why: the seed is on another host (fbhost0), so no POSIX fd; no fabric on a CPU
        assert "not posix_fd" in r["transport_note"] and "'fbhost0'" in r["transport_note"]
    assert hosts.tx_bytes(0) - tx0 >= 2 * NBYTES  # both read every byte from the seed


def test_seed_killed_mid_chain_fails_naming_the_step_within_the_deadline(hosts):
    store = _store_and_seed(hosts, own_store=True)
    # one READ at a time, 1 s each: clone #1 needs 12 s for the image, so the seed dies while it still
    # lacks bytes even on a loaded machine (at 0.4 s #1 could finish before #2 had started: CI saw it)
    slow = _env(FLASHBOOT_TEST_STEP_DELAY_S=1.0, FLASHBOOT_NIXL_DEPTH=1, T_TIMEOUT=10)
    rx1 = hosts.rx_bytes(1)
    c1 = _start(hosts, 1, _CLONE, store, "chain", "nixl", 0, env=slow)  # no start barrier: #1 joins first
    wait_until(lambda: hosts.rx_bytes(1) - rx1 > CHUNK, 60, "clone #1 to be reading from the seed", c1)
    tx1 = hosts.tx_bytes(1)
    c2 = _start(hosts, 2, _CLONE, store, "chain", "nixl", 0, env=slow)
    wait_until(lambda: hosts.tx_bytes(1) - tx1 > CHUNK, 60, "clone #2 to be reading from clone #1", c2)
    t_kill = time.monotonic()
    os.kill(hosts.seed.pid, signal.SIGKILL)  # ip netns exec / unshare / sh exec: the pid is the seed's python
    for c in (c1, c2):
        rc, r, err = _report(c, timeout_s=60)
        assert rc == 3, (r, err[-2000:])
        assert "step" in r["message"] and "the seed" in r["message"], r
    # both ended within their deadline (10 s per wait), not by the test's timeout
    assert time.monotonic() - t_kill < 40


def test_clone_killed_mid_chain_successor_reattaches_to_the_seed_and_finishes(hosts):
    store = _store_and_seed(hosts, data_seed=8)
    slow = _env(FLASHBOOT_TEST_STEP_DELAY_S=1.0, FLASHBOOT_NIXL_DEPTH=1, T_TIMEOUT=20)  # #1 needs 12 s
    rx1 = hosts.rx_bytes(1)
    c1 = _start(hosts, 1, _CLONE, store, "chain", "nixl", 0, env=slow)  # no start barrier: #1 joins first
    wait_until(lambda: hosts.rx_bytes(1) - rx1 > CHUNK, 60, "clone #1 to be reading from the seed", c1)
    tx1 = hosts.tx_bytes(1)
    c2 = _start(hosts, 2, _CLONE, store, "chain", "nixl", 0, env=_env(T_TIMEOUT=20))
    wait_until(lambda: hosts.tx_bytes(1) - tx1 > 2 * CHUNK, 60, "clone #2 to have read a few chunks from #1", c2)
    os.kill(c1.pid, signal.SIGKILL)  # no status published: #2 finds out through NIXL
    rc, r, err = _report(c2, timeout_s=90)
    assert rc == 0, (r, err[-3000:])
    assert r["position"] == 2 and r["sha256"] == _expected_sha(NBYTES, 8) and r["verified"]
    assert any("clone #1 failed at step" in x for x in r["recovered"]), r["recovered"]
    assert "re-attached to the seed" in r["recovered"], r["recovered"]
    assert r["source"] == "the seed, clone #1"


def test_a_successor_of_a_clone_that_finished_and_left_reattaches_to_the_seed(hosts):
    """Found on the H200: clone #1 done and exited, clone #2 joins the chain behind it. Its agent
    cannot be reached any more: #2 reads from the seed instead, byte-exact, and says so."""
    store = _store_and_seed(hosts, data_seed=9)
    c1 = _start(hosts, 1, _CLONE, store, "chain", "nixl", 0)
    rc1, r1, err1 = _report(c1)
    assert rc1 == 0 and r1["position"] == 1, (r1, err1[-2000:])
    c1.wait(timeout=30)  # gone: nothing serves its agent
    c2 = _start(hosts, 2, _CLONE, store, "chain", "nixl", 0, env=_env(T_TIMEOUT=20))
    rc2, r2, err2 = _report(c2, timeout_s=90)
    assert rc2 == 0, (r2, err2[-3000:])
    assert r2["position"] == 2 and r2["sha256"] == _expected_sha(NBYTES, 9) and r2["verified"]
    assert r2["source"] == "the seed"
    assert any("clone #1" in x and "re-attached to the seed" in x for x in r2["recovered"]), r2["recovered"]


def test_link_cut_mid_transfer_ends_by_the_deadline(hosts):
    store = _store_and_seed(hosts, nbytes=48 * MiB)
    env = _env(FLASHBOOT_TEST_STEP_DELAY_S=0.2, T_TIMEOUT=5)
    rx1 = hosts.rx_bytes(1)
    c1 = _start(hosts, 1, _CLONE, store, "star", "nixl", 0, env=env)
    wait_until(lambda: hosts.rx_bytes(1) - rx1 > 2 * CHUNK, 60, "the clone to have read a few chunks", c1)
    hosts.link(1, up=False)
    t_cut = time.monotonic()
    rc, r, err = _report(c1, timeout_s=120)
    assert rc == 3, (r, err[-2000:])
    # NIXL leaves the READ in progress forever; our deadline (or the store's, also across the cut link) ends it
    # (StoreSilentError: the store's own call, across the cut link, unanswered within the deadline)
    assert r["error"] in ("WaitTimeoutError", "StoreSilentError", "RendezvousError", "CloneError"), r
    assert "5 s" in r["message"] or "timed out" in r["message"].lower() or "step" in r["message"], r
    assert time.monotonic() - t_cut < 100


def test_wrong_token_is_refused_before_registration(hosts):
    store = _store_and_seed(hosts)
    c1 = _start(hosts, 1, _CLONE, store, "star", "nixl", 0,
                env=_env(token="not-the-token-0123456789abcdef0123"))
    rc, r, err = _report(c1)
    # the seed's record, signed with the job's token, is one this clone cannot verify (a RendezvousError)
    assert rc == 3 and r["error"] == "ForeignRecordError" and "signed with a different token" in r["message"], r
    assert r["stats"]["registrations"] == 0 and r["stats"]["reads_posted"] == 0, r


_RING = """
import hashlib, json, os, sys, flashboot
store, image, members = sys.argv[1], sys.argv[2], int(sys.argv[3])
timeout_s = float(os.environ.get("T_TIMEOUT", "30"))
try:
    r = flashboot.clone(store, "cpu", "ring", image=image, clones=members, transport="nixl", verify=True,
                        timeout_s=timeout_s, chunk_bytes=int(os.environ.get("T_CHUNK", 2 << 20)), name="ringtest")
except flashboot.FlashBootError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
    sys.exit(3)
rep = r.report.to_dict()
rep["sha256"] = hashlib.sha256(r.arena.bytes().numpy()[:rep["nbytes"]].tobytes()).hexdigest()
print(json.dumps(rep), flush=True)
from flashboot.flashclone import linger
linger(r, timeout_s=timeout_s)
r.close()
"""


def _ring_image(tmp_path, nbytes: int, data_seed: int) -> str:
    """Every member's own copy of the image: one file on the filesystem the namespaces share."""
    import numpy as np

    path = tmp_path / "image.bin"
    path.write_bytes(np.random.default_rng(data_seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    return str(path)


def test_nixl_ring_across_three_namespaces_gathers_every_shard_over_the_links(hosts, tmp_path):
    """Each member loads its third from its own copy of the image and READs the other two thirds
    from its predecessor, over its veth; each member is read by exactly one peer."""
    image = _ring_image(tmp_path, NBYTES, 11)
    store = f"{hosts.address(0)}:{STORE_PORT}"
    _ready(_start(hosts, 0, STORE_SCRIPT, store), "store")
    tx = [hosts.tx_bytes(i) for i in range(3)]
    rx = [hosts.rx_bytes(i) for i in range(3)]
    members = [_start(hosts, i, _RING, store, image, 3) for i in range(3)]
    reports = [_report(m, who=f"ring member on host {i}") for i, m in enumerate(members)]
    want = _expected_sha(NBYTES, 11)
    for rc, r, err in reports:
        assert rc == 0, (r, err[-3000:])
        assert r["transport"] == "nixl" and r["verified"] and r["sha256"] == want and not r["recovered"], r
    assert sorted(r["position"] for _, r, _ in reports) == [1, 2, 3]
    two_thirds = 2 * NBYTES // 3
    for i in range(3):  # every member received two thirds and sent two thirds: one reader each, not a star
        assert hosts.rx_bytes(i) - rx[i] >= 0.95 * two_thirds, (i, hosts.rx_bytes(i) - rx[i])
        assert 0.95 * two_thirds <= hosts.tx_bytes(i) - tx[i] < 1.3 * two_thirds, (i, hosts.tx_bytes(i) - tx[i])


def test_nixl_ring_member_killed_its_successor_loads_the_rest_from_its_own_copy(hosts, tmp_path):
    image = _ring_image(tmp_path, NBYTES, 12)
    store = f"{hosts.address(0)}:{STORE_PORT}"
    _ready(_start(hosts, 0, STORE_SCRIPT, store), "store")
    slow = _env(FLASHBOOT_TEST_STEP_DELAY_S=1.0, FLASHBOOT_NIXL_DEPTH=1, T_TIMEOUT=20)
    members = [_start(hosts, i, _RING, store, image, 3, env=slow) for i in range(3)]
    tx1 = hosts.tx_bytes(1)
    wait_until(lambda: hosts.tx_bytes(1) - tx1 > CHUNK, 60, "the member on host 1 to be read by its successor",
               members[1])
    os.kill(members[1].pid, signal.SIGKILL)  # no status published: its successor finds out through NIXL
    survivors = [_report(members[i], timeout_s=90, who=f"ring member on host {i}") for i in (0, 2)]
    want = _expected_sha(NBYTES, 12)
    recovered = 0
    for rc, r, err in survivors:
        assert rc == 0, (r, err[-3000:])
        assert r["sha256"] == want and r["verified"], r
        if r["recovered"]:
            recovered += 1
            assert any("failed at step" in x for x in r["recovered"]), r["recovered"]
            assert "loaded the rest from the host image" in r["recovered"], r["recovered"]
    assert recovered == 1  # the killed member's successor, and only it
