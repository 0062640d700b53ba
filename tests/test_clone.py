"""FlashClone on the host backend: the executor on real plans, seed and clones through a real
TCPStore (in threads and in processes), the ring load, the broadcast fallback, the chunk sweep.
GPU versions: tests/test_clone_gpu.py; the holder: tests/test_holder.py."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import flashboot
from flashboot.arena import Arena
from flashboot.errors import ArenaError, FlashBootError, RendezvousError, UnknownNameError, WaitTimeoutError
from flashboot.flashclone.executor import Endpoint, Executor, StepFailure, create_flags, rewire
from flashboot.memory import span_of
from flashboot.schedulers import HOST, build_plan

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import (
    CHUNK, MiB, close_endpoints, finish, make_prepacked_image, pattern, spawn_cli, stop, write_raw_image,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_prepacked_image(tmp_path_factory.mktemp("image"))


def _participants(plan, nbytes, data):
    eps = {}
    for p in plan.participants:
        a = Arena.create(nbytes, "cpu")
        if p.role == "seed":
            a.bytes().numpy()[:nbytes] = data
            eps[p.index] = Endpoint(p.index, p.name, a, None)
        else:
            eps[p.index] = Endpoint(p.index, p.name, a, create_flags(plan.flag_count(p.index), "cpu"))
    return eps


# ------------------------------------------------------------------------------------- executor


@pytest.mark.parametrize("schedule", ["chain", "star", "ring"])
def test_executor_delivers_every_schedule_byte_exact(schedule):
    nbytes = 2 * MiB + 12_345
    data = pattern(nbytes, 1)
    plan = build_plan(schedule, 3, nbytes, CHUNK)
    eps = _participants(plan, nbytes, data)
    try:
        receivers = [p.index for p in plan.receivers()]
        rep = Executor(plan, eps, receivers, host_image=span_of(data)).run()
        for i in receivers:
            assert np.array_equal(eps[i].arena.bytes().numpy()[:nbytes], data), f"participant {i}"
            assert rep.participant_nbytes(i) == sum(s.nbytes for s in plan.steps_into(i))
            assert all(v == 1 for v in np.frombuffer(eps[i].flags.bytes().numpy(), np.uint32)[:plan.flag_count(i)])
        assert sum(l.steps for l in rep.lanes) == len(plan)
    finally:
        close_endpoints(eps)


def test_executor_batches_the_steps_no_one_waits_on():
    """Star: every step of a clone reads the seed and no step waits on it -> one unit per lane,
    and its steps continue one another, so one copy per lane (what a batch would merge them
    into). Chain: every step either waits or is awaited -> one copy per step, each raising its flag.
    A unit whose steps leave gaps is one batch."""
    from flashboot.movers.host import HostMover

    class Counting(HostMover):
        def __init__(self):
            super().__init__()
            self.calls, self.batches = 0, []

        def copy(self, *a, **k):
            self.calls += 1
            return super().copy(*a, **k)

        def copy_batch(self, dst, src, chunks, **k):
            self.batches.append(len(chunks))
            return super().copy_batch(dst, src, chunks, **k)

    nbytes = 2 * MiB + 12_345
    data = pattern(nbytes, 2)
    for schedule in ("star", "chain"):
        plan = build_plan(schedule, 3, nbytes, CHUNK)
        eps = _participants(plan, nbytes, data)
        mover = Counting()
        try:
            receivers = [p.index for p in plan.receivers()]
            Executor(plan, eps, receivers, mover=mover).run()
            for i in receivers:
                assert np.array_equal(eps[i].arena.bytes().numpy()[:nbytes], data), (schedule, i)
            if schedule == "star":
                assert mover.batches == [] and mover.calls == len(receivers)
            else:
                assert mover.batches == [] and mover.calls == len(plan)
        finally:
            close_endpoints(eps)
    plan = build_plan("star", 1, nbytes, CHUNK)
    eps = _participants(plan, nbytes, data)
    mover = Counting()
    try:
        steps = plan.steps_into(1)
        gappy = [st for j, st in enumerate(steps) if j != 1]  # the second chunk left out: two runs
        Executor(plan, eps, [1], mover=mover, steps=gappy).run()
        got = eps[1].arena.bytes().numpy()
        for st in gappy:
            assert np.array_equal(got[st.offset:st.end], data[st.offset:st.end])
        assert mover.calls == 0 and mover.batches == [len(gappy)]
    finally:
        close_endpoints(eps)


def test_steps_from_a_source_opened_lazily_map_it_as_they_go():
    """A source opened from an export maps its segments on first use: a batchable run of steps
    from it is copied in groups of 1, 2, 4, 4, ... unmapped segments (MAP_GROUP_MAX_SEGMENTS), each
    group's segments mapped just before its copy (so on a GPU the mapping of one group overlaps
    the copy of the one before); segments mapped already are one copy; once all are mapped, one copy."""
    from flashboot.flashclone.executor import MAP_GROUP_MAX_SEGMENTS
    from flashboot.movers.host import HostMover

    assert MAP_GROUP_MAX_SEGMENTS == 4  # the groups below
    seg = 2 * MiB
    nbytes = 10 * seg
    data = pattern(nbytes, 3)

    class Recording(HostMover):
        def __init__(self, source, target):
            super().__init__()
            self.source, self.target, self.copies, self.batches = source, target, [], []

        def copy(self, dst, src, **k):  # (offset, source bytes mapped so far); the source's ptr would map it all
            self.copies.append((dst.ptr - self.target.ptr, self.source.mapped_nbytes))
            return super().copy(dst, src, **k)

        def copy_batch(self, dst, src, chunks, **k):
            self.batches.append((len(chunks), self.source.mapped_nbytes // seg))
            return super().copy_batch(dst, src, chunks, **k)

    plan = build_plan("star", 1, nbytes, seg)
    with Arena.create(nbytes, "cpu", segment_bytes=seg) as owner:
        owner.bytes().numpy()[:] = data
        with Arena.open(owner.export()) as source, Arena.create(nbytes, "cpu", segment_bytes=seg) as dst, \
                create_flags(plan.flag_count(1), "cpu") as flags:
            eps = {0: Endpoint(0, "seed", source, None), 1: Endpoint(1, "clone", dst, flags)}
            mover = Recording(source, dst)
            Executor(plan, eps, 1, mover=mover).run()
            # (offset, source bytes mapped): the first segment, mapped at open, alone, then groups
            # of 1, 2, 4 and 2 segments, each one copy (its steps continue one another), each group
            # mapped just before its copy: one group ahead, no more
            assert mover.copies == [(0, seg), (seg, 2 * seg), (2 * seg, 4 * seg), (4 * seg, 8 * seg),
                                    (8 * seg, 10 * seg)]
            assert mover.batches == []
            assert np.array_equal(dst.bytes().numpy(), data)
            dst.bytes().numpy()[:] = 0
            Executor(plan, eps, 1, mover=mover, epoch=2).run()  # mapped now: the run is one copy
            assert mover.copies[5:] == [(0, 10 * seg)] and mover.batches == []
            assert np.array_equal(dst.bytes().numpy(), data)
        # chunks smaller than a segment: the same groups of segments, each one copy mapped just before it
        half = build_plan("star", 1, nbytes, seg // 2)
        with Arena.open(owner.export()) as source, Arena.create(nbytes, "cpu", segment_bytes=seg) as dst, \
                create_flags(half.flag_count(1), "cpu") as flags:
            mover = Recording(source, dst)
            Executor(half, {0: Endpoint(0, "seed", source, None), 1: Endpoint(1, "clone", dst, flags)}, 1,
                     mover=mover).run()
            assert mover.copies == [(0, seg), (seg, 2 * seg), (2 * seg, 4 * seg), (4 * seg, 8 * seg),
                                    (8 * seg, 10 * seg)]
            assert mover.batches == []
            assert np.array_equal(dst.bytes().numpy(), data)
        # segments mapped ahead (a clone maps them while its own arena is made): one copy for all of
        # them, issued before any mapping, then the unmapped ones in groups of 1, 2, ...
        with Arena.open(owner.export()) as source, Arena.create(nbytes, "cpu", segment_bytes=seg) as dst, \
                create_flags(half.flag_count(1), "cpu") as flags:
            source.map_range(0, 5 * seg)
            assert source.mapped_segments() == (True,) * 5 + (False,) * 5
            mover = Recording(source, dst)
            Executor(half, {0: Endpoint(0, "seed", source, None), 1: Endpoint(1, "clone", dst, flags)}, 1,
                     mover=mover).run()
            assert mover.copies == [(0, 5 * seg), (5 * seg, 6 * seg), (6 * seg, 8 * seg), (8 * seg, 10 * seg)]
            assert mover.batches == [] and source.mapped_segments() == (True,) * 10
            assert np.array_equal(dst.bytes().numpy(), data)


def test_flags_of_an_earlier_epoch_do_not_satisfy_a_later_run():
    nbytes = MiB
    data = pattern(nbytes, 2)
    plan = build_plan("chain", 2, nbytes, CHUNK)
    eps = _participants(plan, nbytes, data)
    try:
        Executor(plan, eps, [1, 2], epoch=1).run()
        eps[2].arena.bytes().numpy()[:] = 0
        # clone #2 alone at epoch 2: clone #1's flags still say 1, so it must not start
        with pytest.raises(StepFailure, match=r"waited 0.3 s for step \d+'s flag 0 of clone0 \(still 1, needs 2\)") as e:
            Executor(plan, eps, 2, epoch=2, timeout_s=0.3).run()
        assert e.value.peer == 1 and e.value.valid_steps == set() and not e.value.peer_exited
        assert not eps[2].arena.bytes().numpy().any()
        Executor(plan, eps, [1, 2], epoch=2).run()
        assert np.array_equal(eps[2].arena.bytes().numpy()[:nbytes], data)
    finally:
        close_endpoints(eps)


def test_rewire_reattaches_upstream_then_to_a_fallback():
    plan = build_plan("chain", 3, 4 * CHUNK, CHUNK)
    mine = plan.steps_into(3)
    via_seed = rewire(plan, mine, 2, dead={1})  # clones 1 and 2 gone: read from the seed
    assert [(s.src, s.waits, s.kind) for s in via_seed] == [(0, (), "copy")] * 4
    assert [(s.id, s.signal, s.offset) for s in via_seed] == [(s.id, s.signal, s.offset) for s in mine]
    via_1 = rewire(plan, mine, 2)
    assert all(s.src == 1 and len(s.waits) == 1 and plan.steps[s.waits[0]].dst == 1 for s in via_1)
    with pytest.raises(FlashBootError, match="no fallback source"):
        rewire(plan, plan.steps_into(1), 0)
    from_host = rewire(plan, plan.steps_into(1), 0, fallback=HOST)
    assert all(s.kind == "h2d" and s.src == HOST for s in from_host)


def test_executor_refuses_missing_endpoints_and_unknown_movers():
    plan = build_plan("chain", 1, MiB, CHUNK)
    a = Arena.create(MiB, "cpu")
    f = create_flags(plan.flag_count(1), "cpu")
    try:
        with pytest.raises(FlashBootError, match="reads from participant 0, which has no mapped arena"):
            Executor(plan, {1: Endpoint(1, "c", a, f)}, 1)
        with pytest.raises(UnknownNameError, match="unknown mover 'warp'"):
            Executor(plan, {0: Endpoint(0, "s", a), 1: Endpoint(1, "c", a, f)}, 1, mover="warp")
        ring = build_plan("ring", 2, MiB, CHUNK)
        with pytest.raises(FlashBootError, match="pass host_image="):
            Executor(ring, {0: Endpoint(0, "m0", a, f), 1: Endpoint(1, "m1", a, f)}, 0)
    finally:
        f.close()
        a.close()


# ------------------------------------------------------------------------------ seed and clones


def _seed_arena(nbytes: int, seed: int):
    a = Arena.create(nbytes, "cpu")
    data = pattern(a.nbytes, seed)
    a.bytes().numpy()[:] = data
    return a, data


def _run_clones(address, n, schedule, **kw):
    results, errors = {}, []

    def one(i):
        try:
            results[i] = flashboot.clone(address, "cpu", schedule, clones=n, chunk_bytes=CHUNK, timeout_s=10, **kw)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert not errors, errors
    return sorted(results.values(), key=lambda r: r.report.position)


@pytest.mark.parametrize("schedule", ["chain", "star"])
def test_seed_and_clones_in_one_process(store, schedule):
    address, _ = store
    a, data = _seed_arena(4 * MiB, 3)
    s = flashboot.seed(address, a, "cpu", checksum_chunk_bytes=MiB)
    try:
        results = _run_clones(address, 3, schedule, verify=True)
        assert [r.report.position for r in results] == [1, 2, 3]
        for r in results:
            assert np.array_equal(r.arena.bytes().numpy(), data)
            rep = r.report
            assert rep.transport == "posix_fd" and rep.verified and rep.nbytes == a.nbytes
            assert rep.chunk_bytes == CHUNK and rep.transfer_ms > 0 and rep.recovered == []
        expected = ["seed", "clone #1", "clone #2"] if schedule == "chain" else ["seed"] * 3
        assert [r.report.source for r in results] == expected
        for r in results:
            rep, detail = r.report, r.report.exchange_detail
            # the exchange runs from the seed-record request to every source mapped, and splits
            assert detail["seed_record_ms"] == rep.manifest_ms and rep.exchange_ms >= rep.manifest_ms
            assert detail["pidfd_getfd_ms"] > 0 and detail["map_ms"] > 0 and detail["open_ms"] > 0
            assert rep.exchange_ms >= detail["seed_record_ms"] + detail["open_sources_ms"]
            if rep.position > 1 and schedule == "chain":  # read a clone's record and mapped its flags too
                assert detail["member_record_ms"] > 0 and detail["flags_open_ms"] > 0
            else:
                assert "member_record_ms" not in detail and "flags_open_ms" not in detail
            # weights-ready excludes verification; the total includes it
            assert 0 < rep.ready_ms <= rep.total_ms - rep.verify_ms + 1e-6 and rep.verify_ms > 0
            assert 0 < rep.ready_unix <= rep.finished_unix
            assert rep.warm_note == "compiled the host mover's parallel loop"  # while connecting
    finally:
        for r in results:
            r.close()
        s.close()
        a.close()


def test_the_early_call_imports_the_executors_lanes_that_the_transfer_would_import():
    # in a fresh process: an import inside the transfer cost a same-GPU clone ~1 ms of its ~6.7 ms copy
    from _python import run_python

    code = ("import sys, flashboot\n"
            "from flashboot.flashclone.report import CloneReport\n"
            "assert 'flashboot.flashclone.lanes' not in sys.modules\n"
            "w = flashboot.prepare_clone('cpu', mover='host')\n"
            "w.join(CloneReport('star', 1, 'cpu', 0), 120, 'copy')\n"
            "print('flashboot.flashclone.lanes' in sys.modules, w.errors)")
    assert run_python("-c", code, timeout=300).split() == ["True", "[]"]


def test_an_early_call_pays_the_clones_one_time_costs_and_the_report_names_them(store):
    address, _ = store
    a, data = _seed_arena(4 * MiB, 5)
    s = flashboot.seed(address, a, "cpu", checksum_chunk_bytes=MiB)
    try:
        warm = flashboot.prepare_clone("cpu", verify=True, mover="host")  # before the clone knows its source
        with flashboot.clone(address, "cpu", "star", verify=True, timeout_s=10, prepared=warm) as r:
            assert np.array_equal(r.arena.bytes().numpy(), data)
            rep = r.report
            # the numba copy and checksum, the fd table's room for the seed's segment fds, the executor's lanes
            assert set(rep.warm_detail) == {"fd table", "executor lanes", "host copy", "host checksum"}
            d = rep.connect_detail
            assert rep.warm_ms >= max(rep.warm_detail.values()) and d["warm_wait_ms"] <= rep.warm_wait_ms
            assert set(rep.warm_waits) == {"map", "copy", "verify"}  # waited for where each part is needed
            assert sum(rep.warm_waits.values()) == pytest.approx(rep.warm_wait_ms)
            assert rep.phases()["warm-up wait before the copy"] == rep.warm_waits["copy"]
            assert set(d) == {"start_ms", "import_ms", "store_ms", "warm_wait_ms", "other_ms"}
            assert sum(d.values()) == pytest.approx(rep.connect_ms, abs=0.01)
            assert sum(rep.phases().values()) == pytest.approx(rep.ready_ms, abs=0.01)
    finally:
        s.close()
        a.close()


@pytest.mark.parametrize("ours", ["made in the background", "given"])
def test_the_sources_segments_are_mapped_while_our_arena_is_still_being_made(store, monkeypatch, ours):
    """Our own arena is made in the background during the exchange; while it is, the seed's
    segments are mapped in the order the copy reads them (the copy then maps none). An arena the
    caller gives (a refit's) leaves them to the copy, one group ahead of its copies, as before."""
    import time

    address, _ = store
    seed_arena = Arena.create(16 * MiB, "cpu", segment_bytes=2 * MiB)  # 8 segments (the host's granularity)
    data = pattern(seed_arena.nbytes, 11)
    seed_arena.bytes().numpy()[:] = data
    into = Arena.create(16 * MiB, "cpu") if ours == "given" else None
    real_create = Arena.create

    def slow_create(*args, **kwargs):
        time.sleep(0.6)  # the driver's calls for a large arena
        return real_create(*args, **kwargs)

    monkeypatch.setattr(Arena, "create", staticmethod(slow_create))
    s = flashboot.seed(address, seed_arena, "cpu", checksum_chunk_bytes=MiB)
    try:
        with flashboot.clone(address, "cpu", "star", verify=True, chunk_bytes=2 * MiB, timeout_s=10, into=into) as r:
            assert np.array_equal(r.arena.bytes().numpy(), data)
            rep = r.report
            d = rep.alloc_detail  # the rest of alloc_ms, split
            assert set(d) == {"our_arena_ms", "flags_ms", "export_ms", "record_ms"} and min(d.values()) >= 0
            assert sum(d.values()) + rep.map_ahead_ms == pytest.approx(rep.alloc_ms, abs=0.1)
            if into is None:
                assert rep.segments_mapped_ahead == 7 and rep.segments_mapped_during_copy == 0  # the 1st: at open
                assert 0 < rep.map_ahead_ms <= rep.alloc_ms and d["our_arena_ms"] > 0
                assert rep.phases()["map ahead (our arena still being made)"] == rep.map_ahead_ms
            else:
                assert rep.segments_mapped_ahead == 0 and rep.segments_mapped_during_copy == 7
                assert rep.map_ahead_ms == 0
            assert sum(rep.phases().values()) == pytest.approx(rep.ready_ms, abs=0.01)
    finally:
        s.close()
        seed_arena.close()
        if into is not None:
            into.close()


def test_the_summary_names_every_phase_over_5_percent_of_ready():
    from flashboot.flashclone import CloneReport

    rep = CloneReport("star", 1, "cuda:0", 13_760_000_000, source="seed", connect_ms=3_650.0,
                      connect_detail={"import_ms": 3_300.0, "store_ms": 4.0, "warm_wait_ms": 340.0, "other_ms": 6.0},
                      warm_ms=700.0, warm_detail={"CUDA context": 330.0, "peer import": 2.0, "copy stream": 150.0},
                      exchange_ms=25.0, alloc_ms=9.0, transfer_ms=8.6, ready_ms=3_700.0, verify_ms=6.0,
                      total_ms=3_706.0, verified=True)
    line = rep.summary()
    assert "ready 3700.0 ms (import torch 3300.0 ms, warm-up wait (of its 700 ms: CUDA context 330) 340.0 ms)" in line
    assert "store" not in line and "alloc" not in line  # under 5 % of ready
    assert "exchange+map 25.00 ms, transfer 8.6 ms" in line and "+ verify 6.0 ms" in line
    assert sum(rep.phases().values()) == pytest.approx(rep.ready_ms)
    # a clone whose connect is not split (a ring member): the whole connect is one phase
    ring = CloneReport("ring", 2, "cpu", 1, connect_ms=50.0, load_ms=40.0, transfer_ms=10.0, ready_ms=100.0)
    assert "ready 100.0 ms (connect, other 50.0 ms, load 40.0 ms)" in ring.summary()


def test_clone_of_a_prepacked_image_carries_its_tensors(store, image):
    from flashboot.layouts import read_image

    address, _ = store
    img = read_image(image, 0)
    s = flashboot.seed(address, image, "cpu")
    try:
        assert s.manifest.key_digest == img.metadata.key.digest
        with flashboot.clone(address, "cpu", "star", expect=img.metadata.key, verify=True, timeout_s=10) as r:
            assert r.arena.nbytes == 4 * MiB and r.report.nbytes == img.nbytes
            assert set(r.tensors) == set(img.tensors)
            for name in img.tensors:
                assert r.tensors[name].dtype == img.view(name).dtype
                assert bool((r.tensors[name] == img.view(name)).all()), name
    finally:
        s.close()
        img.close()


def test_cli_chain_clones_in_processes(store, image, tmp_path):
    address, rdv = store
    seed = flashboot.seed(address, image, "cpu")  # `flashboot seed` runs as a process in test_clone_faults
    clones = []
    try:
        outs = [tmp_path / f"c{i}.json" for i in range(2)]
        clones = [spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "chain", "--clones", 2,
                            "--chunk-bytes", "256KiB", "--verify", "--json", outs[i], "--timeout", 15) for i in range(2)]
        reports = []
        for p, out in zip(clones, outs):
            rc, stdout, stderr = finish(p, 25)
            assert rc == 0, stderr
            assert "verified byte-exact" in stdout
            reports.append(json.loads(out.read_text()))
        reports.sort(key=lambda r: r["position"])
        assert [r["source"] for r in reports] == ["seed", "clone #1"]
        assert all(r["verified"] and r["transport"] == "posix_fd" for r in reports)
        assert all(r["stream_gbps"] > 0 and r["exchange_ms"] > 0 for r in reports)
    finally:
        for p in clones:
            stop(p)
        seed.close()


