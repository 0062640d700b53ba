"""Run a schedule plan (:mod:`flashboot.schedulers`) in the process of each participant.

Pull model: a process runs the steps whose destination is one of its *local* participants, in
lanes (one stream or thread per ``(dst, lane)``, steps in id order), reading from the source's
arena as mapped into this process, after every step in ``waits`` has raised its flag.

Flags are 32-bit words in a small flags arena per participant (created by its owner, exported and
mapped like the weights). A step raises ``flags[dst][signal] = epoch`` when its copy is done; a
dependent step waits for ``flags[p][f] >= epoch``. Epochs let one flags arena serve many runs.

* **CUDA**: the whole pipeline is enqueued on streams with no SM and no host round trip:
  ``cuStreamWaitValue32(flag, epoch, GEQ)`` before a dependent copy, the copy by any registry
  mover (``copy_engine`` by default), ``cuStreamWriteValue32(flag, epoch)`` after it. The host
  thread only watches: it polls one event per step with a deadline and the source processes'
  liveness; once every step left is a plain copy (no flag to wait on), it waits for their end in
  the driver instead (:func:`~flashboot.cuda_streams.wait_events`, bounded by the same deadline).
  On a stall or a dead source it releases the blocked streams by writing the awaited
  flags from a side stream (so nothing hangs), drains them, and raises :class:`StepFailure`
  naming the step and the peer; steps whose waits were released (their bytes are not trusted)
  are left out of ``StepFailure.valid_steps``.
* **host** (the CPU backend): one thread per lane polls the flag words in the shared memfd
  (aligned 32-bit loads and stores, atomic on the hosts we run on), copies with the ``host``
  mover and stores the flag after the copy has returned. A lane stops cleanly at the first wait
  that runs past its deadline or whose flag owner has exited.

The two backends are in :mod:`flashboot.flashclone.lanes`.

Step issue order is the global step-id order across local lanes: every wait points at a smaller
id, so even when streams share a hardware queue the flag's writer is queued before its waiter.
"""

from __future__ import annotations

import ctypes
import os
import select
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .. import _cuda
from ..errors import FlashBootError, WaitTimeoutError, restated
from ..memory import Device, Span
from ..schedulers import HOST, Plan, Step
from ..units import check_timeout

FLAG_BYTES = 4
DEFAULT_TIMEOUT_S = 60.0
"""A step may wait this long for a flag (or a stream this long without progress) before the run fails."""
MAP_GROUP_MAX_SEGMENTS = 4
"""The most source segments mapped (and granted, in one ``cuMemSetAccess`` where only the home
device is) before the copies that read them are issued: groups of 1, 2, 4, 4, ... segments, so
the first copy starts after one segment and later mapping overlaps copies at a few driver calls
and one batch per 1 GiB (per-segment groups left a same-GPU clone's copy waiting on the host's
mapping and issue: 0.59-0.73x D2D on an H200)."""


class StepFailure(WaitTimeoutError):
    """A run stopped: a step waited past its deadline or its source process exited.

    ``step``: the step that could not proceed; ``peer``: the participant it waited for (or read
    from); ``peer_exited``: whether that process is gone; ``valid_steps``: ids of local steps whose
    bytes are in place and trustworthy (the rest must be redone from another source);
    ``released``: True when blocked CUDA streams were released by writing flags from the host;
    ``tainted_steps``: local steps that completed (and raised their flag) with untrusted bytes
    after such a release -- downstream readers of those ranges must re-read them.
    """

    def __init__(self, message: str, *, step: Step | None, peer: int | None, peer_exited: bool,
                 valid_steps: set[int], released: bool = False, tainted_steps: set[int] = frozenset()):
        super().__init__(message)
        self.step, self.peer, self.peer_exited = step, peer, peer_exited
        self.valid_steps, self.released = set(valid_steps), released
        self.tainted_steps = set(tainted_steps)


