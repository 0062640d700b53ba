"""The clone executor's lanes (flashboot/flashclone/lanes.py) when a run goes wrong.

Host backend on real memfd arenas: a run that gives up on a lane stuck in a copy stops the other
lanes before it raises, and no lane touches the flags once it has (the caller closes them).

CUDA backend without a GPU: an in-process fake of the driver calls CudaRun makes (streams as
queues of wait / write / copy operations over real host words, run as far as their waits allow
whenever an event is asked about), so a failure while issuing or polling can be checked to leave
no stream parked on a flag nobody will raise. The driver plumbing itself is checked through
cuda-bindings in tests/test_cuda_path_stub.py."""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import flashboot.flashclone.lanes as lanes
from flashboot.arena import Arena
from flashboot.errors import CudaError, FlashBootError, WaitTimeoutError
from flashboot.flashclone.executor import Endpoint, Executor, StepFailure, create_flags
from flashboot.memory import Device, Span
from flashboot.movers.host import HostMover
from flashboot.schedulers import build_plan

from _clone_helpers import close_endpoints  # noqa: E402

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
        close_endpoints(eps)


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
        close_endpoints(eps)


# ============================================================================================
# CUDA backend, through a fake driver
# ============================================================================================


class _FakeStream:
    """A stream as a queue of operations that runs, in order, as far as its waits allow."""

    handles = 100

    def __init__(self, sim, device_index=0):
        _FakeStream.handles += 1
        self.sim, self.handle, self.device_index = sim, _FakeStream.handles, device_index
        self.ptr = self.handle
        self.ops: list[tuple] = []
        self.pos = 0
        sim.streams[self.handle] = self

    def advance(self) -> None:
        while self.pos < len(self.ops):
            op = self.ops[self.pos]
            if op[0] == "wait" and ctypes.c_uint32.from_address(op[1]).value < op[2]:
                return  # parked on cuStreamWaitValue32
            if op[0] == "write":
                ctypes.c_uint32.from_address(op[1]).value = op[2]
            elif op[0] == "fn":
                op[1]()
            self.pos += 1

    @property
    def blocked(self) -> bool:
        self.sim.advance()
        return self.pos < len(self.ops)

    def synchronize(self) -> None:
        if self.blocked:
            raise AssertionError(f"stream {self.handle} would block for good on {self.ops[self.pos]}")


class _FakeEvent:
    def __init__(self, sim):
        self.sim, self.stream, self.at = sim, None, 0

    def record(self, stream) -> None:
        self.stream, self.at = stream, len(stream.ops)

    @property
    def done(self) -> bool:
        self.sim.advance()
        return self.stream is None or self.stream.pos >= self.at

    def elapsed_ms(self, end) -> float:
        return 1.0


class _Sim:
    """The fake driver: what CudaRun calls of ``cuda.bindings``' driver, over host words."""

    class CUstreamWaitValue_flags:
        CU_STREAM_WAIT_VALUE_GEQ = 0

    class CUstreamWriteValue_flags:
        CU_STREAM_WRITE_VALUE_DEFAULT = 0

    def __init__(self):
        self.streams: dict[int, _FakeStream] = {}
        self.fail: dict[str, int] = {}  # a driver call -> fail its n-th call from now (0: the next)

    def advance(self) -> None:
        for _ in range(len(self.streams) + 1):  # a write on one stream may unblock another
            for st in list(self.streams.values()):
                st.advance()

    def _call(self, name: str, op: tuple | None, stream: int):
        n = self.fail.get(name)
        if n is not None:
            self.fail[name] = n - 1
            if n == 0:
                return (999,)
        if op is not None:
            self.streams[stream].ops.append(op)
        return (0,)

    @staticmethod
    def CUdeviceptr(p):
        return int(p)

    def cuStreamWaitValue32(self, cs, ptr, value, flags):
        return self._call("cuStreamWaitValue32", ("wait", ptr, value), cs)

    def cuStreamWriteValue32(self, cs, ptr, value, flags):
        return self._call("cuStreamWriteValue32", ("write", ptr, value), cs)

    def cuMemsetD32Async(self, ptr, value, count, cs):
        def memset():
            for i in range(count):
                ctypes.c_uint32.from_address(ptr + 4 * i).value = value
        return self._call("cuMemsetD32Async", ("fn", memset), cs)

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, cs):
        return self._call("cuMemcpyDtoHAsync", ("fn", lambda: ctypes.memmove(dst, src, nbytes)), cs)