@pytest.mark.timeout(240)
def test_cli_chain_clones_run_one_after_another_read_calmly_from_the_seed(store, image, tmp_path):
    """Each clone of a chain run one after another finds its predecessor finished and exited: it is
    not tried (it used to be, and "recovered: source #1 could not be mapped" looked like an error),
    the report says why the seed is the source, and stderr stays empty (no c10d warnings)."""
    address, rdv = store
    seed = flashboot.seed(address, image, "cpu")
    try:
        reports = []
        for i in range(3):
            out = tmp_path / f"c{i}.json"
            rc, stdout, stderr = finish(spawn_cli("clone", "--store", address, "--device", "cpu", "--verify",
                                                  "--json", out, "--timeout", 15), 60)
            assert rc == 0 and stderr == "", stderr
            assert "recovered" not in stdout and "verified byte-exact" in stdout, stdout
            reports.append(json.loads(out.read_text()))
        assert [r["position"] for r in reports] == [1, 2, 3]
        assert [r["source"] for r in reports] == ["seed"] * 3
        assert [r["source_note"] for r in reports] == ["", "clone #1 had finished and exited",
                                                      "clones #1..#2 had finished and exited"]
        assert all(r["recovered"] == [] and r["warnings"] == [] for r in reports)
        # the host mover's compile ran while connecting, not in the transfer (issue 21: 0.6 s of a 2 MB clone),
        # and with the host checksum in the CLI's early call
        assert all(r["warm_note"] == "compiled the host mover's parallel loop" for r in reports)
        assert all(set(r["warm_detail"]) == {"fd table", "executor lanes", "host copy", "host checksum"}
                   for r in reports)
        # the CLI imports torch early: the report names that import's whole length beside the wait for it
        assert all(set(r["connect_detail"]) == {"start_ms", "import_ms", "store_ms", "warm_wait_ms", "other_ms",
                                                "torch_import_early_ms"} for r in reports)
        assert all(r["connect_detail"]["torch_import_early_ms"] >= r["connect_detail"]["import_ms"] for r in reports)
        assert "from seed (clones #1..#2 had finished and exited)" in stdout
    finally:
        seed.close()


