"""The views: every tensor of an image as a zero-copy view of the arena, made in bulk.

A torch view costs ~1.3 us through ``as_strided`` (mostly argument parsing) but ~0.6 us when
``unbind`` makes many at once in C++. A MoE image is mostly runs of tensors of one shape at a
constant spacing (the same projection of consecutive experts), so the views are made per run:
one ``as_strided`` with a leading run dimension, then ``unbind``; tensors in no run get their own
``as_strided``. Everything per tensor is numpy; Python loops over runs, not tensors. The new
tensors then go straight to the collector's oldest generation (``gc_paused(promote=True)``): the
young collection that would otherwise walk them at the first allocation after the bulk cost B's
18,722 views 2.5-5.6 ms on the host backend (~0.1 ms promoted); C's restart views on the H200 went
from 1.12 to 0.61 us a tensor (two runs of 2026-12-03, before and after).
"""

from __future__ import annotations

import operator
import os
import threading

import numpy as np

from ..errors import FlashBootError, LayoutError

MAX_PERIOD = 4
"""Runs are looked for among every k-th tensor of a shape, k <= this (w1 and w3 share a shape and
alternate: k = 2)."""


VIEW_THREADS = min(8, os.cpu_count() or 1)
"""Threads that make the views (``$FLASHBOOT_VIEW_THREADS`` overrides: an engine that keeps its
cores busy may want fewer). torch releases the GIL inside ``unbind`` (the C++ loop that makes
a run's tensors) and takes it back only to wrap each result, so on a host with spare cores the
runs' C++ parts overlap. Shape C's 40,250 views, first call in fresh processes on the H200
machine (16 cores; benchmarks/probes/early_call_parts.py, 2026-12-02 13:29, three rounds): 1
thread 1.10-1.80 us each, 2: 1.20-1.37, 4: 0.84-1.18, 8: 0.79-1.11, 12: 0.85-1.08; inside the
load, beside the daemon's DMA, 8 made them as fast as 4 or faster (benchmarks/RESULTS.md)."""
THREADS_ENV = "FLASHBOOT_VIEW_THREADS"
VIEW_THREAD_MIN_TENSORS = 1000
"""The default uses a thread per this many tensors at most (starting one costs ~0.1 ms: more than
a small model's views take)."""
VIEW_THREAD_TIMEOUT_S = 120.0
"""How long the caller waits for a view thread (each makes its share of ~1 us views and waits on nothing)."""


