"""The order an image lists its tensors in: the order a load makes their views.

A load makes every tensor a zero-copy view of the arena, and a torch view costs ~0.4 us when
``unbind`` makes many at once against ~0.8 us through one ``as_strided`` each. So the views are
made by *runs*: tensors of one dtype, shape and stride at a constant spacing (the same projection
of consecutive experts; one norm of consecutive layers), each one ``as_strided`` with a leading run
dimension, then ``unbind``.

Finding the runs in a table listed by offset takes a sort and a loop over the distinct shapes
(:func:`plan_runs`), and the views then come out in another order than the table's and must be
put back: 6-7 ms of Python for 40,250 tensors on the CPU host, on the critical path of every first
load. So pre-pack lists the tensors run by run (:func:`view_order`, applied by
:meth:`~flashboot.layouts.tensor_table.TensorTable.from_entries`): a load then finds the runs
between neighbouring rows (:func:`table_runs`, a fixed number of numpy passes, ~1 ms there) and
makes the views in table order. The order is a speed-up, never trusted: the runs are found from
the columns themselves, and a table in any other order (an image pre-packed before this order
existed, a JSON-only table) is planned by :func:`plan_runs` as before.
"""

from __future__ import annotations

import numpy as np

MAX_PERIOD = 4
"""Runs are looked for among every k-th tensor of a shape, k <= this (w1 and w3 share a shape and
alternate around w2: k = 2)."""


def plan_runs(dtype_codes: np.ndarray, ndims: np.ndarray, shapes: np.ndarray, strides: np.ndarray,
              elem_offsets: np.ndarray) -> list[tuple[np.ndarray, bool]]:
    """The runs of a table in any order, as ``(rows, is_run)`` groups of table row indices in the
    order their views are made: a run's rows (2+, one dtype, shape and stride, in offset order at a
    constant spacing > 0), or rows in no run (``is_run`` False). Every row is in exactly one group.

    ``shapes`` and ``strides``: ``(n, d)`` columns, zero beyond each row's ``ndims``;
    ``elem_offsets``: offsets in elements of each row's dtype."""
    groups: list[tuple[np.ndarray, bool]] = []
    present = np.flatnonzero(np.bincount(dtype_codes, minlength=1)).tolist() if len(dtype_codes) else []
    kinds = np.flatnonzero(np.bincount(ndims, minlength=1)).tolist() if len(ndims) else []
    for code in present:
        for ndim in kinds:
            if len(present) == 1 and len(kinds) == 1:
                pick = np.arange(len(dtype_codes))
            else:
                pick = np.flatnonzero((dtype_codes == code) & (ndims == ndim))
            if len(pick):
                _plan_group(pick, shapes[pick, :ndim], strides[pick, :ndim], elem_offsets[pick], groups)
    return groups


def view_order(dtype_codes: np.ndarray, ndims: np.ndarray, shapes: np.ndarray, strides: np.ndarray,
               elem_offsets: np.ndarray) -> np.ndarray:
    """The permutation that lists a table run by run (:func:`plan_runs`' groups, one after another)."""
    groups = plan_runs(dtype_codes, ndims, shapes, strides, elem_offsets)
    return np.concatenate([rows for rows, _ in groups]) if groups else np.zeros(0, np.int64)


