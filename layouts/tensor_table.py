"""An image's tensor table, kept as columns (:class:`TensorTable`), and the bulk checks of the
JSON columns it is parsed from. :mod:`flashboot.layouts.format` re-exports every name here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import numpy as np

from flashboot.errors import LayoutError

from .entries import (
    DTYPES, REGIONS, Part, Split, TensorEntry, _entry, _Fields, gc_paused, span_elems,
)

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)
"""Dtype names by code: :attr:`TensorTable.dtype_codes` indexes this."""
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPE_NAMES)}
_ITEMSIZE = np.array([DTYPES[n].itemsize for n in DTYPE_NAMES], np.int64)
_REGION_CODE = {name: code for code, name in enumerate(REGIONS)}
MAX_IMAGE_NBYTES = 1 << 56
"""Largest image (and so tensor) the reader accepts: keeps every offset and span exact in int64."""


@functools.lru_cache(maxsize=4096)
def _split(dim: int, index: int, count: int, blocks: int) -> Split:
    return Split(dim, index, count, blocks)  # interned: thousands of tensors share a few splits


# ------------------------------------------------------------------ bulk checks of JSON columns
def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _first_not(values: list, types: tuple) -> int | None:
    """Index of the first value whose exact type is not one of ``types`` (JSON makes no subclasses;
    ``bool`` is not ``int`` here)."""
    if set(map(type, values)) <= set(types):
        return None
    return next(i for i, v in enumerate(values) if type(v) not in types)


def _gather(objs: list, key: str) -> list:
    """``objs[j].get(key)`` for every j."""
    return list(map(dict.get, objs, repeat(key, len(objs))))


def _refuse(objs: list, values: list, j: int, key: str, type_name: str, where: str, path_of):
    """LayoutError for ``objs[j][key]``: missing, or not of type ``type_name``."""
    if values[j] is None and key not in objs[j]:
        raise LayoutError(f"{where}: missing field {path_of(j) + '.' + key!r}")
    raise LayoutError(f"{where}: field {path_of(j) + '.' + key!r} must be {type_name}, found {values[j]!r}")


def _ints(objs: list, key: str, minimum: int, where: str, path_of, values: list | None = None) -> np.ndarray:
    """Field ``key`` of every object: exact ints >= ``minimum``, as an int64 column."""
    values = _gather(objs, key) if values is None else values
    bad = _first_not(values, (int,))
    if bad is not None:
        _refuse(objs, values, bad, key, "int", where, path_of)
    try:
        column = np.array(values, dtype=np.int64)
    except OverflowError:
        bad = next(j for j, v in enumerate(values) if not -(1 << 63) <= v < 1 << 63)
        raise LayoutError(f"{where}: field {path_of(bad) + '.' + key!r} must be >= {minimum} and below 2**63, "
                          f"found {values[bad]}") from None
    bad = _first(column < minimum)
    if bad is not None:
        raise LayoutError(f"{where}: field {path_of(bad) + '.' + key!r} must be >= {minimum}, found {values[bad]}")
    return column


def _dims(objs: list, key: str, where: str, path_of) -> tuple[list, np.ndarray, np.ndarray]:
    """Shape or stride lists of every object: (the lists, their lengths, all elements flattened)."""
    values = _gather(objs, key)
    bad = _first_not(values, (list,))
    if bad is not None:
        _refuse(objs, values, bad, key, "list", where, path_of)
    lengths = np.fromiter(map(len, values), np.int64, len(values))
    flat = list(chain.from_iterable(values))

    def refuse(k: int, why: str = ""):
        row = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
        raise LayoutError(f"{where}: field {path_of(row) + '.' + key!r} must be a list of ints >= 0{why}, "
                          f"found {values[row]!r}")

    bad = _first_not(flat, (int,))
    if bad is not None:
        refuse(bad)
    try:
        elems = np.array(flat, dtype=np.int64)
    except OverflowError:
        refuse(next(k for k, v in enumerate(flat) if not -(1 << 63) <= v < 1 << 63), " below 2**63")
    bad = _first(elems < 0)
    if bad is not None:
        refuse(bad)
    return values, lengths, elems


def _codes(objs: list, key: str, table: dict, where: str, path_of, unknown) -> np.ndarray:
    """Field ``key`` of every object: a name in ``table``, as a column of its codes;
    ``unknown(j, name)`` raises for a name not in it."""
    values = _gather(objs, key)
    try:
        return np.fromiter(map(table.__getitem__, values), np.uint8, len(values))
    except (KeyError, TypeError):  # not a known name (or not even hashable): say which and why
        pass
    bad = _first_not(values, (str,))
    if bad is not None:
        _refuse(objs, values, bad, key, "str", where, path_of)
    j = next(j for j, v in enumerate(values) if v not in table)
    unknown(j, values[j])


def _spans(lengths: np.ndarray, shape: np.ndarray, stride: np.ndarray, itemsize: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's span in bytes, ``(1 + sum((n - 1) * s)) * itemsize`` (0 when a dim is 0),
    for all tensors at once from the flattened shapes and strides; plus a float estimate of it
    that flags spans too large to be exact in int64."""
    n = len(lengths)
    row = np.repeat(np.arange(n), lengths)
    empty = np.zeros(n, dtype=bool)
    empty[row[shape == 0]] = True
    term = (shape - 1) * stride  # >= 0 for non-empty tensors; may wrap for absurd ones (caught below)
    ends = np.cumsum(lengths)
    cum = np.zeros(len(term) + 1, dtype=np.int64)
    np.cumsum(term, out=cum[1:])  # wraps modulo 2**64, but each tensor's difference is exact
    elems = 1 + cum[ends] - cum[ends - lengths]
    estimate = (1 + np.bincount(row, weights=(shape - 1.0) * stride, minlength=n)) * itemsize
    nbytes = np.where(empty, 0, elems * itemsize)
    estimate[empty] = 0.0
    return nbytes, estimate


