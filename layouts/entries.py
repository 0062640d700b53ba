"""The low pieces of the image format that the rest of it builds on: the dtypes, the regions
and alignments, the strict dict access (:class:`_Fields`), the per-tensor dataclasses
(:class:`TensorEntry` and its :class:`Split` / :class:`Part`, :class:`ParallelLayout`,
:class:`Region`) and small helpers. :mod:`flashboot.layouts.format` re-exports every name here.
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flashboot.errors import LayoutError

TENSOR_ALIGNMENT = 256
"""Every tensor starts at a multiple of this many bytes (covers every dtype's alignment)."""
SEPARATOR_ALIGNMENT = 4096
"""The experts | non-experts separator, and the image size, are multiples of this."""
REGIONS = ("experts", "non_experts")
MAX_WORLD_SIZE = 1 << 16
"""The most ranks one pre-pack job writes (a 72-GPU rack at tp x ep is ~10^2)."""


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
    """Sort key that orders ``layers.2`` before ``layers.10``. The split's odd parts are the
    digit runs: ``str.isdigit`` had also taken a run of superscripts (``"1²"`` leaves ``"²"``),
    and ``int("²")`` raised ValueError out of every family's plan."""
    return tuple(int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name)))


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
        if first.world_size > MAX_WORLD_SIZE:  # a typo's 10^8 ranks exhausted memory here
            raise LayoutError(f"tp={tp_size}, ep={ep_size} make {first.world_size:,} ranks; an image job holds at "
                              f"most {MAX_WORLD_SIZE:,}")
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


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict:
        return {"offset": self.offset, "nbytes": self.nbytes}


@contextmanager
def gc_paused(*, promote: bool = False):
    """Hold off the cyclic garbage collector for a bulk allocation that builds no reference cycles.

    Parsing 10^4 tensors allocates ~10^5 containers (and making their views 10^4 tensors); in a
    process that holds torch, the collections they trigger walk its heap: ``json.loads`` of
    checkpoint B's metadata ran 2-4x slower, and a full collection in the middle of making the
    views cost 100-200 ms (measured on the host backend).

    ``promote``: on exit, move what the block made (and every other object still young) straight
    to the oldest generation, where only a full collection examines it: ``gc.freeze()`` then
    ``gc.unfreeze()``, two list splices. Otherwise the first allocation after the block walks every
    new object in a young collection, and later ones walk them again on their way there: B's
    18,722 views cost 2.5-5.6 ms in that first walk alone (host backend, 2 cores), ~0.1 ms promoted.
    Skipped where the process has frozen objects itself (an engine's ``gc.freeze()``): unfreezing
    would hand them back to the collector."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if promote and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()
