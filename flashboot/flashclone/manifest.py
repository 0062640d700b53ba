"""The manifest of a replication: what a seed publishes and every clone agrees with before any byte
moves (image bytes, arena capacity, per-chunk checksums, the image key)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import RendezvousError
from .records import canonical_json


_HEX16 = re.compile(r"[0-9a-f]{16}")
DEFAULT_CHECKSUM_CHUNK_BYTES = 64 << 20
"""Checksum granularity when a seed computes the table itself (a bare arena without an image)."""


@dataclass(frozen=True)
class Manifest:
    """What is being replicated: a clone must agree with it before any byte moves.

    ``nbytes``: the bytes replicated (the image); ``arena_nbytes``: the arena capacity (the image
    rounded up to the allocation granularity, so seed and clone agree exactly); ``checksums``:
    one 64-bit digest (:func:`flashboot.kernels.checksum.chunk_checksums`) per
    ``checksum_chunk_bytes`` of the image; ``key``: the image key (model, revision, layout,
    dtypes, with its digest) or None for a bare arena.
    """

    nbytes: int
    arena_nbytes: int
    checksum_chunk_bytes: int
    checksums: tuple[int, ...]
    key: dict | None = None

    def __post_init__(self) -> None:
        for name in ("nbytes", "arena_nbytes", "checksum_chunk_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise RendezvousError(f"manifest {name} must be a positive int, got {v!r}")
        if self.arena_nbytes < self.nbytes:
            raise RendezvousError(f"manifest arena_nbytes {self.arena_nbytes:,} is smaller than nbytes {self.nbytes:,}")
        want = -(-self.nbytes // self.checksum_chunk_bytes)
        if len(self.checksums) != want:
            raise RendezvousError(f"manifest has {len(self.checksums)} checksums; {self.nbytes:,} bytes in chunks of "
                                  f"{self.checksum_chunk_bytes:,} need {want}")
        object.__setattr__(self, "checksums", tuple(int(c) for c in self.checksums))

    @property
    def key_digest(self) -> str | None:
        return None if self.key is None else self.key.get("digest")

    def to_dict(self) -> dict:
        return {"nbytes": self.nbytes, "arena_nbytes": self.arena_nbytes,
                "checksum_chunk_bytes": self.checksum_chunk_bytes,
                "checksums": [f"{c:016x}" for c in self.checksums], "key": self.key}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Manifest":
        """Inverse of :meth:`to_dict`; RendezvousError naming the field that is missing or mistyped
        (ints exactly ints, checksums 16 hex digits each, key null or an object with a digest)."""
        if not isinstance(d, Mapping):
            raise RendezvousError(f"malformed manifest: must be an object, found {type(d).__name__}")
        missing = [k for k in ("nbytes", "arena_nbytes", "checksum_chunk_bytes", "checksums") if k not in d]
        if missing:
            raise RendezvousError(f"malformed manifest: missing {missing}")
        for name in ("nbytes", "arena_nbytes", "checksum_chunk_bytes"):
            if type(d[name]) is not int:
                raise RendezvousError(f"malformed manifest: {name} must be an int, found {d[name]!r}")
        sums = d["checksums"]
        if type(sums) is not list or not all(type(c) is str and _HEX16.fullmatch(c) for c in sums):
            raise RendezvousError(f"malformed manifest: checksums must be a list of 16-hex-digit strings, "
                                  f"found {str(sums)[:200]}")
        key = d.get("key")
        if key is not None and not (isinstance(key, dict) and type(key.get("digest")) is str):
            raise RendezvousError(f"malformed manifest: key must be null or an object with a digest, found "
                                  f"{str(key)[:200]}")
        return cls(d["nbytes"], d["arena_nbytes"], d["checksum_chunk_bytes"], tuple(int(c, 16) for c in sums), key)

    @property
    def digest(self) -> str:
        """SHA-256 of the whole manifest: equal digests mean the same bytes are expected."""
        return "sha256:" + hashlib.sha256(canonical_json(self.to_dict())).hexdigest()

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of checksum chunk ``index``."""
        start = index * self.checksum_chunk_bytes
        return start, min(self.checksum_chunk_bytes, self.nbytes - start)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata, arena_nbytes: int | None = None) -> "Manifest":
        """From an image's :class:`~flashboot.layouts.format.ImageMetadata` (key + checksum table)."""
        nbytes = int(metadata.image_nbytes)
        cap = arena_nbytes if arena_nbytes is not None else -(-nbytes // (2 << 20)) * (2 << 20)
        return cls(nbytes, int(cap), int(metadata.checksums.chunk_bytes), tuple(metadata.checksums.digests),
                   metadata.key.to_dict())

    @classmethod
    def of_arena(cls, arena, nbytes: int | None = None, chunk_bytes: int = DEFAULT_CHECKSUM_CHUNK_BYTES,
                 key: dict | None = None) -> "Manifest":
        """Checksum the first ``nbytes`` (default: all) of ``arena`` (on its device) into a manifest."""
        from flashboot.kernels.checksum import chunk_checksums

        n = arena.nbytes if nbytes is None else int(nbytes)
        return cls(n, arena.nbytes, int(chunk_bytes), tuple(chunk_checksums(arena.span(0, n), int(chunk_bytes))), key)

    # -- comparison -------------------------------------------------------------------------
    def mismatches(self, expected: "Manifest | Mapping[str, Any] | Any") -> list[tuple[str, Any, Any]]:
        """``(field, expected, published)`` for every field ``expected`` states that differs.

        ``expected`` may be a Manifest (everything compared), an ImageMetadata (key, nbytes and
        checksums), an ImageKey, or a dict naming any of ``nbytes``, ``arena_nbytes``,
        ``key_digest`` and ImageKey fields (a partial key: the model and layout the caller wants).
        """
        if isinstance(expected, Manifest):
            want: dict[str, Any] = {"nbytes": expected.nbytes, "arena_nbytes": expected.arena_nbytes,
                                    "key_digest": expected.key_digest,
                                    "checksums": (expected.checksum_chunk_bytes, expected.checksums)}
        elif hasattr(expected, "image_nbytes") and hasattr(expected, "checksums"):  # ImageMetadata
            want = {"nbytes": int(expected.image_nbytes), "key_digest": expected.key.digest,
                    "checksums": (int(expected.checksums.chunk_bytes), tuple(expected.checksums.digests))}
        elif hasattr(expected, "fields") and hasattr(expected, "digest"):  # ImageKey
            want = {"key_digest": expected.digest}
        elif isinstance(expected, Mapping):
            want = dict(expected)
        else:
            raise RendezvousError(f"cannot compare a manifest with {type(expected).__name__}")
        have = {"nbytes": self.nbytes, "arena_nbytes": self.arena_nbytes, "key_digest": self.key_digest,
                "checksums": (self.checksum_chunk_bytes, self.checksums)}
        out = []
        for name, value in want.items():
            if name in have:
                found = have[name]
            elif self.key is not None and name in self.key:
                found = self.key[name]
            elif self.key is None:
                found = None
            else:
                raise RendezvousError(f"expected manifest names an unknown field {name!r}")
            if isinstance(value, tuple) and name != "checksums":
                value = list(value)
            if value != found:
                if name == "checksums":
                    value, found = _describe_checksums(*value), _describe_checksums(*found)
                out.append((name, value, found))
        return out

    def require(self, expected: Any, where: str) -> None:
        """Raise RendezvousError listing the mismatches with ``expected`` (see :meth:`mismatches`)."""
        if expected is None:
            return
        bad = self.mismatches(expected)
        if bad:
            lines = "; ".join(f"{k}: expected {e!r}, {where} has {f!r}" for k, e, f in bad)
            raise RendezvousError(f"manifest mismatch with {where} (another model, layout or size), refused before "
                                  f"any byte moved: {lines}")

    def describe(self) -> str:
        what = "bare arena" if self.key is None else f"{self.key.get('model_id')} ({(self.key_digest or '')[:19]})"
        return f"{what}, {self.nbytes:,} bytes in a {self.arena_nbytes:,}-byte arena, {len(self.checksums)} checksums"


def _describe_checksums(chunk_bytes: int, digests: tuple[int, ...]) -> str:
    blob = b"".join(int(d).to_bytes(8, "little") for d in digests)
    return f"{len(digests)} chunks of {chunk_bytes:,} B, sha256 {hashlib.sha256(blob).hexdigest()[:12]}"


__all__ = ["DEFAULT_CHECKSUM_CHUNK_BYTES", "Manifest"]
