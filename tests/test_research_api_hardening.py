"""The research API used as a researcher would: the movers benchmark at odd sizes, the chunked
benchmark's host fallback at odd chunk sizes, movers registered with bad names or signatures,
and plans with malformed steps or queries."""

from __future__ import annotations

import numpy as np
import pytest

import flashboot.movers  # noqa: F401  (registers every built-in mover)


# ---------------------------------------------------------------------------- bench movers
@pytest.mark.parametrize("sizes", [[1], [7, 4097], [1_000_003]])
def test_bench_movers_measures_a_size_that_is_not_a_multiple_of_8(sizes):
    """``--sizes 1`` had ended in torch's 'must be divisible by 8 to view Byte as Long' traceback."""
    from flashboot.benchmarks.movers import run

    rows = run(["host"], sizes, ["host"], repeats=1)
    assert [(r.mover, r.nbytes, r.verified) for r in rows] == [("host", n, True) for n in sizes]


@pytest.mark.parametrize("sizes,match", [
    ([], r"bench movers sizes: give at least one size in bytes"),
    ([4096, 0], r"bench movers sizes: 0 is not a whole number of bytes >= 1 \(in \[4096, 0\]\)"),
    ([1.5], r"bench movers sizes: 1.5 is not a whole number of bytes >= 1"),
])
def test_bench_movers_refuses_sizes_that_are_no_byte_counts_naming_them(sizes, match):
    from flashboot.benchmarks.movers import run
    from flashboot.errors import FlashBootError

    with pytest.raises(FlashBootError, match=match):
        run(["host"], sizes, ["host"], repeats=1)


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk_sizes": (0,)}, r"chunk sizes: 0 is not a whole number of bytes >= 1"),
    ({"chunk_sizes": (4096, -1)}, r"chunk sizes: -1 is not a whole number of bytes >= 1 \(in \[4096, -1\]\)"),
    ({"chunk_sizes": (4096.0,)}, r"chunk sizes: 4096.0 is not"),
    ({"chunk_sizes": (float("nan"),)}, r"chunk sizes: nan is not"),
    ({"chunk_sizes": ()}, r"chunk sizes: give at least one size in bytes"),
    ({"total": 0}, r"total: 0 is not a whole number of bytes >= 1"),
    ({"repeats": 0}, r"repeats must be an int >= 1, got 0"),
])
def test_the_chunked_host_run_refuses_a_chunk_size_that_is_no_byte_count(kwargs, match):
    """A chunk of 0 had ended in range()'s ValueError, a float in its TypeError, a negative one
    in the batch's 'non-empty list' message, no chunk size in a report with no rows (which the
    chunk-size notebook then failed on with a KeyError)."""
    from flashboot.benchmarks.movers_chunked import run_host
    from flashboot.errors import FlashBootError

    with pytest.raises(FlashBootError, match=match):
        run_host(**{"total": 1 << 16, **kwargs})


def test_the_chunked_host_run_takes_numpy_sizes_and_a_chunk_past_the_buffer():
    from flashboot.benchmarks.movers_chunked import run_host

    report = run_host(total=10_001, chunk_sizes=np.array([4096, 1 << 20]), repeats=1)
    assert [(r.chunk_bytes, r.n_chunks, r.mode, r.verified) for r in report.rows] == [
        (4096, 3, "per_call", True), (4096, 3, "batched", True),
        (1 << 20, 1, "per_call", True), (1 << 20, 1, "batched", True)]
    assert all(type(r.chunk_bytes) is int for r in report.rows)  # JSON-ready


# ---------------------------------------------------------------------------- mover registry
@pytest.mark.parametrize("name", [3, ("host",), " mine", "mine\n"])
def test_a_mover_name_that_is_not_a_plain_string_is_refused_and_the_registry_still_lists(name):
    """name = 3 had registered, and every later list_movers() and best_mover() raised
    "'<' not supported between instances of 'int' and 'str'"."""
    from flashboot import FlashBootError
    from flashboot.movers import Mover, best_mover, list_movers, register_mover
    from flashboot.movers.registry import _MOVERS

    class Odd(Mover):
        paths = frozenset({"host"})

        def _copy(self, dst, src, nbytes, path, stream):
            raise AssertionError("never copies")

    Odd.name = name
    with pytest.raises(FlashBootError, match=r"Odd: a mover name must be a string without surrounding spaces, got "):
        register_mover(Odd)
    assert name not in _MOVERS
    assert "host" in [m.name for m in list_movers()]
    assert best_mover("cpu").name == "host"