class _FakeCopyMover:
    """Enqueues each copy on its stream (recorded when it runs); fails on ``fail_at`` offsets."""

    name = "fake_copy"

    def __init__(self, fail_at=()):
        self.fail_at, self.ran = set(fail_at), []

    def copy(self, dst, src, nbytes=None, *, stream=None):
        if dst.ptr in self.fail_at:
            raise RuntimeError(f"copy into {dst.ptr:#x} refused")
        stream.ops.append(("fn", lambda: self.ran.append(dst.ptr)))

    def copy_batch(self, dst, src, chunks, *, stream=None):
        for d, s, n in chunks:
            self.copy(dst.sub(d, n), src.sub(s, n), stream=stream)


class _FakeArena:
    """What the executor reads of a CUDA arena; ``words`` back a flags arena (real host memory)."""

    def __init__(self, base, nbytes, words=None):
        self.device = Device("cuda", 0)
        self.words = words
        self.ptr = base if words is None else words.ctypes.data
        self.nbytes = nbytes if words is None else words.nbytes
        self.mapped_nbytes, self.segment_bytes = self.nbytes, 1 << 28

    def span(self, off=0, n=None):
        return Span(self.ptr + off, self.nbytes - off if n is None else n, self.device)


@pytest.fixture
def sim(monkeypatch):
    sim = _Sim()

    def check(result, call):
        err, *values = result
        if err:
            raise CudaError(call, err, "CUDA_ERROR_FAKE")
        return values[0] if len(values) == 1 else tuple(values) or None

    fake_cuda = SimpleNamespace(driver=lambda: sim, check=check, use_device=lambda i: None)
    monkeypatch.setattr(lanes, "_cuda", fake_cuda)
    monkeypatch.setattr(lanes, "lend_stream", lambda dev: _FakeStream(sim, dev))
    monkeypatch.setattr(lanes, "lend_event", lambda dev, timing=False: _FakeEvent(sim))
    monkeypatch.setattr(lanes, "give_back", lambda *objs: None)
    monkeypatch.setattr(lanes, "wait_events", lambda evs, timeout: all(e.done for e in evs))
    monkeypatch.setattr(lanes, "DRAIN_TIMEOUT_S", 0.5)
    return sim


def _cuda_chain(local, nbytes=4 * MiB):
    """A chain seed -> clone0 -> clone1 on fake CUDA arenas; flags as host words."""
    plan = build_plan("chain", 2, nbytes, MiB)
    eps = {0: Endpoint(0, "seed", _FakeArena(1 << 40, nbytes))}
    for p in plan.receivers():
        words = np.zeros(max(1, plan.flag_count(p.index)), np.uint32)
        eps[p.index] = Endpoint(p.index, p.name, _FakeArena((p.index + 2) << 40, nbytes), _FakeArena(0, 0, words))
    return plan, eps


def _parked(sim) -> list[tuple]:
    return [st.ops[st.pos] for st in sim.streams.values() if st.blocked]


def test_the_fake_driver_runs_a_chain_and_parks_a_wait_on_a_flag_never_raised(sim):
    plan, eps = _cuda_chain([1, 2])
    mover = _FakeCopyMover()
    rep = Executor(plan, eps, [1, 2], mover=mover, h2d_mover=mover, timeout_s=0.3).run()
    assert rep.backend == "cuda" and sum(l.steps for l in rep.lanes) == len(plan) == len(mover.ran)
    assert all(eps[i].flags.words[:plan.flag_count(i)].tolist() == [1] * plan.flag_count(i) for i in (1, 2))
    assert _parked(sim) == []
    # clone1 alone, its source clone0 (another process, here) never raising a flag: released on the stall
    plan, eps = _cuda_chain([2])
    with pytest.raises(StepFailure, match="made no progress for 0.3 s; blocked streams released") as info:
        Executor(plan, eps, [2], mover=_FakeCopyMover(), h2d_mover=_FakeCopyMover(), timeout_s=0.3).run()
    assert info.value.released and info.value.valid_steps == set() and _parked(sim) == []


