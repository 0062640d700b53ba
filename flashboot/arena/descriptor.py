"""What another process on this host needs to open an arena: small and picklable."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable

from .._json import check_fields, int_at_least, is_str
from ..errors import ArenaError
from .segments import HANDLE_FABRIC_POSIX_FD, HANDLE_MEMFD, HANDLE_POSIX_FD, _segment_count


@dataclass(frozen=True)
class ArenaDescriptor:
    """What another process on this host needs to open an arena: small and picklable.

    ``pid`` and ``fds`` name the exporter's shareable fds, one per segment (taken with
    ``pidfd_getfd``); segment *i* covers bytes ``[i * segment_bytes, min((i + 1) *
    segment_bytes, nbytes))``. ``fabric_handles`` (64 bytes each, one per segment) are set only
    for CUDA arenas created with fabric handles.
    """

    backend: str  # "cuda" or "host"
    pid: int
    fds: tuple[int, ...]
    nbytes: int
    device_index: int  # the exporter's CUDA device; -1 for the host backend
    handle_type: str  # "posix_fd", "fabric+posix_fd" or "memfd"
    granularity: int
    segment_bytes: int
    arena_id: str
    fabric_handles: tuple[bytes, ...] | None = None
    hostname: str = ""

    def __post_init__(self) -> None:
        expected = _segment_count(self.nbytes, self.segment_bytes)
        if len(self.fds) != expected:
            raise ArenaError(f"arena descriptor {self.arena_id}: {self.nbytes:,} bytes in segments of "
                             f"{self.segment_bytes:,} need {expected} fds, it lists {len(self.fds)}")
        if self.fabric_handles is not None and len(self.fabric_handles) != expected:
            raise ArenaError(f"arena descriptor {self.arena_id}: {expected} segments but "
                             f"{len(self.fabric_handles)} fabric handles")

    @property
    def segments(self) -> int:
        """Number of physical allocations (one fd each)."""
        return len(self.fds)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (fabric handles as hex)."""
        d = dataclasses.asdict(self)
        d["fds"] = list(self.fds)
        d["fabric_handles"] = [h.hex() for h in self.fabric_handles] if self.fabric_handles is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ArenaDescriptor":
        """Inverse of :meth:`to_dict`; ArenaError naming the field for a missing, unknown or
        mistyped one (a descriptor arrives from another process: every field is checked)."""
        if not isinstance(d, dict):
            raise ArenaError(f"bad arena descriptor: must be an object, found {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"backend", "pid", "fds", "nbytes", "device_index", "handle_type", "granularity", "segment_bytes",
                   "arena_id"} - set(d)
        unknown = set(d) - names
        if missing or unknown:
            raise ArenaError(f"bad arena descriptor: missing {sorted(missing)}, unknown {sorted(unknown)}")
        d = dict(d)
        check_fields(d, _DESCRIPTOR_FIELDS, ArenaError, "bad arena descriptor: ")
        d["fds"] = tuple(d["fds"])
        if d.get("fabric_handles") is not None:
            d["fabric_handles"] = tuple(bytes.fromhex(h) for h in d["fabric_handles"])
        return cls(**d)


_HANDLE_TYPES = (HANDLE_POSIX_FD, HANDLE_FABRIC_POSIX_FD, HANDLE_MEMFD)


def _is_handle(h: Any) -> bool:
    return type(h) is str and len(h) == 128 and all(c in "0123456789abcdef" for c in h)


_DESCRIPTOR_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "backend": ("'cuda' or 'host'", lambda v: v in ("cuda", "host")),
    "pid": ("an int >= 1", int_at_least(1)),
    "fds": ("a list of ints >= 0", lambda v: type(v) is list and all(map(int_at_least(0), v))),
    "nbytes": ("an int >= 1", int_at_least(1)),
    "device_index": ("an int >= -1", int_at_least(-1)),
    "handle_type": (f"one of {_HANDLE_TYPES}", lambda v: v in _HANDLE_TYPES),
    "granularity": ("an int >= 1", int_at_least(1)),
    "segment_bytes": ("an int >= 1", int_at_least(1)),
    "arena_id": ("1-64 hex digits", lambda v: is_str(v) and re.fullmatch(r"[0-9a-f]{1,64}", v) is not None),
    "fabric_handles": ("null or a list of 64-byte hex handles",
                       lambda v: v is None or (type(v) is list and all(map(_is_handle, v)))),
    "hostname": ("a string", is_str),
}
"""What each descriptor field must be (in words) and its test; :meth:`ArenaDescriptor.from_dict` checks them."""