def test_paths_given_as_one_string_are_refused_naming_the_set_to_write():
    """paths = "host" had been refused as the unknown paths 'h', 'o', 's', 't'."""
    from flashboot import FlashBootError
    from flashboot.movers import Mover, register_mover

    class OneString(Mover):
        name, paths = "one_string_for_test", "host"

    with pytest.raises(FlashBootError, match=r"OneString: `paths` must be a set of path names, got the string 'host'; "
                                             r"e.g. frozenset\(\{'host'\}\)"):
        register_mover(OneString)


def _plain_copy(self, dst, src, nbytes, path, stream):
    import ctypes

    ctypes.memmove(dst.ptr, src.ptr, nbytes)


@pytest.mark.parametrize("copy,match", [
    (None, r"NoCopy must implement _copy\(self, dst, src, nbytes, path, stream\): Mover.copy, batches and the "
           r"executor call it"),
    (lambda self, dst, src: None, r"NoCopy.<lambda>\(self, dst, src\) does not take the arguments of "
                                  r"_copy\(self, dst, src, nbytes, path, stream\): too many positional arguments"),
    (lambda self, dst, src, nbytes, path, stream, extra: None, r"missing a required argument: 'extra'"),
])
def test_a_mover_without_a_copy_of_the_right_signature_is_refused_at_registration(copy, match):
    """It had registered; its first copy raised a bare NotImplementedError (no _copy) or a
    TypeError from inside Mover.copy (another signature)."""
    from flashboot import FlashBootError
    from flashboot.movers import Mover, register_mover
    from flashboot.movers.registry import _MOVERS

    body = {"name": "no_copy_for_test", "paths": frozenset({"host"})}
    if copy is not None:
        body["_copy"] = copy
    cls = type("NoCopy", (Mover,), body)
    with pytest.raises(FlashBootError, match=match):
        register_mover(cls)
    assert "no_copy_for_test" not in _MOVERS


def test_a_mover_of_its_own_copies_through_copy_and_batches():
    """What the refusals above still let through: a copy with defaults or *args, registered and
    run by the same validation as the built-in movers."""
    from flashboot.movers import Mover, create_mover, register_mover
    from flashboot.movers.registry import _MOVERS

    @register_mover
    class Plain(Mover):
        name, paths = "plain_for_test", frozenset({"host"})
        _copy = _plain_copy

    @register_mover
    class Loose(Mover):
        name, paths = "loose_for_test", frozenset({"host"})

        def _copy(self, dst, src, *args, **kw):
            _plain_copy(self, dst, src, *args, **kw)

    try:
        src = (np.arange(10_001) % 251).astype(np.uint8)
        for name in ("plain_for_test", "loose_for_test"):
            dst = np.zeros_like(src)
            mover = create_mover(name)
            mover.copy(dst[3:], src[:-3], stream=None)
            mover.copy_batch(dst, src, [(0, 0, 1), (5, 5, 7)], stream=None)
            expected = np.concatenate([src[:1], np.zeros(2, np.uint8), src[:2], src[5:12], src[9:-3]])
            assert np.array_equal(dst, expected)
    finally:
        _MOVERS.pop("plain_for_test", None)
        _MOVERS.pop("loose_for_test", None)


# ---------------------------------------------------------------------------- plans
def _chain_dict():
    from flashboot.schedulers import build_plan

    return build_plan("chain", 1, 10_000, 1000).to_dict()