@pytest.mark.timeout(120)
def test_cli_store_waits_that_run_out_print_one_line(store):
    """c10d warns twice on stderr for every store wait that times out; the CLI shows only its error."""
    address, _ = store
    rc, _, stderr = finish(spawn_cli("clone", "--store", address, "--device", "cpu", "--name", "nobody-here",
                                     "--timeout", 1), 60)
    assert rc == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("flashboot clone: error: waited 1 s for the seed's manifest and descriptor")


# ------------------------------------------------------------------------------------- ring


def test_ring_load_gathers_the_whole_image(store, tmp_path):
    address, _ = store
    path = tmp_path / "image.bin"
    data = write_raw_image(path, 3 * MiB + 777, 4)
    results, errors = [], []

    def member():
        try:
            results.append(flashboot.clone(address, "cpu", "ring", image=path, clones=3, chunk_bytes=CHUNK,
                                           verify=True, timeout_s=10))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    try:
        assert not errors, errors
        assert sorted(r.report.position for r in results) == [1, 2, 3]
        for r in results:
            assert np.array_equal(r.arena.bytes().numpy()[:data.size], data)
            assert r.report.verified and r.report.schedule == "ring"
    finally:
        for r in results:
            r.close()


@pytest.mark.parametrize("pin_early", [False, True])
def test_ring_load_pins_early_or_on_the_path(store, tmp_path, pin_early):
    address, _ = store
    path = tmp_path / "image.bin"
    data = write_raw_image(path, 2 * MiB + 99, 6)
    results, errors = [], []

    def member():
        try:
            results.append(flashboot.clone(address, "cpu", "ring", image=path, clones=2, chunk_bytes=CHUNK,
                                           verify=True, timeout_s=10, name=f"pin{pin_early}", pin_early=pin_early))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    try:
        assert not errors, errors
        for r in results:
            assert np.array_equal(r.arena.bytes().numpy()[:data.size], data)
            assert r.report.pin_early is pin_early and r.report.load_ms > 0
            assert r.report.pin_ms == 0.0  # the host backend copies from pageable memory
            assert r.report.ready_ms <= r.report.total_ms
    finally:
        for r in results:
            r.close()


