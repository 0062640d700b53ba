"""FlashClone on CUDA: stream memory operations, peer mappings across processes, faults on GPUs.

Skipped without CUDA (``gpu``) or without two devices (``two_gpus``); the lead runs them on the
H200 x2. Sizes are small (tens of MB): these check behaviour, ``flashboot bench clone`` measures.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

import flashboot

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import MiB, finish, spawn_cli, stop, wait_until

pytestmark = pytest.mark.timeout(60)
NBYTES = 64 * MiB
CHUNK = 4 * MiB



def _seed_arena(device, nbytes=NBYTES, seed=1):
    from flashboot.arena import Arena
    from flashboot.benchmarks.clone import fill_random

    a = Arena.create(nbytes, device)
    fill_random(a, a.nbytes, seed)
    return a


def _flags(endpoint, count: int) -> list[int]:
    """The first ``count`` flag words of ``endpoint``, as the host reads them."""
    import torch

    torch.cuda.synchronize()
    return endpoint.flags.bytes()[:4 * count].view(torch.int32).cpu().tolist()


def _equal(a, b) -> bool:
    return bool((a.bytes() == b.bytes().to(a.bytes().device)).all())


# ---------------------------------------------------------------------------- executor, one GPU


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["chain", "star"])
def test_stream_memop_pipeline_is_byte_exact(schedule):
    from flashboot.arena import Arena
    from flashboot.flashclone.executor import Endpoint, Executor, create_flags
    from flashboot.schedulers import build_plan

    plan = build_plan(schedule, 3, NBYTES, CHUNK)
    eps = {0: Endpoint(0, "seed", _seed_arena(0))}
    for p in plan.receivers():
        eps[p.index] = Endpoint(p.index, p.name, Arena.create(NBYTES, 0), create_flags(plan.flag_count(p.index), 0))
    try:
        rep = Executor(plan, eps, [1, 2, 3], mover="copy_engine").run()
        assert rep.backend == "cuda" and sum(l.steps for l in rep.lanes) == len(plan)
        for i in (1, 2, 3):
            assert _equal(eps[0].arena, eps[i].arena), i
            assert _flags(eps[i], plan.flag_count(i)) == [1] * plan.flag_count(i), i
        # a second run on the same flags needs a new epoch, and works with one (on streams and
        # events the first run handed back to the pool)
        for i in (1, 2, 3):
            eps[i].arena.bytes().zero_()
        Executor(plan, eps, [1, 2, 3], epoch=2).run()
        assert all(_equal(eps[0].arena, eps[i].arena) for i in (1, 2, 3))
        # a star's steps wait for nothing: each receiver's flags are raised by one memset
        assert all(_flags(eps[i], plan.flag_count(i)) == [2] * plan.flag_count(i) for i in (1, 2, 3))
    finally:
        for ep in eps.values():
            for a in (ep.flags, ep.arena):
                if a is not None:
                    a.close()


@pytest.mark.gpu
def test_blocked_stream_is_released_from_the_host_and_reported():
    from flashboot.arena import Arena
    from flashboot.flashclone.executor import Endpoint, Executor, StepFailure, create_flags
    from flashboot.schedulers import build_plan

    plan = build_plan("chain", 2, NBYTES, CHUNK)
    eps = {0: Endpoint(0, "seed", _seed_arena(0))}
    for p in plan.receivers():
        eps[p.index] = Endpoint(p.index, p.name, Arena.create(NBYTES, 0), create_flags(plan.flag_count(p.index), 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(StepFailure, match="made no progress for 0.5 s; blocked streams released") as e:
            Executor(plan, eps, 2, timeout_s=0.5).run()  # clone0 never runs: clone1's waits never clear
        assert time.monotonic() - t0 < 15
        err = e.value
        assert err.released and err.peer == 1 and err.valid_steps == set()
        assert err.tainted_steps == {s.id for s in plan.steps_into(2)}
    finally:
        for ep in eps.values():
            for a in (ep.flags, ep.arena):
                if a is not None:
                    a.close()


@pytest.mark.gpu
def test_seed_and_clones_in_one_process_on_a_gpu(store):
    address, _ = store
    a = _seed_arena(0)
    s = flashboot.seed(address, a, 0)
    results, errors = [], []

    def one():
        try:
            results.append(flashboot.clone(address, 0, "chain", clones=2, chunk_bytes=CHUNK, verify=True,
                                           timeout_s=30))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    try:
        assert not errors, errors
        for r in results:
            assert r.report.verified and r.report.transport == "posix_fd" and _equal(a, r.arena)
    finally:
        for r in results:
            r.close()
        s.close()
        a.close()


# ---------------------------------------------------------------------------- two GPUs, processes


@pytest.mark.two_gpus
def test_chain_across_gpus_and_processes(store, tmp_path):
    address, _ = store
    a = _seed_arena(0)
    s = flashboot.seed(address, a, 0)
    procs = []
    try:
        outs = [tmp_path / f"c{i}.json" for i in range(3)]
        procs = [spawn_cli("clone", "--store", address, "--device", f"cuda:{(i + 1) % 2}", "--schedule", "chain",
                           "--clones", 3, "--chunk-bytes", "4MiB", "--verify", "--json", outs[i], "--timeout", 30)
                 for i in range(3)]
        reports = []
        for p, out in zip(procs, outs):
            rc, _out, err = finish(p, 55)
            assert rc == 0, err
            reports.append(json.loads(out.read_text()))
        assert all(r["verified"] and r["transport"] == "posix_fd" for r in reports)
        assert sorted(r["source"] for r in reports) == ["clone #1", "clone #2", "seed"]
        for r in reports:  # the driver warm-up ran before the exchange; the exchange splits into its steps
            assert r["warm_ms"] > 0
            detail = r["exchange_detail"]
            assert detail["import_ms"] > 0 and detail["set_access_ms"] > 0 and detail["pidfd_getfd_ms"] > 0
            assert r["exchange_ms"] >= detail["seed_record_ms"] + detail["open_sources_ms"]
    finally:
        for p in procs:
            stop(p)
        s.close()
        a.close()


@pytest.mark.two_gpus
def test_clone_killed_mid_chain_on_gpus_successor_recovers(store):
    address, rdv = store
    a = _seed_arena(0)
    s = flashboot.seed(address, a, 0)
    gen = s.generation
    first = spawn_cli("clone", "--store", address, "--device", "cuda:1", "--schedule", "chain", "--chunk-bytes",
                      "4MiB", "--timeout", 30, FLASHBOOT_TEST_STEP_DELAY_S=0.05)
    box = {}
    try:
        wait_until(lambda: rdv.has(f"g/{gen}/chain/member/1"), 40, "clone #1 to join", first)

        def second():
            try:
                box["r"] = flashboot.clone(address, 0, "chain", chunk_bytes=CHUNK, verify=True, timeout_s=20)
            except BaseException as exc:
                box["e"] = exc

        t = threading.Thread(target=second)
        t.start()
        wait_until(lambda: rdv.has(f"g/{gen}/chain/member/2"), 30, "clone #2 to join")
        time.sleep(0.3)
        first.kill()
        t.join(50)
        assert not t.is_alive()
        assert "e" not in box, box.get("e")
        with box["r"] as r:
            assert r.report.verified and _equal(a, r.arena)
            assert any("exited" in e for e in r.report.recovered)
    finally:
        stop(first)
        s.close()
        a.close()


@pytest.mark.two_gpus
def test_broadcast_fallback_on_gpus(store, tmp_path):
    address, _ = store
    a = _seed_arena(0)
    s = flashboot.seed(address, a, 0)
    out = tmp_path / "c.json"
    p = spawn_cli("clone", "--store", address, "--device", "cuda:1", "--schedule", "star", "--transport", "nccl",
                  "--verify", "--json", out, "--timeout", 40)
    try:
        rc, _o, err = finish(p, 58)
        assert rc == 0, err
        rep = json.loads(out.read_text())
        assert rep["transport"] == "nccl" and rep["mover"] == "nccl" and rep["verified"]
    finally:
        stop(p)
        s.close()
        a.close()


@pytest.fixture
def shm_path():
    """A file path in /dev/shm (tmpfs), removed afterwards: pinning a shared mapping of a file on a
    disk filesystem is refused by the driver on our machines (CUDA_ERROR_INVALID_VALUE), as the
    ring loader's error says; staged images live in /dev/shm."""
    import os
    import secrets
    from pathlib import Path

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    path = Path("/dev/shm") / f"flashboot-test-{secrets.token_hex(6)}.bin"
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.two_gpus
def test_ring_load_on_two_gpus(store, shm_path):
    from _clone_helpers import write_raw_image

    address, _ = store
    path = shm_path
    write_raw_image(path, 48 * MiB + 4096, 9)
    results, errors = [], []

    def member(dev):
        try:
            results.append(flashboot.clone(address, dev, "ring", image=path, clones=2, chunk_bytes=CHUNK,
                                           verify=True, timeout_s=30))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(55)
    try:
        assert not errors, errors
        assert len(results) == 2 and all(r.report.verified for r in results)
    finally:
        for r in results:
            r.close()


