"""Pre-packed images: the format (version 1, see FORMAT.md), the strict reader, the family
rules that turn a Hugging Face checkpoint into per-rank images, and the image writer."""

from __future__ import annotations

from .checkpoint import Checkpoint, SourceTensor, open_checkpoint
from .format import (
    DEFAULT_CHUNK_BYTES, DTYPES, FORMAT_VERSION, SEPARATOR_ALIGNMENT, TARGETS, TENSOR_ALIGNMENT, ChecksumTable,
    ExpertMap, FamilyInfo, ImageKey, ImageMetadata, Layout, LayoutSlot, ParallelLayout, Part, Region, SourceInfo,
    Split, TensorEntry, compute_layout,
)
from .image import (
    Image, JobInfo, VerifyResult, image_ranks, read_image, read_image_metadata, read_job, reassemble, verify_image,
)

__all__ = [
    "Checkpoint", "ChecksumTable", "DEFAULT_CHUNK_BYTES", "DTYPES", "ExpertMap", "FORMAT_VERSION", "FamilyInfo",
    "Image", "ImageKey", "ImageMetadata", "JobInfo", "Layout", "LayoutSlot", "ParallelLayout", "Part", "Region",
    "SEPARATOR_ALIGNMENT", "SourceInfo", "SourceTensor", "Split", "TARGETS", "TENSOR_ALIGNMENT", "TensorEntry",
    "VerifyResult", "compute_layout", "image_ranks", "open_checkpoint", "read_image", "read_image_metadata",
    "read_job", "reassemble", "verify_image",
]
