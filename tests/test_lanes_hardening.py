"""The clone executor's lanes (flashboot/flashclone/lanes.py) when a run goes wrong.

Host backend on real memfd arenas: a run that gives up on a lane stuck in a copy stops the other
lanes before it raises, and no lane touches the flags once it has (the caller closes them)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import flashboot.flashclone.lanes as lanes
from flashboot.arena import Arena
from flashboot.errors import WaitTimeoutError
from flashboot.flashclone.executor import Endpoint, Executor, create_flags
from flashboot.movers.host import HostMover
from flashboot.schedulers import build_plan

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


# ============================================================================================
# Host backend
# ============================================================================================


def _host_participants(plan, nbytes):
    eps = {}
    for p in plan.participants:
        a = Arena.create(nbytes, "cpu")
        if p.role == "seed":
            a.bytes().numpy()[:nbytes] = np.arange(nbytes, dtype=np.uint8) * 7
        eps[p.index] = Endpoint(p.index, p.name, a, None if p.role == "seed" else
                                create_flags(plan.flag_count(p.index), "cpu"))
    return eps


def _close(eps):
    for ep in eps.values():
        for a in (ep.flags, ep.arena):
            if a is not None and not a.closed:
                a.close()


class _Gated(HostMover):
    """The host mover, but the copy into ``dst`` at ``offset`` returns only once ``gate`` is set
    (its bytes are copied first: a long copy that ends after the run has given up)."""

    def __init__(self, arena, offset):
        super().__init__()
        self.arena, self.offset = arena, offset
        self.gate, self.entered, self.returned = threading.Event(), threading.Event(), threading.Event()

    def copy(self, dst, src, *a, **k):
        out = super().copy(dst, src, *a, **k)
        if dst.ptr == self.arena.ptr + self.offset:
            self.entered.set()
            self.gate.wait(30)
            self.returned.set()
        return out


def test_a_run_that_gives_up_stops_its_lanes_and_no_late_copy_raises_a_flag(monkeypatch):
    """The backstop had raised "abandoned after the backstop" with its lanes still running: one
    that then finished its copy stored its flag into a flags arena the caller had closed by then
    (a segfault). Now the run stops the lanes first, names the one left in its copy, and that lane
    touches no flag when its copy returns."""
    monkeypatch.setattr(lanes, "BACKSTOP_SLACK_S", 0.0)
    monkeypatch.setattr(lanes, "DRAIN_TIMEOUT_S", 0.5)
    nbytes = 2 * MiB
    plan = build_plan("chain", 2, nbytes, MiB)
    eps = _host_participants(plan, nbytes)
    stuck = next(s for s in plan.steps if s.dst == 1 and s.offset == MiB)  # seed -> clone0, second chunk
    mover = _Gated(eps[1].arena, stuck.offset)
    mover.copy(eps[2].arena.span(0, MiB), eps[0].arena.span(0, MiB))  # compiled before the clock runs
    before = set(threading.enumerate())
    try:
        with pytest.raises(WaitTimeoutError) as info:
            Executor(plan, eps, [1, 2], mover=mover, timeout_s=0.5).run()
        msg = str(info.value)
        assert (f"lane 1.0 was still copying step {stuck.id} (bytes 1,048,576..2,097,152 from seed into clone0) "
                "0.5 s later") in msg
        assert "first failure: step" in msg and "waited 0.5 s for step" in msg  # clone1's wait that ran out
        left = info.value.lanes_running
        assert [t.name for t in left] == ["flashboot-lane-1.0"]  # clone1's lane, polling a flag, has left
        assert not mover.returned.is_set()
        mover.gate.set()
        left[0].join(10)
        assert not left[0].is_alive()
        # the copy came back after the run had raised: its flag (and the ones after it) stayed down
        flags = np.frombuffer(eps[1].flags.bytes().numpy(), np.uint32)
        assert flags[stuck.signal] == 0 and flags[plan.steps[0].signal] == 1
    finally:
        mover.gate.set()
        _close(eps)


def test_an_interrupted_run_stops_its_lanes_before_the_interrupt_unwinds(monkeypatch):
    """Ctrl-C while run() joined its lanes: the KeyboardInterrupt unwound into the caller (which
    closes the arenas) with every lane still polling or copying. Now the lanes stop first."""
    import signal

    monkeypatch.setattr(lanes, "DRAIN_TIMEOUT_S", 5.0)
    nbytes = 4 * MiB
    plan = build_plan("chain", 2, nbytes, MiB)
    eps = _host_participants(plan, nbytes)
    stuck = next(s for s in plan.steps if s.dst == 1 and s.offset == MiB)
    mover = _Gated(eps[1].arena, stuck.offset)
    mover.copy(eps[2].arena.span(0, MiB), eps[0].arena.span(0, MiB))
    main = threading.get_ident()

    def interrupt():
        mover.entered.wait(20)
        time.sleep(0.2)  # clone1's lane is polling the stuck step's flag by now
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.3)  # let the run stop what it can before the copy returns
        mover.gate.set()

    before = set(threading.enumerate())
    helper = threading.Thread(target=interrupt, daemon=True)
    helper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            Executor(plan, eps, [1, 2], mover=mover, timeout_s=20).run()
        assert mover.returned.is_set()  # the run waited for the copy before it let the interrupt through
        for t in threading.enumerate():
            if t not in before and t is not helper:
                t.join(10)  # each lane has left its loop; its thread is ending
        flags = np.frombuffer(eps[1].flags.bytes().numpy(), np.uint32)
        assert flags[stuck.signal] == 0 and flags[plan.steps[0].signal] == 1
    finally:
        mover.gate.set()
        helper.join(10)
        _close(eps)

