"""The schedule comparison surfaces used as a researcher would: options of one schedule passed to
another, registrations with bad names or model types, movers that fail midway under the executor,
arenas too small for the plan, and the stored notebook outputs against a fresh run."""

from __future__ import annotations

import re

import pytest

from flashboot.schedulers import PlanError, build_plan, list_schedules, register_schedule
from flashboot.schedulers.chain import plan_chain

from _clone_helpers import close_endpoints  # noqa: E402


# ------------------------------------------------------------------------------------- registry
@pytest.mark.parametrize("schedule,options,match", [
    ("chain", {"align_bytes": 4096}, r"schedule 'chain' takes no option 'align_bytes'; its options: \(none\)"),
    ("star", {"align": 1, "zz": 2}, r"schedule 'star' takes no option 'align', 'zz'"),
    ("ring", {"alignment": 64}, r"schedule 'ring' takes no option 'alignment'; its options: align_bytes"),
])
def test_an_option_the_schedule_does_not_take_is_a_plan_error(schedule, options, match):
    with pytest.raises(PlanError, match=match):
        build_plan(schedule, 2, 1000, 100, options=options)
    with pytest.raises(PlanError, match=match):
        build_plan(schedule, 2, 1000, 100, **options)


def test_the_same_options_dict_still_reaches_the_planner_that_takes_it():
    plan = build_plan("ring", 3, 10, 2, options={"align_bytes": 1})
    assert sum(s.nbytes for s in plan.steps if s.kind == "h2d") == 10


@pytest.mark.parametrize("name", [None, "", 3, " chain", "tree\n"])
def test_a_schedule_name_that_is_not_a_plain_string_is_refused_and_the_registry_still_lists(name):
    before = list_schedules()
    with pytest.raises(PlanError, match="a schedule name must be a non-empty string"):
        register_schedule(name)(plan_chain)
    assert list_schedules() == before
    with pytest.raises(KeyError, match="known: chain, ring, star"):
        build_plan("broadcast-tree", 2, 10, 1)


@pytest.mark.parametrize("model_types", ["llama2", ("llama2", ""), ["llama2"], ("llama2", None)])
def test_a_family_whose_model_types_are_not_a_tuple_of_names_is_refused(model_types):
    from flashboot.errors import FlashBootError
    from flashboot.layouts.families import family_for, list_families, register_family
    from flashboot.layouts.families.llama import LlamaFamily

    class Llama2(LlamaFamily):
        name = "llama2-probe"

    Llama2.model_types = model_types
    with pytest.raises(FlashBootError, match=r"family 'llama2-probe': model_types must be a tuple of non-empty "
                                             r"strings, got " + __import__("re").escape(repr(model_types))):
        register_family(Llama2)
    assert "llama2-probe" not in list_families() and family_for("l").fallback



# ------------------------------------------------------------------------------------- executor
MiB = 1 << 20


def _endpoints(plan, nbytes, data, arena_nbytes=None):
    import numpy as np

    from flashboot.arena import Arena
    from flashboot.flashclone.executor import Endpoint, create_flags

    eps = {}
    for p in plan.participants:
        a = Arena.create(arena_nbytes.get(p.index, nbytes) if arena_nbytes else nbytes, "cpu")
        if p.role == "seed":
            a.bytes().numpy()[: min(nbytes, a.nbytes)] = data[: a.nbytes]
            eps[p.index] = Endpoint(p.index, p.name, a, None)
        else:
            eps[p.index] = Endpoint(p.index, p.name, a, create_flags(plan.flag_count(p.index), "cpu"))
    assert all(isinstance(ep.arena.bytes().numpy(), np.ndarray) for ep in eps.values())
    return eps


def _flags(ep, count):
    import numpy as np

    return np.frombuffer(ep.flags.bytes().numpy(), np.uint32)[:count].tolist()


@pytest.mark.parametrize("short,match", [
    (1, r"step 4 writes bytes 2,097,152..3,145,728 into clone0, whose arena holds 2,097,152 bytes"),
    (0, r"step 4 reads bytes 2,097,152..3,145,728 from seed, whose arena holds 2,097,152 bytes"),
])
def test_an_arena_shorter_than_the_plan_is_refused_before_any_byte_moves(short, match):
    import numpy as np

    from flashboot.errors import FlashBootError
    from flashboot.flashclone.executor import Executor

    nbytes = 3 * MiB
    data = (np.arange(nbytes) % 251).astype(np.uint8)
    plan = build_plan("chain", 2, nbytes, MiB)
    eps = _endpoints(plan, nbytes, data, {short: 2 * MiB})
    try:
        with pytest.raises(FlashBootError, match=match):
            Executor(plan, eps, [1, 2]).run()
        assert _flags(eps[1], 3) == [0, 0, 0] and _flags(eps[2], 3) == [0, 0, 0]  # no chunk was vouched for
        assert not eps[2].arena.bytes().numpy()[:nbytes].any()
    finally:
        close_endpoints(eps)


class _FailingMover:
    """The host mover, failing at its ``at``-th copy (a disk or driver error midway)."""

    def __new__(cls, at):
        from flashboot.movers.host import HostMover

        class Failing(HostMover):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def copy(self, *a, **k):
                self.calls += 1
                if self.calls == at:
                    raise OSError(5, "Input/output error")
                return super().copy(*a, **k)

        return Failing()