@dataclass(frozen=True)
class DimColumns:
    """Every tensor's shape and stride as columns: ``ndims[i]`` dims, ``shapes[i, :ndims[i]]`` and
    ``strides[i, :ndims[i]]`` (int64, zero beyond). What ``tensors.bin`` stores; read-only."""

    ndims: np.ndarray
    shapes: np.ndarray
    strides: np.ndarray

    @classmethod
    def of(cls, shapes, strides) -> "DimColumns":
        n = len(shapes)
        ndims = np.fromiter(map(len, shapes), np.uint8, n) if n else np.zeros(0, np.uint8)
        d = int(ndims.max()) if n else 0
        cols = []
        for rows in (shapes, strides):
            a = np.zeros((n, d), np.int64)
            for k in np.flatnonzero(np.bincount(ndims, minlength=1)).tolist():
                pick = np.flatnonzero(ndims == k)
                if k:
                    a[pick, :k] = [rows[i] for i in pick.tolist()]
            cols.append(_frozen(a))
        return cls(_frozen(ndims), *cols)

    def groups(self) -> list[tuple[int, np.ndarray]]:
        """``(ndim, rows with that many dims)`` for each ndim present."""
        kinds = np.flatnonzero(np.bincount(self.ndims, minlength=1)).tolist() if len(self.ndims) else []
        if len(kinds) == 1:
            return [(kinds[0], np.arange(len(self.ndims)))]
        return [(k, np.flatnonzero(self.ndims == k)) for k in kinds]

    def rows(self, a: np.ndarray) -> list[tuple[int, ...]]:
        """Row i of ``a`` (``shapes`` or ``strides``) cut to ``ndims[i]`` entries, as tuples; one
        bulk conversion per distinct ndim."""
        groups = self.groups()
        if len(groups) == 1:
            return list(map(tuple, a[:, :groups[0][0]].tolist()))
        out: list = [()] * len(self.ndims)
        for k, pick in groups:
            for i, row in zip(pick.tolist(), map(tuple, a[pick, :k].tolist())):
                out[i] = row
        return out