# ============================================================================================
# Flags
# ============================================================================================


def create_flags(nflags: int, device: Any, *, access: Any = None) -> "Arena":  # noqa: F821
    """A zeroed flags arena with room for ``nflags`` 32-bit flags on ``device`` (exportable).

    ``access``: other CUDA devices of this process that wait on these flags (in-process runs that
    span GPUs); other processes map the flags themselves."""
    from ..arena import Arena

    if not isinstance(nflags, int) or nflags < 0:
        raise FlashBootError(f"nflags must be a non-negative int, got {nflags!r}")
    dev = Device.parse(device)
    arena = Arena.create(max(1, nflags) * FLAG_BYTES, dev, access=access if dev.is_cuda else None)
    if dev.is_cuda:  # VMM memory is not zeroed on allocation
        try:
            _zero_device(arena.ptr, arena.nbytes, dev.index)
        except BaseException:
            arena.close()
            raise
    return arena


@_cuda.keeps_context
def _zero_device(ptr: int, nbytes: int, index: int) -> None:
    drv = _cuda.driver()
    _cuda.use_device(index)
    stream = _cuda.check(drv.cuStreamCreate(int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
    try:
        _cuda.check(drv.cuMemsetD32Async(drv.CUdeviceptr(ptr), 0, nbytes // FLAG_BYTES, stream), "cuMemsetD32Async(flags)")
        _cuda.check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize(flags zero)")
    finally:
        _cuda.check(drv.cuStreamDestroy(stream), "cuStreamDestroy")




class HostFlags:
    """A participant's flags in a host (memfd) arena, as 32-bit words this process reads/writes."""

    def __init__(self, arena):
        self.arena = arena
        n = arena.nbytes // FLAG_BYTES
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * n).from_address(arena.ptr))

    def get(self, i: int) -> int:
        return int(self.words[i])

    def set(self, i: int, value: int) -> None:
        self.words[i] = value

    def __len__(self) -> int:
        return len(self.words)


# ============================================================================================
# Endpoints, liveness
# ============================================================================================


@dataclass
class Endpoint:
    """One participant as this process sees it.

    ``arena``: its weights, mapped here (None for the host image, :data:`HOST`); ``flags``: its
    flags arena mapped here (None for a seed, which raises no flags); ``pid``: its process, watched
    for exit while we depend on it (None: not watched, e.g. local or on another host).
    """

    index: int
    name: str
    arena: Any = None
    flags: Any = None
    pid: int | None = None


class PeerWatch:
    """Notices a process's exit through a pidfd (no polling of /proc, no pid-reuse race)."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
            self._exited = False
        except ProcessLookupError:
            self._fd, self._exited = None, True
        if self._fd is not None:
            # registered once: the lanes ask before each step (0.35 us a poll, against 0.9 for a
            # select, which also refuses fd numbers past 1,024, as an engine's can be)
            self._poller = select.poll()
            self._poller.register(self._fd, select.POLLIN)

    def exited(self) -> bool:
        if not self._exited and self._fd is not None:
            self._exited = bool(self._poller.poll(0))
        return self._exited

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ============================================================================================
# Reports
# ============================================================================================


@dataclass
class LaneReport:
    """Timing of one lane: ``seconds`` from its start to its last step's end; ``step_end_s`` for
    each step (relative to the lane start), for pipeline-fill and tail analysis."""

    participant: int
    lane: int
    steps: int
    nbytes: int
    seconds: float
    step_end_s: list[float] = field(default_factory=list)
    first_start_s: float = 0.0
    """When the first step's copy could start (its waits satisfied), relative to the lane start."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class ExecReport:
    """What one :meth:`Executor.run` did in this process."""

    schedule: str
    backend: str  # "cuda" or "host"
    mover: str
    epoch: int
    lanes: list[LaneReport]
    wall_s: float

    def participant_seconds(self, index: int) -> float:
        """The slowest lane of participant ``index`` (its time to hold every byte it receives)."""
        return max((l.seconds for l in self.lanes if l.participant == index), default=0.0)

    def participant_nbytes(self, index: int) -> int:
        return sum(l.nbytes for l in self.lanes if l.participant == index)

    def participant_gbps(self, index: int) -> float:
        s = self.participant_seconds(index)
        return self.participant_nbytes(index) / s / 1e9 if s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "backend": self.backend, "mover": self.mover, "epoch": self.epoch,
                "wall_s": self.wall_s,
                "lanes": [{"participant": l.participant, "lane": l.lane, "steps": l.steps, "nbytes": l.nbytes,
                           "seconds": l.seconds, "gbps": l.gbps, "first_start_s": l.first_start_s}
                          for l in self.lanes]}


# ============================================================================================
# Plan surgery: re-attach upstream
# ============================================================================================


def rewire(plan: Plan, steps: Sequence[Step], lost: int, *, fallback: int | None = None,
           dead: Iterable[int] = ()) -> list[Step]:
    """``steps`` with every read from participant ``lost`` redirected upstream.

    A step that read range R from ``lost`` now reads R where ``lost`` got it from: the source of
    the step (in ``waits``) that brought R into ``lost``, waiting on what that step waited on;
    repeated while that source is in ``dead``. Where ``lost`` got R from nobody (a seed),
    ``fallback`` is used instead: another participant holding every byte (no waits) or
    :data:`HOST` (the host image, an ``h2d`` step). Ids and signals are kept, so the flags
    downstream participants wait on do not change. Raises FlashBootError when no source is left.
    """
    dead = set(dead) | {lost}
    by_id = plan.steps
    out = []
    for s in steps:
        new = s
        guard = 0
        while new.src in dead:
            guard += 1
            if guard > len(plan.participants) + 1:
                raise FlashBootError(f"cannot re-attach step {s.id}: every upstream source is gone")
            feeders = [by_id[w] for w in new.waits if by_id[w].dst == new.src]
            others = tuple(w for w in new.waits if by_id[w].dst != new.src)
            if feeders:
                f = feeders[0]
                new = replace(new, src=f.src, kind=f.kind, waits=tuple(sorted(set(others) | set(f.waits))))
            elif fallback is not None:
                new = replace(new, src=fallback, kind="h2d" if fallback == HOST else "copy", waits=others)
            else:
                raise FlashBootError(
                    f"step {s.id} (bytes {s.offset:,}..{s.end:,}) read from participant {new.src}, which is gone "
                    "and holds bytes nobody else upstream has; no fallback source (another full copy or the host image)"
                )
        out.append(new)
    return out


# ============================================================================================
# The executor
# ============================================================================================


def _contiguous(steps: Sequence[Step]) -> bool:
    """Whether each step starts where the one before it ends (the same offsets at both ends)."""
    return all(a.end == b.offset for a, b in zip(steps, steps[1:]))


class Executor:
    """Runs the steps of ``plan`` whose destination is in ``local``, in this process.

    ``endpoints``: every participant a local step reads from or waits on, plus the local ones
    (their ``arena`` and ``flags`` are the ones this process owns). ``mover``: a registry name or
    a Mover for participant-to-participant copies (default ``copy_engine`` on CUDA, ``host`` on the
    host backend); ``h2d_mover`` for steps from the host image ``host_image`` (a Span).
    ``timeout_s``: how long a step may wait for a flag (or a stream go without progress).
    ``epoch``: the flag value of this run (flags from earlier runs hold smaller values).
    ``steps``: the local steps to run (default: from the plan; pass rewired ones to re-attach);
    ``skip``: ids already done. ``step_hook(step)``: called before each step is issued (tests use
    it to slow a transfer down). ``window``: on CUDA, how many steps a lane may have enqueued
    ahead of completion (None: all, or 1 with a ``step_hook``).
    """

    def __init__(self, plan: Plan, endpoints: Mapping[int, Endpoint], local: Sequence[int] | int, *,
                 mover: Any = None, h2d_mover: Any = None, host_image: Span | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, epoch: int = 1, steps: Sequence[Step] | None = None,
                 skip: Iterable[int] = (), step_hook: Callable[[Step], None] | None = None,
                 window: int | None = None):
        self.plan = plan
        self.local = [local] if isinstance(local, int) else list(local)
        if not self.local:  # had been refused as "local participants mix the host backend and CUDA"
            raise FlashBootError(f"plan {plan.schedule!r}: no local participant given; name the destinations whose "
                                 f"steps this process runs (receivers: {[p.index for p in plan.receivers()]})")
        self.endpoints = dict(endpoints)
        # NaN had failed the run at once as "abandoned after the backstop" with its lanes still
        # running, a negative one failed the first wait as having "waited -1 s"
        self.timeout_s = check_timeout(timeout_s, "Executor timeout_s")
        if not 0 < epoch < 2**31:
            raise FlashBootError(f"epoch must be in 1..2**31-1, got {epoch}")
        self.epoch = int(epoch)
        self.host_image = host_image
        self.step_hook = step_hook
        skip = set(skip)
        chosen = list(steps) if steps is not None else [s for s in plan.steps if s.dst in self.local]
        self.steps = [s for s in chosen if s.id not in skip]
        if any(a.id > b.id for a, b in zip(self.steps, self.steps[1:])):
            self.steps.sort(key=lambda s: s.id)
        for s in self.steps:
            if s.dst not in self.local:
                raise FlashBootError(f"step {s.id} writes into participant {s.dst}, which is not local ({self.local})")
        self._check_endpoints()
        kinds = {self.endpoints[i].arena.device.is_cuda for i in self.local}
        if len(kinds) != 1:
            raise FlashBootError("local participants mix the host backend and CUDA")
        self.device: Device = self.endpoints[self.local[0]].arena.device
        self.backend = "cuda" if self.device.is_cuda else "host"
        self.mover = self._mover(mover, "copy_engine" if self.device.is_cuda else "host")
        self.h2d_mover = self._mover(h2d_mover, "copy_engine" if self.device.is_cuda else "host")
        self.window = window if window is not None else (1 if step_hook is not None else None)

    # -- setup -----------------------------------------------------------------------------------
    @staticmethod
    def _mover(spec: Any, default: str):
        from flashboot.movers import create_mover

        if spec is None:
            spec = default
        return create_mover(spec) if isinstance(spec, str) else spec

    def _check_endpoints(self) -> None:
        for i in self.local:
            ep = self.endpoints.get(i)
            if ep is None or ep.arena is None or ep.flags is None:
                raise FlashBootError(f"local participant {i} needs an endpoint with its arena and flags")
        for s in self.steps:
            # every range inside both arenas before the first copy: a short arena had failed midway,
            # the earlier chunks copied and their flags raised, with the span's error naming no step
            held = self.endpoints[s.dst].arena.nbytes
            if s.end > held:
                raise FlashBootError(f"step {s.id} writes bytes {s.offset:,}..{s.end:,} into {self._name(s.dst)}, "
                                     f"whose arena holds {held:,} bytes")
            if s.kind == "copy" and s.src in self.endpoints and self.endpoints[s.src].arena is not None:
                held = self.endpoints[s.src].arena.nbytes
                if s.end > held:
                    raise FlashBootError(f"step {s.id} reads bytes {s.offset:,}..{s.end:,} from {self._name(s.src)}, "
                                         f"whose arena holds {held:,} bytes")
            if s.kind == "h2d":
                if self.host_image is None:
                    raise FlashBootError(f"step {s.id} loads bytes {s.offset:,}..{s.end:,} from the host image; "
                                         "pass host_image=")
                if s.end > self.host_image.nbytes:
                    raise FlashBootError(f"step {s.id} reads to byte {s.end:,} of a {self.host_image.nbytes:,}-byte host image")
            elif s.src not in self.endpoints or self.endpoints[s.src].arena is None:
                raise FlashBootError(f"step {s.id} reads from participant {s.src}, which has no mapped arena here")
            for w in s.waits:
                p, _ = self.plan.flag_of(w)
                if p not in self.endpoints or self.endpoints[p].flags is None:
                    raise FlashBootError(f"step {s.id} waits on step {w} (a flag of participant {p}), whose flags "
                                         "are not mapped here")

    def _name(self, i: int) -> str:
        if i == HOST:
            return "the host image"
        ep = self.endpoints.get(i)
        who = ep.name if ep else f"participant {i}"
        return f"{who} (pid {ep.pid})" if ep is not None and ep.pid else who

    def _source_span(self, s: Step) -> Span:
        if s.kind == "h2d":
            return self.host_image.sub(s.offset, s.nbytes)
        return self.endpoints[s.src].arena.span(s.offset, s.nbytes)

    def _lanes(self) -> dict[tuple[int, int], list[Step]]:
        lanes: dict[tuple[int, int], list[Step]] = {}
        for s in self.steps:
            lanes.setdefault((s.dst, s.lane), []).append(s)
        return lanes

    def _units(self, steps: Sequence[Step]) -> list[list[Step]]:
        """``steps`` (id order) cut into what goes to a mover in one call: consecutive steps of a
        lane from one source that wait for nothing and that no step of the plan waits for (their
        flags order nothing but completion, so raising them together at the batch's end delays no
        reader) become one validated batch (``Mover.copy_batch``); every other step stays alone.
        Without batching (a ``step_hook`` sees every step) each step is its own unit."""
        if self.step_hook is not None:
            return [[s] for s in steps]
        awaited = self.plan.awaited | {w for st in self.steps for w in st.waits}  # rewired steps too
        units: list[list[Step]] = []
        last: dict[tuple[int, int], list[Step]] = {}
        for s in steps:
            key = (s.dst, s.lane)
            run = last.get(key)
            batchable = not s.waits and s.id not in awaited
            if (batchable and run is not None and run is units[-1] and run[-1].kind == s.kind and run[-1].src == s.src
                    and not run[-1].waits and run[-1].id not in awaited):
                run.append(s)
                continue
            units.append([s])
            last[key] = units[-1]
        return units

    def _copy_unit(self, unit: Sequence[Step], stream: Any) -> None:
        """Copy the steps of one unit: one ``mover.copy`` for a single step or a run of steps that
        continue one another (nothing waits between them: a star's or a refit's whole image is
        one copy, as the copy engine's batch would merge it, without building a batch), batches
        otherwise. A mover's failure is raised naming the steps, their bytes and both ends (the
        mover's own error names neither the plan's step nor the participants), as its own class
        where that is a FlashBootError."""
        try:
            self._copy_steps(unit, stream)
        except Exception as exc:
            s, last = unit[0], unit[-1]
            which = f"step {s.id}" if len(unit) == 1 else f"steps {s.id}..{last.id}"
            lo, hi = min(u.offset for u in unit), max(u.end for u in unit)
            mover = getattr(self.h2d_mover if s.kind == "h2d" else self.mover, "name", "?")
            raise restated(exc, f"{self.plan.schedule} {which} (bytes {lo:,}..{hi:,} from {self._name(s.src)} into "
                                f"{self._name(s.dst)}): mover {mover} failed: {type(exc).__name__}: {exc}") from exc

    def _copy_steps(self, unit: Sequence[Step], stream: Any) -> None:
        s = unit[0]
        mover = self.h2d_mover if s.kind == "h2d" else self.mover
        dst_arena = self.endpoints[s.dst].arena
        if len(unit) == 1:
            mover.copy(dst_arena.span(s.offset, s.nbytes), self._source_span(s), stream=stream)
            return
        if s.kind == "h2d":
            if _contiguous(unit):
                lo, hi = unit[0].offset, unit[-1].end
                mover.copy(dst_arena.span(lo, hi - lo), self.host_image.sub(lo, hi - lo), stream=stream)
                return
            mover.copy_batch(dst_arena.span(), self.host_image, [(u.offset, u.offset, u.nbytes) for u in unit],
                             stream=stream)
            return
        for group in self._mapping_groups(unit):
            lo, hi = min(u.offset for u in group), max(u.end for u in group)
            src = self.endpoints[s.src].arena.span(lo, hi - lo)  # maps the segments this group reads
            if _contiguous(group):
                mover.copy(dst_arena.span(lo, hi - lo), src, stream=stream)
            else:
                mover.copy_batch(dst_arena.span(), src, [(u.offset, u.offset - lo, u.nbytes) for u in group],
                                 stream=stream)

    def _mapping_groups(self, unit: Sequence[Step]) -> list[list[Step]]:
        """``unit`` as one group, or, where its source still maps segments on first use (opened
        from another process), cut into groups: steps whose segments are all mapped already (a
        clone maps ahead while its arena is made) join one group, copied at once; the others
        form groups ending in 1, 2, 4, ... up to :data:`MAP_GROUP_MAX_SEGMENTS` unmapped source
        segments: each group's segments are mapped just before its copies are issued, so mapping
        group k+1 overlaps the copy of group k. One batch would map them all before any copy: a
        same-GPU refit of 13.8 GB (52 segments) ran at half the copy rate that way. Growing
        groups over segments mapped ahead held back the copies the device could run while the
        rest were mapped (13.76 GB on an H200 with 39 of 52 segments mapped ahead: 0.85x D2D)."""
        arena = self.endpoints[unit[0].src].arena
        if arena.mapped_nbytes == arena.nbytes:
            return [list(unit)]
        seg, mapped = arena.segment_bytes, arena.mapped_segments()
        groups: list[list[Step]] = []
        width, last_seg, ready_group = 0, -1, False  # segments the current group may end in, up to last_seg
        for u in unit:
            first_seg, end_seg = u.offset // seg, (u.end - 1) // seg
            if all(mapped[first_seg:end_seg + 1]):
                if not (groups and (ready_group or end_seg <= last_seg)):
                    groups.append([])
                    ready_group = True
                groups[-1].append(u)
                continue
            if groups and end_seg <= last_seg:
                groups[-1].append(u)
                continue
            width = min(max(1, 2 * width), MAP_GROUP_MAX_SEGMENTS)
            last_seg = max(end_seg, first_seg + width - 1)
            groups.append([u])
            ready_group = False
        return groups

    def _watches(self) -> dict[int, PeerWatch]:
        """Watch every non-local process a local step depends on."""
        pids = {}
        for s in self.steps:
            deps = {self.plan.flag_of(w)[0] for w in s.waits}
            if s.kind == "copy":
                deps.add(s.src)
            for p in deps:
                ep = self.endpoints.get(p)
                if p not in self.local and ep is not None and ep.pid and ep.pid != os.getpid():
                    pids[p] = ep.pid
        return {p: PeerWatch(pid) for p, pid in pids.items()}

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> ExecReport:
        """Run every local step; returns the timing report or raises :class:`StepFailure`."""
        watches = self._watches()
        try:
            from .lanes import CudaRun, HostRun  # the backends build on this module's types

            if self.backend == "cuda":
                return CudaRun(self, watches).run()
            return HostRun(self, watches).run()
        finally:
            for w in watches.values():
                w.close()


__all__ = ["DEFAULT_TIMEOUT_S", "Endpoint", "ExecReport", "Executor", "HostFlags", "LaneReport", "PeerWatch",
           "StepFailure", "create_flags", "rewire"]
