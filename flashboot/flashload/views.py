"""The views: every tensor of an image as a zero-copy view of the arena, made in bulk."""

from __future__ import annotations

import operator

import numpy as np

from ..errors import LayoutError


def make_views(arena, metadata) -> dict:
    """name -> a zero-copy view of the arena at the tensor's offset, shape, stride and dtype.

    The same views as ``arena.view(offset, shape, dtype, stride)``, made in bulk from the tensor
    table's columns: one typed view of the arena per dtype, then one ``as_strided`` per tensor,
    fed with plain lists converted a group (same dtype and ndim) at a time. The strict reader has
    already checked every tensor's bounds and alignment against the image (which fits the arena),
    and the per-call checks of ``arena.view`` cost ~25 us a tensor, half a second for the 18,722
    tensors of checkpoint B. What is left is torch's own cost of a tensor object (~2 us a view),
    which :func:`load` spends while the bulk copy runs (nothing reads a view before the copy ends).
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
    picks, made = [], []
    with gc_paused():
        for code in present:
            dtype = getattr(torch, DTYPE_NAMES[code])
            typed = flat[: arena.nbytes - arena.nbytes % dtype.itemsize].view(dtype)
            for ndim, rows in dims.groups():
                pick = rows[codes[rows] == code] if len(present) > 1 else rows
                picks.append(pick)
                made += map(typed.as_strided, dims.shapes[pick, :ndim].tolist(), dims.strides[pick, :ndim].tolist(),
                            elem_offsets[pick].tolist())
        if len(picks) > 1:  # back to table order: one C-level gather, not a Python loop
            position = np.empty(n, np.int64)
            position[np.concatenate(picks)] = np.arange(n)
            made = operator.itemgetter(*position.tolist())(made) if n > 1 else made
        return dict(zip(table.names, made))


__all__ = ["make_views"]
