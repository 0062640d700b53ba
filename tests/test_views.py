"""The bulk views against a per-tensor ``as_strided`` reference, on the host and on a GPU."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashboot import Arena
from flashboot.flashload.views import make_views
from flashboot.layouts.entries import DTYPES, TENSOR_ALIGNMENT, TensorEntry
from flashboot.layouts.table import decode_table, encode_table
from flashboot.layouts.tensor_table import TensorTable

MiB = 1 << 20


def _entries(seed: int) -> dict[str, TensorEntry]:
    """Every dtype; 0-d, 1-d, empty, permuted, padded and broadcast strides; and MoE-like runs:
    experts of one shape at a constant spacing, two shapes alternating (w1/w3 around w2), a run
    whose spacing changes half-way, all in shuffled table order."""
    rng = random.Random(seed)
    entries, cursor = [], 0

    def add(name, shape, stride, dtype):
        nonlocal cursor
        cursor = -(-cursor // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
        e = TensorEntry(name, cursor, tuple(shape), tuple(stride), dtype, "experts")
        entries.append(e)
        cursor += max(e.nbytes, 1)

    for i, dtype in enumerate(sorted(DTYPES) * 3):
        shape = [rng.choice([0, 1, 3, 5]) if rng.random() < 0.2 else rng.randint(1, 7) for _ in range(i % 5)]
        stride = list(torch.empty(shape).stride())
        if len(shape) > 1 and i % 3 == 0:
            stride = list(torch.empty(shape[::-1]).stride())[::-1]  # a transposed layout
        if stride and i % 4 == 1:
            stride[0] *= 3  # padded rows
        if stride and i % 7 == 2:
            stride[-1] = 0  # broadcast
        add(f"odd.{i}.{dtype}", shape, stride, dtype)
    for layer in range(3):
        for e in range(9):
            for w, shape in (("w1", (8, 4)), ("w2", (4, 8)), ("w3", (8, 4))):
                add(f"layers.{layer}.experts.{e}.{w}", shape, torch.empty(shape).stride(), "bfloat16")
        add(f"layers.{layer}.norm", (16,), (1,), "float32")
        if layer == 1:
            cursor += 3 * TENSOR_ALIGNMENT  # the next layer's spacing differs
    rng.shuffle(entries)
    return {e.name: e for e in entries}


def _metadata(entries: dict, from_table_file: bool, run_order: bool = True):
    """``run_order`` False: the table in the entries' own (shuffled) order, as an image pre-packed
    before the run order lists its tensors by offset: the views are then planned."""
    table = TensorTable.from_entries(entries, run_order=run_order)
    if from_table_file:  # as the reader makes it from tensors.bin: columns, no tuples
        meta_bytes = b'{\n "tensors": {}}'
        table, _ = decode_table(encode_table(table, meta_bytes), meta_bytes, "tensors.bin")
    nbytes = max(e.offset + e.nbytes for e in entries.values())
    return SimpleNamespace(tensors=table, image_nbytes=-(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT)


def _check_against_reference(arena, meta, threads: int | None = 1) -> None:
    """``make_views`` by ``threads`` threads (None: its default) against per-tensor ``as_strided``."""
    flat = arena.bytes()
    views = make_views(arena, meta, threads=threads)
    assert list(views) == list(meta.tensors.names)
    for e in meta.tensors.entries():
        dtype = getattr(torch, e.dtype)
        typed = flat[: arena.nbytes - arena.nbytes % dtype.itemsize].view(dtype)
        want = typed.as_strided(e.shape, e.stride, e.offset // dtype.itemsize)
        got = views[e.name]
        assert (got.dtype, got.shape, got.stride(), got.storage_offset(), got.device) == \
               (want.dtype, want.shape, want.stride(), want.storage_offset(), want.device), e.name
        if got.numel():  # an empty tensor's data_ptr is 0
            assert got.data_ptr() == want.data_ptr() == arena.ptr + e.offset, e.name
        raw = [t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*raw), e.name  # bytes: random bits make NaNs


@pytest.mark.parametrize("run_order", [True, False])
@pytest.mark.parametrize("from_table_file, threads", [(False, 1), (True, 1), (True, 3)])
def test_bulk_views_equal_per_tensor_as_strided(from_table_file, threads, run_order):
    meta = _metadata(_entries(seed=3), from_table_file, run_order)
    with Arena.create(meta.image_nbytes, "cpu") as arena:
        g = torch.Generator().manual_seed(1)
        arena.bytes()[:] = torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8, generator=g)
        _check_against_reference(arena, meta, threads)


@pytest.mark.parametrize("threads", [1, 3])
def test_views_are_plain_tensors_over_the_arena_and_writes_through_them_land_there(threads):
    """Made below torch's view tracking: no autograd view record, yet the arena's storage itself,
    so a write through a view (a refit) is in the arena and in every other tensor over those bytes."""
    meta = _metadata(_entries(seed=5), True)
    with Arena.create(meta.image_nbytes, "cpu") as arena:
        arena.bytes().zero_()
        views = make_views(arena, meta, threads=threads)
        flat = arena.bytes()
        assert not any(v._is_view() or v.requires_grad for v in views.values())
        assert {v.untyped_storage().data_ptr() for v in views.values()} == {flat.untyped_storage().data_ptr()}
        name = next(n for n in meta.tensors.names if n.endswith("experts.4.w2"))
        entry = next(e for e in meta.tensors.entries() if e.name == name)
        views[name].fill_(1.5)
        again = make_views(arena, meta, threads=1)[name]
        assert torch.equal(again, torch.full((4, 8), 1.5, dtype=torch.bfloat16))
        span = flat[entry.offset: entry.offset + entry.nbytes]
        assert torch.equal(span.view(torch.bfloat16), torch.full((32,), 1.5, dtype=torch.bfloat16))
        assert int(flat.count_nonzero()) == int(span.count_nonzero())  # nothing else written


@pytest.mark.gpu
@pytest.mark.parametrize("run_order", [True, False])
def test_bulk_views_of_an_opened_multi_segment_cuda_arena_equal_the_reference(run_order):
    meta = _metadata(_entries(seed=4), True, run_order)
    nbytes = max(meta.image_nbytes, 7 * MiB)
    with Arena.create(nbytes, "cuda:0", segment_bytes=2 * MiB) as owner:
        g = torch.Generator().manual_seed(2)
        owner.bytes().copy_(torch.randint(0, 256, (owner.nbytes,), dtype=torch.uint8, generator=g))
        torch.cuda.synchronize()
        with Arena.open(owner.export(), "cuda:0") as opened:
            assert opened.segments == 4 and opened.mapped_nbytes == 2 * MiB
            opened.map_range()  # the three others at once: one grant over their run
            assert opened.mapped_nbytes == opened.nbytes and opened.map_stats["segments"] == 3
            assert torch.equal(opened.bytes(), owner.bytes())
            _check_against_reference(opened, meta)
            _check_against_reference(opened, meta, threads=4)


def test_an_error_in_a_view_thread_reaches_the_caller(monkeypatch):
    from flashboot.flashload import views as views_mod

    meta = _metadata(_entries(seed=6), True)
    real, calls = views_mod._run_views, []

    def failing_late(typed, size, stride, start):
        calls.append(size)
        if len(calls) == 5:  # a job in a worker's share, not the caller's first
            raise RuntimeError(f"injected: views of {size} at {start}")
        return real(typed, size, stride, start)

    monkeypatch.setattr(views_mod, "_run_views", failing_late)
    with Arena.create(meta.image_nbytes, "cpu") as arena:
        with pytest.raises(RuntimeError, match="injected: views of"):
            make_views(arena, meta, threads=3)
        import threading

        assert len(calls) > 5  # the other shares ran on
        assert not [t for t in threading.enumerate() if t.name.startswith("flashboot-views")]  # all joined


def test_a_view_thread_past_its_timeout_is_named(monkeypatch):
    import threading
    import time

    from flashboot.errors import FlashBootError
    from flashboot.flashload import views as views_mod

    meta = _metadata(_entries(seed=7), True)
    real, calls = views_mod._run_views, []

    def slow_late(typed, size, stride, start):
        if threading.current_thread() is not threading.main_thread() and not calls:
            calls.append(size)
            time.sleep(1.0)  # once, in a worker's share: the caller's own share runs in the main thread
        return real(typed, size, stride, start)

    monkeypatch.setattr(views_mod, "_run_views", slow_late)
    monkeypatch.setattr(views_mod, "VIEW_THREAD_TIMEOUT_S", 0.05)
    with Arena.create(meta.image_nbytes, "cpu") as arena:
        with pytest.raises(FlashBootError, match=r"flashboot-views-\d did not make its share of the [\d,]+ views in 0.05 s"):
            make_views(arena, meta, threads=3)
        time.sleep(1.2)  # the slow share ends on its own before the arena closes


@pytest.mark.parametrize("period", [1, 2, 3, 4])
def test_runs_find_the_period_of_interleaved_experts(period):
    """``period`` projections of one shape per expert, interleaved in memory (w1 and w3 around w2
    make 2), over 3 layers spaced apart: one run per projection and layer, nothing left over."""
    import numpy as np

    from flashboot.layouts.view_order import _runs

    experts, gap = 16, 96
    offs = np.array(sorted(layer * 100_000 + e * period * gap + p * gap + p * p * 8  # no shorter period
                           for layer in range(3) for e in range(experts) for p in range(period)), np.int64)
    runs, rest = _runs(offs)
    assert len(rest) == 0 and len(runs) == 3 * period
    members = np.sort(np.concatenate(runs))
    assert members.tolist() == list(range(len(offs)))
    for m in runs:
        start, step = offs[m[0]], offs[m[1]] - offs[m[0]]
        assert len(m) == experts and step == period * gap
        assert offs[m].tolist() == [start + step * i for i in range(experts)]


def test_runs_never_join_tensors_at_one_offset():
    """Zero-size tensors may share an offset: a step of 0 makes no run."""
    import numpy as np

    from flashboot.layouts.view_order import _runs

    offs = np.array([0, 0, 0, 64, 64, 128], np.int64)
    runs, rest = _runs(offs)
    for m in runs:
        assert offs[m[1]] > offs[m[0]] and len(m) >= 2
    assert sorted(np.concatenate(runs + [rest]).tolist()) == list(range(6))


def test_the_thread_count_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    from flashboot import FlashBootError
    from flashboot.flashload import views as views_mod

    meta = _metadata(_entries(seed=7), True)
    used = []
    real = views_mod._run_jobs
    monkeypatch.setattr(views_mod, "VIEW_THREAD_MIN_TENSORS", 1)  # the table is small: let it use them all
    monkeypatch.setattr(views_mod, "_run_jobs", lambda jobs, threads: used.append(threads) or real(jobs, threads))
    with Arena.create(meta.image_nbytes, "cpu") as arena:
        monkeypatch.setenv("FLASHBOOT_VIEW_THREADS", "3")
        _check_against_reference(arena, meta, threads=None)
        assert used[0] == 3  # the first call: the shares then run with one thread each
        monkeypatch.delenv("FLASHBOOT_VIEW_THREADS")
        used.clear()
        make_views(arena, meta)
        assert used[0] == min(views_mod.VIEW_THREADS, len(meta.tensors))
        for bad in ("0", "-2", "four"):
            monkeypatch.setenv("FLASHBOOT_VIEW_THREADS", bad)
            with pytest.raises(FlashBootError, match=rf"\$FLASHBOOT_VIEW_THREADS must be a positive number.*'{bad}'"):
                make_views(arena, meta)


def _moe_layout(layers: int = 4, experts: int = 24):
    """A MoE model's layout as pre-pack computes it (tensors placed in name order): per layer a
    norm, attention, and per expert w1 / w2 / w3 (w1 and w3 of one shape, around w2), the layers'
    expert counts uneven and a small tensor after each layer's experts, so that the spacing
    between one layer's experts and the next changes."""
    from flashboot.layouts.format import LayoutSlot, compute_layout

    slots = []
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for e in sorted(range(experts + layer), key=str):  # name order: 0, 1, 10, 11, ...
            for w, shape in (("w1", (16, 8)), ("w2", (8, 16)), ("w3", (16, 8))):
                slots.append(LayoutSlot(f"{p}.mlp.experts.{e}.{w}.weight", "bfloat16", shape, "experts"))
        slots.append(LayoutSlot(f"{p}.mlp.experts.scale", "float32", (1 + layer % 2, 8), "experts"))
        slots.append(LayoutSlot(f"{p}.input_layernorm.weight", "float32", (8,), "non_experts"))
        for proj, shape in (("q", (8, 8)), ("k", (4, 8)), ("v", (4, 8)), ("o", (8, 8))):
            slots.append(LayoutSlot(f"{p}.self_attn.{proj}_proj.weight", "bfloat16", shape, "non_experts"))
    slots.append(LayoutSlot("model.embed_tokens.weight", "bfloat16", (32, 8), "non_experts"))
    return compute_layout(slots)


