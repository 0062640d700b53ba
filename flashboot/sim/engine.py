"""Discrete-event simulation of a :class:`~flashboot.schedulers.Plan` on a :class:`Topology`.

It runs the very plans the schedulers build: each ``(dst, lane)`` is a stream that takes its
steps in order; a step starts once its waits have completed (plus the signal latency between the
two GPUs), spends ``chunk_sync_us`` on its lane (``launch_latency_us`` too for the first op of a
lane, which has nothing to hide behind; pinning too for a host load when asked), then moves its
bytes as a fluid flow. Concurrent flows share every resource they cross max-min fairly
(progressive filling): per-GPU egress, ingress and duplex (egress + ingress) budgets, direct links
per direction, HBM for same-GPU copies, the host link and host memory for loads. A flow also never
exceeds the copy-engine rate for its size (the topology's curve).
"""

from __future__ import annotations

import dataclasses
import heapq
import numbers
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from flashboot.errors import FlashBootError
from flashboot.schedulers import HOST, Plan

from .topology import load_topology


class SimError(FlashBootError, ValueError):
    """The simulation cannot run this plan on this topology (placement, missing link...)."""


@dataclass(frozen=True)
class SimOptions:
    """How a plan is laid onto a topology.

    ``placement``: GPU index of each participant (default: participant ``i`` on GPU
    ``i mod gpus``, so with more clones than GPUs they alternate). ``pin_on_critical_path``: host
    loads first pin their bytes at ``host.pin_gbps`` (the engine pays the pin) instead of reading
    an image pinned beforehand. ``record_steps``: keep each step's (ready, flow start, end) times
    in :attr:`SimResult.step_times`.
    """

    placement: tuple[int, ...] | None = None
    pin_on_critical_path: bool = False
    record_steps: bool = False

    def __post_init__(self) -> None:
        if self.placement is not None:
            p = tuple(self.placement)
            # numpy's ints are indices too (np.arange(n) % gpus was refused as "not >= 0")
            if any(isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0 for g in p):
                raise SimError(f"placement must list GPU indices (ints >= 0), got {list(p)}")
            object.__setattr__(self, "placement", tuple(int(g) for g in p))

    @classmethod
    def from_value(cls, value: "SimOptions | Mapping[str, Any] | None") -> "SimOptions":
        """Accept SimOptions, a plain dict of its fields, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, SimOptions):
            return value
        if not isinstance(value, Mapping):
            raise SimError(f"sim options: expected a mapping, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise SimError(f"sim options: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class SimResult:
    """What a simulated plan did. Times in seconds from the common start; GB/s = 1e9 B/s.

    ``per_clone_gbps[k]`` is ``total_bytes / finish`` of the k-th receiver (participants that are
    not seeds, in index order: chain position, ring member), the way the paper and our chain
    measurement report per-clone bandwidth (bytes over time until that clone holds them all).
    ``head_to_tail`` is ``1 - per_clone_gbps[-1] / per_clone_gbps[0]``.
    """

    schedule: str
    topology: str
    total_bytes: int
    chunk_bytes: int
    receivers: tuple[str, ...]
    placement: tuple[int, ...]
    first_byte_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    per_clone_gbps: tuple[float, ...]
    last_clone_s: float
    head_to_tail: float
    n_steps: int
    n_events: int
    step_times: tuple[tuple[float, float, float], ...] | None = None
    """Per step id: (lane and waits satisfied, bytes start moving, done); with ``record_steps``."""

    @property
    def mean_gbps(self) -> float:
        return sum(self.per_clone_gbps) / len(self.per_clone_gbps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``per_clone_gbps`` a list, ``last_clone_s`` a float, ...)."""
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        d["mean_gbps"] = self.mean_gbps
        return d


_GB = 1e9