@pytest.mark.parametrize("where, step, why", [
    ("mover", 3, "mover fake_copy failed: RuntimeError: copy into"),
    ("cuStreamWaitValue32", 3, "cuStreamWaitValue32(step 3 waits on step 2) failed"),
    ("cuStreamWriteValue32", 3, "cuStreamWriteValue32(step 3 done) failed"),
])
def test_a_failure_while_issuing_releases_the_waits_already_parked(sim, where, step, why):
    """clone1 runs alone; clone0 (another process) has raised none of its flags yet. A mover or
    driver error while issuing step 3 had been raised as it was, leaving step 1's stream parked
    on clone0's flag 0 (and step 3's on flag 1): its copy into our arena would run whenever clone0
    got there, after the caller had freed the arena. Now every parked wait is released (the
    stream drained) before the error is raised, naming the step."""
    plan, eps = _cuda_chain([2])
    mover = _FakeCopyMover(fail_at={eps[2].arena.ptr + MiB} if where == "mover" else ())
    if where != "mover":
        sim.fail[where] = 1  # its second call: step 3's
    with pytest.raises(FlashBootError) as info:
        Executor(plan, eps, [2], mover=mover, h2d_mover=mover, timeout_s=5).run()
    msg = str(info.value)
    assert f"step {step} (bytes 1,048,576..2,097,152" in msg and why in msg, msg
    assert msg.endswith("; blocked streams released from the host"), msg
    assert not isinstance(info.value, StepFailure)  # no peer to blame: a retry would not help
    # a driver error stays a CudaError (its call and code kept) once the step is named: it was
    # raised as a plain FlashBootError, which a caller's ``except CudaError`` missed
    assert isinstance(info.value, CudaError) == (where != "mover"), type(info.value)
    if where != "mover":
        assert info.value.call.startswith(where) and info.value.code == 999, vars(info.value)
    assert _parked(sim) == []
    assert eps[1].flags.words[:2].tolist() == [1, 1]  # what the parked waits waited for, written by us


