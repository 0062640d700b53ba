"""FlashClone across hosts when the network misbehaves, as a cluster operator meets it (CPU, root).

Hosts are network namespaces on one bridge (:mod:`flashboot.benchmarks.netns`, addresses 10.214.0.x,
apart from test_clone_nixl's 10.213.0.x); the store runs on a host of its own, so a fault can take a
seed or a clone away while the store stays reachable. Faults are made with iproute2 alone: a link
set down (a cut cable), a neighbour entry to a MAC nobody has (packets to one host silently dropped,
as behind a firewall), a blackhole route. Every clone runs NIXL over TCP (``UCX_TLS=tcp``) and
reports, besides its result or error, what it still holds afterwards (threads, fds, arena
mappings, /dev/shm/flashboot-* files), then may try again in the same process.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from flashboot.benchmarks.netns import Hosts, cannot_create

from _clone_helpers import SEED_SCRIPT, STORE_SCRIPT, TOKEN, MiB

SUBNET = "10.214.0"
STORE_PORT = 29681
CHUNK = 2 * MiB

_WHY = cannot_create()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"cannot create network namespaces here: {_WHY}")


_AT_BARRIER = """
import json, sys, time
from flashboot.flashclone.rendezvous import Rendezvous
r = Rendezvous.connect(sys.argv[1], timeout_s=30)
key = f"barrier/g/{r.read('seed', what='the seed').body['generation']}/star/start/count"
deadline = time.monotonic() + 60
while r.add(key, 0) < 1 and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"at_barrier": r.add(key, 0)}), flush=True)
"""

_CLONE = """
import hashlib, json, os, sys, threading, time, flashboot
from flashboot.flashclone.transports import nixl
store, schedule = sys.argv[1], sys.argv[2]
timeout_s = float(os.environ.get("T_TIMEOUT", "10"))

def held():
    # what this process still holds: threads, fds, mappings of arenas (memfd on the host backend)
    # and fds of /dev/shm/flashboot-* files (other processes' files there are theirs)
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        arenas = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                         for line in f if "flashboot-arena" in line})
    return {"threads": sorted(t.name for t in threading.enumerate()), "fds": len(links), "arenas": arenas,
            "shm": sorted(x for x in links if x.startswith("/dev/shm/flashboot-"))}

print(json.dumps({"before": held()}), flush=True)
for attempt in range(int(os.environ.get("T_ATTEMPTS", "1"))):
    if attempt:
        sys.stdin.readline()  # the test says when to try again
    t0 = time.monotonic()
    try:
        r = flashboot.clone(store, "cpu", schedule, transport=os.environ.get("T_TRANSPORT", "nixl"), verify=True,
                            timeout_s=timeout_s, chunk_bytes=%d, clones=int(os.environ.get("T_CLONES", "0")) or None)
    except flashboot.FlashBootError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    else:
        rep = r.report.to_dict()
        out = {k: rep[k] for k in ("position", "source", "recovered", "warnings", "verified", "nbytes", "transport")}
        out["sha256"] = hashlib.sha256(r.arena.bytes().numpy()[:rep["nbytes"]].tobytes()).hexdigest()
        if os.environ.get("T_HOLD") == "1":  # a source for others until the test says
            print(json.dumps({"holding": True}), flush=True)
            sys.stdin.readline()
        r.close()
    out.update(attempt=attempt, elapsed=time.monotonic() - t0, after=held(), stats=dict(nixl.stats))
    print(json.dumps(out), flush=True)