@pytest.mark.parametrize("schedule,at,match", [
    ("chain", 3, r"chain step 4 \(bytes 2,000..3,000 from seed into clone0\): mover host failed: OSError: "
                 r"\[Errno 5\] Input/output error"),
    ("ring", 2, r"ring step \d+ \(bytes [\d,]+..[\d,]+ from (the host image|shard\d) into shard\d\): mover host failed"),
])
def test_a_mover_failing_midway_names_the_step_its_bytes_and_both_ends(schedule, at, match):
    import threading

    import numpy as np

    from flashboot.errors import FlashBootError
    from flashboot.flashclone.executor import Executor
    from flashboot.memory import span_of

    nbytes = 10_000
    data = (np.arange(nbytes) % 251).astype(np.uint8)
    plan = build_plan(schedule, 2, nbytes, 1000, **({"align_bytes": 1} if schedule == "ring" else {}))
    eps = _endpoints(plan, nbytes, data)
    threads = threading.active_count()
    try:
        receivers = [1] if schedule == "chain" else [0, 1]  # chain: one lane, its copies in order
        mover = _FailingMover(at)
        with pytest.raises(FlashBootError, match=match) as failed:
            Executor(plan, eps, receivers, mover=mover, h2d_mover=mover if schedule == "ring" else None,
                     host_image=span_of(data), timeout_s=5).run()
        assert isinstance(failed.value.__cause__, OSError)
        assert threading.active_count() == threads  # every lane stopped
        if schedule == "chain":  # two chunks copied and vouched for, the failed step raised no flag
            assert _flags(eps[1], 4) == [1, 1, 0, 0]
            assert np.array_equal(eps[1].arena.bytes().numpy()[:2000], data[:2000])
    finally:
        close_endpoints(eps)


def test_a_movers_own_error_keeps_its_class_once_the_step_is_named():
    """A MoverError (here: a copy into a range nothing backs) came out of the executor as a plain
    FlashBootError, which a caller's ``except MoverError`` missed."""
    import numpy as np

    from flashboot.errors import MoverError
    from flashboot.flashclone.executor import Executor
    from flashboot.movers.host import HostMover

    class Refusing(HostMover):
        def copy(self, dst, src, nbytes=None, stream=None):
            raise MoverError(f"host: nothing backs the destination of {nbytes or 0:,} bytes")

    nbytes = 10_000
    data = (np.arange(nbytes) % 251).astype(np.uint8)
    plan = build_plan("chain", 1, nbytes, 1000)
    eps = _endpoints(plan, nbytes, data)
    try:
        with pytest.raises(MoverError, match=r"chain steps 0..9 \(bytes 0..10,000 from seed into clone0\): mover host "
                                             r"failed: MoverError: host: nothing backs") as failed:
            Executor(plan, eps, [1], mover=Refusing(), timeout_s=5).run()
        assert isinstance(failed.value.__cause__, MoverError) and failed.value is not failed.value.__cause__
    finally:
        close_endpoints(eps)


@pytest.mark.parametrize("timeout_s", [float("nan"), -1, 0, float("inf"), "5"])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused_before_any_lane_starts(timeout_s):
    import threading

    import numpy as np

    from flashboot.errors import FlashBootError
    from flashboot.flashclone.executor import Executor

    nbytes = 10_000
    data = (np.arange(nbytes) % 251).astype(np.uint8)
    plan = build_plan("chain", 2, nbytes, 1000)
    eps = _endpoints(plan, nbytes, data)
    threads = threading.active_count()
    try:
        with pytest.raises(FlashBootError, match=r"Executor timeout_s must be a finite number of seconds in "
                                                 r"\(0, 1e\+06\], got " + __import__("re").escape(repr(timeout_s))):
            Executor(plan, eps, [2], timeout_s=timeout_s).run()  # clone1 alone waits on clone0's flags
        assert threading.active_count() == threads
    finally:
        close_endpoints(eps)


def test_an_executor_with_no_local_participant_says_so():
    import numpy as np

    from flashboot.errors import FlashBootError
    from flashboot.flashclone.executor import Executor

    plan = build_plan("chain", 2, 100, 10)
    eps = _endpoints(plan, 100, np.zeros(100, np.uint8))
    try:
        with pytest.raises(FlashBootError, match=r"plan 'chain': no local participant given; .* \(receivers: \[1, 2\]\)"):
            Executor(plan, eps, [])
    finally:
        close_endpoints(eps)


def test_a_family_whose_constructor_fails_is_not_reported_unknown():
    from flashboot.layouts.families import get_family, register_family
    from flashboot.layouts.families.llama import LlamaFamily

    @register_family
    class NeedsKey(LlamaFamily):
        name = "needs-key-probe"
        model_types = ("needs-key-probe",)

        def __init__(self):
            {}["rope_scaling"]

    with pytest.raises(KeyError) as failed:
        get_family("needs-key-probe")
    assert "unknown family" not in str(failed.value) and failed.value.args == ("rope_scaling",)


@pytest.mark.parametrize("offset,nbytes", [(0, -5), (-8, 5), (0.5, 5), (0, 5.0), (True, 5)])
def test_split_range_refuses_an_offset_or_size_that_is_no_int_from_zero(offset, nbytes):
    """split_range(0, -5, 4) had returned no piece (nothing covered, no error), split_range(-8, 5, 4)
    pieces at negative offsets, and a float offset raised range()'s raw TypeError."""
    from flashboot.schedulers import PlanError, split_range

    with pytest.raises(PlanError, match=re.escape(f"split_range: offset and nbytes must be ints >= 0, got offset "
                                                  f"{offset!r}, nbytes {nbytes!r}")):
        split_range(offset, nbytes, 4)
    assert split_range(0, 0, 4) == [] and split_range(3, 5, 4) == [(3, 4), (7, 1)]