def test_pin_refusal_says_to_stage_into_dev_shm(tmp_path):
    from flashboot.pinning import fs_type as _fs_type, pin_refused_message

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n"
                      "tmpfs /dev/shm tmpfs rw,nosuid 0 0\n"
                      "/dev/sdb1 /data\\040disk xfs rw 0 0\n")
    assert _fs_type("/home/u/img.bin", str(mounts)) == "ext4"
    assert _fs_type("/dev/shm/x/img.bin", str(mounts)) == "tmpfs"
    assert _fs_type("/dev/shmother/img.bin", str(mounts)) == "ext4"  # a prefix of a name is not its mount
    assert _fs_type("/data disk/img.bin", str(mounts)) == "xfs"
    assert _fs_type("/x", str(tmp_path / "no-such-file")) == "unknown"

    msg = pin_refused_message("/data/img.bin", 4096, 25_165_824, "ext4", "CUDA_ERROR_INVALID_VALUE (1)")
    assert "25,165,824 bytes at offset 4,096 of /data/img.bin (a ext4 file)" in msg
    assert "CUDA_ERROR_INVALID_VALUE" in msg and "anonymous or tmpfs-backed" in msg
    assert "/dev/shm" in msg and "flashboot preload" in msg
    tmpfs = pin_refused_message("/dev/shm/img.bin", 0, 4096, "tmpfs", "CUDA_ERROR_INVALID_VALUE (1)")
    assert "on tmpfs already" in tmpfs and "flashboot preload" not in tmpfs


