"""The pre-packed image format, version 1: the metadata's dataclasses, the offset layout and
the strict parsing of ``metadata.json``. ``layouts/FORMAT.md`` is the prose description.

Every dataclass here validates itself when built from a dict (:meth:`from_dict`) and raises
:class:`~flashboot.errors.LayoutError` naming the file and the field; nothing is trusted
because it parsed as JSON.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

import numpy as np

from flashboot._json import loads
from flashboot.errors import LayoutError

FORMAT_NAME = "flashboot-image"
FORMAT_VERSION = 1
JOB_FORMAT_NAME = "flashboot-prepack"

TENSOR_ALIGNMENT = 256
"""Every tensor starts at a multiple of this many bytes (covers every dtype's alignment)."""
SEPARATOR_ALIGNMENT = 4096
"""The experts | non-experts separator, and the image size, are multiples of this."""
DEFAULT_CHUNK_BYTES = 64 << 20
CHECKSUM_ALGORITHM = "flashboot-checksum-v1"
"""The digest of ``flashboot.kernels.checksum_spec.checksum_reference``, per chunk."""

_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
"""What ``image.file`` may be: one portable file name (no path, no byte the filesystem may refuse)."""
REGIONS = ("experts", "non_experts")
IMAGE_FILE = "image.bin"
METADATA_FILE = "metadata.json"
JOB_FILE = "prepack.json"
TARGETS = ("transformers", "sglang")


@dataclass(frozen=True)
class DType:
    """One supported element type: its name here (= torch's), safetensors' code, size."""

    name: str
    safetensors: str
    itemsize: int


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", "F64", 8), DType("float32", "F32", 4), DType("float16", "F16", 2),
        DType("bfloat16", "BF16", 2), DType("float8_e4m3fn", "F8_E4M3", 1),
        DType("float8_e5m2", "F8_E5M2", 1), DType("int64", "I64", 8), DType("int32", "I32", 4),
        DType("int16", "I16", 2), DType("int8", "I8", 1), DType("uint8", "U8", 1),
        DType("bool", "BOOL", 1),
    )
}
"""Element types an image may hold, by name. Anything else is refused (LayoutError)."""
DTYPES_BY_SAFETENSORS = {d.safetensors: d for d in DTYPES.values()}