def table_runs(dtype_codes: np.ndarray, ndims: np.ndarray, shapes: np.ndarray, strides: np.ndarray,
               elem_offsets: np.ndarray) -> np.ndarray:
    """Where the runs of neighbouring rows start (sorted row indices; each run ends where the next
    starts): row i continues its predecessor's run when both have one dtype, shape and stride and i
    lies the run's spacing (> 0) further on. Taken greedily from the top, as :func:`_phase_runs`
    does: where the spacing changes (a layer's first expert after the last of the previous
    layer), the row after the change starts a new run, which its successor then continues. For a
    table in :func:`view_order` these are that order's runs; for any table, every run found is one
    (consecutive rows, one layout, constant spacing)."""
    n = len(dtype_codes)
    if n < 2:
        return np.zeros(n, np.int64)
    alike = dtype_codes[1:] == dtype_codes[:-1]
    alike &= ndims[1:] == ndims[:-1]
    for k in range(shapes.shape[1]):  # a column at a time (numpy reduces short rows slowly)
        alike &= shapes[1:, k] == shapes[:-1, k]
        alike &= strides[1:, k] == strides[:-1, k]
    step = np.diff(elem_offsets)
    fresh = np.ones(n, bool)  # row i cannot continue row i-1
    fresh[1:] = ~alike | (step <= 0)
    # the spacing changes at i (neither i nor i-1 fresh): greedily, the first of a chain of such
    # rows starts a run, the second continues it, the third starts the next, and so on
    changed = np.zeros(n, bool)
    changed[2:] = ~fresh[2:] & ~fresh[1:-1] & (step[1:] != step[:-1])
    chain_start = changed.copy()
    chain_start[1:] &= ~changed[:-1]
    rows = np.arange(n)
    first = np.maximum.accumulate(np.where(chain_start, rows, 0))
    return np.flatnonzero(fresh | (changed & ((rows - first) % 2 == 0)))


def _plan_group(pick: np.ndarray, shapes: np.ndarray, strides: np.ndarray, offsets: np.ndarray,
                groups: list) -> None:
    """:func:`plan_runs` for the rows ``pick`` (one dtype and ndim), appended to ``groups``."""
    # one segment per distinct (shape, stride), each sorted by offset
    by = np.lexsort((offsets, *strides.T[::-1], *shapes.T[::-1]))
    change = np.zeros(max(len(by) - 1, 0), bool)
    for column in (*shapes.T, *strides.T):  # a column at a time: numpy reduces short rows slowly (any(axis=1))
        ranked = column[by]
        change |= ranked[1:] != ranked[:-1]
    lone = []
    for seg in np.split(by, np.flatnonzero(change) + 1):
        if len(seg) < 2:
            lone.append(seg)
            continue
        runs, rest = _runs(offsets[seg])
        groups.extend((pick[seg[members]], True) for members in runs)
        lone.append(seg[rest])
    lone = np.concatenate(lone) if lone else np.zeros(0, np.int64)
    if len(lone):
        groups.append((pick[lone], False))


def _runs(offs: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Split sorted ``offs`` (element offsets of tensors of one shape) into arithmetic runs of at
    least 2, among every k-th entry; returns each run's member positions and the positions in no
    run. k (1..:data:`MAX_PERIOD`) is the one under which most entries continue their run (the
    step from the entry k before repeats): w1 and w3 alternating make k = 2."""
    period = min(MAX_PERIOD, len(offs) - 1)
    continued = []
    for k in range(1, period + 1):
        dk = offs[k:] - offs[:-k]
        continued.append(int(np.count_nonzero((dk[k:] == dk[:-k]) & (dk[k:] > 0))))
    k = 1 + int(np.argmax(continued))  # the first of equals: fewer phases
    runs, rest = [], []
    for phase in range(k):
        starts, lengths, valid = _phase_runs(offs[phase::k])
        for a, n in zip(starts[valid].tolist(), lengths[valid].tolist()):
            first = phase + k * a
            runs.append(np.arange(first, first + k * n, k))
        rest.append(np.arange(phase, len(offs), k)[~np.repeat(valid, lengths)])
    return runs, np.concatenate(rest)


def _phase_runs(x: np.ndarray):
    """Runs in ``x`` (every k-th offset, from one phase): a run ends where the step changes and the
    next one starts after that entry, or with it where the step after it continues (the first
    expert of the next layer). Returns ``(starts, lengths, valid)`` (positions in ``x``; valid: 2+
    entries, step > 0)."""
    if len(x) < 2:
        one = np.zeros(len(x), np.int64)
        return one, one + 1, np.zeros(len(x), bool)
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
    return starts, lengths, (lengths >= 2) & (steps > 0)


__all__ = ["MAX_PERIOD", "plan_runs", "table_runs", "view_order"]