""" % CHUNK


def _env(**extra) -> dict:
    e = dict(os.environ)
    e.update({"FLASHBOOT_TOKEN": TOKEN, "UCX_TLS": "tcp", "PYTHONFAULTHANDLER": "1"})
    e.update({k: str(v) for k, v in extra.items()})
    return e


def _expected_sha(nbytes: int, seed: int) -> str:
    import numpy as np

    return hashlib.sha256(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()).hexdigest()


class _Net:
    """``count`` hosts, the last one the store's; every process started has its output read by
    threads (its lines on a queue, so a wait for one is bounded), and is killed at the end."""

    def __init__(self, count: int, subnet: str = SUBNET):
        self.hosts = Hosts(count, tag="nf", subnet=subnet)
        self.procs: list[subprocess.Popen] = []
        self.store_host = count - 1
        self.store = f"{self.hosts.address(self.store_host)}:{STORE_PORT}"

    def start(self, i: int, code: str, *args, env=None, stdin=None) -> subprocess.Popen:
        p = self.hosts.popen(i, [sys.executable, "-c", code, *map(str, args)], env=env or _env(), stdin=stdin)
        p.lines, p.err = queue.Queue(), []
        threading.Thread(target=lambda: [p.lines.put(x) for x in p.stdout] + [p.lines.put(None)], daemon=True).start()
        threading.Thread(target=lambda: p.err.extend(p.stderr), daemon=True).start()
        self.procs.append(p)
        return p

    def store_and_seed(self, nbytes: int, data_seed: int, broadcast_timeout_s: float | None = None) -> None:
        seed_args = (nbytes, data_seed) + (() if broadcast_timeout_s is None else (broadcast_timeout_s,))
        for i, code, args in ((self.store_host, STORE_SCRIPT, ()), (0, SEED_SCRIPT, seed_args)):
            p = self.start(i, code, self.store, *args)
            line = p.lines.get(timeout=60)
            assert line is not None and line.startswith("ready"), (line, "".join(p.err)[-3000:])

    def clone(self, i: int, schedule: str = "star", stdin=None, **env) -> subprocess.Popen:
        p = self.start(i, _CLONE, self.store, schedule, env=_env(**env), stdin=stdin)
        before = _result(p, "the clone", 60)
        assert "before" in before, before
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.hosts.close()


def _result(proc: subprocess.Popen, what: str, timeout_s: float) -> dict:
    """The process's next JSON line, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no result from {what} within {timeout_s} s:\n{''.join(proc.err)[-5000:]}") from None
        if line is None:
            proc.wait()
            raise AssertionError(f"{what} ended (rc {proc.returncode}) with no result:\n{''.join(proc.err)[-5000:]}")
        if line.startswith("{"):
            return json.loads(line)