class _Flow:
    """A step's bytes in flight. ``remaining`` is as of time ``since`` (the last rate change), so an
    event touches only the flows whose rate it changes; ``version`` tells stale end times apart."""

    __slots__ = ("step", "remaining", "cap", "resources", "rate", "since", "version")

    def __init__(self, step: int, nbytes: float, cap: float, resources: tuple, since: float = 0.0):
        self.step, self.remaining, self.cap, self.resources, self.rate = step, float(nbytes), cap, resources, 0.0
        self.since, self.version = since, 0


def _fair_rates(flows: Sequence[_Flow], capacity: Mapping[Any, float]) -> None:
    """Max-min fair rates with per-flow caps, by progressive filling: raise every unfrozen flow
    together until a resource saturates or a flow reaches its cap; freeze those; repeat."""
    for f in flows:
        f.rate = 0.0
    active = list(flows)
    left = {r: capacity[r] for f in flows for r in f.resources}
    while active:
        counts = Counter(r for f in active for r in f.resources)
        inc = min(f.cap - f.rate for f in active)
        if counts:
            inc = min(inc, min(left[r] / n for r, n in counts.items()))
        inc = max(inc, 0.0)
        for f in active:
            f.rate += inc
        full = set()
        for r, n in counts.items():
            left[r] -= inc * n
            if left[r] <= 1e-9 * capacity[r]:
                full.add(r)
        active = [f for f in active if f.cap - f.rate > 1e-9 * f.cap and not full.intersection(f.resources)]