def test_a_failure_while_recording_a_steps_event_releases_its_wait(sim, monkeypatch):
    """The unit was issued (its wait parked) but its end event could not be made: its wait is
    released as well, and the step named."""
    plan, eps = _cuda_chain([2])
    made = []

    def lend_event(dev, timing=False):
        made.append(dev)
        if len(made) == 3:  # the lane's start event, step 1's, then step 3's
            raise CudaError("cuEventCreate(cuda:0)", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return _FakeEvent(sim)

    monkeypatch.setattr(lanes, "lend_event", lend_event)
    mover = _FakeCopyMover()
    with pytest.raises(FlashBootError) as info:
        Executor(plan, eps, [2], mover=mover, h2d_mover=mover, timeout_s=5).run()
    msg = str(info.value)
    assert "step 3 (bytes 1,048,576..2,097,152 into clone1)" in msg and "cuEventCreate(cuda:0) failed" in msg, msg
    assert _parked(sim) == [] and eps[1].flags.words[:2].tolist() == [1, 1]


def test_a_fault_while_polling_still_releases_the_waits(sim, monkeypatch):
    """An event query raising (a device fault) while the host polled the lanes: the waits parked
    are released before the error goes up, naming the step it was polling."""
    plan, eps = _cuda_chain([2])
    polls = []
    done = _FakeEvent.done

    def faulty(self):
        polls.append(self)
        if len(polls) == 1:
            raise CudaError("cuEventQuery(cuda:0)", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        return done.fget(self)

    monkeypatch.setattr(_FakeEvent, "done", property(faulty))
    mover = _FakeCopyMover()
    with pytest.raises(FlashBootError) as info:
        Executor(plan, eps, [2], mover=mover, h2d_mover=mover, timeout_s=5).run()
    msg = str(info.value)
    assert "step 1 (bytes 0..1,048,576 into clone1)" in msg and "CUDA_ERROR_ILLEGAL_ADDRESS" in msg, msg
    assert msg.endswith("; blocked streams released from the host"), msg
    assert _parked(sim) == []


def test_a_long_timeout_over_many_steps_runs():
    """timeout_s=1e6 (the most check_timeout allows) over 10,000 steps made a backstop past what
    a thread wait takes: the run raised OverflowError at once, its lanes left running."""
    nbytes = 10_000 * 4096
    plan = build_plan("chain", 1, nbytes, 4096)
    eps = _host_participants(plan, nbytes)
    try:
        rep = Executor(plan, eps, [1], timeout_s=1e6).run()
        assert rep.participant_nbytes(1) == nbytes
        assert np.array_equal(eps[1].arena.bytes().numpy()[:nbytes], eps[0].arena.bytes().numpy()[:nbytes])
    finally:
        close_endpoints(eps)


def test_an_interrupt_while_issuing_releases_the_waits_and_goes_up_as_it_is(sim):
    """Ctrl-C (here from the step hook) while step 3 was being issued, step 1's stream parked on
    clone0's flag: released, then the KeyboardInterrupt itself goes up."""
    plan, eps = _cuda_chain([2])

    def hook(step):
        if step.id == 3:
            raise KeyboardInterrupt

    mover = _FakeCopyMover()
    with pytest.raises(KeyboardInterrupt):
        Executor(plan, eps, [2], mover=mover, h2d_mover=mover, timeout_s=5, step_hook=hook, window=4).run()
    assert _parked(sim) == [] and eps[1].flags.words[0] == 1


def test_a_session_leaves_mapped_what_a_copy_it_gave_up_on_may_still_write(monkeypatch):
    """A host run that gave up while a lane was inside a copy raised naming the thread; the clone's
    session then closed its arenas under that copy (a segfault). It keeps them until the copy ends."""
    from flashboot.flashclone import session as sessions

    monkeypatch.setattr(sessions, "LANES_JOIN_S", 0.2)
    release = threading.Event()
    copying = threading.Thread(target=release.wait, args=(30,))  # stands in for a lane inside a copy
    copying.start()

    class GaveUp:
        def run(self):
            err = WaitTimeoutError("host lanes of chain did not finish")
            err.lanes_running = [copying]
            raise err

    session = sessions._Session(None)
    session.arena = Arena.create(1 << 20, "cpu")
    try:
        with pytest.raises(WaitTimeoutError, match="did not finish"):
            session.run(GaveUp())
        with pytest.warns(RuntimeWarning, match=r"1 copy thread\(s\) of an abandoned clone run are still copying"):
            session.close(keep_arena=False)
        assert not session.arena.closed  # left mapped under the copy
    finally:
        release.set()
        copying.join(10)
    arena = session.arena
    session.close(keep_arena=False)  # the copy ended: everything goes
    assert arena.closed and session.arena is None


def test_a_session_left_mapped_under_a_copy_still_leaves_the_store(monkeypatch):
    """Only the memory the copy may write stays: the store's connection had stayed open (and the
    participant never said it left) until the process exited."""
    from flashboot.flashclone import session as sessions

    monkeypatch.setattr(sessions, "LANES_JOIN_S", 0.2)
    release = threading.Event()
    copying = threading.Thread(target=release.wait, args=(30,))  # stands in for a lane inside a copy
    copying.start()

    class Store:
        timeout_s, published, closed = 5.0, [], False

        def publish(self, key, body):
            self.published.append(key)

        def close(self):
            self.closed = True

    class GaveUp:
        def run(self):
            err = WaitTimeoutError("host lanes of chain did not finish")
            err.lanes_running = [copying]
            raise err

    store = Store()
    session = sessions._Session(store)
    session.status_key = "g/1/status/2"
    session.arena = Arena.create(1 << 20, "cpu")
    try:
        with pytest.raises(WaitTimeoutError):
            session.run(GaveUp())
        with pytest.warns(RuntimeWarning, match="still copying"):
            session.close(keep_arena=False)
        assert not session.arena.closed
        assert store.closed and store.published == ["g/1/status/2/left"] and session.rdv is None
    finally:
        release.set()
        copying.join(10)
    session.close(keep_arena=False)
