"""The views: every tensor of an image as a zero-copy view of the arena, made in bulk.

A torch view costs ~0.8 us through ``as_strided`` (mostly argument parsing) but ~0.4 us when
``unbind`` makes many at once in C++. So the views are made by runs
(:mod:`flashboot.layouts.view_order`): one ``as_strided`` with a leading run dimension, then
``unbind``; tensors in no run get their own ``as_strided``. An image pre-packed run by run has its
runs between neighbouring rows of its table (found in a few numpy passes, views made in table
order); any other table is planned by shape and offset and its views put back in table order.
Everything per tensor is numpy; Python loops over runs, not tensors. The tensors are made below
torch's autograd and view-tracking layer (:func:`below_view_tracking`): plain tensors over the
arena's storage, not autograd views of its flat tensor, which saves a view-tracking record each
(B's 18,722 views 12.5 -> 8.9 ms, C's 40,250 25.6 -> 18.3 ms: host backend, first call in a fresh
process, 1 thread, 2026-12-03). The new tensors then go
straight to the collector's oldest generation (``gc_paused(promote=True)``): the young collection
that would otherwise walk them at the first allocation after the bulk cost B's 18,722 views
2.5-5.6 ms on the host backend (~0.1 ms promoted); C's restart views on the H200 went from 1.12 to
0.61 us a tensor (two runs of 2026-12-03, before and after).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading

import numpy as np

from ..errors import FlashBootError, LayoutError

VIEW_THREADS = min(4, os.cpu_count() or 1)
"""Threads that make the views (``$FLASHBOOT_VIEW_THREADS`` overrides: an engine that keeps its
cores busy may want fewer). torch releases the GIL inside ``unbind`` (the C++ loop that makes
a run's tensors) and takes it back only to wrap each result, so on a host with spare cores the
runs' C++ parts overlap. Restart views on the H200 machine (16 cores; ``first_calls views
--view-threads``, fresh processes, two rounds, 2026-12-03 21:42, views made below the view
tracking), us a tensor: B's 18,722 by 1 thread 1.14-1.24, 2: 0.73-0.98, 4: 0.72-0.80, 8:
0.89-0.91; C's 40,250 by 1: 0.83-1.24, 2: 0.77-1.03, 4: 0.70-0.79, 8: 0.72-0.77. Beyond 4 the
threads' turns at the GIL cost more than their C++ parts overlap (8 had been best, or as good
as 4, while each view also made its autograd view record: 2026-12-02)."""
THREADS_ENV = "FLASHBOOT_VIEW_THREADS"
VIEW_THREAD_MIN_TENSORS = 1000
"""The default uses a thread per this many tensors at most (starting one costs ~0.1 ms: more than
a small model's views take)."""
VIEW_THREAD_TIMEOUT_S = 120.0
"""How long the caller waits for a view thread (each makes its share of ~1 us views and waits on nothing)."""


MIN_MEAN_RUN = 8
"""A table whose neighbouring rows form runs of at least this many tensors on average is made in
table order; any other (listed by offset: an image pre-packed before the run order) is planned."""


def make_views(arena, metadata, *, threads: int | None = None) -> dict:
    """name -> a zero-copy view of the arena at the tensor's offset, shape, stride and dtype, in
    table order.

    The same views as ``arena.view(offset, shape, dtype, stride)`` (same data pointer, shape,
    stride and dtype), made in bulk from the tensor table's columns (see the module docstring).
    The strict reader has already checked every tensor's bounds and alignment against the image
    (which fits the arena), and the per-call checks of ``arena.view`` cost ~25 us a tensor.
    ``threads``: how many threads make them (default :func:`view_threads`, one per
    :data:`VIEW_THREAD_MIN_TENSORS` tensors at most).
    """
    import torch

    from ..layouts.format import DTYPE_NAMES, gc_paused
    from ..layouts.view_order import plan_runs, table_runs

    if metadata.image_nbytes > arena.nbytes:
        raise LayoutError(f"image of {metadata.image_nbytes:,} bytes does not fit the {arena.nbytes:,}-byte arena")
    table = metadata.tensors
    n = len(table)
    if not n:
        return {}
    flat = arena.bytes()
    dims = table.dim_columns()
    columns = (table.dtype_codes, dims.ndims, dims.shapes, dims.strides, table.offsets // table.itemsizes)
    typed = {}  # dtype code -> the arena as that dtype
    for code in np.flatnonzero(np.bincount(table.dtype_codes)).tolist():
        dtype = getattr(torch, DTYPE_NAMES[code])
        typed[code] = flat[: arena.nbytes - arena.nbytes % dtype.itemsize].view(dtype)
    with gc_paused(promote=True):
        starts = table_runs(*columns)
        if len(starts) * MIN_MEAN_RUN <= n:  # listed run by run: the views come out in table order
            groups, order = _neighbour_groups(starts, n), None
        else:
            groups = plan_runs(*columns)
            order = [rows for rows, _ in groups]
        jobs = _jobs_of(typed, columns, groups)
        if threads is None:
            threads = max(1, min(view_threads(), n // VIEW_THREAD_MIN_TENSORS))
        made = _run_jobs(jobs, threads)
        if order is not None:  # back to table order: one C-level gather, not a Python loop
            position = np.empty(n, np.int64)
            position[np.concatenate(order)] = np.arange(n)
            made = operator.itemgetter(*position.tolist())(made) if n > 1 else made
        return dict(zip(table.names, made))


def _neighbour_groups(starts: np.ndarray, n: int) -> list[tuple[np.ndarray, bool]]:
    """``table_runs``' runs as ``(rows, is_run)`` groups in table order; neighbouring rows in no
    run (runs of one) go together in one group."""
    ends = np.append(starts[1:], n)
    groups: list[tuple[np.ndarray, bool]] = []
    single_from = None
    for a, b in zip(starts.tolist(), ends.tolist()):
        if b - a == 1:
            if single_from is None:
                single_from = a
            continue
        if single_from is not None:
            groups.append((np.arange(single_from, a), False))
            single_from = None
        groups.append((np.arange(a, b), True))
    if single_from is not None:
        groups.append((np.arange(single_from, n), False))
    return groups


def _jobs_of(typed: dict, columns, groups: list) -> list:
    """A job per ``(rows, is_run)`` group: ``(count, call, args)``, ``call(*args)`` returning the
    views of those rows in order. A run (2+ rows of one dtype, shape and stride at a constant
    spacing > 0, as ``view_order`` finds them) is one ``as_strided``, then ``unbind``; other rows
    get an ``as_strided`` each."""
    codes, ndims, shapes, strides, offsets = columns
    jobs = []
    for rows, is_run in groups:
        if is_run:
            first = int(rows[0])
            k = int(ndims[first])
            shape, stride = tuple(shapes[first, :k].tolist()), tuple(strides[first, :k].tolist())
            step = int(offsets[rows[1]] - offsets[first])
            jobs.append((len(rows), _run_views, (typed[int(codes[first])], (len(rows), *shape), (step, *stride),
                                                 int(offsets[first]))))
        else:
            jobs.append((len(rows), _lone_views, (typed, codes[rows].tolist(), ndims[rows].tolist(),
                                                  shapes[rows].tolist(), strides[rows].tolist(),
                                                  offsets[rows].tolist())))
    return jobs


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


def _run_views(typed, size: tuple, stride: tuple, start: int):
    return typed.as_strided(size, stride, start).unbind(0)


def _lone_views(typed: dict, codes: list, ndims: list, shapes: list, strides: list, offsets: list) -> list:
    return [typed[c].as_strided(shape[:k], stride[:k], offset)
            for c, k, shape, stride, offset in zip(codes, ndims, shapes, strides, offsets)]


def below_view_tracking():
    """A context in which torch makes tensors below its autograd and view-tracking dispatch
    (``torch._C._AutoDispatchBelowADInplaceOrView``, thread-local): ``as_strided`` and ``unbind``
    then return plain tensors over the same storage (same data pointer, shape, stride and dtype),
    without the view record (base, version counter shared with it, creation meta) each autograd
    view carries. Weights need none of it: they neither require grad nor are changed through the
    arena's flat tensor, and an in-place write to one (a refit) needs no shared version counter.
    A torch without that guard gets ordinary views."""
    import torch

    guard = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
    return guard() if guard is not None else contextlib.nullcontext()


def _run_jobs(jobs: list, threads: int) -> list:
    """Every job's views, in job order; with ``threads`` > 1, contiguous shares of about equal
    tensor counts run in that many threads, joined before returning (a job only builds tensors
    and waits on nothing; :data:`VIEW_THREAD_TIMEOUT_S` bounds the wait all the same)."""
    if threads <= 1 or len(jobs) < 2:
        made: list = []
        with below_view_tracking():
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


__all__ = ["make_views"]