def test_warm_import_is_a_no_op_on_the_host_backend():
    from flashboot.arena import warm_import

    assert warm_import("cpu") == {"warm_ms": 0.0, "context_ms": 0.0, "peers": [], "errors": []}


def test_ring_members_with_different_images_are_refused(store, tmp_path):
    address, _ = store
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    write_raw_image(paths[0], MiB, 5)
    write_raw_image(paths[1], MiB, 6)
    errors = []

    def member(p):
        try:
            flashboot.clone(address, "cpu", "ring", image=p, clones=2, chunk_bytes=CHUNK, timeout_s=10)
        except RendezvousError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=member, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert len(errors) == 2 and all("holds another image" in e and "refused before any byte moved" in e
                                    for e in errors)


# ------------------------------------------------------------------------------ fallback transport


def test_broadcast_fallback_is_used_and_reported(store):
    address, _ = store
    a, data = _seed_arena(2 * MiB, 7)
    s = flashboot.seed(address, a, "cpu", checksum_chunk_bytes=MiB)
    try:
        with flashboot.clone(address, "cpu", "star", transport="nccl", verify=True, timeout_s=15) as r:
            assert r.report.transport == "nccl" and r.report.mover == "gloo"
            assert r.report.verified
            assert np.array_equal(r.arena.bytes().numpy(), data)
        assert s.nccl_served == 1
    finally:
        s.close()
        a.close()


