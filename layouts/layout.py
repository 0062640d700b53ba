"""The offset layout of an image: where each tensor goes (:func:`compute_layout`), and the
config hash. :mod:`flashboot.layouts.format` re-exports every name here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashboot.errors import LayoutError

from .entries import (
    REGIONS, SEPARATOR_ALIGNMENT, TENSOR_ALIGNMENT, Part, Region, Split, TensorEntry, align_up,
    contiguous_stride, dtype_of,
)
from .tensor_table import MAX_IMAGE_NBYTES


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
    for what, value, least in (("tensor_alignment", tensor_alignment, TENSOR_ALIGNMENT),
                               ("separator_alignment", separator_alignment, SEPARATOR_ALIGNMENT)):
        # the readers' rule (validate_layout), here before any byte is written: 0 had been a
        # ZeroDivisionError, and 16 refused by the metadata check after the whole image was written
        if type(value) is not int or not least <= value <= MAX_IMAGE_NBYTES or value & (value - 1):
            raise LayoutError(f"{what} must be a power of two in {least}..2**56 (what an image's readers take), "
                              f"got {value!r}")
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