@pytest.mark.parametrize("field,value,match", [
    (4, 3000.5, r"plan 'chain' step 3: offset 3000.5; id, src, dst, offset, nbytes, lane, signal must be ints"),
    (5, 1000.0, r"step 3: nbytes 1000.0;"),
    (7, 0.5, r"step 3: lane 0.5;"),
    (8, 3.0, r"step 3: signal 3.0;"),
    (3, True, r"step 3: dst True;"),
    (6, [2.0], r"step 3: waits \[2.0\] must be distinct ids of earlier steps"),
])
def test_a_plan_from_json_with_a_step_field_that_is_no_int_is_refused(field, value, match):
    """offset 3000.5 had validated and failed in the mover mid-run, signal 3.0 in the executor's
    flag indexing (a raw IndexError); lane 0.5 ran as a lane of its own."""
    from flashboot.schedulers import Plan, PlanError

    d = _chain_dict()
    d["steps"][3][field] = value
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(d)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.__setitem__("exclusive_sources", "false"), r"exclusive_sources must be true or false, got 'false'"),
    (lambda d: d["participants"][0].__setitem__("index", "0"), r"participant 'seed' has index '0', expected 0"),
    (lambda d: d["participants"][1].__setitem__("name", 1), r"participant 1 has name 1; names are strings"),
])
def test_a_plan_from_json_with_malformed_plan_fields_is_refused(mutate, match):
    """exclusive_sources "false" had read as True; index "0" was refused as 'has index 0, expected 0'."""
    from flashboot.schedulers import Plan, PlanError

    d = _chain_dict()
    mutate(d)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(d)


def test_a_hand_built_plan_with_waits_as_a_list_still_validates():
    from flashboot.schedulers import Participant, Plan, Step

    parts = (Participant(0, "seed", "seed"), Participant(1, "clone0", "clone"), Participant(2, "clone1", "clone"))
    plan = Plan("handmade", parts, 8, 8, (Step(0, "copy", 0, 1, 0, 8), Step(1, "copy", 1, 2, 0, 8, [0])))
    assert plan.steps[1].waits == [0] and plan.exclusive_sources is False


@pytest.mark.parametrize("query,match", [
    (lambda p: p.flag_of(-1), r"plan 'chain' has no step -1 \(ids 0..5\)"),
    (lambda p: p.flag_of(6), r"plan 'chain' has no step 6 \(ids 0..5\)"),
    (lambda p: p.flag_of(2.0), r"plan 'chain' has no step 2.0"),
    (lambda p: p.flag_count(3), r"plan 'chain' has no participant 3 \(indices 0..2\)"),
    (lambda p: p.flag_count(-1), r"plan 'chain' has no participant -1"),
    (lambda p: p.flag_count("clone0"), r"plan 'chain' has no participant 'clone0'"),
])
def test_flag_queries_for_a_step_or_participant_the_plan_lacks_are_refused(query, match):
    """flag_of(-1) had answered with the last step's flag (HOST is -1: a wait on the host image
    looked like one on clone1); flag_of(6) and flag_count(3) raised a bare IndexError / KeyError."""
    from flashboot.schedulers import PlanError, build_plan

    plan = build_plan("chain", 2, 3000, 1000)
    assert [plan.flag_of(i) for i in range(6)] == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    assert [plan.flag_count(i) for i in range(3)] == [0, 3, 3]
    with pytest.raises(PlanError, match=match):
        query(plan)


@pytest.mark.parametrize("helper,args,match", [
    ("split_range", (0, 10, 0), r"split_range: chunk_bytes must be a positive int, got 0"),
    ("split_range", (0, 10, -1), r"split_range: chunk_bytes must be a positive int, got -1"),
    ("split_range", (0, 10, 3.0), r"split_range: chunk_bytes must be a positive int, got 3.0"),
    ("shard_bounds", (100, 0), r"ring: member count must be a positive int, got 0"),
    ("shard_bounds", (100, -1), r"ring: member count must be a positive int, got -1"),
    ("shard_bounds", (100.0, 3, 1), r"ring: total_bytes must be an int >= 0, got 100.0"),
    ("build_plan", ("ring", 2, 10_000, 4096, {"align_bytes": True}), r"ring: align_bytes must be a positive int, got True"),
])
def test_the_public_range_helpers_refuse_counts_that_are_no_positive_ints(helper, args, match):
    """split_range(0, 10, -1) had returned no piece (nothing covered, no error) and a chunk of 0
    raised range()'s ValueError; shard_bounds of 0 or -1 members returned no shard, of a float
    image float offsets; align_bytes=True aligned the ring's shards to 1 byte."""
    import flashboot.schedulers as schedulers

    with pytest.raises(schedulers.PlanError, match=match):
        getattr(schedulers, helper)(*args)