def dtype_of(name: str, where: str) -> DType:
    """The :class:`DType` called ``name``; LayoutError listing the supported ones otherwise."""
    d = DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise LayoutError(f"{where}: unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return d


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def natural_key(name: str) -> tuple:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def contiguous_stride(shape: Iterable[int]) -> tuple[int, ...]:
    """C-order strides, in elements."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def span_elems(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to one past the last element a strided view touches."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


# -------------------------------------------------------------------------- strict dict access
class _Fields:
    """Typed access to a JSON object, naming the file and the dotted field on any mismatch."""

    def __init__(self, obj: Any, where: str, path: str):
        if not isinstance(obj, dict):
            raise LayoutError(f"{where}: {path or 'metadata'} must be an object, found {type(obj).__name__}")
        self.obj, self.where, self.path = obj, where, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, types, *, optional: bool = False, default: Any = None):
        if key not in self.obj:
            if optional:
                return default
            raise LayoutError(f"{self.where}: missing field {self._name(key)!r}")
        value = self.obj[key]
        if optional and value is None:
            return default
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _tuple(types))
        if not ok:
            names = "/".join(t.__name__ for t in _tuple(types))
            raise LayoutError(f"{self.where}: field {self._name(key)!r} must be {names}, found {value!r}")
        return value

    def int(self, key: str, *, minimum: int | None = 0, optional: bool = False) -> int:
        value = self.get(key, int, optional=optional)
        if value is not None and minimum is not None and value < minimum:
            raise LayoutError(f"{self.where}: field {self._name(key)!r} must be >= {minimum}, found {value}")
        return value

    def ints(self, key: str) -> tuple[int, ...]:
        value = self.get(key, list)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise LayoutError(f"{self.where}: field {self._name(key)!r} must be a list of ints >= 0, found {value!r}")
        return tuple(value)

    def sub(self, key: str, *, optional: bool = False) -> "_Fields | None":
        value = self.get(key, dict, optional=optional)
        return None if value is None else _Fields(value, self.where, self._name(key))


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


# ------------------------------------------------------------------------------- the dataclasses
@dataclass(frozen=True)
class ParallelLayout:
    """Which slice of the model one rank holds.

    ``world_size = max(tp, ep)`` ranks; the smaller of ``tp`` and ``ep`` must divide the larger.
    Attention and dense layers are split ``tp`` ways (``tp_rank = rank % tp``; with ``ep > tp``
    each attention shard is replicated, SGLang's DP-attention). Experts are split ``ep`` ways in
    contiguous blocks (``ep_rank = rank // moe_tp_size``) and each expert's intermediate
    dimension ``moe_tp_size = world_size // ep`` ways (``moe_tp_rank = rank % moe_tp_size``).
    """

    rank: int
    tp_size: int = 1
    ep_size: int = 1

    def __post_init__(self):
        for name in ("tp_size", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"{name} must be an int >= 1, got {v!r}")
        big, small = max(self.tp_size, self.ep_size), min(self.tp_size, self.ep_size)
        if big % small:
            raise LayoutError(
                f"tp={self.tp_size} and ep={self.ep_size}: the smaller must divide the larger "
                f"(ranks = max(tp, ep))")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world_size:
            raise LayoutError(f"rank {self.rank!r} is outside 0..{self.world_size - 1} (tp={self.tp_size}, ep={self.ep_size})")

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def moe_tp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @classmethod
    def all_ranks(cls, tp_size: int = 1, ep_size: int = 1) -> list["ParallelLayout"]:
        first = cls(0, tp_size, ep_size)
        return [cls(r, tp_size, ep_size) for r in range(first.world_size)]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "ep_rank": self.ep_rank, "ep_size": self.ep_size,
                "moe_tp_rank": self.moe_tp_rank, "moe_tp_size": self.moe_tp_size}

    @classmethod
    def from_dict(cls, f: _Fields) -> "ParallelLayout":
        p = cls(f.int("rank"), f.int("tp_size", minimum=1), f.int("ep_size", minimum=1))
        for key, value in p.to_dict().items():
            if f.get(key, int) != value:
                raise LayoutError(f"{f.where}: parallel.{key} is {f.obj[key]} but rank {p.rank} with "
                                  f"tp={p.tp_size}, ep={p.ep_size} implies {value}")
        return p


@dataclass(frozen=True)
class Split:
    """How one rank's tensor is cut from the full one along ``dim``: the full dimension is
    ``blocks`` equal blocks (2 for a fused gate|up), each cut into ``count`` equal pieces, and
    this rank holds piece ``index`` of every block, concatenated in block order."""

    dim: int
    index: int
    count: int
    blocks: int = 1

    def to_dict(self) -> dict:
        return {"dim": self.dim, "index": self.index, "count": self.count, "blocks": self.blocks}

    @classmethod
    def from_dict(cls, f: _Fields) -> "Split":
        s = cls(f.int("dim"), f.int("index"), f.int("count", minimum=1), f.int("blocks", minimum=1))
        if s.index >= s.count:
            raise LayoutError(f"{f.where}: {f.path}: index {s.index} >= count {s.count}")
        return s


@dataclass(frozen=True)
class Part:
    """A logically separate tensor fused into rows ``start:stop`` (dim 0) of an image tensor,
    e.g. ``q_proj.weight`` inside SGLang's ``qkv_proj.weight``."""

    name: str
    start: int
    stop: int
    shard: tuple[Split, ...] = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "start": self.start, "stop": self.stop,
                "shard": [s.to_dict() for s in self.shard]}

    @classmethod
    def from_dict(cls, f: _Fields) -> "Part":
        shard = tuple(Split.from_dict(_Fields(s, f.where, f"{f.path}.shard")) for s in f.get("shard", list))
        p = cls(f.get("name", str), f.int("start"), f.int("stop"), shard)
        if p.stop < p.start:
            raise LayoutError(f"{f.where}: {f.path}: stop {p.stop} < start {p.start}")
        return p


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the image: ``offset`` bytes from the image's start, ``shape`` and
    ``stride`` in elements, ``dtype``, ``region``; ``shard`` says which slice of the full tensor
    it is (empty: the whole tensor), ``parts`` which logical tensors it fuses (empty: none).
    ``nbytes``, the tensor's span in bytes, is computed once when the entry is made."""

    name: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    region: str
    shard: tuple[Split, ...] = ()
    parts: tuple[Part, ...] = ()
    nbytes: int = field(init=False, repr=False, compare=False)
    """Bytes from the first to one past the last byte of the tensor (its span)."""

    def __post_init__(self):
        itemsize = dtype_of(self.dtype, f"tensor {self.name!r}").itemsize
        object.__setattr__(self, "nbytes", span_elems(self.shape, self.stride) * itemsize)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict:
        d = {"offset": self.offset, "nbytes": self.nbytes, "shape": list(self.shape),
             "stride": list(self.stride), "dtype": self.dtype, "region": self.region}
        if self.shard:
            d["shard"] = [s.to_dict() for s in self.shard]
        if self.parts:
            d["parts"] = [p.to_dict() for p in self.parts]
        return d


_new, _set = object.__new__, object.__setattr__


def _entry(name, offset, shape, stride, dtype, region, shard, parts, nbytes) -> TensorEntry:
    """A TensorEntry from values a :class:`TensorTable` has already validated (nbytes included)."""
    e = _new(TensorEntry)
    _set(e, "name", name)
    _set(e, "offset", offset)
    _set(e, "shape", shape)
    _set(e, "stride", stride)
    _set(e, "dtype", dtype)
    _set(e, "region", region)
    _set(e, "shard", shard)
    _set(e, "parts", parts)
    _set(e, "nbytes", nbytes)
    return e


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
    def from_entries(cls, entries: Mapping[str, TensorEntry]) -> "TensorTable":
        """The table of ``entries`` (as :func:`compute_layout` makes them)."""
        es = list(entries.values())
        names = list(entries)
        for name, e in zip(names, es):
            if e.name != name:
                raise LayoutError(f"tensor table: entry {e.name!r} filed under {name!r}")
            if e.region not in _REGION_CODE:
                raise LayoutError(f"tensor {name!r} has region {e.region!r}; known: {', '.join(REGIONS)}")
        n = len(es)
        shards = [e.shard or None for e in es]
        reuse = all(type(e.shape) is tuple and type(e.stride) is tuple for e in es)
        return cls(names, np.fromiter((e.offset for e in es), np.int64, n),
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


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict:
        return {"offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True)
class ChecksumTable:
    """Digest of every ``chunk_bytes`` piece of the image (the last one may be short)."""

    chunk_bytes: int
    digests: tuple[int, ...]
    algorithm: str = CHECKSUM_ALGORITHM

    def chunk_range(self, index: int, image_nbytes: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(self.chunk_bytes, image_nbytes - start)

    def to_dict(self) -> dict:
        return {"algorithm": self.algorithm, "chunk_bytes": self.chunk_bytes,
                "chunks": [f"{d:016x}" for d in self.digests]}

    @classmethod
    def from_dict(cls, f: _Fields) -> "ChecksumTable":
        algorithm = f.get("algorithm", str)
        if algorithm != CHECKSUM_ALGORITHM:
            raise LayoutError(f"{f.where}: checksum algorithm {algorithm!r}; this flashboot knows {CHECKSUM_ALGORITHM!r}")
        digests = []
        for i, text in enumerate(f.get("chunks", list)):
            if not isinstance(text, str) or not re.fullmatch(r"[0-9a-f]{16}", text):
                raise LayoutError(f"{f.where}: checksums.chunks[{i}] must be 16 hex digits, found {text!r}")
            digests.append(int(text, 16))
        return cls(f.int("chunk_bytes", minimum=1), tuple(digests), algorithm)


@dataclass(frozen=True)
class ImageKey:
    """What an image was made from and for. A load that expects another key is refused.

    ``digest`` is a hash of the other fields, so a hand-edited key is caught too.
    """

    model_id: str
    revision: str | None
    config_hash: str
    family: str
    target: str
    tp_size: int
    ep_size: int
    dtypes: tuple[str, ...]
    format_version: int = FORMAT_VERSION

    FIELDS = ("model_id", "revision", "config_hash", "family", "target", "tp_size", "ep_size",
              "dtypes", "format_version")

    def fields(self) -> dict:
        return {k: (list(getattr(self, k)) if k == "dtypes" else getattr(self, k)) for k in self.FIELDS}

    @property
    def digest(self) -> str:
        blob = json.dumps(self.fields(), sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    def to_dict(self) -> dict:
        return {**self.fields(), "digest": self.digest}

    def describe(self) -> str:
        return (f"{self.model_id}@{self.revision or '?'} ({self.config_hash[:19]}, {self.family}/{self.target}, "
                f"tp={self.tp_size}, ep={self.ep_size}, {'+'.join(self.dtypes)})")

    def mismatches(self, expected: "ImageKey | Mapping[str, Any]") -> list[tuple[str, Any, Any]]:
        """(field, expected, recorded) for every field ``expected`` names that differs.
        A mapping may name a subset of the fields (what the caller knows)."""
        want = expected.fields() if isinstance(expected, ImageKey) else dict(expected)
        unknown = set(want) - set(self.FIELDS) - {"digest"}
        if unknown:
            raise LayoutError(f"expected key names unknown fields {sorted(unknown)}; known: {', '.join(self.FIELDS)}")
        have = self.to_dict()
        out = []
        for k, v in want.items():
            v = list(v) if isinstance(v, tuple) else v
            if have[k] != v:
                out.append((k, v, have[k]))
        return out

    @classmethod
    def from_dict(cls, f: _Fields) -> "ImageKey":
        dtypes = f.get("dtypes", list)
        for d in dtypes:
            dtype_of(d, f"{f.where}: key.dtypes")
        key = cls(f.get("model_id", str), f.get("revision", str, optional=True), f.get("config_hash", str),
                  f.get("family", str), f.get("target", str), f.int("tp_size", minimum=1),
                  f.int("ep_size", minimum=1), tuple(dtypes), f.int("format_version"))
        recorded = f.get("digest", str)
        if recorded != key.digest:
            raise LayoutError(f"{f.where}: key digest {recorded} does not match its fields ({key.digest}); "
                              "the key was edited or damaged")
        return key


@dataclass(frozen=True)
class SourceInfo:
    """The checkpoint an image was made from."""

    path: str
    model_id: str
    revision: str | None
    config_hash: str
    model_type: str | None

    def to_dict(self) -> dict:
        return {"path": self.path, "model_id": self.model_id, "revision": self.revision,
                "config_hash": self.config_hash, "model_type": self.model_type}

    @classmethod
    def from_dict(cls, f: _Fields) -> "SourceInfo":
        return cls(f.get("path", str), f.get("model_id", str), f.get("revision", str, optional=True),
                   f.get("config_hash", str), f.get("model_type", str, optional=True))


@dataclass(frozen=True)
class FamilyInfo:
    """The family rules used; ``fallback`` is true where the model type had none (generic)."""

    name: str
    model_type: str | None
    fallback: bool = False
    warning: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "model_type": self.model_type, "fallback": self.fallback,
                "warning": self.warning}

    @classmethod
    def from_dict(cls, f: _Fields) -> "FamilyInfo":
        return cls(f.get("name", str), f.get("model_type", str, optional=True), f.get("fallback", bool),
                   f.get("warning", str, optional=True))


@dataclass(frozen=True)
class ExpertMap:
    """This rank's routed experts: global ids ``local_start .. local_start + local_count - 1``;
    a global id ``g`` is local index ``g - local_start``."""

    num_experts: int
    local_start: int
    local_count: int

    def local_index(self, global_id: int) -> int:
        if not self.local_start <= global_id < self.local_start + self.local_count:
            raise LayoutError(f"expert {global_id} is not on this rank (holds {self.local_start}.."
                              f"{self.local_start + self.local_count - 1})")
        return global_id - self.local_start

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "local_start": self.local_start, "local_count": self.local_count}

    @classmethod
    def from_dict(cls, f: _Fields) -> "ExpertMap":
        m = cls(f.int("num_experts", minimum=1), f.int("local_start"), f.int("local_count", minimum=1))
        if m.local_start + m.local_count > m.num_experts:
            raise LayoutError(f"{f.where}: experts {m.local_start}+{m.local_count} exceed num_experts {m.num_experts}")
        return m


@dataclass(frozen=True)
class ImageMetadata:
    """Everything ``metadata.json`` records about one rank's image (see FORMAT.md)."""

    flashboot_version: str
    job_id: str
    source: SourceInfo
    family: FamilyInfo
    target: str
    parallel: ParallelLayout
    experts: ExpertMap | None
    image_file: str
    image_nbytes: int
    regions: dict[str, Region]
    tensors: TensorTable
    """Name -> :class:`TensorEntry` (a :class:`TensorTable`; a plain dict given here becomes one)."""
    checksums: ChecksumTable
    key: ImageKey
    tensor_alignment: int = TENSOR_ALIGNMENT
    separator_alignment: int = SEPARATOR_ALIGNMENT
    format_version: int = FORMAT_VERSION
    warnings: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.tensors, TensorTable):
            object.__setattr__(self, "tensors", TensorTable.from_entries(self.tensors))

    @property
    def separator(self) -> int:
        """Byte offset where the non-expert region starts (= expert region size)."""
        return self.regions["non_experts"].offset

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "flashboot_version": self.flashboot_version,
            "job_id": self.job_id,
            "source": self.source.to_dict(),
            "family": self.family.to_dict(),
            "target": self.target,
            "parallel": self.parallel.to_dict(),
            "experts": self.experts.to_dict() if self.experts else None,
            "alignment": {"tensor_bytes": self.tensor_alignment, "separator_bytes": self.separator_alignment},
            "image": {"file": self.image_file, "nbytes": self.image_nbytes},
            "regions": {name: self.regions[name].to_dict() for name in REGIONS},
            "checksums": self.checksums.to_dict(),
            "key": self.key.to_dict(),
            "warnings": list(self.warnings),
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
        }

    def to_json(self) -> str:
        """Indented JSON with one line per tensor (tables of ~10^4 tensors stay readable)."""
        d = self.to_dict()
        tensors = d.pop("tensors")
        head = json.dumps(d, indent=1)
        rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in tensors.items())
        return head[:-2] + ',\n "tensors": {\n' + rows + ("\n }\n}\n" if rows else " }\n}\n")

    @classmethod
    def from_dict(cls, obj: Any, where: str, tensors: "TensorTable | None" = None) -> "ImageMetadata":
        """Parse and validate (everything that needs no file: see :func:`validate_layout`).
        ``tensors``: the table, already decoded and checked (from ``tensors.bin``); ``obj``'s own is
        then ignored."""
        f = _Fields(obj, where, "")
        fmt = f.get("format", str)
        if fmt != FORMAT_NAME:
            raise LayoutError(f"{where}: format {fmt!r} is not {FORMAT_NAME!r}")
        version = f.int("format_version")
        if version != FORMAT_VERSION:
            raise LayoutError(f"{where}: format version {version}; this flashboot reads version {FORMAT_VERSION} "
                              "(re-run flashboot prepack with this version)")
        target = f.get("target", str)
        if target not in TARGETS:
            raise LayoutError(f"{where}: target {target!r}; known: {', '.join(TARGETS)}")
        align = f.sub("alignment")
        image = f.sub("image")
        regions_f = f.sub("regions")
        regions = {}
        for name in REGIONS:
            r = regions_f.sub(name)
            regions[name] = Region(r.int("offset"), r.int("nbytes"))
        extra = set(regions_f.obj) - set(REGIONS)
        if extra:
            raise LayoutError(f"{where}: unknown regions {sorted(extra)}; known: {', '.join(REGIONS)}")
        if tensors is None:
            tensors = TensorTable.from_json(f.get("tensors", dict), where)
        experts_f = f.sub("experts", optional=True)
        meta = cls(
            flashboot_version=f.get("flashboot_version", str),
            job_id=f.get("job_id", str),
            source=SourceInfo.from_dict(f.sub("source")),
            family=FamilyInfo.from_dict(f.sub("family")),
            target=target,
            parallel=ParallelLayout.from_dict(f.sub("parallel")),
            experts=ExpertMap.from_dict(experts_f) if experts_f else None,
            image_file=image.get("file", str),
            image_nbytes=image.int("nbytes"),
            regions=regions,
            tensors=tensors,
            checksums=ChecksumTable.from_dict(f.sub("checksums")),
            key=ImageKey.from_dict(f.sub("key")),
            tensor_alignment=align.int("tensor_bytes", minimum=1),
            separator_alignment=align.int("separator_bytes", minimum=1),
            format_version=version,
            warnings=tuple(f.get("warnings", list, optional=True, default=[])),
        )
        bad = _first_not(list(meta.warnings), (str,))
        if bad is not None:
            raise LayoutError(f"{where}: warnings[{bad}] must be str, found {meta.warnings[bad]!r}")
        if not _PLAIN_FILE_NAME.fullmatch(meta.image_file) or meta.image_file in (".", ".."):
            raise LayoutError(f"{where}: image.file {meta.image_file[:300]!r} must be a plain file name "
                              "(1-255 of A-Z a-z 0-9 . _ -)")
        validate_layout(meta, where)
        return meta


def validate_layout(meta: ImageMetadata, where: str) -> None:
    """The layout invariants of FORMAT.md, checked on the metadata alone (no file needed):
    alignment, regions tiling the image, every tensor inside its region, no two overlapping,
    checksums covering the image, the key agreeing with the rest. Vectorised over the tensor
    table's columns: 10^4 tensors in a few milliseconds."""
    ta, sa = meta.tensor_alignment, meta.separator_alignment
    # Bounded above too: the checks below take int64 remainders by these.
    if not TENSOR_ALIGNMENT <= ta <= MAX_IMAGE_NBYTES or ta & (ta - 1):
        raise LayoutError(f"{where}: tensor alignment {ta} must be a power of two in {TENSOR_ALIGNMENT}..2**56")
    if not SEPARATOR_ALIGNMENT <= sa <= MAX_IMAGE_NBYTES or sa & (sa - 1):
        raise LayoutError(f"{where}: separator alignment {sa} must be a power of two in {SEPARATOR_ALIGNMENT}..2**56")
    if meta.image_nbytes > MAX_IMAGE_NBYTES:
        raise LayoutError(f"{where}: image size {meta.image_nbytes:,} exceeds the largest supported, "
                          f"{MAX_IMAGE_NBYTES:,} bytes")
    ex, ne = meta.regions["experts"], meta.regions["non_experts"]
    if ex.offset != 0:
        raise LayoutError(f"{where}: region experts starts at {ex.offset:,}, expected 0")
    if ne.offset != ex.end:
        raise LayoutError(f"{where}: region non_experts starts at {ne.offset:,}, expected {ex.end:,} "
                          "(the end of the experts region)")
    if ne.offset % sa:
        raise LayoutError(f"{where}: separator {ne.offset:,} is not a multiple of {sa} bytes")
    if ne.end != meta.image_nbytes:
        raise LayoutError(f"{where}: regions end at {ne.end:,} but the image is {meta.image_nbytes:,} bytes")
    if meta.image_nbytes % sa:
        raise LayoutError(f"{where}: image size {meta.image_nbytes:,} is not a multiple of {sa} bytes")
    tab: TensorTable = meta.tensors
    names, offsets, nbytes = tab.names, tab.offsets, tab.nbytes
    bad = _first((offsets % ta != 0) | (offsets % tab.itemsizes != 0))
    if bad is not None:
        raise LayoutError(f"{where}: tensor {names[bad]!r} at offset {int(offsets[bad]):,} is not aligned to {ta} bytes")
    # Spans are <= MAX_IMAGE_NBYTES (TensorTable.from_json); clamping offsets keeps the ends exact in int64.
    ends = np.minimum(offsets, MAX_IMAGE_NBYTES + 1) + nbytes
    region_start = np.array([meta.regions[r].offset for r in REGIONS], dtype=np.int64)[tab.region_codes]
    region_end = np.array([meta.regions[r].end for r in REGIONS], dtype=np.int64)[tab.region_codes]
    bad = _first((offsets < region_start) | (ends > region_end))
    if bad is not None:
        region = meta.regions[REGIONS[tab.region_codes[bad]]]
        start = int(offsets[bad])
        raise LayoutError(f"{where}: tensor {names[bad]!r} spans bytes {start:,}..{start + int(nbytes[bad]):,}, "
                          f"outside its region {REGIONS[tab.region_codes[bad]]} ({region.offset:,}..{region.end:,})")
    for i in sorted(tab._parts):
        shape = tab.shapes[i]
        for p in tab._parts[i]:
            if not shape or p.stop > shape[0]:
                raise LayoutError(f"{where}: tensor {names[i]!r}: part {p.name!r} rows {p.start}..{p.stop} "
                                  f"exceed the tensor's shape {list(shape)}")
    # Overlaps: sorted by (start, end), any overlap shows between neighbours. Empty tensors take no bytes.
    live = np.flatnonzero(nbytes > 0)
    order = live[np.lexsort((ends[live], offsets[live]))]
    bad = _first(offsets[order[1:]] < ends[order[:-1]])
    if bad is not None:
        a, b = int(order[bad]), int(order[bad + 1])
        if (offsets[a], ends[a]) == (offsets[b], ends[b]) and names[b] < names[a]:
            a, b = b, a
        raise LayoutError(f"{where}: tensors {names[a]!r} (bytes {int(offsets[a]):,}..{int(ends[a]):,}) and "
                          f"{names[b]!r} (bytes {int(offsets[b]):,}..{int(ends[b]):,}) overlap")
    cs = meta.checksums
    n_chunks = -(-meta.image_nbytes // cs.chunk_bytes)
    if len(cs.digests) != n_chunks:
        raise LayoutError(f"{where}: {len(cs.digests)} chunk checksums for {meta.image_nbytes:,} bytes in chunks "
                          f"of {cs.chunk_bytes:,}; expected {n_chunks}")
    p, k, e = meta.parallel, meta.key, meta.experts
    if e is not None and (e.num_experts != e.local_count * p.ep_size or e.local_start != p.ep_rank * e.local_count):
        raise LayoutError(f"{where}: experts {e.local_start}..{e.local_start + e.local_count - 1} of {e.num_experts}, "
                          f"but ep rank {p.ep_rank} of ep={p.ep_size} holds block {p.ep_rank} of {p.ep_size} equal "
                          f"blocks: num_experts must be local_count x ep ({e.local_count * p.ep_size}) and local_start "
                          f"{p.ep_rank * e.local_count}")
    for field_name, recorded, implied in (("tp_size", k.tp_size, p.tp_size), ("ep_size", k.ep_size, p.ep_size),
                                          ("family", k.family, meta.family.name), ("target", k.target, meta.target),
                                          ("config_hash", k.config_hash, meta.source.config_hash),
                                          ("model_id", k.model_id, meta.source.model_id),
                                          ("format_version", k.format_version, meta.format_version)):
        if recorded != implied:
            raise LayoutError(f"{where}: key.{field_name} is {recorded!r} but the metadata says {implied!r}")
    dtypes = tab.dtypes()
    if not dtypes <= set(k.dtypes):
        raise LayoutError(f"{where}: tensors use dtypes {sorted(dtypes - set(k.dtypes))} missing from key.dtypes")


@contextmanager
def gc_paused():
    """Hold off the cyclic garbage collector for a bulk allocation that builds no reference cycles.

    Parsing 10^4 tensors allocates ~10^5 containers (and making their views 10^4 tensors); in a
    process that holds torch, the collections they trigger walk its heap: ``json.loads`` of
    checkpoint B's metadata ran 2-4x slower, and a full collection in the middle of making the
    views cost 100-200 ms (measured on the host backend)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_metadata(raw: bytes | str, where: str, table: bytes | None = None, table_where: str = "",
                   metadata_sha256: str | None = None) -> ImageMetadata:
    """The text of a ``metadata.json`` -> validated :class:`ImageMetadata` (LayoutError naming ``where``).

    ``table``: the bytes of the ``tensors.bin`` beside it (:mod:`flashboot.layouts.table`): the
    tensor table then comes from its columns and only the rest of the JSON is parsed;
    ``metadata_sha256``: the hex sha256 of ``raw`` where the caller computed it already."""
    tensors = None
    if table is not None:
        from .table import decode_table

        raw = raw.encode() if isinstance(raw, str) else raw
        tensors, (start, end) = decode_table(table, raw, table_where or where, metadata_sha256)
        raw = raw[:start] + b"{}" + raw[end:]
    with gc_paused():
        obj = loads(raw, where, LayoutError)
        try:
            return ImageMetadata.from_dict(obj, where, tensors)
        finally:
            del obj  # freed before the collector resumes, which would otherwise walk all of it once


# --------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class LayoutSlot:
    """A tensor to place: name, dtype, shape, region (plus shard/parts carried into the entry)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    region: str
    shard: tuple[Split, ...] = ()
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True)
class Layout:
    """Offsets for every tensor, the two regions and the image size."""

    tensors: dict[str, TensorEntry]
    regions: dict[str, Region]
    image_nbytes: int
    expert_nbytes: int = field(default=0)
    """Bytes of expert tensors proper (without alignment padding)."""


def compute_layout(slots: Iterable[LayoutSlot], *, tensor_alignment: int = TENSOR_ALIGNMENT,
                   separator_alignment: int = SEPARATOR_ALIGNMENT) -> Layout:
    """Place tensors as ``[experts | non-experts]``: each region in the order given, each tensor
    at the next multiple of ``tensor_alignment``, the separator and the image end rounded up to
    ``separator_alignment``. C-contiguous strides."""
    by_region: dict[str, list[LayoutSlot]] = {r: [] for r in REGIONS}
    seen = set()
    for s in slots:
        if s.region not in by_region:
            raise LayoutError(f"tensor {s.name!r}: region {s.region!r}; known: {', '.join(REGIONS)}")
        if s.name in seen:
            raise LayoutError(f"tensor {s.name!r} placed twice")
        seen.add(s.name)
        dtype_of(s.dtype, f"tensor {s.name!r}")
        by_region[s.region].append(s)
    tensors: dict[str, TensorEntry] = {}
    regions: dict[str, Region] = {}
    cursor, start, payload = 0, 0, 0
    for region in REGIONS:
        for s in by_region[region]:
            cursor = align_up(cursor, tensor_alignment)
            t = TensorEntry(s.name, cursor, tuple(s.shape), contiguous_stride(s.shape), s.dtype, region,
                            s.shard, s.parts)
            tensors[s.name] = t
            cursor = t.end
            if region == "experts":
                payload += t.nbytes
        cursor = align_up(cursor, separator_alignment)
        regions[region] = Region(start, cursor - start)
        start = cursor
    return Layout(tensors, regions, cursor, payload)


def config_hash(config: Mapping[str, Any]) -> str:
    """``sha256:`` of the config's canonical JSON (sorted keys, no whitespace)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