def test_a_seed_reconnected_to_its_own_store_answers_only_new_broadcast_requests(store):
    """The seed's store connection broke while the store itself stayed (a silent spell, a network
    blip): on reconnecting, the seed counted the broadcast requests from 0 again, as for a
    restarted store, replayed request 1 for a clone long gone (waiting its timeout), and the next
    clone's request timed out behind it."""
    address, _ = store
    a, data = _seed_arena(2 * MiB, 9)
    s = flashboot.seed(address, a, "cpu", checksum_chunk_bytes=MiB, timeout_s=20)
    try:
        with flashboot.clone(address, "cpu", "star", transport="nccl", verify=True, timeout_s=15) as r:
            assert np.array_equal(r.arena.bytes().numpy(), data)
        s.rendezvous._lost("a test's call", RuntimeError("connection reset"))  # the store stays up
        assert s.check_published() and s.nccl_served == 1  # reconnected; the store still counts 1
        with flashboot.clone(address, "cpu", "star", transport="nccl", verify=True, timeout_s=8) as r:
            assert np.array_equal(r.arena.bytes().numpy(), data)
        assert s.nccl_served == 2
    finally:
        s.close()
        a.close()


def test_choose_transport_explains_fallbacks():
    from flashboot.flashclone.transports.registry import Seen, choose_transport
    from flashboot.arena import ArenaDescriptor
    from flashboot.memory import CPU

    remote = ArenaDescriptor("host", 1, (3,), 2 * MiB, -1, "memfd", 2 * MiB, 2 * MiB, "x", None, "another-host")
    cls, note = choose_transport(Seen(remote, {"nccl": True}), CPU, "auto")
    assert cls.name == "nccl" and "no fabric handle (memfd)" in note and note.endswith("gloo broadcast")
    with pytest.raises(RendezvousError, match="lives on host 'another-host'"):
        choose_transport(Seen(remote, {}), CPU, "posix_fd")
    with pytest.raises(RendezvousError, match="has no fabric handle"):
        choose_transport(Seen(remote, {}), CPU, "fabric")