def test_the_range_helpers_still_cover_every_byte():
    from flashboot.schedulers import shard_bounds, split_range

    assert split_range(5, 10, 4) == [(5, 4), (9, 4), (13, 2)] and split_range(5, 0, 4) == []
    assert shard_bounds(3, 4, 1) == [(0, 0), (0, 1), (1, 1), (2, 1)] and shard_bounds(0, 2) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("error,cls", [(RuntimeError("boom"), "FlashBootError"), (None, "MoverError")])
def test_a_mover_failing_in_bench_movers_is_named_with_its_path_and_size(error, cls):
    """A researcher's mover raising RuntimeError("boom") had ended the benchmark with just that:
    no word of which mover, path or size; a MoverError keeps its class once named."""
    from flashboot.benchmarks.movers import run
    from flashboot.errors import FlashBootError, MoverError
    from flashboot.movers import Mover, register_mover
    from flashboot.movers.registry import _MOVERS

    @register_mover
    class Failing(Mover):
        name, paths = "failing_for_test", frozenset({"host"})

        def _copy(self, dst, src, nbytes, path, stream):
            raise error or MoverError(f"failing_for_test: cannot copy {nbytes:,} bytes")

    try:
        with pytest.raises(FlashBootError, match=r"bench movers: mover 'failing_for_test' failed on host at 4,097 bytes: "
                                                 r"(RuntimeError: boom|MoverError: failing_for_test: cannot copy 4,097)") as failed:
            run(["host"], [4097], ["host", "failing_for_test"], repeats=1)
        assert type(failed.value).__name__ == cls
    finally:
        _MOVERS.pop("failing_for_test", None)


@pytest.mark.parametrize("availability,why", [
    (lambda cls: __import__("no_such_library_for_test"), r"raised ModuleNotFoundError: No module named 'no_such_library_for_test'"),
    (lambda cls: True, r"returned True, not \(ok: bool, why: str\)"),
])
def test_a_mover_whose_availability_fails_is_listed_unavailable_and_breaks_no_listing(availability, why):
    """Its availability() importing a missing library had made list_movers(), best_mover() and
    ``bench movers`` raise that ImportError for every mover; returning True, a bare TypeError."""
    import re

    from flashboot.benchmarks.movers import run
    from flashboot.errors import CapabilityError
    from flashboot.movers import Mover, best_mover, create_mover, list_movers, register_mover
    from flashboot.movers.registry import _MOVERS

    @register_mover
    class Fragile(Mover):
        name, paths = "aaa_fragile_for_test", frozenset({"host"})  # sorted first: listed before host
        _copy = _plain_copy

    Fragile.availability = classmethod(availability)
    try:
        info = {m.name: m for m in list_movers()}["aaa_fragile_for_test"]
        assert not info.available and re.search(r"Fragile.availability\(\) " + why, info.reason), info.reason
        assert best_mover("cpu").name == "host"
        with pytest.raises(CapabilityError, match=r"mover 'aaa_fragile_for_test' cannot run here: Fragile.availability\(\) "
                                                  + why):
            create_mover("aaa_fragile_for_test")
        assert [(r.mover, r.verified) for r in run(["host"], [4096], repeats=1)] == [("host", True)]
    finally:
        _MOVERS.pop("aaa_fragile_for_test", None)


@pytest.mark.parametrize("content,match", [
    (b'{"rows": [', r"report.json: not JSON \("),
    (b'"rows total_bytes"', r"report.json: not a `bench movers --chunked` report \(no rows/total_bytes\)"),
    (b"\xff\xfe", r"report.json: not JSON"),
])
def test_a_chunked_report_that_is_no_report_is_refused_naming_its_path(tmp_path, content, match):
    """The chunk-size notebook reads $FLASHBOOT_MOVERS_JSON: a truncated file had raised a bare
    JSONDecodeError naming no file, a JSON string an AttributeError."""
    from flashboot.benchmarks.movers_chunked import load_report
    from flashboot.errors import FlashBootError

    path = tmp_path / "report.json"
    path.write_bytes(content)
    with pytest.raises(FlashBootError, match=match):
        load_report(path)


