"""The pre-packed image format, version 1: the metadata's dataclasses, the offset layout and
the strict parsing of ``metadata.json``. ``layouts/FORMAT.md`` is the prose description.

Every dataclass here validates itself when built from a dict (:meth:`from_dict`) and raises
:class:`~flashboot.errors.LayoutError` naming the file and the field; nothing is trusted
because it parsed as JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

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
    d = DTYPES.get(name)
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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the image: ``offset`` bytes from the image's start, ``shape`` and
    ``stride`` in elements, ``dtype``, ``region``; ``shard`` says which slice of the full tensor
    it is (empty: the whole tensor), ``parts`` which logical tensors it fuses (empty: none)."""

    name: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    region: str
    shard: tuple[Split, ...] = ()
    parts: tuple[Part, ...] = ()

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes from the first to one past the last byte of the tensor (its span)."""
        return span_elems(self.shape, self.stride) * self.itemsize

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

    @classmethod
    def from_dict(cls, name: str, f: _Fields) -> "TensorEntry":
        dtype = f.get("dtype", str)
        dtype_of(dtype, f"{f.where}: tensor {name!r}")
        region = f.get("region", str)
        if region not in REGIONS:
            raise LayoutError(f"{f.where}: tensor {name!r} has region {region!r}; known: {', '.join(REGIONS)}")
        shape, stride = f.ints("shape"), f.ints("stride")
        if len(shape) != len(stride):
            raise LayoutError(f"{f.where}: tensor {name!r} has shape {list(shape)} but stride {list(stride)}")
        shard = tuple(Split.from_dict(_Fields(s, f.where, f"{f.path}.shard"))
                      for s in f.get("shard", list, optional=True, default=[]))
        parts = tuple(Part.from_dict(_Fields(p, f.where, f"{f.path}.parts"))
                      for p in f.get("parts", list, optional=True, default=[]))
        t = cls(name, f.int("offset"), shape, stride, dtype, region, shard, parts)
        for s in shard:
            if s.dim >= len(shape):
                raise LayoutError(f"{f.where}: tensor {name!r}: shard dim {s.dim} but the tensor has {len(shape)} dims")
        recorded = f.int("nbytes", optional=True)
        if recorded is not None and recorded != t.nbytes:
            raise LayoutError(f"{f.where}: tensor {name!r} records nbytes {recorded:,} but shape {list(shape)}, "
                              f"stride {list(stride)} and {dtype} span {t.nbytes:,} bytes")
        return t


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
    tensors: dict[str, TensorEntry]
    checksums: ChecksumTable
    key: ImageKey
    tensor_alignment: int = TENSOR_ALIGNMENT
    separator_alignment: int = SEPARATOR_ALIGNMENT
    format_version: int = FORMAT_VERSION
    warnings: tuple[str, ...] = ()

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
    def from_dict(cls, obj: Any, where: str) -> "ImageMetadata":
        """Parse and validate (everything that needs no file: see :func:`validate_layout`)."""
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
        tensors_f = f.sub("tensors")
        tensors = {name: TensorEntry.from_dict(name, tensors_f.sub(name)) for name in tensors_f.obj}
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
        if "/" in meta.image_file or meta.image_file in ("", ".", ".."):
            raise LayoutError(f"{where}: image.file {meta.image_file!r} must be a plain file name")
        validate_layout(meta, where)
        return meta


def validate_layout(meta: ImageMetadata, where: str) -> None:
    """The layout invariants of FORMAT.md, checked on the metadata alone (no file needed):
    alignment, regions tiling the image, every tensor inside its region, no two overlapping,
    checksums covering the image, the key agreeing with the rest."""
    ta, sa = meta.tensor_alignment, meta.separator_alignment
    if ta < TENSOR_ALIGNMENT or ta & (ta - 1):
        raise LayoutError(f"{where}: tensor alignment {ta} must be a power of two >= {TENSOR_ALIGNMENT}")
    if sa < SEPARATOR_ALIGNMENT or sa & (sa - 1):
        raise LayoutError(f"{where}: separator alignment {sa} must be a power of two >= {SEPARATOR_ALIGNMENT}")
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
    spans = []
    for t in meta.tensors.values():
        region = meta.regions[t.region]
        if t.offset % ta or t.offset % t.itemsize:
            raise LayoutError(f"{where}: tensor {t.name!r} at offset {t.offset:,} is not aligned to {ta} bytes")
        if t.offset < region.offset or t.end > region.end:
            raise LayoutError(f"{where}: tensor {t.name!r} spans bytes {t.offset:,}..{t.end:,}, outside its region "
                              f"{t.region} ({region.offset:,}..{region.end:,})")
        for p in t.parts:
            if not t.shape or p.stop > t.shape[0]:
                raise LayoutError(f"{where}: tensor {t.name!r}: part {p.name!r} rows {p.start}..{p.stop} "
                                  f"exceed the tensor's shape {list(t.shape)}")
        if t.nbytes:
            spans.append((t.offset, t.end, t.name))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise LayoutError(f"{where}: tensors {a!r} (bytes {a0:,}..{a1:,}) and {b!r} (bytes {b0:,}..{b1:,}) overlap")
    cs = meta.checksums
    n_chunks = -(-meta.image_nbytes // cs.chunk_bytes)
    if len(cs.digests) != n_chunks:
        raise LayoutError(f"{where}: {len(cs.digests)} chunk checksums for {meta.image_nbytes:,} bytes in chunks "
                          f"of {cs.chunk_bytes:,}; expected {n_chunks}")
    p, k = meta.parallel, meta.key
    for field_name, recorded, implied in (("tp_size", k.tp_size, p.tp_size), ("ep_size", k.ep_size, p.ep_size),
                                          ("family", k.family, meta.family.name), ("target", k.target, meta.target),
                                          ("config_hash", k.config_hash, meta.source.config_hash),
                                          ("model_id", k.model_id, meta.source.model_id),
                                          ("format_version", k.format_version, meta.format_version)):
        if recorded != implied:
            raise LayoutError(f"{where}: key.{field_name} is {recorded!r} but the metadata says {implied!r}")
    dtypes = {t.dtype for t in meta.tensors.values()}
    if not dtypes <= set(k.dtypes):
        raise LayoutError(f"{where}: tensors use dtypes {sorted(dtypes - set(k.dtypes))} missing from key.dtypes")


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