def make_views(arena, metadata, *, threads: int | None = None) -> dict:
    """name -> a zero-copy view of the arena at the tensor's offset, shape, stride and dtype.

    The same views as ``arena.view(offset, shape, dtype, stride)`` (same data pointer, shape,
    stride and dtype), made in bulk from the tensor table's columns (see the module docstring).
    The strict reader has already checked every tensor's bounds and alignment against the image
    (which fits the arena), and the per-call checks of ``arena.view`` cost ~25 us a tensor.
    ``threads``: how many threads make them (default :func:`view_threads`, one per
    :data:`VIEW_THREAD_MIN_TENSORS` tensors at most).
    """
    import torch

    from ..layouts.format import DTYPE_NAMES, gc_paused

    if metadata.image_nbytes > arena.nbytes:
        raise LayoutError(f"image of {metadata.image_nbytes:,} bytes does not fit the {arena.nbytes:,}-byte arena")
    table = metadata.tensors
    n = len(table)
    if not n:
        return {}
    flat = arena.bytes()
    dims = table.dim_columns()
    codes = table.dtype_codes
    elem_offsets = table.offsets // table.itemsizes
    present = np.flatnonzero(np.bincount(codes)).tolist()
    order, jobs = [], []
    with gc_paused(promote=True):
        for code in present:
            dtype = getattr(torch, DTYPE_NAMES[code])
            typed = flat[: arena.nbytes - arena.nbytes % dtype.itemsize].view(dtype)
            for ndim, rows in dims.groups():
                pick = rows[codes[rows] == code] if len(present) > 1 else rows
                if len(pick):
                    _plan(typed, pick, dims.shapes[pick, :ndim], dims.strides[pick, :ndim], elem_offsets[pick],
                          order, jobs)
        if threads is None:
            threads = max(1, min(view_threads(), n // VIEW_THREAD_MIN_TENSORS))
        made = _run_jobs(jobs, threads)
        position = np.empty(n, np.int64)  # back to table order: one C-level gather, not a Python loop
        position[np.concatenate(order)] = np.arange(n)
        made = operator.itemgetter(*position.tolist())(made) if n > 1 else made
        return dict(zip(table.names, made))


def view_threads() -> int:
    """:data:`VIEW_THREADS`, or ``$FLASHBOOT_VIEW_THREADS`` where set (a positive int; anything
    else is refused by name, not ignored)."""
    env = os.environ.get(THREADS_ENV)
    if not env:
        return VIEW_THREADS
    try:
        threads = int(env)
    except ValueError:
        threads = 0
    if threads < 1:
        raise FlashBootError(f"${THREADS_ENV} must be a positive number of threads, got {env!r}")
    return threads


def _plan(typed, pick: np.ndarray, shapes: np.ndarray, strides: np.ndarray, offsets: np.ndarray,
          order: list, jobs: list) -> None:
    """Jobs making the views of the tensors ``pick`` (one dtype and ndim) appended to ``jobs``,
    their table indices to ``order`` in the order the jobs make them. A job is ``(count, call,
    args)``: ``call(*args)`` returns ``count`` views."""
    # one segment per distinct (shape, stride), each sorted by offset
    by = np.lexsort((offsets, *strides.T[::-1], *shapes.T[::-1]))
    change = np.zeros(max(len(by) - 1, 0), bool)
    for column in (*shapes.T, *strides.T):  # a column at a time: numpy reduces short rows slowly (any(axis=1))
        ranked = column[by]
        change |= ranked[1:] != ranked[:-1]
    cut = np.flatnonzero(change) + 1
    lone = []
    for seg in np.split(by, cut):
        if len(seg) < 2:
            lone.append(seg)
            continue
        shape, stride = tuple(shapes[seg[0]].tolist()), tuple(strides[seg[0]].tolist())
        runs, rest = _runs(offsets[seg])
        for start, step, members in runs:
            order.append(pick[seg[members]])
            jobs.append((len(members), _run_views, (typed, (len(members), *shape), (step, *stride), start)))
        lone.append(seg[rest])
    lone = np.concatenate(lone) if lone else np.zeros(0, np.int64)
    if len(lone):
        order.append(pick[lone])
        jobs.append((len(lone), _lone_views, (typed, shapes[lone].tolist(), strides[lone].tolist(),
                                              offsets[lone].tolist())))


def _run_views(typed, size: tuple, stride: tuple, start: int):
    return typed.as_strided(size, stride, start).unbind(0)


def _lone_views(typed, shapes: list, strides: list, offsets: list) -> list:
    return list(map(typed.as_strided, shapes, strides, offsets))


def _run_jobs(jobs: list, threads: int) -> list:
    """Every job's views, in job order; with ``threads`` > 1, contiguous shares of about equal
    tensor counts run in that many threads, joined before returning (a job only builds tensors
    and waits on nothing; :data:`VIEW_THREAD_TIMEOUT_S` bounds the wait all the same)."""
    if threads <= 1 or len(jobs) < 2:
        made: list = []
        for _, call, args in jobs:
            made += call(*args)
        return made
    ends = np.searchsorted(np.cumsum([count for count, _, _ in jobs]),
                           np.linspace(0, sum(count for count, _, _ in jobs), threads + 1)[1:-1], side="right")
    shares = [jobs[a:b] for a, b in zip([0, *ends.tolist()], [*ends.tolist(), len(jobs)]) if b > a]
    results: list = [None] * len(shares)

    def work(i: int) -> None:
        try:
            results[i] = _run_jobs(shares[i], 1)
        except BaseException as exc:  # raised by the caller below
            results[i] = exc

    workers = [threading.Thread(target=work, args=(i,), name=f"flashboot-views-{i}") for i in range(1, len(shares))]
    for w in workers:
        w.start()
    work(0)
    for w in workers:
        w.join(VIEW_THREAD_TIMEOUT_S)
        if w.is_alive():
            raise FlashBootError(f"{w.name} did not make its share of the {sum(c for c, _, _ in jobs):,} views "
                                 f"in {VIEW_THREAD_TIMEOUT_S:g} s")
    made = []
    for part in results:
        if isinstance(part, BaseException):
            raise part
        made += part
    return made


def _runs(offs: np.ndarray) -> tuple[list[tuple[int, int, np.ndarray]], np.ndarray]:
    """Split sorted ``offs`` (element offsets of tensors of one shape) into arithmetic runs of at
    least 2, among every k-th entry; returns ``[(first offset, step, member positions)]`` and the
    positions in no run. k (1..:data:`MAX_PERIOD`) is the one under which most entries continue
    their run (the step from the entry k before repeats): w1 and w3 alternating make k = 2."""
    period = min(MAX_PERIOD, len(offs) - 1)
    continued = []
    for k in range(1, period + 1):
        dk = offs[k:] - offs[:-k]
        continued.append(int(np.count_nonzero((dk[k:] == dk[:-k]) & (dk[k:] > 0))))
    k = 1 + int(np.argmax(continued))  # the first of equals: fewer phases
    runs, rest = [], []
    for phase in range(k):
        starts, lengths, valid, steps = _phase_runs(offs[phase::k])
        for a, n, step in zip(starts[valid].tolist(), lengths[valid].tolist(), steps[valid].tolist()):
            first = phase + k * a
            runs.append((int(offs[first]), step, np.arange(first, first + k * n, k)))
        rest.append(np.arange(phase, len(offs), k)[~np.repeat(valid, lengths)])
    return runs, np.concatenate(rest)


def _phase_runs(x: np.ndarray):
    """Runs in ``x`` (every k-th offset, from one phase): a run ends where the step changes and the
    next one starts after that entry, or with it where the step after it continues (the first
    expert of the next layer). Returns ``(starts, lengths, valid, steps)`` (positions in ``x``;
    valid: 2+ entries, step > 0)."""
    if len(x) < 2:
        one = np.zeros(len(x), np.int64)
        return one, one + 1, np.zeros(len(x), bool), one
    d = np.diff(x)
    starts = np.concatenate(([0], np.flatnonzero(d[1:] != d[:-1]) + 2))
    starts = starts[starts < len(x)]
    lengths = np.diff(np.concatenate((starts, [len(x)])))
    # The entry just after a jump (the first expert of the next layer) starts a run of one under
    # that rule; where the step after it is the next run's step, that run starts with it.
    lone = starts[(lengths == 1) & (starts + 2 < len(x))]
    joined = lone[d[lone] == d[lone + 1]] + 1
    if len(joined):
        dropped = np.zeros(len(x), bool)
        dropped[joined] = True
        starts = starts[~dropped[starts]]
        lengths = np.diff(np.concatenate((starts, [len(x)])))
    steps = d[np.minimum(starts, len(d) - 1)]
    return starts, lengths, (lengths >= 2) & (steps > 0), steps


__all__ = ["make_views"]