# ------------------------------------------------------------------------------------- sweep


def test_sweep_chunks_on_the_host_backend():
    from flashboot.benchmarks.clone import sweep_chunks

    rows = sweep_chunks("chain", [CHUNK, 512 * 1024], 2 * MiB, clones=2, devices=["cpu"], repeats=1, timeout_s=10)
    assert [r["chunk_bytes"] for r in rows] == [CHUNK, 512 * 1024]
    assert [r["steps"] for r in rows] == [16, 8]
    for r in rows:
        assert r["verified"] is True and len(r["per_clone_gbps"]) == 2 and r["min_gbps"] > 0
        assert r["tail_s"] >= 0 and r["fill_s"] > 0


# ------------------------------------------------------------------------------------- CLI


def test_cli_registers_seed_clone_hold_and_bench_clone():
    from flashboot.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["clone", "--store", "h:1", "--device", "cpu", "--schedule", "star", "--verify"])
    assert args.schedule == "star" and args.verify and args.func.__name__ == "run_clone"
    assert parser.parse_args(["seed", "img", "--store", "h:1"]).func.__name__ == "run_seed"
    assert parser.parse_args(["hold", "--registry", "r"]).func.__name__ == "run_hold"
    assert parser.parse_args(["bench", "clone", "--device", "cpu"]).func.__module__ == "flashboot.benchmarks.clone"


def test_clone_refuses_bad_requests_before_connecting():
    with pytest.raises(FlashBootError, match="schedule must be one of chain, star, ring"):
        flashboot.clone("127.0.0.1:1", "cpu", "tree")
    with pytest.raises(FlashBootError, match="pass image= and clones="):
        flashboot.clone("127.0.0.1:1", "cpu", "ring")
    with pytest.raises(UnknownNameError, match="unknown mover"):
        flashboot.clone("127.0.0.1:1", "cpu", mover="warp")
    with pytest.raises(FlashBootError, match="mover 'copy_engine' cannot copy between cpu arenas"):
        flashboot.clone("127.0.0.1:1", "cpu", mover="copy_engine")  # refused on its class, before any driver call
    warm = flashboot.prepare_clone("cpu")  # the check clone() makes first on a prepared warm-up
    with pytest.raises(FlashBootError, match="the clone warm-up was prepared for cpu, not for cuda:1"):
        warm.check_device(flashboot.Device("cuda", 1))


def test_the_warm_up_is_waited_for_stage_by_stage(monkeypatch):
    """A clone waits for each part of its warm-up only where it needs it: the mapping part does not
    wait for the copy's imports, a stage not done in time is named, and the waits add up."""
    from flashboot.flashclone.report import CloneReport
    from flashboot.flashclone.warmup import CloneWarmup

    release = threading.Event()
    ran = []
    plan = [("driver", "map", lambda: ran.append("driver")),
            ("mover imports", "copy", lambda: (release.wait(30), ran.append("mover imports"))),
            ("checksum kernel", "verify", lambda: ran.append("checksum kernel"))]
    monkeypatch.setattr(CloneWarmup, "_plan", lambda self, mover: plan)
    warm = CloneWarmup("cpu")
    rep = CloneReport("star", 1, "cpu", 0)
    warm.join(rep, 10, "map")
    assert "driver" in ran and "mover imports" not in warm.parts  # the checksum's thread may have run too
    with pytest.raises(WaitTimeoutError, match="did not finish its 'copy' parts within 0.2 s"):
        warm.join(rep, 0.2, "copy")
    waited = rep.warm_wait_ms
    release.set()
    warm.join(rep, 10)
    assert sorted(ran) == ["checksum kernel", "driver", "mover imports"]
    assert set(rep.warm_detail) == {"driver", "mover imports", "checksum kernel"}
    assert rep.warm_wait_ms > waited and rep.warm_ms >= rep.warm_detail["mover imports"]
    with pytest.raises(FlashBootError, match="stage must be one of map, copy, verify, got 'load'"):
        warm.join(rep, 1, "load")