class TensorTable(Mapping):
    """An image's tensor table: name -> :class:`TensorEntry`, kept as columns.

    The reader validates 10^4 tensors in bulk (numpy over the columns), not one object at a
    time, and a load needs only the columns: ``names``, ``offsets`` and ``nbytes`` (int64
    arrays), ``dtype_codes`` (into :data:`DTYPE_NAMES`), ``region_codes`` (into ``REGIONS``),
    ``shapes`` and ``strides`` (tuples). Entries are built on first access, all at once, and
    kept. Read-only.
    """

    __slots__ = ("names", "offsets", "nbytes", "dtype_codes", "region_codes", "_shapes", "_strides", "_dims",
                 "_shards", "_parts", "_index", "_entries")

    def __init__(self, names, offsets, nbytes, dtype_codes, region_codes, shapes, strides, shards=None,
                 parts=None, entries=None):
        self.names: tuple[str, ...] = tuple(names)
        self.offsets: np.ndarray = _frozen(offsets)
        self.nbytes: np.ndarray = _frozen(nbytes)
        self.dtype_codes: np.ndarray = _frozen(dtype_codes)
        self.region_codes: np.ndarray = _frozen(region_codes)
        if isinstance(shapes, DimColumns):  # from tensors.bin: tuples only when someone asks for them
            self._dims, self._shapes, self._strides = shapes, None, None
        else:
            # Tuples, not the JSON lists: immutable, and the collector stops tracking them after one look.
            self._dims = None
            self._shapes = tuple(map(tuple, shapes))
            self._strides = tuple(map(tuple, strides))
        self._shards = shards  # None, or per tensor: None / validated JSON splits / tuple of Split
        self._parts = parts or {}  # index -> tuple of Part
        self._index: dict[str, int] | None = None
        self._entries: list[TensorEntry] | None = entries

    # ---- building
    @classmethod
    def from_entries(cls, entries: Mapping[str, TensorEntry], *, run_order: bool = True) -> "TensorTable":
        """The table of ``entries`` (as :func:`compute_layout` makes them), listed run by run
        (:func:`~flashboot.layouts.view_order.view_order`: what pre-pack writes, so that a load
        makes the views in table order), or in the order given where ``run_order`` is False."""
        es = list(entries.values())
        names = list(entries)
        for name, e in zip(names, es):
            if e.name != name:
                raise LayoutError(f"tensor table: entry {e.name!r} filed under {name!r}")
            if e.region not in _REGION_CODE:
                raise LayoutError(f"tensor {name!r} has region {e.region!r}; known: {', '.join(REGIONS)}")
        table = cls._of_entries(es)
        if run_order and len(es) > 1:
            from .view_order import view_order

            dims = table.dim_columns()
            order = view_order(table.dtype_codes, dims.ndims, dims.shapes, dims.strides, table.offsets // table.itemsizes)
            if (order != np.arange(len(es))).any():
                table = cls._of_entries([es[i] for i in order.tolist()])
        return table

    @classmethod
    def _of_entries(cls, es: list[TensorEntry]) -> "TensorTable":
        n = len(es)
        shards = [e.shard or None for e in es]
        reuse = all(type(e.shape) is tuple and type(e.stride) is tuple for e in es)
        return cls([e.name for e in es], np.fromiter((e.offset for e in es), np.int64, n),
                   np.fromiter((e.nbytes for e in es), np.int64, n),
                   np.fromiter((_DTYPE_CODE[e.dtype] for e in es), np.uint8, n),
                   np.fromiter((_REGION_CODE[e.region] for e in es), np.uint8, n),
                   (tuple(e.shape) for e in es), (tuple(e.stride) for e in es),
                   shards if any(shards) else None, {i: e.parts for i, e in enumerate(es) if e.parts},
                   es if reuse else None)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "TensorTable":
        """Parse and validate the ``tensors`` object of ``metadata.json``: every field's type, dtypes,
        regions, shape/stride agreement, shards, parts and the recorded ``nbytes`` against the span
        of shape, stride and dtype. The layout (alignment, bounds, overlaps) is
        :func:`validate_layout`'s. Takes ownership of ``obj`` (the parsed JSON)."""
        if not isinstance(obj, dict):
            raise LayoutError(f"{where}: tensors must be an object, found {type(obj).__name__}")
        names = list(obj)
        rows = list(obj.values())
        n = len(rows)

        def path_of(j: int) -> str:
            return f"tensors.{names[j]}"

        bad = _first_not(rows, (dict,))
        if bad is not None:
            raise LayoutError(f"{where}: {path_of(bad)} must be an object, found {type(rows[bad]).__name__}")

        def unknown_dtype(j, name):
            raise LayoutError(f"{where}: tensor {names[j]!r}: unsupported dtype {name!r}; "
                              f"supported: {', '.join(DTYPES)}")

        def unknown_region(j, name):
            raise LayoutError(f"{where}: tensor {names[j]!r} has region {name!r}; known: {', '.join(REGIONS)}")

        dtype_codes = _codes(rows, "dtype", _DTYPE_CODE, where, path_of, unknown_dtype)
        region_codes = _codes(rows, "region", _REGION_CODE, where, path_of, unknown_region)
        shapes, ndim, shape_flat = _dims(rows, "shape", where, path_of)
        strides, ndim_s, stride_flat = _dims(rows, "stride", where, path_of)
        bad = _first(ndim != ndim_s)
        if bad is not None:
            raise LayoutError(f"{where}: tensor {names[bad]!r} has shape {shapes[bad]} but stride {strides[bad]}")
        # Optional fields: absent and null both mean "none" (as _Fields.get(optional=True)). Rows
        # with just the six common keys (most tables) have neither.
        recorded = _gather(rows, "nbytes")
        plain = recorded.count(None) == 0 and set(map(len, rows)) <= {6}
        shards = None if plain else _gather(rows, "shard")
        shard_rows = [j for j, v in enumerate(shards) if v is not None] if shards and shards.count(None) != n else []
        shard_dims = _check_shards(shards, shard_rows, where, path_of) if shard_rows else None
        parts = {}
        parts_col = None if plain else _gather(rows, "parts")
        if parts_col and parts_col.count(None) != n:
            for j, v in enumerate(parts_col):
                if v is None:
                    continue
                if type(v) is not list:  # rare (SGLang's stacked projections): parsed one by one
                    raise LayoutError(f"{where}: field {path_of(j) + '.parts'!r} must be list, found {v!r}")
                if v:
                    parts[j] = tuple(Part.from_dict(_Fields(p, where, f"{path_of(j)}.parts")) for p in v)
        offsets = _ints(rows, "offset", 0, where, path_of)
        if shard_dims is not None:
            owner, dims = shard_dims
            bad = _first(dims >= ndim[owner])
            if bad is not None:
                j = int(owner[bad])
                raise LayoutError(f"{where}: tensor {names[j]!r}: shard dim {int(dims[bad])} but the tensor has "
                                  f"{int(ndim[j])} dims")
        itemsize = _ITEMSIZE[dtype_codes]
        nbytes, estimate = _spans(ndim, shape_flat, stride_flat, itemsize)
        bad = _first(estimate > MAX_IMAGE_NBYTES)
        if bad is not None:
            exact = span_elems(tuple(shapes[bad]), tuple(strides[bad])) * int(itemsize[bad])
            raise LayoutError(f"{where}: tensor {names[bad]!r}: shape {shapes[bad]} and stride {strides[bad]} of "
                              f"{DTYPE_NAMES[dtype_codes[bad]]} span {exact:,} bytes, more than an image may hold "
                              f"({MAX_IMAGE_NBYTES:,})")
        missing = recorded.count(None)  # nbytes is optional: checked where given
        if missing == 0:
            given, column = None, _ints(rows, "nbytes", 0, where, path_of, recorded)
            bad = _first(column != nbytes)
        elif missing < n:
            given = [j for j, v in enumerate(recorded) if v is not None]
            column = _ints([rows[j] for j in given], "nbytes", 0, where, lambda k: path_of(given[k]),
                           [recorded[j] for j in given])
            bad = _first(column != nbytes[given])
        else:
            bad = None
        if bad is not None:
            j = bad if given is None else given[bad]
            raise LayoutError(f"{where}: tensor {names[j]!r} records nbytes {recorded[j]:,} but shape "
                              f"{shapes[j]}, stride {strides[j]} and {DTYPE_NAMES[dtype_codes[j]]} span "
                              f"{int(nbytes[j]):,} bytes")
        return cls(names, offsets, nbytes, dtype_codes, region_codes, shapes, strides, shards if shard_rows else None,
                   parts)

    # ---- columns
    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each tensor's shape as a tuple (built from the columns on first use)."""
        if self._shapes is None:
            self._shapes = tuple(self._dims.rows(self._dims.shapes))
        return self._shapes

    @property
    def strides(self) -> tuple[tuple[int, ...], ...]:
        """Each tensor's stride in elements, as a tuple (built from the columns on first use)."""
        if self._strides is None:
            self._strides = tuple(self._dims.rows(self._dims.strides))
        return self._strides

    def dim_columns(self) -> "DimColumns":
        """Shapes and strides as int64 columns (what bulk consumers such as the views want)."""
        if self._dims is None:
            self._dims = DimColumns.of(self._shapes, self._strides)
        return self._dims

    @property
    def ends(self) -> np.ndarray:
        """One past each tensor's last byte."""
        return self.offsets + self.nbytes

    @property
    def itemsizes(self) -> np.ndarray:
        return _ITEMSIZE[self.dtype_codes]

    def dtypes(self) -> set[str]:
        """The dtype names the table uses."""
        # bincount, not np.unique: unique's first call imports numpy.ma (~10-40 ms in a fresh process)
        return {DTYPE_NAMES[c] for c in np.flatnonzero(np.bincount(self.dtype_codes, minlength=1)).tolist()}

    def shard_of(self, i: int) -> tuple[Split, ...]:
        raw = None if self._shards is None else self._shards[i]
        if not raw:
            return ()
        if isinstance(raw, tuple):
            return raw
        return tuple(_split(s["dim"], s["index"], s["count"], s["blocks"]) for s in raw)

    def parts_of(self, i: int) -> tuple[Part, ...]:
        return self._parts.get(i, ())

    # ---- the mapping
    def entries(self) -> list[TensorEntry]:
        """Every entry, in table order (built on first use)."""
        if self._entries is None:
            n = len(self.names)
            dtypes = map(DTYPE_NAMES.__getitem__, self.dtype_codes.tolist())
            regions = map(REGIONS.__getitem__, self.region_codes.tolist())
            plain = self._shards is None and not self._parts
            shards = repeat((), n) if plain else map(self.shard_of, range(n))
            parts = repeat((), n) if plain else map(self.parts_of, range(n))
            with gc_paused():
                self._entries = list(map(_entry, self.names, self.offsets.tolist(), self.shapes, self.strides,
                                         dtypes, regions, shards, parts, self.nbytes.tolist()))
        return self._entries

    def index(self, name: str) -> int:
        """Position of ``name`` in the table (KeyError if absent)."""
        if self._index is None:
            self._index = dict(zip(self.names, range(len(self.names))))
        return self._index[name]

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries()[self.index(name)]

    def __contains__(self, name: object) -> bool:
        try:
            self.index(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors, {int(self.nbytes.sum()):,} bytes)"

    def __reduce__(self):  # pickle and copy: rebuilt (and frozen) by the constructor, entries not carried
        dims = self._dims if self._shapes is None else self._shapes
        return (TensorTable, (self.names, self.offsets, self.nbytes, self.dtype_codes, self.region_codes, dims,
                              self._strides, self._shards, self._parts))


def _frozen(a) -> np.ndarray:
    a = np.asarray(a)
    a.flags.writeable = False
    return a


def _check_shards(shards: list, rows: list[int], where: str, path_of) -> tuple[np.ndarray, np.ndarray]:
    """Validate the ``shard`` lists of tensors ``rows`` in bulk (as :meth:`Split.from_dict` would);
    returns (owning tensor, dim) of every split for the caller's dim-vs-ndim check."""
    values = [shards[j] for j in rows]
    bad = _first_not(values, (list,))
    if bad is not None:
        raise LayoutError(f"{where}: field {path_of(rows[bad]) + '.shard'!r} must be list, found {values[bad]!r}")
    counts = np.fromiter(map(len, values), np.int64, len(values))
    owner = np.repeat(np.asarray(rows, dtype=np.int64), counts)
    splits = list(chain.from_iterable(values))

    def split_path(k: int) -> str:
        return f"{path_of(int(owner[k]))}.shard"

    bad = _first_not(splits, (dict,))
    if bad is not None:
        raise LayoutError(f"{where}: {split_path(bad)} must be an object, found {type(splits[bad]).__name__}")
    cols = {key: _ints(splits, key, minimum, where, split_path)
            for key, minimum in (("dim", 0), ("index", 0), ("count", 1), ("blocks", 1))}
    bad = _first(cols["index"] >= cols["count"])
    if bad is not None:
        raise LayoutError(f"{where}: {split_path(bad)}: index {int(cols['index'][bad])} >= count "
                          f"{int(cols['count'][bad])}")
    return owner, cols["dim"]