def _columns(table):
    dims = table.dim_columns()
    return table.dtype_codes, dims.ndims, dims.shapes, dims.strides, table.offsets // table.itemsizes


def test_pre_pack_lists_the_tensors_run_by_run_and_the_load_finds_the_same_runs(monkeypatch):
    """The table pre-pack writes lists each run's tensors one after another, so the load finds
    exactly the planner's runs between neighbouring rows and makes the views in table order
    without planning; the same layout listed by offset (an older image) is planned, and both
    give the reference views."""
    from flashboot.layouts import view_order

    layout = _moe_layout()
    by_offset = TensorTable.from_entries(layout.tensors, run_order=False)
    by_runs = TensorTable.from_entries(layout.tensors)
    assert sorted(by_runs.names) == sorted(by_offset.names) and list(by_runs.names) != list(by_offset.names)
    planned = view_order.plan_runs(*_columns(by_offset))
    runs_planned = [len(rows) for rows, is_run in planned if is_run]
    singles = sum(len(rows) for rows, is_run in planned if not is_run)
    assert len(runs_planned) >= 4 * 3 + 5 and singles >= 1  # each layer's w1, w2, w3; norms, attention; the embedding
    starts = view_order.table_runs(*_columns(by_runs))
    lengths = np.diff(np.append(starts, len(by_runs)))
    assert sorted(lengths[lengths > 1].tolist()) == sorted(runs_planned) and (lengths == 1).sum() == singles
    nbytes = layout.image_nbytes
    real, calls = view_order.plan_runs, []
    for table, plans in ((by_runs, False), (by_offset, True)):
        calls.clear()
        monkeypatch.setattr(view_order, "plan_runs", lambda *a: calls.append(1) or real(*a))
        with Arena.create(nbytes, "cpu") as arena:
            g = torch.Generator().manual_seed(5)
            arena.bytes()[:] = torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8, generator=g)
            _check_against_reference(arena, SimpleNamespace(tensors=table, image_nbytes=nbytes))
        assert bool(calls) == plans


@pytest.mark.parametrize("seed", range(4))
def test_every_run_found_between_neighbours_is_a_run_whatever_the_order(seed):
    """``table_runs`` trusts no order: on tables listed at random, by offset or run by run, each
    run it reports is consecutive rows of one dtype, shape and stride at one spacing > 0."""
    from flashboot.layouts import view_order

    entries = _entries(seed)
    for run_order in (True, False):
        table = TensorTable.from_entries(entries, run_order=run_order)
        codes, ndims, shapes, strides, offs = _columns(table)
        starts = view_order.table_runs(codes, ndims, shapes, strides, offs)
        assert starts[0] == 0 and (np.diff(starts) > 0).all()
        for a, b in zip(starts.tolist(), np.append(starts[1:], len(table)).tolist()):
            if b - a < 2:
                continue
            for col in (codes, ndims, shapes, strides):
                assert (col[a:b] == col[a]).all()
            step = np.diff(offs[a:b])
            assert step[0] > 0 and (step == step[0]).all()
        if run_order:
            assert len(starts) < len(table) // 2  # the experts' runs were found