def test_the_clones_arena_is_made_during_the_exchange_and_released_if_never_taken(monkeypatch):
    """``start_arena`` makes the arena in a background thread, ``take_arena`` takes that one (or
    raises its error); a session closed before taking it (a failed exchange) releases it."""
    from flashboot.flashclone.session import _Session

    made = []
    real = Arena.create

    def create(nbytes, device=None, **kw):
        made.append((threading.current_thread().name, real(nbytes, device, **kw)))
        return made[-1][1]

    monkeypatch.setattr(Arena, "create", create)
    cpu = flashboot.Device("cpu")
    s = _Session(None)
    s.start_arena(None, 2 * MiB, cpu)
    s.take_arena(None, 2 * MiB, cpu)
    assert made[0][0] == "flashboot-clone-arena" and s.arena is made[0][1] and s.arena.nbytes >= 2 * MiB
    s.close(keep_arena=False)
    assert made[0][1].closed
    s = _Session(None)
    s.start_arena(None, 2 * MiB, cpu)  # the exchange fails: never taken
    s.close(keep_arena=False)
    assert len(made) == 2 and made[1][1].closed
    s = _Session(None)
    s.start_arena(None, 0, cpu)
    with pytest.raises(ArenaError, match="0"):
        s.take_arena(None, 0, cpu)
    s.close(keep_arena=False)
    with Arena.create(MiB, "cpu") as mine:  # the caller's arena: nothing made, never closed here
        s = _Session(None)
        s.start_arena(mine, mine.nbytes, cpu)  # the seed's capacity, as a clone passes it
        s.take_arena(mine, mine.nbytes, cpu)
        s.close(keep_arena=False)
        assert s.arena is mine and not mine.closed and len(made) == 3  # 3: ours, made above
    # made and exported in the background (the record later clones read carries the export) ...
    s = _Session(None)
    s.start_arena(None, 2 * MiB, cpu)
    s.take_arena(None, 2 * MiB, cpu)
    assert s.arena._descriptor is not None  # exported already: the record costs no export
    s.close(keep_arena=False)
    # ... and an export that fails is raised by take_arena, the arena released

    def refuse(self):
        raise ArenaError("export refused (test)")

    monkeypatch.setattr(Arena, "export", refuse)
    s = _Session(None)
    s.start_arena(None, 2 * MiB, cpu)
    with pytest.raises(ArenaError, match="export refused"):
        s.take_arena(None, 2 * MiB, cpu)
    assert made[-1][1].closed
    s.close(keep_arena=False)


def test_the_warm_up_threads_start_after_the_packages_they_share_with_the_clone_are_imported():
    """A warm-up thread importing ``flashboot.movers.host`` while the clone's thread ran
    ``flashboot.movers``' __init__ ended in Python's _DeadlockError (CI, 2026-12-01): the packages
    both import are imported before any warm-up thread starts."""
    from _python import run_python

    code = ("import sys\n"
            "from flashboot.flashclone import warmup\n"
            "from flashboot.flashclone.report import CloneReport\n"
            "assert 'flashboot.movers' not in sys.modules and 'flashboot.arena' not in sys.modules\n"
            "seen = []\n"
            "run = warmup.CloneWarmup._run\n"
            "def recording(self, stage):\n"
            "    seen.append(all(p in sys.modules for p in ('flashboot.movers', 'flashboot.arena')))\n"
            "    return run(self, stage)\n"
            "warmup.CloneWarmup._run = recording\n"
            "warm = warmup.CloneWarmup('cpu', verify=True, mover='host')\n"
            "warm.join(CloneReport('star', 1, 'cpu', 0), 120)\n"
            "print(seen, sorted(warm.parts), warm.errors)")
    assert run_python("-c", code, timeout=300).strip() == ("[True, True, True] ['executor lanes', 'fd table', "
                                                           "'host checksum', 'host copy'] []")


def test_a_cloned_view_held_past_close_reads_its_bytes_until_dropped(store, image):
    """A replica's parameter still bound to a closed CloneResult read unmapped memory (a segfault on
    the host, an illegal address on CUDA), as a loaded image's had: the memory now goes with the
    last view. A failed engine load's close (``force``) still releases at once."""
    import gc
    import os
    import warnings

    def memfds() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum(os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
                   for fd in fds)

    address, _ = store
    s = flashboot.seed(address, image, "cpu")
    try:
        gc.collect()
        base = memfds()
        r = flashboot.clone(address, "cpu", "star", verify=True, timeout_s=10)
        name = next(iter(r.tensors))
        param = r.tensors[name]
        want = param.clone()
        with pytest.warns(ResourceWarning, match="closed while views of it are still held"):
            r.close()
        assert memfds() > base and bool((param == want).all())
        del param
        gc.collect()
        assert memfds() == base
        r = flashboot.clone(address, "cpu", "star", verify=True, timeout_s=10)
        param = r.tensors[name]
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            r.close(force=True)
        assert memfds() == base
    finally:
        s.close()