def _until(predicate, what: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (rc {proc.returncode}) while waiting for {what}:\n"
                                 f"{''.join(proc.err)[-5000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(0.02)


def _again(proc: subprocess.Popen) -> None:
    proc.stdin.write("again\n")
    proc.stdin.flush()


@pytest.fixture
def net():
    n = _Net(4)
    try:
        yield n
    finally:
        n.close()


def _leaves_nothing(r: dict) -> None:
    """After the clone ended (either way), nothing of it is left in the process."""
    assert r["after"]["shm"] == [] and r["after"]["arenas"] == [], r["after"]
    assert r["after"]["threads"] == ["MainThread"], r["after"]


def _chain_of_two_reading(net, nbytes: int, data_seed: int, *, c1_timeout_s: float, c1_step_delay_s: float):
    """A store and seed of ``nbytes`` on host 0, chain clone #1 (host 1) reading from the seed one
    READ at a time, slowed by ``c1_step_delay_s`` a step, and #2 (host 2) reading from #1: once
    each has read a chunk over its link, ``(c1, c2)``."""
    net.store_and_seed(nbytes, data_seed)
    hosts = net.hosts
    rx1 = hosts.rx_bytes(1)
    c1 = net.clone(1, "chain", T_TIMEOUT=c1_timeout_s, FLASHBOOT_TEST_STEP_DELAY_S=c1_step_delay_s,
                   FLASHBOOT_NIXL_DEPTH=1)
    _until(lambda: hosts.rx_bytes(1) - rx1 > CHUNK, "clone #1 to be reading from the seed", c1)
    tx1 = hosts.tx_bytes(1)
    c2 = net.clone(2, "chain", T_TIMEOUT=5)
    _until(lambda: hosts.tx_bytes(1) - tx1 > CHUNK, "clone #2 to be reading from clone #1", c2)
    return c1, c2


def test_chain_source_whose_host_vanishes_is_read_past_from_the_seed(net):
    """Clone #1's link goes down (never up again) while #2 follows its progress: #1 publishes nothing
    more and a READ of it stays in progress for ever (NIXL fails none). #2 takes #1 as failed and
    re-attaches to the seed, which it can still reach, byte-exact; before, it failed with a
    WaitTimeoutError although the seed was there."""
    nbytes = 24 * MiB
    hosts = net.hosts
    c1, c2 = _chain_of_two_reading(net, nbytes, 21, c1_timeout_s=30, c1_step_delay_s=1.0)
    hosts.link(1, up=False)
    r2 = _result(c2, "clone #2", 60)
    assert "error" not in r2, r2
    assert r2["position"] == 2 and r2["verified"] and r2["sha256"] == _expected_sha(nbytes, 21), r2
    stalled = [x for x in r2["recovered"] if x.startswith("clone #1 failed at step")]
    # #2 was waiting for #1's progress (most of the time), or had a READ of it in flight
    assert stalled and ("its progress stayed at" in stalled[0] or "still in progress after 5 s" in stalled[0]), r2
    assert "bytes in place" in stalled[0] and "re-attached to the seed" in r2["recovered"], r2
    _leaves_nothing(r2)


def test_a_read_in_flight_to_a_host_that_vanished_fails_its_source_not_the_clone(net):
    """Clone #1 holds the whole image (it finished and stays a source); #2 READs from it
    one piece a second when #1's link goes down: the READ posted after that stays in progress. #2
    re-attaches to the seed once it has waited its timeout, and says how far it had got."""
    nbytes = 16 * MiB
    net.store_and_seed(nbytes, 22)
    hosts = net.hosts
    c1 = net.clone(1, "chain", T_TIMEOUT=30, T_HOLD=1, stdin=subprocess.PIPE)
    assert _result(c1, "clone #1", 60) == {"holding": True}
    tx1 = hosts.tx_bytes(1)
    c2 = net.clone(2, "chain", T_TIMEOUT=5, FLASHBOOT_TEST_STEP_DELAY_S=1.0, FLASHBOOT_NIXL_DEPTH=1)
    _until(lambda: hosts.tx_bytes(1) - tx1 > CHUNK, "clone #2 to be reading from clone #1", c2)
    hosts.link(1, up=False)
    r2 = _result(c2, "clone #2", 60)
    assert "error" not in r2, r2
    assert r2["verified"] and r2["sha256"] == _expected_sha(nbytes, 22), r2
    stalled = [x for x in r2["recovered"] if x.startswith("clone #1 failed at step")]
    assert stalled and "its READ was still in progress after 5 s" in stalled[0], r2
    assert f"of {nbytes:,} bytes in place" in stalled[0] and "re-attached to the seed" in r2["recovered"], r2
    assert r2["source"] == "the seed, clone #1", r2
    _leaves_nothing(r2)


def test_a_seed_behind_a_silent_drop_fails_the_clone_within_its_timeout_then_a_retry_succeeds(net):
    """The clone's packets to the seed's host vanish (a firewall that drops them) while the store
    answers. Loading the seed's agent connects to it inside NIXL, where the kernel retried the SYN
    for 127 s: a clone given 8 s failed after 136. Now UCX gives up within the clone's timeout, the
    error names the seed, and the same process clones byte-exact once the path is open again."""
    nbytes = 8 * MiB
    net.store_and_seed(nbytes, 23)
    net.hosts.silence(1, 0)
    c = net.clone(1, "star", stdin=subprocess.PIPE, T_TIMEOUT=8, T_ATTEMPTS=2)
    r = _result(c, "the clone", 40)  # 7 s of SYNs (3 tries) and the agent's start, not 127 s
    assert r.get("error") == "RendezvousError", r
    # the seed's host and pid (not the store's address), and what to look at
    assert "of the seed (pid " in r["message"] and "on fbhost0)" in r["message"], r
    assert "is that host reachable from here" in r["message"] and net.store not in r["message"], r
    _leaves_nothing(r)
    net.hosts.silence(1, 0, on=False)
    _again(c)
    r = _result(c, "the clone, again", 60)
    assert "error" not in r and r["verified"] and r["sha256"] == _expected_sha(nbytes, 23), r
    _leaves_nothing(r)


def test_an_upstream_clone_behind_a_silent_drop_is_tried_once_then_read_past(net):
    """Clone #1 finished and serves; #2's packets to #1's host vanish. Loading #1's agent runs out
    of SYNs (bounded by #2's timeout); it was tried three times, 3 x 7 s here and 3 x 31 s with the
    default 60 s timeout, before #2 read from the seed. A try that took seconds is not repeated."""
    nbytes = 8 * MiB
    net.store_and_seed(nbytes, 24)
    c1 = net.clone(1, "chain", T_TIMEOUT=30, T_HOLD=1, stdin=subprocess.PIPE)
    assert _result(c1, "clone #1", 60) == {"holding": True}
    net.hosts.silence(2, 1)
    c2 = net.clone(2, "chain", T_TIMEOUT=8)
    r = _result(c2, "clone #2", 60)
    assert "error" not in r and r["verified"] and r["sha256"] == _expected_sha(nbytes, 24), r
    assert r["position"] == 2 and r["source"] == "the seed", r
    assert len(r["recovered"]) == 1 and r["recovered"][0].startswith("clone #1 cannot be reached"), r
    assert r["stats"]["remotes_loaded"] == 2, r["stats"]  # clone #1 once, then the seed
    _leaves_nothing(r)


def test_the_store_going_silent_at_the_start_barrier_is_named_as_such(net):
    """A clone waits at the start barrier for a second one when the store's host loses its link.
    It ends by its timeout with StoreSilentError naming the barrier and the store; before, the
    barrier took the silence for its own timeout and asked the silent store who had arrived, which
    raised StoreLostError about that question ("not counting ..."). Once the link is back, the
    same process clones byte-exact."""
    nbytes = 8 * MiB
    net.store_and_seed(nbytes, 25)
    c = net.clone(1, "star", stdin=subprocess.PIPE, T_TIMEOUT=6, T_CLONES=2, T_ATTEMPTS=2)
    watch = net.start(net.store_host, _AT_BARRIER, net.store)
    assert _result(watch, "the store's watcher", 60) == {"at_barrier": 1}
    net.hosts.link(net.store_host, up=False)
    r = _result(c, "the clone", 40)
    assert r.get("error") == "StoreSilentError", r
    assert "start barrier" in r["message"] and f"the store at {net.store} did not answer within 6 s" in r["message"], r
    assert r["after"]["shm"] == [] and r["after"]["arenas"] == [], r
    net.hosts.link(net.store_host, up=True)
    _again(c)
    r = _result(c, "the clone, again", 60)
    assert "error" not in r and r["verified"] and r["sha256"] == _expected_sha(nbytes, 25), r


def test_a_chain_whose_store_goes_silent_mid_transfer_finishes_from_the_seed(net):
    """The store's host loses its link while clone #1 READs from the seed and #2 follows #1. Both
    can still reach the seed: #1 reads on without announcing its progress, #2 (which cannot read
    #1's progress any more) re-attaches to the seed; both keep verified weights and say the store
    is gone. Before, the first progress #1 could not announce failed it, and #2 with it."""
    nbytes = 16 * MiB
    net.store_and_seed(nbytes, 26)
    hosts = net.hosts
    rx1 = hosts.rx_bytes(1)
    c1 = net.clone(1, "chain", T_TIMEOUT=5, FLASHBOOT_TEST_STEP_DELAY_S=0.5, FLASHBOOT_NIXL_DEPTH=1)
    _until(lambda: hosts.rx_bytes(1) - rx1 > CHUNK, "clone #1 to be reading from the seed", c1)
    tx1 = hosts.tx_bytes(1)
    c2 = net.clone(2, "chain", T_TIMEOUT=5)
    _until(lambda: hosts.tx_bytes(1) - tx1 > CHUNK, "clone #2 to be reading from clone #1", c2)
    hosts.link(net.store_host, up=False)
    r1, r2 = _result(c1, "clone #1", 60), _result(c2, "clone #2", 60)
    for r in (r1, r2):
        assert "error" not in r and r["verified"] and r["sha256"] == _expected_sha(nbytes, 26), r
        assert any(f"the store at {net.store}" in w for w in r["warnings"]), r
        assert any("kept the weights" in w and "not announced as a source" in w for w in r["warnings"]), r
    assert r1["source"] == "the seed" and any("without announcing its progress" in w for w in r1["warnings"]), r1
    assert any(x.startswith("clone #1 failed at step") and "progress cannot be read" in x for x in r2["recovered"]), r2
    assert "re-attached to the seed" in r2["recovered"], r2


def test_a_broadcast_clone_from_another_host_connects_to_the_seeds_address_not_loopback(net):
    """A seed without NIXL answers broadcasts (gloo on the host backend); auto picks it for a clone
    on another host. gloo listened on, and told its peer, what the host's name resolves to (here
    nothing: loopback; 127.0.1.1 on a stock Debian or Ubuntu), so each side waited for the other on
    its own loopback until a raw RuntimeError 40 s later. Each side now takes the address it
    reaches the store from: byte-exact, over the link."""
    nbytes = 8 * MiB
    net.store_and_seed(nbytes, 27, broadcast_timeout_s=10)
    rx1 = net.hosts.rx_bytes(1)
    c = net.clone(1, "star", T_TIMEOUT=10, T_TRANSPORT="auto")
    r = _result(c, "the clone", 60)
    assert "error" not in r and r["transport"] == "nccl" and r["source"] == "seed (broadcast)", r
    assert r["verified"] and r["sha256"] == _expected_sha(nbytes, 27), r
    assert net.hosts.rx_bytes(1) - rx1 >= nbytes  # it came over the link
    _leaves_nothing(r)


def test_a_broadcast_cut_mid_way_ends_by_the_timeout_naming_the_seed_and_a_later_clone_succeeds(net):
    """The clone's link goes down in the middle of a broadcast (a slow link: 20 Mbit/s). The clone
    ends by its timeout with a WaitTimeoutError naming the seed and the bytes, where gloo's raw
    RuntimeError ("Operation timed out!") had escaped with its C++ frames. Once the seed's own side
    of that broadcast has timed out, a clone from another host gets every byte."""
    nbytes = 8 * MiB
    net.store_and_seed(nbytes, 28, broadcast_timeout_s=5)
    hosts = net.hosts
    hosts.rate(1, "20mbit")  # ~3.4 s for the image
    rx1 = hosts.rx_bytes(1)
    c1 = net.clone(1, "star", T_TIMEOUT=5, T_TRANSPORT="nccl")
    _until(lambda: hosts.rx_bytes(1) - rx1 > MiB, "the broadcast to be under way", c1)
    hosts.link(1, up=False)
    r1 = _result(c1, "clone #1", 40)
    assert r1.get("error") == "WaitTimeoutError", r1
    assert f"the broadcast of {nbytes:,} bytes with the seed (pid " in r1["message"], r1
    assert "on fbhost0)" in r1["message"], r1
    _leaves_nothing(r1)
    c2 = net.clone(2, "star", T_TIMEOUT=20, T_TRANSPORT="nccl")  # the seed serves one broadcast at a time
    r2 = _result(c2, "clone #2", 40)
    assert "error" not in r2 and r2["verified"] and r2["sha256"] == _expected_sha(nbytes, 28), r2


def test_a_seed_whose_host_vanishes_mid_chain_fails_both_clones_naming_it_then_a_later_clone_succeeds(net):
    """The seed's link goes down while #1 READs from it and #2 follows #1. #1 fails naming the seed,
    the step and the bytes it had; #2, whose source failed, cannot reach the seed either and says
    so. Neither leaves anything behind in its process, nor records that stop a clone made once the
    link is back: it reads past both and gets every byte."""
    nbytes = 16 * MiB
    hosts = net.hosts
    c1, c2 = _chain_of_two_reading(net, nbytes, 29, c1_timeout_s=5, c1_step_delay_s=0.5)
    hosts.link(0, up=False)
    r1, r2 = _result(c1, "clone #1", 60), _result(c2, "clone #2", 60)
    assert r1.get("error") == "CloneError", r1
    assert "the seed failed at step" in r1["message"] and "no source upstream of the seed" in r1["message"], r1
    assert f"of {nbytes:,} bytes in place" in r1["message"], r1
    assert r2.get("error") == "CloneError" and "clone #1 failed at step" in r2["message"], r2
    assert "the seed (pid " in r2["message"] and "on fbhost0)" in r2["message"], r2
    for r in (r1, r2):
        _leaves_nothing(r)
    hosts.link(0, up=True)
    c3 = net.clone(2, "chain", T_TIMEOUT=10)
    r3 = _result(c3, "clone #3", 60)
    assert "error" not in r3 and r3["position"] == 3 and r3["source"] == "the seed", r3
    assert r3["verified"] and r3["sha256"] == _expected_sha(nbytes, 29), r3


def test_a_slow_but_healthy_link_is_not_taken_for_a_stalled_one(net):
    """20 Mbit/s to the clone, a 5 s timeout: every READ of the first window (8 x 2 MiB, which UCX
    interleaves) needed ~6.7 s, so none landed within the timeout and the seed was taken as stalled,
    a healthy clone failed (as a star of 16 clones of one seed on 1 GbE does at the default 60 s).
    READs in flight are now kept to what lands within half the timeout at the rate seen so far."""
    nbytes = 16 * MiB
    net.store_and_seed(nbytes, 30)
    net.hosts.rate(1, "20mbit")
    c = net.clone(1, "star", T_TIMEOUT=5)
    r = _result(c, "the clone", 60)
    assert "error" not in r and r["verified"] and r["sha256"] == _expected_sha(nbytes, 30), r
    assert r["recovered"] == [] and r["source"] == "the seed", r


def test_a_broadcast_from_a_seed_hosting_the_store_on_every_interface_uses_its_names_address():
    """A seed that hosts the store at 0.0.0.0 reaches it over loopback, which is no address for a
    clone on another host (the group did not form): gloo then keeps the address the seed's name
    resolves to (here from the namespace's own /etc/hosts, as a cluster's DNS would give it)."""
    nbytes = 4 * MiB
    net = _Net(2, "192.168.214")  # above 127.0.0.1: which side of a gloo pair connects goes by the address
    etc = f"/etc/netns/{net.hosts.names[0]}"
    os.makedirs(etc, exist_ok=True)
    try:
        with open(f"{etc}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{net.hosts.address(0)} fbhost0\n")
        seed = net.start(0, SEED_SCRIPT, f"0.0.0.0:{STORE_PORT}", nbytes, 31, 10)
        line = seed.lines.get(timeout=60)
        assert line is not None and line.startswith("ready"), (line, "".join(seed.err)[-3000:])
        c = net.start(1, _CLONE, f"{net.hosts.address(0)}:{STORE_PORT}", "star",
                      env=_env(T_TIMEOUT=10, T_TRANSPORT="nccl"))
        assert "before" in _result(c, "the clone", 60)
        r = _result(c, "the clone", 60)
        assert "error" not in r and r["verified"] and r["sha256"] == _expected_sha(nbytes, 31), r
    finally:
        import shutil

        shutil.rmtree(etc, ignore_errors=True)
        net.close()