@pytest.mark.parametrize("call,kind,match", [
    (lambda: __import__("flashboot.movers").movers.create_mover(["host"]), "UnknownNameError",
     r"unknown mover \['host'\]; known: copy_engine, host"),
    (lambda: __import__("flashboot.schedulers").schedulers.build_plan(["chain"], 2, 100), "UnknownNameError",
     r"unknown schedule \['chain'\]; known: chain, ring, star"),
    (lambda: __import__("flashboot.schedulers").schedulers.build_plan("ring", 2, 100, None, [("align_bytes", 1)]),
     "PlanError", r"schedule 'ring': options must be a dict of option name to value, got \[\('align_bytes', 1\)\]"),
])
def test_a_name_or_options_of_the_wrong_kind_is_refused_by_the_registries(call, kind, match):
    """A list for a name had raised 'unhashable type: list'; options as a list of pairs
    "'list' object is not a mapping", neither naming the registry nor what it knows."""
    from flashboot.errors import FlashBootError

    with pytest.raises(FlashBootError, match=match) as refused:
        call()
    assert type(refused.value).__name__ == kind


def test_a_planner_of_another_signature_or_answer_is_refused_naming_the_schedule():
    """A planner taking (n, total_bytes) had registered and build_plan raised its TypeError; one
    returning None had handed None back as the plan; one planning half the image a plan of the
    wrong size, taken for the bytes asked for."""
    from flashboot.schedulers import PlanError, build_plan, list_schedules, register_schedule
    from flashboot.schedulers.registry import _SCHEDULES

    try:
        with pytest.raises(PlanError, match=r"schedule 'two_args_for_test': its planner must take \(n, total_bytes, "
                                            r"chunk_bytes, \*\*options\): too many positional arguments"):
            register_schedule("two_args_for_test")(lambda n, total_bytes: None)
        assert "two_args_for_test" not in list_schedules()
        register_schedule("none_for_test")(lambda n, total_bytes, chunk_bytes: None)
        with pytest.raises(PlanError, match=r"schedule 'none_for_test': its planner returned NoneType, not a Plan"):
            build_plan("none_for_test", 2, 100)
        register_schedule("half_for_test")(lambda n, total_bytes, chunk_bytes: build_plan("chain", n, total_bytes // 2,
                                                                                           chunk_bytes))
        with pytest.raises(PlanError, match=r"schedule 'half_for_test': its planner made a plan of 50 bytes; 100 were "
                                            r"asked for"):
            build_plan("half_for_test", 2, 100)
        register_schedule("chain_again_for_test")(lambda n, total_bytes, chunk_bytes, **opts: build_plan(
            "chain", n, total_bytes, chunk_bytes))
        assert build_plan("chain_again_for_test", 2, 100, 10) == build_plan("chain", 2, 100, 10)
    finally:
        for name in ("two_args_for_test", "none_for_test", "half_for_test", "chain_again_for_test"):
            _SCHEDULES.pop(name, None)


def test_a_mover_with_a_blank_docstring_lists_with_an_empty_summary():
    """A docstring of spaces had made every list_movers() raise IndexError."""
    from flashboot.movers import Mover, list_movers, register_mover
    from flashboot.movers.registry import _MOVERS

    @register_mover
    class Blank(Mover):
        """   """
        name, paths = "blank_for_test", frozenset({"host"})
        _copy = _plain_copy

    try:
        summaries = {m.name: m.summary for m in list_movers()}
        assert summaries["blank_for_test"] == "" and summaries["host"].startswith("numba-parallel host->host copy")
    finally:
        _MOVERS.pop("blank_for_test", None)


@pytest.mark.parametrize("alignment", ["16", 4.5, 0, True])
def test_a_mover_alignment_that_is_no_positive_int_is_refused_at_registration(alignment):
    """alignment "16" had registered, and every copy and batch raised a TypeError comparing it;
    4.5 a numpy ufunc error in batches."""
    from flashboot import FlashBootError
    from flashboot.movers import Mover, register_mover
    from flashboot.movers.registry import _MOVERS

    cls = type("Aligned", (Mover,), {"name": "aligned_for_test", "paths": frozenset({"host"}),
                                     "alignment": alignment, "_copy": _plain_copy})
    with pytest.raises(FlashBootError, match=r"Aligned: `alignment` must be an int >= 1 \(bytes\), got "):
        register_mover(cls)
    assert "aligned_for_test" not in _MOVERS