@pytest.mark.gpu
def test_pinning_a_disk_file_is_refused_with_what_to_do(tmp_path):
    """Where the driver refuses to pin a shared mapping of a file on disk (ours: ext4 ->
    CUDA_ERROR_INVALID_VALUE), the error names the path, the bytes and the fix (/dev/shm)."""
    from _clone_helpers import write_raw_image

    from flashboot.flashclone.sources import _HostImage
    from flashboot.pinning import fs_type as _fs_type
    from flashboot.errors import CapabilityError
    from flashboot.memory import Device

    path = tmp_path / "image.bin"
    write_raw_image(path, 4 * MiB, 2)
    if _fs_type(str(path)) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on tmpfs here: nothing on disk to refuse")
    try:
        img = _HostImage(path, Device.parse("cuda:0"), pin=(0, 4 * MiB))
    except CapabilityError as exc:
        msg = str(exc)
        assert str(path) in msg and "4,194,304 bytes" in msg and "/dev/shm" in msg and "flashboot preload" in msg
    else:  # this driver pins file-backed pages: the loader works from disk too
        img.close()


@pytest.mark.two_gpus
def test_warm_import_keeps_one_granule_per_peer_until_released():
    from flashboot.arena import release_warm_imports, warm_import

    release_warm_imports()
    out = warm_import("cuda:1")
    assert out["errors"] == [] and sorted(out["peers"]) == [0, 1] and out["warm_ms"] > 0
    again = warm_import("cuda:1", peers=[0])  # kept: nothing to do again
    assert again["errors"] == [] and again["peers"] == [0]
    assert release_warm_imports() == 2 and release_warm_imports() == 0
    cold = warm_import("cuda:1", peers=[0], keep=False)
    assert cold["errors"] == [] and cold["peers"] == [0] and release_warm_imports() == 0


