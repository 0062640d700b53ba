"""The pre-packed image format, version 1: the metadata's dataclasses, the offset layout and
the strict parsing of ``metadata.json``. ``layouts/FORMAT.md`` is the prose description.

Every dataclass here validates itself when built from a dict (:meth:`from_dict`) and raises
:class:`~flashboot.errors.LayoutError` naming the file and the field; nothing is trusted
because it parsed as JSON.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashboot._json import loads
from flashboot.errors import LayoutError

# The format's pieces live in their own modules and are re-exported here, so every import from
# flashboot.layouts.format keeps working: entries (dtypes, dict access, per-tensor dataclasses),
# tensor_table (the tensor table and its bulk JSON checks), layout (offsets, config hash).
from .entries import (  # noqa: F401
    DTYPES, DTYPES_BY_SAFETENSORS, REGIONS, SEPARATOR_ALIGNMENT, TENSOR_ALIGNMENT, DType, ParallelLayout, Part,
    Region, Split, TensorEntry, _entry, _Fields, _new, _set, _tuple, align_up, contiguous_stride, dtype_of,
    gc_paused, natural_key, span_elems,
)
from .layout import Layout, LayoutSlot, compute_layout, config_hash  # noqa: F401
from .tensor_table import (  # noqa: F401
    _DTYPE_CODE, _ITEMSIZE, _REGION_CODE, DTYPE_NAMES, MAX_IMAGE_NBYTES, DimColumns, TensorTable, _check_shards,
    _codes, _dims, _first, _first_not, _frozen, _gather, _ints, _refuse, _spans, _split,
)

FORMAT_NAME = "flashboot-image"
FORMAT_VERSION = 1
JOB_FORMAT_NAME = "flashboot-prepack"

DEFAULT_CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 1 << 30
"""The largest checksum chunk: a check on the host reads a chunk at a time into one buffer (a
chunk of 2**50 bytes had pre-packed, then failed every verified load with MemoryError)."""
CHECKSUM_ALGORITHM = "flashboot-checksum-v1"
"""The digest of ``flashboot.kernels.checksum_spec.checksum_reference``, per chunk."""

_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
"""What ``image.file`` may be: one portable file name (no path, no byte the filesystem may refuse)."""
_CHUNK_DIGEST = re.compile(r"[0-9a-f]{16}")  # compiled at import, not in a first load
IMAGE_FILE = "image.bin"
METADATA_FILE = "metadata.json"
JOB_FILE = "prepack.json"
TARGETS = ("transformers", "sglang")


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
            if not isinstance(text, str) or not _CHUNK_DIGEST.fullmatch(text):
                raise LayoutError(f"{f.where}: checksums.chunks[{i}] must be 16 hex digits, found {text!r}")
            digests.append(int(text, 16))
        chunk_bytes = f.int("chunk_bytes", minimum=1)
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise LayoutError(f"{f.where}: checksums.chunk_bytes is {chunk_bytes:,}, more than the {MAX_CHUNK_BYTES:,} "
                              "a reader checks at a time")
        return cls(chunk_bytes, tuple(digests), algorithm)


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


def parse_metadata(raw: bytes | str, where: str, table: bytes | None = None, table_where: str = "",
                   metadata_sha256: str | None = None, decoded=None) -> ImageMetadata:
    """The text of a ``metadata.json`` -> validated :class:`ImageMetadata` (LayoutError naming ``where``).

    ``table``: the bytes of the ``tensors.bin`` beside it (:mod:`flashboot.layouts.table`): the
    tensor table then comes from its columns and only the rest of the JSON is parsed;
    ``metadata_sha256``: the hex sha256 of ``raw`` where the caller computed it already;
    ``decoded``: the table's :func:`~flashboot.layouts.table.predecode_table`, made while ``raw`` was read."""
    tensors = None
    if table is not None:
        from .table import decode_table

        raw = raw.encode() if isinstance(raw, str) else raw
        tensors, (start, end) = decode_table(table, raw, table_where or where, metadata_sha256, decoded)
        raw = raw[:start] + b"{}" + raw[end:]
    with gc_paused():
        obj = loads(raw, where, LayoutError)
        try:
            return ImageMetadata.from_dict(obj, where, tensors)
        finally:
            del obj  # freed before the collector resumes, which would otherwise walk all of it once
