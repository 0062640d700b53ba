"""Scheduler plans against a reference checker written independently of the planners.

The checker only reads the raw step fields (id, kind, src, dst, offset, nbytes, waits, lane) and
simulates the plan: it never calls the planners' helpers. It asserts that
- every receiver ends with every byte exactly once (no gap, no double delivery), seeds get nothing;
- a step only reads bytes its source is guaranteed to hold once the steps it waits on (and,
  transitively, theirs) have completed: the seed holds everything, the host holds everything;
- run with random step durations, lanes in order, the plan always finishes (no deadlock), and,
  where the schedule promises it, no participant is read by two steps at the same moment.
"""

from __future__ import annotations

import heapq
import json
import random

import pytest

from flashboot.errors import UnknownNameError
from flashboot.schedulers import (
    DEFAULT_CHUNK_BYTES,
    HOST,
    Participant,
    Plan,
    PlanError,
    Step,
    build_plan,
    list_schedules,
    shard_bounds,
)


# --- the reference checker ------------------------------------------------------------------
def _merge(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _covers(intervals, lo, hi):
    return any(a <= lo and hi <= b for a, b in _merge(intervals))


def check_delivery(plan: Plan) -> None:
    """Every receiver holds [0, total) exactly once at the end; seeds receive nothing."""
    total = plan.total_bytes
    got = {p.index: [] for p in plan.participants}
    for s in plan.steps:
        got[s.dst].append((s.offset, s.offset + s.nbytes))
    for p in plan.participants:
        pieces = sorted(got[p.index])
        if p.role == "seed":
            assert pieces == [], f"seed {p.name} receives {pieces[:3]}"
            continue
        pos = 0
        for lo, hi in pieces:
            assert lo >= pos, f"{p.name}: bytes {lo}..{min(hi, pos)} delivered twice"
            assert lo == pos, f"{p.name}: gap {pos}..{lo}"
            pos = hi
        assert pos == total, f"{p.name}: holds only up to byte {pos} of {total}"


def check_reads_are_covered(plan: Plan) -> None:
    """A step's source holds its bytes given only the step's waits (transitively)."""
    closure: list[int] = []  # bit set of step ids guaranteed complete before step i starts
    for s in plan.steps:
        bits = 0
        for w in s.waits:
            assert w < s.id
            bits |= (1 << w) | closure[w]
        closure.append(bits)
        if s.src == HOST:
            assert s.kind == "h2d"
            continue
        if plan.participants[s.src].role == "seed":
            continue
        held = [(t.offset, t.offset + t.nbytes) for t in plan.steps[: s.id] if (bits >> t.id) & 1 and t.dst == s.src]
        assert _covers(held, s.offset, s.offset + s.nbytes), (
            f"step {s.id} reads {s.offset}..{s.offset + s.nbytes} from {s.src} before it is guaranteed there"
        )


def run_timed(plan: Plan, seed: int) -> float:
    """Event simulation: random durations, one stream per (dst, lane), waits honoured. Checks
    the exclusive-source promise at every instant and that everything completes."""
    rng = random.Random(seed)
    queues: dict[tuple[int, int], list[Step]] = {}
    for s in plan.steps:
        queues.setdefault((s.dst, s.lane), []).append(s)
    head = {k: 0 for k in queues}
    busy = {k: False for k in queues}
    done: set[int] = set()
    running: list[tuple[float, int, tuple[int, int]]] = []
    readers: dict[int, int] = {}
    now = 0.0

    def start_ready():
        for key, q in queues.items():
            if busy[key] or head[key] >= len(q):
                continue
            s = q[head[key]]
            if all(w in done for w in s.waits):
                busy[key] = True
                if s.src != HOST:
                    readers[s.src] = readers.get(s.src, 0) + 1
                    if plan.exclusive_sources:
                        assert readers[s.src] == 1, f"participant {s.src} read by two steps at t={now:.3f}"
                heapq.heappush(running, (now + rng.uniform(0.1, 2.0) * (1 + s.nbytes / plan.chunk_bytes), s.id, key))

    start_ready()
    while running:
        now, sid, key = heapq.heappop(running)
        s = plan.steps[sid]
        done.add(sid)
        busy[key] = False
        head[key] += 1
        if s.src != HOST:
            readers[s.src] -= 1
        start_ready()
    assert len(done) == len(plan.steps), f"deadlock: {len(plan.steps) - len(done)} steps never ran"
    return now


def check_plan(plan: Plan, seeds=(0, 1, 2)) -> None:
    check_delivery(plan)
    check_reads_are_covered(plan)
    for seed in seeds:
        run_timed(plan, seed)


# --- the schedules over many shapes -----------------------------------------------------------
SHAPES = [  # (n, total_bytes, chunk_bytes)
    (1, 1, 1), (1, 10, 3), (2, 10, 3), (3, 100, 7), (4, 64, 16), (5, 1000, 1000), (2, 999, 2000),
    (8, 4097, 512), (7, 12345, 1000), (16, 300, 13), (3, 5, 1),
]


@pytest.mark.parametrize("schedule", ["star", "chain"])
@pytest.mark.parametrize("n,total,chunk", SHAPES)
def test_star_and_chain_plans(schedule, n, total, chunk):
    plan = build_plan(schedule, n, total, chunk)
    check_plan(plan)
    assert [p.role for p in plan.participants] == ["seed"] + ["clone"] * n
    assert plan.exclusive_sources == (schedule == "chain")
    if schedule == "chain":  # each clone reads only its predecessor
        assert all(s.src == s.dst - 1 for s in plan.steps)
    else:
        assert all(s.src == 0 for s in plan.steps)


@pytest.mark.parametrize("n,total,chunk", SHAPES + [(4, 10, 3), (6, 5, 2)])
@pytest.mark.parametrize("align", [1, 4])
def test_ring_plans(n, total, chunk, align):
    plan = build_plan("ring", n, total, chunk, options={"align_bytes": align})
    check_plan(plan)
    assert all(p.role == "shard" for p in plan.participants) and len(plan.participants) == n
    h2d = [s for s in plan.steps if s.kind == "h2d"]
    # the host is read exactly once per byte in all, each member loading only its own shard
    pos = 0
    for lo, hi in sorted((s.offset, s.offset + s.nbytes) for s in h2d):
        assert lo == pos
        pos = hi
    assert pos == total
    for s in h2d:
        off, nb = shard_bounds(total, n, align)[s.dst]
        assert off <= s.offset and s.offset + s.nbytes <= off + nb
    assert all(s.src == (s.dst - 1) % n for s in plan.steps if s.kind == "copy")


def test_ring_shards_are_aligned_and_balanced():
    bounds = shard_bounds(10 * 4096 + 5, 4, 4096)
    assert [o % 4096 for o, _ in bounds] == [0, 0, 0, 0]
    assert sum(nb for _, nb in bounds) == 10 * 4096 + 5
    assert max(nb for _, nb in bounds) - min(nb for _, nb in bounds) <= 4096 + 5
    assert shard_bounds(3, 4, 1) == [(0, 0), (0, 1), (1, 1), (2, 1)]


def test_large_plans_chunk_counts():
    gib = 1 << 30
    plan = build_plan("chain", 8, 217 * 10**9, DEFAULT_CHUNK_BYTES)
    assert len(plan.steps) == 8 * -(-217 * 10**9 // (256 << 20))  # 809 chunks of 256 MiB (paper §5.4)
    assert -(-217 * 10**9 // (256 << 20)) == 809
    check_delivery(plan)
    ring = build_plan("ring", 4, 8 * gib, 256 << 20)
    check_plan(ring, seeds=(0,))


def test_chain_pipelines_chunk_by_chunk():
    # hop k's chunk j waits on hop k-1's chunk j only, not on the whole image
    plan = build_plan("chain", 3, 40, 10)
    by = {(s.dst, s.offset): s for s in plan.steps}
    assert by[(2, 0)].waits == (by[(1, 0)].id,)
    assert by[(3, 30)].waits == (by[(2, 30)].id,)
    assert by[(1, 10)].waits == ()


def test_ring_member_reads_start_before_predecessor_finishes_loading():
    plan = build_plan("ring", 2, 40, 10, align_bytes=1)
    first_read = next(s for s in plan.steps if s.kind == "copy" and s.dst == 1)
    (w,) = first_read.waits
    assert plan.steps[w].kind == "h2d" and plan.steps[w].nbytes == 10  # one sub-chunk, not the shard


def test_flags_numbered_per_destination():
    plan = build_plan("ring", 3, 90, 10, align_bytes=1)
    for p in plan.participants:
        signals = [s.signal for s in plan.steps if s.dst == p.index]
        assert signals == list(range(len(signals))) == list(range(plan.flag_count(p.index)))
    s = plan.steps[-1]
    assert plan.flag_of(s.id) == (s.dst, s.signal)


def test_lanes_group_streams():
    plan = build_plan("ring", 3, 90, 10, align_bytes=1)
    lanes = plan.lanes()
    assert set(lanes) == {(i, lane) for i in range(3) for lane in (0, 1)}
    assert all([s.id for s in q] == sorted(s.id for s in q) for q in lanes.values())


def test_plan_round_trips_through_json():
    plan = build_plan("ring", 3, 1000, 64, align_bytes=8)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_registry():
    assert {"chain", "ring", "star"} <= set(list_schedules())
    with pytest.raises(UnknownNameError, match="known: .*chain"):
        build_plan("broadcast-tree", 2, 10, 1)


@pytest.mark.parametrize("bad", [
    dict(n=0, total_bytes=10, chunk_bytes=1), dict(n=2, total_bytes=0, chunk_bytes=1),
    dict(n=2, total_bytes=10, chunk_bytes=0), dict(n=2, total_bytes=10, chunk_bytes=2.5),
])
def test_bad_requests(bad):
    with pytest.raises(PlanError):
        build_plan("chain", **bad)


@pytest.mark.parametrize("schedule,n,total,chunk,match", [
    ("chain", 3, 10**9, 1, r"3 receivers x 1,000,000,000 chunks of 1 bytes .* is 3,000,000,000 steps, over the "
                           r"2,000,000 a plan may hold; use chunks of at least 1,500 bytes"),
    ("star", 8, 217 * 10**9, 64 << 10, r"use chunks of at least 868,000 bytes"),
    ("ring", 2000, 10**9, 1 << 20, r"2,000 members alone make 4,000,000"),
])
def test_a_plan_too_large_to_build_is_refused_before_any_step(schedule, n, total, chunk, match):
    with pytest.raises(PlanError, match=match):
        build_plan(schedule, n, total, chunk)


@pytest.mark.parametrize("schedule", ["chain", "star", "ring"])
def test_the_smallest_chunk_the_refusal_names_builds(schedule, monkeypatch):
    from flashboot.schedulers import plan as plan_module

    monkeypatch.setattr(plan_module, "MAX_PLAN_STEPS", 20_000)  # the same arithmetic, a plan built in a blink
    n, total = 4, 10**9
    with pytest.raises(PlanError) as refused:
        build_plan(schedule, n, total, 64)
    fits = int(str(refused.value).rsplit("at least ", 1)[1].split()[0].replace(",", ""))
    plan = build_plan(schedule, n, total, fits)
    assert len(plan.steps) <= 20_000
    assert sum(s.nbytes for s in plan.steps if s.dst == plan.participants[-1].index) == total


def _one(**kw):
    base = dict(id=0, kind="copy", src=0, dst=1, offset=0, nbytes=4, waits=(), lane=0, signal=0)
    base.update(kw)
    return Step(**base)


@pytest.mark.parametrize("step,match", [
    (_one(offset=8), "not inside"), (_one(nbytes=0), "not inside"), (_one(waits=(0,)), "earlier"),
    (_one(dst=0, src=1), "seed"), (_one(kind="h2d"), "host"), (_one(src=HOST), "host"),
    (_one(dst=5), "distinct"), (_one(signal=3), "signal"), (_one(id=2), "numbered"),
])
def test_validation_rejects(step, match):
    parts = (Participant(0, "seed", "seed"), Participant(1, "clone0", "clone"))
    with pytest.raises(PlanError, match=match):
        Plan("handmade", parts, 10, 4, (step,))


def test_checker_catches_broken_plans():
    """The reference checker itself must fail on a gap, a double delivery, a premature read and a
    shared source: otherwise passing it would prove nothing."""
    parts = (Participant(0, "seed", "seed"), Participant(1, "clone0", "clone"), Participant(2, "clone1", "clone"))
    gap = Plan("x", parts, 8, 4, (_one(), Step(1, "copy", 0, 2, 0, 8, (), 0, 0)))
    with pytest.raises(AssertionError, match="holds only"):
        check_delivery(gap)
    twice = Plan("x", parts, 8, 4, (_one(nbytes=8), Step(1, "copy", 0, 1, 4, 4, (), 1, 1), Step(2, "copy", 0, 2, 0, 8, (), 0, 0)))
    with pytest.raises(AssertionError, match="twice"):
        check_delivery(twice)
    early = Plan("x", parts, 4, 4, (_one(), Step(1, "copy", 1, 2, 0, 4, (), 0, 0)))
    with pytest.raises(AssertionError, match="before it is guaranteed"):
        check_reads_are_covered(early)
    shared = Plan("x", parts, 4, 4, (_one(), Step(1, "copy", 0, 2, 0, 4, (), 0, 0)), exclusive_sources=True)
    with pytest.raises(AssertionError, match="read by two"):
        run_timed(shared, 0)