@pytest.mark.two_gpus
def test_sweep_chunks_on_two_gpus():
    from flashboot.benchmarks.clone import sweep_chunks

    for schedule in ("chain", "star", "ring"):
        rows = sweep_chunks(schedule, [4 * MiB, 16 * MiB], NBYTES, clones=3, devices=["cuda:0", "cuda:1"], repeats=1)
        assert all(r["verified"] for r in rows), schedule
        assert all(g > 0 for r in rows for g in r["per_clone_gbps"])


# ---------------------------------------------------------------------------- the holder, CUDA

_ENGINE = """
import sys, torch
from flashboot.arena import Arena
from flashboot.flashclone.holder import hand_over
from flashboot.kernels.checksum import checksum
a = Arena.create(32 << 20, 0)
a.bytes().random_(0, 256, generator=torch.Generator(device="cuda:0").manual_seed(5))
torch.cuda.synchronize()
d = hand_over(a, "weights", registry=sys.argv[1], timeout_s=30)
print(d.arena_id, checksum(a.span()))
"""

_RESTARTED = """
import sys, time
from flashboot.flashclone.holder import open_held
from flashboot.kernels.checksum import checksum
t0 = time.perf_counter()
a = open_held("weights", registry=sys.argv[1])
ms = (time.perf_counter() - t0) * 1e3
print(a.arena_id, checksum(a.span()), f"{ms:.2f}")
a.close()
"""


@pytest.mark.gpu
def test_holder_keeps_gpu_weights_across_an_engine_restart(tmp_path):
    import subprocess
    import sys

    registry = tmp_path / "registry"
    holder = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: (registry / "held").is_dir(), 30, "the holder", holder)

        def run(code):
            p = subprocess.run([sys.executable, "-c", code, str(registry)], capture_output=True, text=True, timeout=50)
            assert p.returncode == 0, p.stderr
            return p.stdout.split()

        arena_id, digest = run(_ENGINE)  # the engine exits: only the holder keeps the allocation
        again_id, again_digest, _ms = run(_RESTARTED)
        assert (again_id, again_digest) == (arena_id, digest)
    finally:
        stop(holder)