def simulate(plan: Plan, topology: Any, options: "SimOptions | Mapping[str, Any] | None" = None) -> SimResult:
    """Run ``plan`` on ``topology`` (a Topology, shipped name, YAML path or dict).

    Raises SimError when the plan cannot be placed (a participant on a GPU the topology lacks, a
    copy between GPUs with no link on a direct fabric).
    """
    topo = load_topology(topology)
    opts = SimOptions.from_value(options)
    n = plan.n_participants
    placement = opts.placement if opts.placement is not None else tuple(i % topo.gpus for i in range(n))
    if len(placement) != n:
        raise SimError(f"placement lists {len(placement)} GPUs for {n} participants")
    if max(placement) >= topo.gpus:
        raise SimError(f"placement uses GPU {max(placement)} but {topo.name} has {topo.gpus}")

    fab, host = topo.fabric, topo.host
    capacity: dict[Any, float] = {}
    # only the GPUs the plan uses: a topology may name far more than a plan places
    for g in sorted(set(placement)):
        capacity[("egress", g)] = fab.egress_gbps * _GB
        capacity[("ingress", g)] = fab.ingress_gbps * _GB
        capacity[("duplex", g)] = fab.duplex_gbps * _GB
        capacity[("hbm", g)] = topo.local_copy_gbps * _GB
        capacity[("hostlink", g)] = host.link_gbps * _GB
        capacity[("hostmem", g // host.gpus_per_host)] = host.memory_gbps * _GB
    for link in fab.links:
        capacity[("link", link.a, link.b)] = link.gbps_a_to_b * _GB
        capacity[("link", link.b, link.a)] = link.gbps_b_to_a * _GB

    steps = plan.steps

    def flow_shape(s) -> tuple[float, tuple]:
        gd = placement[s.dst]
        if s.src == HOST:
            return topo.h2d_gbps(s.nbytes) * _GB, (("hostlink", gd), ("hostmem", gd // host.gpus_per_host))
        gs = placement[s.src]
        if gs == gd:
            return topo.local_copy_gbps * _GB, (("hbm", gd),)
        res = [("egress", gs), ("ingress", gd), ("duplex", gs), ("duplex", gd)]
        if fab.kind == "direct":
            if ("link", gs, gd) not in capacity:
                raise SimError(f"{topo.name}: step {s.id} copies GPU {gs} -> GPU {gd} but no link joins them")
            res.append(("link", gs, gd))
        return topo.dma_gbps(s.nbytes) * _GB, tuple(res)

    shapes = [flow_shape(s) for s in steps]

    # Lanes and dependency bookkeeping.
    lanes: dict[tuple[int, int], list[int]] = {}
    for s in steps:
        lanes.setdefault((s.dst, s.lane), []).append(s.id)
    lane_pos = {k: 0 for k in lanes}
    lane_busy = {k: False for k in lanes}
    lane_started = {k: False for k in lanes}
    dependents: dict[int, list[int]] = {}
    pending = [len(s.waits) for s in steps]
    for s in steps:
        for w in s.waits:
            dependents.setdefault(w, []).append(s.id)
    done_at = [None] * len(steps)
    ready_at = [0.0] * len(steps)
    flow_at = [0.0] * len(steps)

    now = 0.0
    timers: list[tuple[float, int]] = []  # (time the overhead ends and the flow starts, step)
    flows: dict[int, _Flow] = {}
    first_byte = [None] * n
    finish = [0.0] * n
    events = 0

    def try_start(key) -> None:
        if lane_busy[key] or lane_pos[key] >= len(lanes[key]):
            return
        sid = lanes[key][lane_pos[key]]
        if pending[sid]:
            return
        s = steps[sid]
        ready = now
        for w in s.waits:
            lat = topo.latency_us(placement[steps[w].dst], placement[s.dst]) * 1e-6
            ready = max(ready, done_at[w] + lat)
        overhead = topo.chunk_sync_us * 1e-6
        if not lane_started[key]:
            overhead += topo.launch_latency_us * 1e-6
            lane_started[key] = True
        if s.src == HOST and opts.pin_on_critical_path:
            overhead += s.nbytes / (host.pin_gbps * _GB)
        lane_busy[key] = True
        ready_at[sid] = ready
        heapq.heappush(timers, (ready + overhead, sid))

    for key in lanes:
        try_start(key)

    # Rates change only where an event changes the flows, so each flow keeps its predicted end in a
    # heap (stale entries skipped by version) and max-min rates are recomputed for all flows only
    # when a start or an end can move another flow's rate: re-pricing every flow at every event
    # made a ring of 1,000 members (a million steps) run for most of an hour.
    ends: list[tuple[float, int, int]] = []  # (predicted end, flow version, step)
    usage: dict[Any, float] = dict.fromkeys(capacity, 0.0)  # bytes/s in use per resource
    users: dict[Any, set[int]] = {r: set() for r in capacity}  # flows crossing each resource

    def saturated(r) -> bool:
        return capacity[r] - usage[r] <= 1e-9 * capacity[r]  # _fair_rates' own tolerance

    def at_cap(f: _Flow) -> bool:
        return f.cap - f.rate <= 1e-9 * f.cap

    def set_rate(f: _Flow, rate: float) -> None:
        f.remaining -= f.rate * (now - f.since)
        f.since, f.rate = now, rate
        f.version += 1
        if rate > 0:
            heapq.heappush(ends, (now + max(f.remaining, 0.0) / rate, f.version, f.step))

    def removal_keeps_rates(f: _Flow) -> bool:
        # Max-min fair iff every flow is at its cap or has the top rate on a saturated resource:
        # removing f frees only f's resources, so the others keep their rates unless one of them
        # was held back (below its cap) on a resource f saturated with it.
        return all(not saturated(r) or all(at_cap(flows[o]) for o in users[r] if o != f.step) for r in f.resources)

    def add_at_cap(f: _Flow) -> bool:
        # a new flow that fits at its cap on every resource it crosses takes nothing from anyone
        return all(capacity[r] - usage[r] >= f.cap - 1e-9 * capacity[r] for r in f.resources)

    # Every event starts a step's flow or ends one (the flow ending first ends even when its end
    # rounds to ``now``), so a plan needs at most two per step; more means the loop spins.
    max_events = 2 * len(steps) + 2
    while timers or flows:
        if events > max_events:
            raise SimError(f"simulation made no progress: {events} events for {len(steps)} steps at t={now!r}s")
        while ends and (ends[0][2] not in flows or flows[ends[0][2]].version != ends[0][1]):
            heapq.heappop(ends)  # the flow ended or its rate changed since this entry
        t_timer = timers[0][0] if timers else float("inf")
        t_flow = ends[0][0] if ends else float("inf")
        if t_timer == float("inf") and t_flow == float("inf"):
            raise SimError(f"simulation stalled at t={now:.6f}s with {len(flows)} flows at rate 0")
        now = min(t_timer, t_flow)
        finished = []
        while ends:
            end, version, sid = ends[0]
            f = flows.get(sid)
            if f is None or f.version != version:
                heapq.heappop(ends)
                continue
            left = f.remaining - f.rate * (now - f.since)
            if not (end <= now or left <= 1e-6 * max(1.0, steps[sid].nbytes * 1e-9) or left / f.rate <= 1e-12):
                break
            heapq.heappop(ends)
            finished.append(sid)
        events += 1
        started = []
        while timers and timers[0][0] <= now:
            _, sid = heapq.heappop(timers)
            cap, res = shapes[sid]
            flows[sid] = _Flow(sid, steps[sid].nbytes, cap, res, now)
            started.append(sid)
            flow_at[sid] = now
            dst = steps[sid].dst
            if first_byte[dst] is None:
                first_byte[dst] = now
        recompute = False
        for sid in finished:
            f = flows[sid]
            recompute = recompute or not removal_keeps_rates(f)
            for r in f.resources:
                users[r].discard(sid)
                usage[r] = usage[r] - f.rate if users[r] else 0.0
            del flows[sid]
            s = steps[sid]
            done_at[sid] = now
            finish[s.dst] = max(finish[s.dst], now)
            key = (s.dst, s.lane)
            lane_busy[key] = False
            lane_pos[key] += 1
            try_start(key)
            for d in dependents.get(sid, ()):
                pending[d] -= 1
                if not pending[d]:
                    try_start((steps[d].dst, steps[d].lane))
        for sid in started:
            f = flows[sid]
            if not recompute and add_at_cap(f):
                set_rate(f, f.cap)
                for r in f.resources:
                    usage[r] += f.cap
            else:
                recompute = True
            for r in f.resources:
                users[r].add(sid)
        if recompute and flows:
            active = list(flows.values())
            old = [f.rate for f in active]
            _fair_rates(active, capacity)
            new = [f.rate for f in active]
            for r in usage:
                usage[r] = 0.0
            for f, was, rate in zip(active, old, new):
                f.rate = was  # set_rate settles the bytes moved at the old rate first
                if rate != was or f.version == 0:
                    set_rate(f, rate)
                for r in f.resources:
                    usage[r] += rate

    if any(t is None for t in done_at):
        raise SimError(f"{sum(t is None for t in done_at)} steps never ran (plan cannot complete)")
    receivers = plan.receivers()
    gbps = tuple(plan.total_bytes / finish[p.index] / _GB for p in receivers)
    return SimResult(
        schedule=plan.schedule,
        topology=topo.name,
        total_bytes=plan.total_bytes,
        chunk_bytes=plan.chunk_bytes,
        receivers=tuple(p.name for p in receivers),
        placement=placement,
        first_byte_s=tuple(first_byte[p.index] or 0.0 for p in receivers),
        finish_s=tuple(finish[p.index] for p in receivers),
        per_clone_gbps=gbps,
        last_clone_s=max(finish[p.index] for p in receivers),
        head_to_tail=1.0 - gbps[-1] / gbps[0],
        n_steps=len(steps),
        n_events=events,
        step_times=tuple(zip(ready_at, flow_at, done_at)) if opts.record_steps else None,
    )


__all__ = ["SimError", "SimOptions", "SimResult", "simulate"]
