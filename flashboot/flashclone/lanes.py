"""How a participant's lanes run a plan's steps (:class:`~flashboot.flashclone.executor.Executor`
picks one): :class:`CudaRun` enqueues every step on CUDA streams (flag waits and writes as stream
memory operations, the host only watching), :class:`HostRun` runs one thread per lane on the
host backend. See :mod:`flashboot.flashclone.executor` for the model both follow."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .. import _cuda
from ..cuda_streams import Stream, give_back, lend_event, lend_stream, wait_events
from ..errors import FlashBootError, WaitTimeoutError, restated
from ..schedulers import Step
from .executor import FLAG_BYTES, ExecReport, Executor, HostFlags, LaneReport, PeerWatch, StepFailure

DRAIN_TIMEOUT_S = 10.0
"""After releasing blocked streams, how long the host waits for them to drain before giving up; on
the host backend, how long a run that gives up on its lanes waits for them to stop."""
BACKSTOP_SLACK_S = 60.0
"""Host lanes: added to ``timeout_s`` per step (each wait's own bound) for the join's backstop."""


# ============================================================================================
# Host backend
# ============================================================================================


class HostRun:
    def __init__(self, ex: Executor, watches: dict[int, PeerWatch]):
        self.ex = ex
        self.watches = watches
        self.flags = {i: HostFlags(ep.flags) for i, ep in ex.endpoints.items() if ep.flags is not None}
        self.abort = threading.Event()
        self.failures: list[StepFailure] = []
        self.done: set[int] = set()
        self.lock = threading.Lock()
        # set under ``lock`` once run() gives up on its lanes: from then on no lane touches a flag
        # (the caller may close the flags arenas as soon as run() has raised)
        self.abandoned = False
        self.doing: dict[tuple[int, int], tuple[str, Step]] = {}  # each lane's phase, for that error
        # set by each lane as it leaves, after its last touch of any arena: what run() waits on (an
        # interrupted Thread.join marks a live thread stopped on Python 3.11, bpo-45274's release)
        self.ended: dict[tuple[int, int], threading.Event] = {}

    def _fail(self, message: str, step: Step, peer: int | None, exited: bool) -> None:
        with self.lock:
            self.failures.append(StepFailure(message, step=step, peer=peer, peer_exited=exited, valid_steps=set()))
        self.abort.set()

    def _exited(self, p: int) -> bool:
        w = self.watches.get(p)
        return w is not None and w.exited()

    def _await(self, step: Step, w: int) -> bool:
        """Poll the flag of step ``w`` until it reaches the epoch; False when the run must stop."""
        ex = self.ex
        p, f = ex.plan.flag_of(w)
        flags = self.flags[p]
        epoch = ex.epoch
        t0 = time.monotonic()
        delay = 2e-5
        while True:
            if ((flags.get(f) - epoch) & 0xFFFFFFFF) < 0x80000000:  # cyclic >=, as cuStreamWaitValue32 GEQ
                return True
            if self.abort.is_set():
                return False
            waited = time.monotonic() - t0
            if self._exited(p):
                if ((flags.get(f) - epoch) & 0xFFFFFFFF) < 0x80000000:
                    return True
                self._fail(f"step {step.id} (bytes {step.offset:,}..{step.end:,} into {ex._name(step.dst)}) waited for "
                           f"step {w}'s flag {f} of {ex._name(p)}, which exited before raising it", step, p, True)
                return False
            if waited > ex.timeout_s:
                self._fail(f"step {step.id} (bytes {step.offset:,}..{step.end:,} into {ex._name(step.dst)}) waited "
                           f"{ex.timeout_s:g} s for step {w}'s flag {f} of {ex._name(p)} (still {flags.get(f)}, "
                           f"needs {epoch})", step, p, False)
                return False
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _lane(self, key: tuple[int, int], steps: list[Step], report: LaneReport, t_start: float) -> None:
        ex = self.ex
        dst, _ = key
        own = self.flags[dst]
        try:
            for i, unit in enumerate(ex._units(steps)):
                s = unit[0]
                self.doing[key] = ("waiting for the flags of", s)
                for w in s.waits:
                    if not self._await(s, w):
                        return
                # a source whose flags vouch for the range may have exited since (our mapping keeps
                # its memory); a source without flags (a seed) is trusted only while it lives
                vouched = any(ex.plan.flag_of(w)[0] == s.src for w in s.waits)
                if s.kind == "copy" and not vouched and self._exited(s.src):
                    self._fail(f"step {s.id} (bytes {s.offset:,}..{s.end:,}) reads from {ex._name(s.src)}, which "
                               "exited", s, s.src, True)
                    return
                if self.abort.is_set():
                    return
                if i == 0:
                    report.first_start_s = time.perf_counter() - t_start
                if ex.step_hook is not None:
                    self.doing[key] = ("in the step hook of", s)
                    ex.step_hook(s)
                    if self.abort.is_set():
                        return
                self.doing[key] = ("copying", s)
                ex._copy_unit(unit, None)
                with self.lock:
                    if self.abandoned:  # run() has raised: the flags may be unmapped by now
                        return
                    for u in unit:
                        own.set(u.signal, ex.epoch)  # after the copy returned: the bytes are in place
                    self.done.update(u.id for u in unit)
                end = time.perf_counter() - t_start
                report.step_end_s.extend([end] * len(unit))
                report.steps += len(unit)
                report.nbytes += sum(u.nbytes for u in unit)
        except BaseException as exc:  # a mover error: stop everyone, re-raised by run()
            with self.lock:
                self.failures.append(exc)  # type: ignore[arg-type]
            self.abort.set()
        finally:
            self.doing.pop(key, None)
            self.ended[key].set()

    def run(self) -> ExecReport:
        ex = self.ex
        lanes = ex._lanes()
        reports = {k: LaneReport(k[0], k[1], 0, 0, 0.0) for k in lanes}
        t0 = time.perf_counter()
        threads = {k: threading.Thread(target=self._lane, args=(k, steps, reports[k], t0), daemon=True,
                                       name=f"flashboot-lane-{k[0]}.{k[1]}") for k, steps in lanes.items()}
        self.ended = {k: threading.Event() for k in lanes}
        # every lane wait is bounded by timeout_s per flag; the join bound is only a backstop, at
        # most half of what a thread wait takes (1e6 s over 10,000 steps had raised OverflowError)
        limit = min(ex.timeout_s * (len(ex.steps) + 1) + BACKSTOP_SLACK_S, threading.TIMEOUT_MAX / 2)
        backstop = time.monotonic() + limit
        try:
            for t in threads.values():
                t.start()
            for ended in self.ended.values():
                ended.wait(max(0.0, backstop - time.monotonic()))
        except BaseException:  # an interrupt: the caller unwinds and frees the arenas, so stop the lanes first
            self._stop(threads)
            raise
        if not all(ended.is_set() for ended in self.ended.values()):
            running = self._stop(threads)
            if running:
                err = WaitTimeoutError(
                    f"host lanes of {ex.plan.schedule} did not finish within {limit:g} s; stopped the others, but "
                    f"{'; '.join(running)}: a copy cannot be interrupted, so the arenas it touches stay referenced "
                    "until it returns (closing them before then faults the process; join .lanes_running first)"
                    + self._first_failure())
                err.lanes_running = [t for k, t in threads.items()
                                     if t.ident is not None and not self.ended[k].is_set()]
                raise err
            raise WaitTimeoutError(f"host lanes of {ex.plan.schedule} did not finish within {limit:g} s; stopped "
                                   "them" + self._first_failure())
        wall = time.perf_counter() - t0
        for r in reports.values():
            r.seconds = r.step_end_s[-1] if r.step_end_s else 0.0
        if self.failures:
            first = self.failures[0]
            if not isinstance(first, StepFailure):
                raise first
            first.valid_steps = set(self.done)
            raise first
        return ExecReport(ex.plan.schedule, "host", ex.mover.name, ex.epoch, list(reports.values()), wall)

    def _stop(self, threads: dict[tuple[int, int], threading.Thread]) -> list[str]:
        """Give up on the lanes: stop them, wait up to :data:`DRAIN_TIMEOUT_S` for them to leave (a
        lane polling a flag leaves within a poll, one in a copy when the copy returns) and name the
        lanes still running. None of them touches a flag from here on; the bytes a copy still
        running touches stay mapped as long as the caller does not close them: the lane's thread
        holds this run, and through it every arena."""
        with self.lock:
            self.abandoned = True
        self.abort.set()
        started = {k: self.ended[k] for k, t in threads.items() if t.ident is not None}
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for ended in started.values():
            ended.wait(max(0.0, deadline - time.monotonic()))
        ex = self.ex
        running = []
        for (dst, lane), ended in started.items():
            if ended.is_set():
                continue
            phase, s = self.doing.get((dst, lane), ("starting", None))
            what = "" if s is None else (f" step {s.id} (bytes {s.offset:,}..{s.end:,} from {ex._name(s.src)} into "
                                         f"{ex._name(s.dst)})")
            running.append(f"lane {dst}.{lane} was still {phase}{what} {DRAIN_TIMEOUT_S:g} s later")
        return running

    def _first_failure(self) -> str:
        with self.lock:
            return f" (first failure: {self.failures[0]})" if self.failures else ""


# ============================================================================================
# CUDA backend: stream memory operations
# ============================================================================================


class CudaRun:
    @_cuda.keeps_context
    def __init__(self, ex: Executor, watches: dict[int, PeerWatch]):
        self.drv = _cuda.driver()
        self.ex = ex
        self.watches = watches
        self.lanes = ex._lanes()
        # each lane runs on a stream of its destination's device (in-process runs may span GPUs)
        self.lane_device = {k: ex.endpoints[k[0]].arena.device.index for k in self.lanes}
        self.streams, self.side = {}, {}
        for k, dev in self.lane_device.items():
            # private non-blocking streams (not torch's shared pool): the legacy default stream,
            # or another library's work, must never serialise with a blocked wait; lent by this
            # process's pool and handed back after a run that ended cleanly (a refit repeats)
            self.streams[k] = lend_stream(dev)
            if dev not in self.side:
                self.side[dev] = lend_stream(dev)
        self._final_flags: dict[int, np.ndarray] = {}
        self._in_copy = False
        self.geq = int(self.drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self.write_default = int(self.drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)

    def _flag_ptr(self, participant: int, flag: int) -> int:
        return self.ex.endpoints[participant].flags.ptr + FLAG_BYTES * flag

    def _cu(self, stream: Stream) -> Any:
        return stream.handle

    def _issue(self, unit: list[Step], stream) -> None:
        ex, drv = self.ex, self.drv
        cs = self._cu(stream)
        s = unit[0]
        for w in s.waits:
            p, f = ex.plan.flag_of(w)
            _cuda.check(drv.cuStreamWaitValue32(cs, drv.CUdeviceptr(self._flag_ptr(p, f)), ex.epoch, self.geq),
                        f"cuStreamWaitValue32(step {s.id} waits on step {w})")
        self._in_copy = True  # the mover's error names the steps, the bytes and both ends already
        ex._copy_unit(unit, stream)
        self._in_copy = False
        first = unit[0].signal
        if len(unit) > 1 and all(u.signal == first + i for i, u in enumerate(unit)):
            # a run's flags are consecutive words: one stream-ordered memset raises them all after
            # its copy (51 memory operations, one per 256 MiB step of a 13.8 GB refit, cost the
            # host ~0.2 ms and the stream their own time before the lane's end)
            _cuda.check(drv.cuMemsetD32Async(drv.CUdeviceptr(self._flag_ptr(s.dst, first)), ex.epoch, len(unit), cs),
                        f"cuMemsetD32Async(flags of steps {s.id}..{unit[-1].id} done)")
            return
        for u in unit:  # default flags: each write is ordered after the copy with a memory barrier
            _cuda.check(drv.cuStreamWriteValue32(cs, drv.CUdeviceptr(self._flag_ptr(u.dst, u.signal)), ex.epoch,
                                                 self.write_default), f"cuStreamWriteValue32(step {u.id} done)")

    @_cuda.keeps_context
    def _read_flags(self, participant: int, count: int, dev: int) -> np.ndarray:
        """The first ``count`` flags of ``participant`` read to the host on ``dev``'s side stream."""
        out = np.zeros(max(count, 1), np.uint32)
        drv = self.drv
        side = self.side[dev]
        _cuda.use_device(dev)
        _cuda.check(drv.cuMemcpyDtoHAsync(out.ctypes.data, drv.CUdeviceptr(self._flag_ptr(participant, 0)),
                                          out.nbytes, self._cu(side)), "cuMemcpyDtoHAsync(flags)")
        side.synchronize()
        return out

    @_cuda.keeps_context
    def run(self) -> ExecReport:
        ex = self.ex
        order = ex._units(ex.steps)  # global id order of each unit's first step (see module doc)
        key_of = {u[0].id: (u[0].dst, u[0].lane) for u in order}
        issued: dict[tuple[int, int], list[tuple[Step, Any]]] = {k: [] for k in self.lanes}
        completed: dict[tuple[int, int], int] = {k: 0 for k in self.lanes}
        start_ev, unit_events = {}, []
        for k, st in self.streams.items():
            start_ev[k] = lend_event(self.lane_device[k], timing=True)
            start_ev[k].record(st)
        t0 = time.perf_counter()
        next_i = 0
        last_progress = time.monotonic()
        failure: tuple[str, Step | None, int | None, bool] | None = None
        # what the host was doing, for an error's message: (step, phase); a unit being issued
        # when an error struck (its wait may be parked already) is released with the rest
        at: tuple[Step | None, str] = (None, "starting the lanes")
        issuing: tuple[tuple[int, int], list[Step]] | None = None
        try:
            while True:
                # issue in global id order, as far as the windows allow
                while next_i < len(order):
                    unit = order[next_i]
                    s = unit[0]
                    k = key_of[s.id]
                    if ex.window is not None and len(issued[k]) - completed[k] >= ex.window:
                        break
                    at = (s, "checking its sources")
                    failure = self._dead_failure(s)
                    if failure is not None:
                        break
                    if ex.step_hook is not None:
                        at = (s, "in the step hook")
                        ex.step_hook(s)
                    at = (s, "issuing it")
                    issuing = (k, unit)
                    _cuda.use_device(self.lane_device[k])
                    self._issue(unit, self.streams[k])
                    at = (s, "recording its end")
                    ev = lend_event(self.lane_device[k], timing=True)
                    ev.record(self.streams[k])
                    unit_events.append(ev)
                    issued[k].extend((u, ev) for u in unit)
                    issuing = None
                    next_i += 1
                if failure is not None:
                    break
                if next_i == len(order) and not any(s.waits for k, lst in issued.items()
                                                    for s, _ in lst[completed[k]:]):
                    # every step left is a plain copy (no flag to wait on): wait for the lanes' last
                    # events in the driver, the GIL released, and wake as they pass, not up to a poll later
                    left = {k: lst for k, lst in issued.items() if completed[k] < len(lst)}
                    if left:
                        k, lst = next(iter(left.items()))
                        at = (lst[completed[k]][0], "waiting for the lanes' last copies")
                    if not left or wait_events([lst[-1][1] for lst in left.values()], ex.timeout_s):
                        for k, lst in left.items():
                            completed[k] = len(lst)
                        break
                    k, lst = next(iter(left.items()))
                    s = lst[completed[k]][0]
                    failure = (f"step {s.id} (bytes {s.offset:,}..{s.end:,} into {ex._name(s.dst)}) did not end within "
                               f"{ex.timeout_s:g} s", s, self._awaited_peer(s, self.lane_device[k]), False)
                    break
                progressed = False
                for k, lst in issued.items():
                    while completed[k] < len(lst):
                        at = (lst[completed[k]][0], "polling its end")
                        if not lst[completed[k]][1].done:
                            break
                        completed[k] += 1
                        progressed = True
                if progressed:
                    last_progress = time.monotonic()
                if next_i == len(order) and all(completed[k] == len(issued[k]) for k in issued):
                    break
                blocked = [(k, issued[k][completed[k]][0]) for k in issued if completed[k] < len(issued[k])]
                for k, s in blocked:
                    at = (s, "checking its sources")
                    failure = self._dead_failure(s)
                    if failure is not None:
                        break
                if failure is not None:
                    break
                if time.monotonic() - last_progress > ex.timeout_s:
                    k, s = blocked[0] if blocked else (key_of[order[next_i][0].id], order[next_i][0])
                    failure = (f"step {s.id} (bytes {s.offset:,}..{s.end:,} into {ex._name(s.dst)}) made no progress "
                               f"for {ex.timeout_s:g} s", s, self._awaited_peer(s, self.lane_device[k]), False)
                    break
                if not progressed:
                    time.sleep(2e-4)
        except BaseException as exc:  # a mover's or the driver's error, the hook's, an interrupt
            self._release_after_error(exc, at, issuing, issued, completed)
        wall = time.perf_counter() - t0
        if failure is not None:
            self._release_and_raise(failure, issued, completed)
        reports = []
        for k, lst in issued.items():
            at: dict[int, float] = {}  # one event per unit: asked once
            ends = [at[id(ev)] if id(ev) in at else at.setdefault(id(ev), start_ev[k].elapsed_ms(ev) / 1e3)
                    for _, ev in lst]
            reports.append(LaneReport(k[0], k[1], len(lst), sum(s.nbytes for s, _ in lst),
                                      ends[-1] if ends else 0.0, ends))
        # every event has passed and no stream holds a wait: all reusable (after a failure they are
        # dropped instead, a released stream may still be draining)
        give_back(*self.streams.values(), *self.side.values(), *start_ev.values(), *unit_events)
        return ExecReport(ex.plan.schedule, "cuda", ex.mover.name, ex.epoch, reports, wall)

    def _dead_failure(self, s: Step) -> tuple | None:
        """The failure of ``s`` when it depends on a participant that exited (see below), or None."""
        dead = self._dead_dependency(s)
        if dead is None:
            return None
        return (f"step {s.id} (bytes {s.offset:,}..{s.end:,}) depends on {self.ex._name(dead)}, which exited", s,
                dead, True)

    def _dead_dependency(self, s: Step) -> int | None:
        """A participant ``s`` depends on that exited before it could vouch for ``s``'s bytes."""
        ex = self.ex
        owners = {ex.plan.flag_of(w)[0] for w in s.waits}
        for p in owners | ({s.src} if s.kind == "copy" else set()):
            w = self.watches.get(p)
            if w is None or not w.exited():
                continue
            if p not in owners:
                return p  # a seed-like source (no flags) is trusted only while it lives
            # an exited process's flags are final: the wait can still be met if they were raised
            final = self._final_flags.get(p)
            if final is None:
                dev = ex.endpoints[s.dst].arena.device.index
                final = self._final_flags[p] = self._read_flags(p, ex.plan.flag_count(p), dev)
            if any(int(final[f]) < ex.epoch for q, f in map(ex.plan.flag_of, s.waits) if q == p):
                return p
        return None

    def _awaited_peer(self, s: Step, dev: int) -> int | None:
        for w in s.waits:
            p, f = self.ex.plan.flag_of(w)
            try:
                if int(self._read_flags(p, f + 1, dev)[f]) < self.ex.epoch:
                    return p
            except FlashBootError:
                return p
        return s.src if s.kind == "copy" else None

    def _release_and_raise(self, failure, issued, completed) -> None:
        """Unblock every enqueued wait from the host, drain the streams, raise StepFailure."""
        message, step, peer, exited = failure
        pending = {s.id for k, lst in issued.items() for s, _ in lst[completed[k]:]}
        out = {"valid": {s.id for k, lst in issued.items() for s, _ in lst[:completed[k]]}, "tainted": set(),
               "released": False}
        try:
            self._release(issued, completed, peer, exited, out)
        except FlashBootError as exc:
            raise StepFailure(f"{message}; {exc}", step=step, peer=peer, peer_exited=exited, valid_steps=out["valid"],
                              released=out["released"], tainted_steps=pending - out["valid"]) from exc
        raise StepFailure(message + ("; blocked streams released from the host" if out["released"] else ""), step=step,
                          peer=peer, peer_exited=exited, valid_steps=out["valid"], released=out["released"],
                          tainted_steps=out["tainted"])

    def _release_after_error(self, exc: BaseException, at: tuple[Step | None, str], issuing, issued,
                             completed) -> None:
        """After an error while issuing or watching the steps: release and drain the streams as
        :meth:`_release_and_raise` does (a wait left parked on a flag nobody raises would run its
        copy into our arena whenever the flag came, after the caller freed it), then raise the
        error naming the step; an interrupt is re-raised as it is, after the release."""
        ex = self.ex
        s, phase = at
        if issuing is not None:  # its wait may be parked, its copy half enqueued: released as well
            k, unit = issuing
            try:
                ev = lend_event(self.lane_device[k], timing=True)
                ev.record(self.streams[k])
            except BaseException:  # its end cannot be watched: its waits are released all the same
                ev = None
            issued[k].extend((u, ev) for u in unit)
        out = {"valid": set(), "tainted": set(), "released": False}
        try:
            self._release(issued, completed, None, False, out)
            note = "; blocked streams released from the host" if out["released"] else ""
        except FlashBootError as rel:
            note = f"; {rel}"
        if not isinstance(exc, Exception):
            raise exc
        if phase == "issuing it" and self._in_copy:
            message = str(exc)
        else:
            where = "" if s is None else (f" step {s.id} (bytes {s.offset:,}..{s.end:,} into "
                                          f"{ex._name(s.dst)})")
            message = f"{ex.plan.schedule}{where}: {phase} failed: {type(exc).__name__}: {exc}"
        raise restated(exc, message + note) from exc

    def _release(self, issued, completed, peer, exited, out: dict) -> None:
        """Write every awaited flag not raised yet from a side stream (releasing the parked
        waits), then wait for the streams to drain. Fills ``out``: ``valid`` (steps drained with
        trusted bytes), ``tainted`` (drained after a released wait, or from a source that
        exited), ``released``; raises FlashBootError saying what failed."""
        ex = self.ex
        pending = [(k, s) for k, lst in issued.items() for s, _ in lst[completed[k]:]]
        legit: dict[tuple[int, int], bool] = {}
        try:
            # which awaited flags were raised legitimately, read before we write any
            need: dict[tuple[int, int], int] = {}
            for k, s in pending:
                for w in s.waits:
                    p, f = ex.plan.flag_of(w)
                    key = (p, self.lane_device[k])
                    need[key] = max(need.get(key, 0), f + 1)
            snapshot = {key: self._read_flags(key[0], n, key[1]) for key, n in need.items()}
            for k, s in pending:
                dev = self.lane_device[k]
                for w in s.waits:
                    p, f = ex.plan.flag_of(w)
                    ok = int(snapshot[(p, dev)][f]) >= ex.epoch
                    legit[(p, f)] = legit.get((p, f), True) and ok
                    if not ok:
                        _cuda.use_device(dev)
                        _cuda.check(self.drv.cuStreamWriteValue32(
                            self._cu(self.side[dev]), self.drv.CUdeviceptr(self._flag_ptr(p, f)), ex.epoch,
                            self.write_default), f"cuStreamWriteValue32(release flag {f} of participant {p})")
                        out["released"] = True
            for side in self.side.values():
                side.synchronize()
        except FlashBootError as exc:
            raise FlashBootError(f"releasing the blocked streams failed: {exc}") from exc
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for k, lst in issued.items():
            for s, ev in lst[completed[k]:]:
                if ev is None:  # a unit whose end event could not be made: not trusted
                    continue
                try:
                    while not ev.done:
                        if time.monotonic() > deadline:
                            raise WaitTimeoutError(f"after releasing its waits the stream of participant {k[0]} "
                                                   f"did not drain within {DRAIN_TIMEOUT_S:g} s")
                        time.sleep(1e-3)
                except WaitTimeoutError:
                    raise
                except FlashBootError as exc:
                    raise FlashBootError(f"releasing the blocked streams failed: {exc}") from exc
                # bytes copied after a released wait (or from a source that exited) are not trusted
                if all(legit.get(ex.plan.flag_of(w), True) for w in s.waits) and not (
                        s.kind == "copy" and s.src == peer and exited):
                    out["valid"].add(s.id)
                else:
                    out["tainted"].add(s.id)


__all__ = ["CudaRun", "DRAIN_TIMEOUT_S", "HostRun"]
