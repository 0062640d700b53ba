"""The transport registry and the bad input each transport must refuse (host backend, one machine).

Across a real link: tests/test_clone_nixl.py. On two GPUs: tests/test_clone_nixl_gpu.py.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest

import flashboot
from flashboot.arena import Arena, ArenaDescriptor
from flashboot.errors import CapabilityError, FlashBootError, RendezvousError, UnknownNameError
from flashboot.flashclone.common import SEED_KEY
from flashboot.flashclone.manifest import Manifest
from flashboot.flashclone.transports import nixl
from flashboot.flashclone.transports.registry import (
    MEMORY, REACH, Seen, choose_transport, list_transports, transport_names,
)
from flashboot.memory import CPU

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import MiB, spawn_python, stop, wait_until

pytestmark = pytest.mark.timeout(120)  # processes starting under load take their time


def _remote(host: str = "another-host") -> ArenaDescriptor:
    return ArenaDescriptor("host", 1, (3,), 2 * MiB, -1, "memfd", 2 * MiB, 2 * MiB, "x", None, host)


# ----------------------------------------------------------------------------------- registry


def test_every_transport_states_what_it_can_do_as_data():
    infos = list_transports()
    assert [t.name for t in infos] == transport_names() == ["posix_fd", "fabric", "nixl", "nccl"]
    for t in infos:
        assert t.reach in REACH and t.memory and set(t.memory) <= set(MEMORY) and t.setup
        assert t.available or t.reason  # an unavailable one says why
    by_name = {t.name: t for t in infos}
    assert by_name["posix_fd"].reach == "same_host" and by_name["fabric"].reach == "nvlink_domain"
    assert by_name["nixl"].reach == by_name["nccl"].reach == "any_host"
    assert by_name["fabric"].memory == ("device",)
    assert not by_name["fabric"].available  # no CUDA on this machine: and it says so
    assert "CUDA" in by_name["fabric"].reason


def test_unknown_transport_lists_the_known_ones_before_connecting():
    with pytest.raises(UnknownNameError, match="nixl") as info:
        flashboot.clone("127.0.0.1:1", "cpu", transport="rdma-magic", timeout_s=1)
    assert "posix_fd" in str(info.value) and "auto" in str(info.value)


def test_auto_takes_the_first_usable_in_order_and_says_why_it_passed_the_others():
    here = socket.gethostname()
    cls, note = choose_transport(Seen(_remote(here), {"nixl": True, "nccl": True}), CPU, "auto")
    assert cls.name == "posix_fd" and note == ""
    cls, note = choose_transport(Seen(_remote(), {"nixl": True, "nccl": True}), CPU, "auto")
    assert cls.name == "nixl"
    assert f"not posix_fd: the seed's arena lives on host 'another-host', this clone runs on {here!r}" in note
    assert "not fabric: the seed's arena has no fabric handle (memfd)" in note
    cls, note = choose_transport(Seen(_remote(), {"nixl": False, "nccl": True}), CPU, "auto")
    assert cls.name == "nccl"
    assert "not nixl: the seed publishes no NIXL agent" in note and note.endswith("gloo broadcast")
    with pytest.raises(RendezvousError, match="no transport can reach the seed on 'another-host'"):
        choose_transport(Seen(_remote(), {"nixl": False, "nccl": False}), CPU, "auto")


def test_posix_fd_refuses_a_descriptor_from_another_host_naming_both():
    with pytest.raises(RendezvousError) as info:
        choose_transport(Seen(_remote("gpu-node-7"), {}), CPU, "posix_fd")
    msg = str(info.value)
    assert "'gpu-node-7'" in msg and repr(socket.gethostname()) in msg and "does not cross hosts" in msg
    with pytest.raises(RendezvousError, match="has no fabric handle"):
        choose_transport(Seen(_remote(), {}), CPU, "fabric")


def test_flashboot_info_lists_the_transports():
    from flashboot.commands.info import collect_info, format_info

    info = collect_info()
    assert [t["name"] for t in info["transports"]] == ["posix_fd", "fabric", "nixl", "nccl"]
    text = format_info(info)
    assert "Clone transports" in text and "nixl      any_host" in text and "posix_fd  same_host" in text


@pytest.mark.parametrize("schedule,n", [("chain", 2), ("star", 3)])
def test_nixl_pieces_cover_each_step_once_and_never_cross_a_segment(schedule, n):
    from flashboot.schedulers import build_plan

    seg, read = 32 * MiB, 12 * MiB
    nbytes = 100 * MiB + 12345
    plan = build_plan(schedule, n, nbytes, 20 * MiB)
    for dst in range(1, n + 1):
        steps = [s for s in plan.steps_into(dst) if s.kind == "copy"]
        got = list(nixl.pieces(steps, seg, read))
        covered = np.zeros(nbytes, dtype=np.uint8)
        for p in got:
            assert 0 < p.nbytes <= read and p.offset // seg == (p.end - 1) // seg
            covered[p.offset:p.end] += 1
        assert covered.min() == covered.max() == 1  # every byte exactly once
        want = {s.id: s.src for s in steps}
        assert all(want[p.step] == p.src for p in got)
        assert [p.offset for p in got] == sorted(p.offset for p in got)  # in order: a successor can follow


# ----------------------------------------------------------------------------- nixl: bad input


def test_nixl_missing_names_the_extra(monkeypatch, store):
    address, _ = store
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(CapabilityError, match=r"pip install flashboot\[nixl\]"):
        flashboot.clone(address, "cpu", transport="nixl", timeout_s=2)
    a = Arena.create(2 * MiB, "cpu")
    try:
        with pytest.raises(CapabilityError, match=r"pip install flashboot\[nixl\]"):
            flashboot.seed(address, a, nixl=True, timeout_s=2)
    finally:
        a.close()
    info = {t.name: t for t in list_transports()}["nixl"]
    assert not info.available and "pip install flashboot[nixl]" in info.reason


def _publish_fake_seed(rdv, arena, manifest, nixl_record) -> None:
    rdv.publish(SEED_KEY, {"generation": "fake01", "pid": os.getpid(), "host": socket.gethostname(),
                           "device": "cpu", "manifest": manifest.to_dict(), "nccl": False, "nixl": True,
                           "published_at": time.time()},
                sealed={"arena": arena.export().to_dict(), "nixl": nixl_record})


@pytest.mark.parametrize("lie", ["fewer_bytes", "other_agent", "bad_metadata"])
def test_nixl_record_not_matching_the_manifest_is_refused_before_any_read(store, lie):
    address, rdv = store
    a = Arena.create(8 * MiB, "cpu")
    small = Arena.create(4 * MiB, "cpu")
    agent = nixl.Agent(f"fake-seed-{lie}")
    try:
        a.bytes().numpy()[:] = 7
        manifest = Manifest.of_arena(a)
        record = agent.register(small if lie == "fewer_bytes" else a)
        if lie == "other_agent":
            record = {**record, "agent": "somebody-else"}
        if lie == "bad_metadata":
            record = {**record, "metadata": nixl._b64(b"not nixl metadata at all")}
        _publish_fake_seed(rdv, a, manifest, record)
        before = dict(nixl.stats)
        with pytest.raises(RendezvousError) as info:
            flashboot.clone(address, "cpu", "star", transport="nixl", timeout_s=5)
        msg = str(info.value)
        if lie == "fewer_bytes":
            assert f"registers {small.nbytes:,} bytes" in msg and f"{a.nbytes:,}" in msg
        elif lie == "other_agent":
            assert "'somebody-else'" in msg and "fake-seed-other_agent" in msg
        else:
            assert "NIXL refused the agent metadata" in msg
        assert "refused before any READ" in msg or lie == "bad_metadata"
        assert nixl.stats["reads_posted"] == before["reads_posted"]  # not one READ was posted
    finally:
        agent.close()
        small.close()
        a.close()


_NIXL_SEED = """
import sys, numpy as np, flashboot
from flashboot.arena import Arena
a = Arena.create(8 << 20, "cpu")
a.bytes().numpy()[:] = np.arange(a.nbytes, dtype=np.uint64).view(np.uint8)[:a.nbytes]
s = flashboot.seed(sys.argv[1], a, nixl=True, serve_nccl=False, timeout_s=20)
print("ready", flush=True)
s.serve_forever()
"""


def test_remote_agent_gone_between_exchange_and_read(store):
    address, _ = store
    seed = spawn_python(_NIXL_SEED.replace("sys.argv[1]", repr(address)))
    try:
        assert seed.stdout.readline().startswith("ready"), seed.stderr.read()
        registered = nixl.stats["registrations"]
        outcome: dict = {}

        def run():
            try:  # 2 s before each READ is posted: the seed dies in that window, after the exchange
                flashboot.clone(address, "cpu", "star", transport="nixl", timeout_s=8, chunk_bytes=4 * MiB,
                                step_delay_s=2.0)
            except FlashBootError as exc:
                outcome["error"] = exc
            outcome["t"] = time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: nixl.stats["registrations"] > registered, 30, "the clone to register its arena")
        t_kill = time.monotonic()
        os.kill(seed.pid, signal.SIGKILL)
        t.join(40)
        assert not t.is_alive(), "the clone did not end within its deadline"
        err = outcome.get("error")
        assert err is not None, "the clone finished although its source died before any READ"
        assert "the seed" in str(err) and "step" in str(err), str(err)
        assert outcome["t"] - t_kill < 30
    finally:
        stop(seed)


def test_cli_seed_with_nixl_and_a_clone_over_nixl(store, tmp_path):
    """`flashboot seed DIR --nixl` and `flashboot clone --transport nixl --json -` on one machine."""
    import json

    from _clone_helpers import finish, make_prepacked_image, spawn_cli

    address, _ = store
    image = make_prepacked_image(tmp_path)
    seed = spawn_cli("seed", image, "--device", "cpu", "--store", address, "--nixl", "--timeout", "30")
    try:
        assert seed.stdout.readline().startswith("seed ready"), seed.stderr.read() if seed.poll() is not None else ""
        clone = spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "star", "--transport", "nixl",
                          "--verify", "--json", "-", "--timeout", "30")
        rc, out, err = finish(clone, 50)
        assert rc == 0, err[-3000:]
        report = json.loads(out[out.index("{"):])  # the summary line, then the JSON (NIXL's own log stays quiet)
        assert report["transport"] == "nixl" and report["verified"] and report["source"] == "the seed"
        assert report["transport_note"] == "asked for" and report["exchange_detail"]["register_ms"] > 0
    finally:
        stop(seed)


class _NativeAgent:
    """NIXL's agent as the transport calls it, recording what it was asked; a READ's handle can be
    held 'still aborting' (its release refused, as NIXL refuses one in progress)."""

    backends = ["UCX"]

    def __init__(self):
        self.removed: list[str] = []
        self.aborting: set[int] = set()
        self.handles = 0

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata

    def get_xfer_descs(self, descs, mem):
        return descs

    def initialize_xfer(self, op, local, remote, peer) -> int:
        self.handles += 1
        return self.handles

    def transfer(self, handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle) -> str:
        return "ERR"

    def release_xfer_handle(self, handle) -> None:
        if handle in self.aborting:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)


@pytest.fixture
def native(monkeypatch) -> _NativeAgent:
    """The stand-in every nixl.Agent made in the test wraps."""
    stand_in = _NativeAgent()
    monkeypatch.setattr(nixl, "nixl_module", lambda: None)
    monkeypatch.setattr(nixl, "_create_agent", lambda mod, name: stand_in)
    return stand_in


def test_a_dropped_peer_stays_loaded_until_its_aborting_read_is_released(native):
    """Unloading a dead peer while UCX still aborts a READ of it frees what UCX's threads use
    (ai-dynamo/nixl#1868): the agent defers the unload to that READ's release."""
    agent = nixl.Agent("defer-test")
    record = {"agent": "dead-peer", "metadata": nixl._b64(b"dead-peer")}
    assert agent.add_remote(record, "the dead peer") == "dead-peer"
    assert agent.add_remote({"agent": "idle-peer", "metadata": nixl._b64(b"idle-peer")}, "the idle peer") == "idle-peer"
    ticket = agent.read([(0, 1, 0)], [(0, 1, 0)], "DRAM", "DRAM", "dead-peer")
    native.aborting.add(agent._live[ticket])
    with pytest.raises(nixl.ReadFailed, match="READ failed"):
        agent.state(ticket)
    assert agent.release(ticket) is False  # NIXL is still aborting it
    agent.remove_remote("dead-peer")
    agent.remove_remote("idle-peer")
    assert native.removed == ["idle-peer"]  # no READ of it: unloaded at once; the dead one waits
    with pytest.raises(RendezvousError, match=r"'dead-peer'\) was dropped and a READ of it is still being aborted"):
        agent.add_remote(record, "the dead peer")
    native.aborting.clear()
    assert agent.release(ticket) is True
    assert native.removed == ["idle-peer", "dead-peer"]
    agent.close()
    assert native.removed == ["idle-peer", "dead-peer"]  # not twice


def test_close_leaves_a_peer_with_an_unreleasable_read_to_the_agents_destructor(native, monkeypatch):
    monkeypatch.setattr(nixl, "SETTLE_S", 0.05)
    agent = nixl.Agent("close-test")
    agent.add_remote({"agent": "dead-peer", "metadata": nixl._b64(b"dead-peer")}, "the dead peer")
    ticket = agent.read([(0, 1, 0)], [(0, 1, 0)], "DRAM", "DRAM", "dead-peer")
    native.aborting.add(agent._live[ticket])
    agent.close()
    assert native.removed == []  # the destructor unloads it after aborting the READ
