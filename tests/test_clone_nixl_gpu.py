"""FlashClone over NIXL between two GPUs (VRAM -> VRAM READs of registered VMM arenas).

Skipped without two CUDA devices (``two_gpus``). The lead runs them on the H200 x2 through
``benchmarks/gpu_nixl.sh``; ``flashboot bench clone --transport ...`` measures.
"""

from __future__ import annotations

import json

import pytest

import flashboot

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import MiB, finish, spawn_cli, stop

pytestmark = pytest.mark.timeout(120)
NBYTES = 96 * MiB  # not a multiple of the READ pieces or the segments' size: the last ones are short


def _seed_arena(device, nbytes=NBYTES, seed=3):
    from flashboot.arena import Arena
    from flashboot.benchmarks.clone import fill_random

    a = Arena.create(nbytes, device, segment_bytes=32 * MiB)  # several segments, each registered
    fill_random(a, a.nbytes, seed)
    return a


def _clones(address, name, devices, schedule, tmp_path):
    outs = [tmp_path / f"{name}{i}.json" for i in range(len(devices))]
    procs = [spawn_cli("clone", "--store", address, "--name", name, "--device", d, "--schedule", schedule,
                       "--clones", len(devices), "--transport", "nixl", "--chunk-bytes", "8MiB", "--verify",
                       "--json", out, "--timeout", 60)
             for d, out in zip(devices, outs)]
    try:
        reports = []
        for p, out in zip(procs, outs):
            rc, _out, err = finish(p, 110)
            assert rc == 0, err[-4000:]
            reports.append(json.loads(out.read_text()))
        return sorted(reports, key=lambda r: r["position"])
    finally:
        for p in procs:
            stop(p)


@pytest.mark.two_gpus
def test_nixl_vram_to_vram_one_clone_and_a_chain_of_two(store, tmp_path):
    address, _ = store
    a = _seed_arena(0)
    seeds = [flashboot.seed(address, a, 0, nixl=True, serve_nccl=False, name=n) for n in ("one", "chain")]
    try:
        (one,) = _clones(address, "one", ["cuda:1"], "star", tmp_path)
        assert one["transport"] == "nixl" and one["mover"] == "nixl/UCX" and one["verified"]
        assert one["source"] == "the seed" and one["device"] == "cuda:1" and one["nbytes"] == a.nbytes
        detail = one["exchange_detail"]
        assert detail["agent_create_ms"] > 0 and detail["register_ms"] > 0 and detail["add_remote_ms"] > 0
        first, second = _clones(address, "chain", ["cuda:1", "cuda:0"], "chain", tmp_path)
        assert first["source"] == "the seed" and second["source"] == "clone #1"
        assert first["verified"] and second["verified"] and {first["device"], second["device"]} == {"cuda:0", "cuda:1"}
    finally:
        for s in seeds:
            s.close()
        a.close()


@pytest.mark.two_gpus
def test_nixl_seed_registers_every_segment_of_a_vram_arena():
    from flashboot.flashclone.transports import nixl

    a = _seed_arena(0)
    agent = nixl.Agent("segments-probe")
    try:
        record = agent.register(a)
        assert record["mem"] == "VRAM" and record["devid"] == 0
        assert record["segments"] == [[0, 32 * MiB], [32 * MiB, 32 * MiB], [64 * MiB, 32 * MiB]]
        assert sum(n for _, n in record["segments"]) == a.nbytes
    finally:
        agent.close()
        a.close()