def test_the_chunked_report_counts_one_copy_per_chunk_for_a_mover_with_the_default_batch():
    """``copies`` of a batched row had been 1 for any mover whose batch keeps no count, so a
    researcher's mover that batches with the default (one call per chunk) read as one copy."""
    from flashboot.benchmarks.movers_chunked import batch_copies
    from flashboot.movers import Mover, create_mover, register_mover
    from flashboot.movers.registry import _MOVERS

    @register_mover
    class PerChunk(Mover):
        name, paths = "per_chunk_for_test", frozenset({"host"})
        _copy = _plain_copy

    try:
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
        chunks = [(o, o, 16) for o in range(0, 64, 16)]
        batch = create_mover("per_chunk_for_test").batch(dst, src, chunks)
        batch.run(stream=None)
        assert np.array_equal(dst, src) and batch_copies(batch) == 4
        assert batch_copies(create_mover("host").batch(dst, src, chunks)) == 1  # a batch of its own: one launch or call
    finally:
        _MOVERS.pop("per_chunk_for_test", None)


def _define_planner(name):
    from flashboot.schedulers import build_plan, register_schedule

    @register_schedule(name)
    def mine(n, total_bytes, chunk_bytes):
        return build_plan("chain", n, total_bytes, chunk_bytes)

    return mine


def test_a_cell_run_twice_registers_its_mover_and_schedule_again_and_another_class_is_still_refused():
    """Running a notebook cell that registers a mover or schedule a second time had been refused
    as 'already registered by Mine' (the same name, the earlier run's class)."""
    from flashboot import FlashBootError
    from flashboot.movers import Mover, create_mover, register_mover
    from flashboot.movers.registry import _MOVERS
    from flashboot.schedulers import PlanError, build_plan, register_schedule
    from flashboot.schedulers.registry import _SCHEDULES

    try:
        for _ in range(2):  # the cell's class, defined anew each run
            cls = type("Mine", (Mover,), {"name": "cell_for_test", "paths": frozenset({"host"}), "_copy": _plain_copy,
                                          "__module__": __name__, "__qualname__": "cell.<locals>.Mine"})
            register_mover(cls)
            assert type(create_mover("cell_for_test")) is cls
        other = type("Other", (Mover,), {"name": "cell_for_test", "paths": frozenset({"host"}), "_copy": _plain_copy})
        with pytest.raises(FlashBootError, match=r"mover 'cell_for_test' is already registered by "
                                                 r"test_research_api_hardening.cell.<locals>.Mine; .*Other needs another name"):
            register_mover(other)
        with pytest.raises(FlashBootError, match=r"mover 'host' is already registered by flashboot.movers.host.HostMover"):
            register_mover(type("HostMover", (Mover,), {"name": "host", "paths": frozenset({"host"}), "_copy": _plain_copy}))

        first, second = _define_planner("cell_for_test"), _define_planner("cell_for_test")
        assert first is not second and _SCHEDULES["cell_for_test"] is second
        assert len(build_plan("cell_for_test", 2, 100, 10)) == 20
        with pytest.raises(PlanError, match=r"schedule 'cell_for_test' is already registered by "
                                            r"test_research_api_hardening._define_planner.<locals>.mine; .*<lambda> needs"):
            register_schedule("cell_for_test")(lambda n, total_bytes, chunk_bytes: None)
    finally:
        _MOVERS.pop("cell_for_test", None)
        _SCHEDULES.pop("cell_for_test", None)


@pytest.mark.parametrize("nbytes", [np.int64(4097), np.uint32(4097), np.intp(4097)])
def test_mover_copy_takes_a_size_computed_with_numpy(nbytes):
    """copy(dst, src, np.int64(4097)) had been refused: 'nbytes must be a positive int, got
    np.int64(4097)' (batches and Span.sub take numpy integers)."""
    from flashboot.movers import create_mover

    src, dst = (np.arange(5000) % 251).astype(np.uint8), np.zeros(5000, np.uint8)
    create_mover("host").copy(dst, src, nbytes)
    assert np.array_equal(dst[:4097], src[:4097]) and not dst[4097:].any()


@pytest.mark.parametrize("nbytes", [np.bool_(True), np.float64(4096.0), np.int64(0), np.int64(-1)])
def test_mover_copy_still_refuses_numpy_sizes_that_are_no_positive_ints(nbytes):
    from flashboot.errors import MoverError
    from flashboot.movers import create_mover

    src, dst = np.zeros(5000, np.uint8), np.zeros(5000, np.uint8)
    with pytest.raises(MoverError, match=r"host: nbytes must be a positive int, got "):
        create_mover("host").copy(dst, src, nbytes)


@pytest.mark.parametrize("schedule", ["chain", "star", "ring"])
def test_build_plan_takes_counts_computed_with_numpy(schedule):
    """A chunk sweep over 2 ** np.arange(...) had been refused: 'chunk_bytes must be a positive int,
    got np.int64(4096)'; the plan holds plain ints (JSON-ready)."""
    import json

    from flashboot.schedulers import Plan, PlanError, build_plan

    plan = build_plan(schedule, np.int64(3), np.uint64(10_001), 2 ** np.arange(12, 13)[0])
    assert plan == build_plan(schedule, 3, 10_001, 4096)
    assert type(plan.total_bytes) is int and type(plan.chunk_bytes) is int
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    for bad in (np.bool_(True), np.float64(4096.0), np.int64(0)):
        with pytest.raises(PlanError, match=rf"{schedule}: chunk_bytes must be a positive int, got "):
            build_plan(schedule, 3, 10_001, bad)


def test_bench_movers_closes_its_arenas_when_a_mover_fails():
    """The failing mover's traceback (which a notebook keeps as sys.last_value) had held both
    arenas of the path, the largest size each, mapped."""
    import os

    from flashboot.benchmarks.movers import run
    from flashboot.errors import FlashBootError
    from flashboot.movers import Mover, register_mover
    from flashboot.movers.registry import _MOVERS

    def memfds():
        out = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                out += "memfd:" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return out

    @register_mover
    class Failing(Mover):
        name, paths = "failing_arenas_for_test", frozenset({"host"})

        def _copy(self, dst, src, nbytes, path, stream):
            raise RuntimeError("boom")

    before = memfds()
    try:
        with pytest.raises(FlashBootError, match="mover 'failing_arenas_for_test' failed") as failed:
            run(["host"], [1 << 20], ["failing_arenas_for_test"], repeats=1)
        assert failed.value.__traceback__ is not None and memfds() == before
    finally:
        _MOVERS.pop("failing_arenas_for_test", None)


_CONCURRENT_COPIES = """
import threading
import numpy as np
import numba
from flashboot.movers import create_mover

mover, n, bad = create_mover("host"), 4 << 20, []

def lane(k):
    src, dst = np.full(n, k, np.uint8), np.zeros(n, np.uint8)
    for i in range(8):
        dst[:] = 0
        mover.copy(dst, src)
        if not (dst == k).all():
            bad.append((k, i))

threads = [threading.Thread(target=lane, args=(k,)) for k in range(1, 5)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(numba.threading_layer(), bad)
"""


def test_host_copies_from_several_threads_under_numbas_workqueue_layer_copy_every_byte():
    """Without OpenMP or TBB (a slim image has no libgomp) numba runs its workqueue layer, which
    is not thread-safe: two executor lanes copying 1 MiB or more at once had ended the process
    ("Concurrent access has been detected")."""
    import os

    from _python import run_python

    out = run_python("-c", _CONCURRENT_COPIES, timeout=300, env={**os.environ, "NUMBA_THREADING_LAYER": "workqueue"})
    assert out.split() == ["workqueue", "[]"]


_COPY_IN_A_FORKED_CHILD = """
import os
import numpy as np
import numba
from flashboot.movers import create_mover

mover, n = create_mover("host"), 4 << 20
src, dst = np.full(n, 3, np.uint8), np.zeros(n, np.uint8)
mover.copy(dst, src)  # the parent's first parallel copy starts numba's pool
pid = os.fork()
if pid == 0:
    out = np.zeros(n, np.uint8)
    mover.copy(out, src)
    os._exit(0 if (out == 3).all() else 3)
_, status = os.waitpid(pid, 0)
print(numba.threading_layer(), bool((dst == 3).all()), os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_after_host_copies_copies_too():
    """A child forked from a process whose host copies had started GNU OpenMP's pool (numba's
    omp layer; multiprocessing forks on Linux) was ended at its first copy of 1 MiB or more:
    'fork() called from a process already using GNU OpenMP, this is unsafe'."""
    import os

    from _python import run_python

    out = run_python("-c", _COPY_IN_A_FORKED_CHILD, timeout=300, env={**os.environ, "NUMBA_THREADING_LAYER": "omp"})
    assert out.split() == ["omp", "True", "0"]
