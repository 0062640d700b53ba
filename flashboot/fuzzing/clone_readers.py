"""Readers of what a clone receives: arena descriptors, manifests, rendezvous records (sealed
and plain)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from ..errors import FlashBootError
from .campaign import Reader

_TOKEN = "fuzz-token-0123456789abcdef"
_KEY = "flashboot/v1/fuzz/seed"


def _seed_descriptor() -> dict:
    return {"backend": "host", "pid": os.getpid(), "fds": [7, 8], "nbytes": 3 << 20, "device_index": -1,
            "handle_type": "memfd", "granularity": 4096, "segment_bytes": 2 << 20, "arena_id": "0123456789abcdef",
            "fabric_handles": None, "hostname": "host-a"}


def _seed_manifest(image_dir: Path) -> dict:
    from flashboot.flashclone.manifest import Manifest
    from flashboot.layouts.format import parse_metadata

    meta = parse_metadata((image_dir / "rank-0" / "metadata.json").read_bytes(), "seed")
    return Manifest.from_metadata(meta).to_dict()


def _check_descriptor(desc) -> str | None:
    if desc.backend not in ("cuda", "host") or desc.handle_type not in ("posix_fd", "fabric+posix_fd", "memfd"):
        return f"backend {desc.backend!r}, handle type {desc.handle_type!r}"
    for name in ("pid", "nbytes", "granularity", "segment_bytes"):
        v = getattr(desc, name)
        if type(v) is not int or v <= 0:
            return f"{name} {v!r}"
    if type(desc.device_index) is not int or desc.device_index < -1:
        return f"device_index {desc.device_index!r}"
    if not all(type(fd) is int and fd >= 0 for fd in desc.fds):
        return f"fds {desc.fds!r}"
    if type(desc.arena_id) is not str or type(desc.hostname) is not str:
        return f"arena_id {desc.arena_id!r}, hostname {desc.hostname!r}"
    if desc.fabric_handles is not None and not all(type(h) is bytes and len(h) == 64 for h in desc.fabric_handles):
        return f"fabric handles {desc.fabric_handles!r}"
    return None


def _check_manifest(m) -> str | None:
    for name in ("nbytes", "arena_nbytes", "checksum_chunk_bytes"):
        v = getattr(m, name)
        if type(v) is not int or v <= 0:
            return f"{name} {v!r}"
    if not all(type(c) is int and 0 <= c < 1 << 64 for c in m.checksums):
        return "checksums outside 64 bits"
    if m.key is not None and (not isinstance(m.key, dict) or type(m.key.get("digest")) is not str):
        return f"key {m.key!r}"
    return None


def descriptor_reader() -> Reader:
    """``ArenaDescriptor.from_dict`` of a mutated descriptor (as a clone or the preloader gets it)."""
    from flashboot.arena import ArenaDescriptor

    return Reader("arena descriptor (from_dict)", [json.dumps(_seed_descriptor()).encode()],
                  _json_feed(ArenaDescriptor.from_dict), lambda d, data: _check_descriptor(d))


def _json_feed(parse: Callable[[Any], Any]) -> Callable[[bytes], Any]:
    """Inputs that are not JSON at all are not this reader's: only parsed JSON reaches ``parse``."""
    def feed(data: bytes):
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            raise _NotJson() from None
        return parse(obj)
    return feed


class _NotJson(FlashBootError):
    """The mutation broke the JSON text itself; the reader under test takes parsed JSON."""


def manifest_reader(image_dir: Path) -> Reader:
    """``Manifest.from_dict`` of a mutated manifest (what a clone reads from the seed's record)."""
    from flashboot.flashclone.manifest import Manifest

    return Reader("manifest (from_dict)", [json.dumps(_seed_manifest(image_dir)).encode()],
                  _json_feed(Manifest.from_dict), lambda m, data: _check_manifest(m))


def record_reader(image_dir: Path, *, sealed_garbage: bool) -> Reader:
    """``decode_record`` as a clone reads the seed's record.

    ``sealed_garbage=False``: the stored bytes are mutated (no token: everything but a no-op must
    fail authentication). ``True``: the record's body and sealed part are mutated *before* they are
    authenticated with the right token (a participant with a bug), then decoded and the manifest
    and sealed descriptor parsed as the clone does."""
    from flashboot.arena import ArenaDescriptor
    from flashboot.flashclone.manifest import Manifest
    from flashboot.flashclone.records import Token, decode_record, encode_record

    token = Token(_TOKEN)
    body = {"manifest": _seed_manifest(image_dir), "generation": "g0", "pid": os.getpid()}
    sealed = {"arena": _seed_descriptor()}
    original = decode_record(token, _KEY, encode_record(token, _KEY, body, sealed))
    if not sealed_garbage:
        def feed(data: bytes):
            return decode_record(token, _KEY, data)

        def check(rec, data: bytes) -> str | None:
            if (rec.body, rec.sealed) != (original.body, original.sealed):
                return "a changed record passed authentication"
            return None

        return Reader("rendezvous record (stored bytes)", [encode_record(token, _KEY, body, sealed)], feed, check)

    seed = json.dumps({"body": body, "sealed": sealed}).encode()

    def feed_sealed(data: bytes):
        try:
            doc = json.loads(data)
            b, s = doc["body"], doc["sealed"]
            raw = encode_record(token, _KEY, b, s)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            raise _NotJson() from None  # not a record anyone could write: encode_record needs mappings
        rec = decode_record(token, _KEY, raw)
        manifest = Manifest.from_dict(rec.body.get("manifest"))
        desc = ArenaDescriptor.from_dict(rec.sealed.get("arena")) if rec.sealed is not None else None
        return manifest, desc

    def check_sealed(parsed, data: bytes) -> str | None:
        manifest, desc = parsed
        return _check_manifest(manifest) or (desc is not None and _check_descriptor(desc)) or None

    return Reader("rendezvous record (sealed, authenticated garbage)", [seed], feed_sealed, check_sealed)


# ----------------------------------------------------------------- a holder registry's record
def held_reader(work: Path) -> Reader:
    """``held_descriptor`` of a mutated ``held/NAME.json`` in a holder registry directory: what a
    restarted engine reads before it maps the arena held for it (``flashboot.load(..., holder=)``,
    ``open_held``). The seed names this live process as its holder, so the record is read through
    to its descriptor."""
    from flashboot.flashclone.holder import HOLDER_PROTOCOL, held_descriptor
    from flashboot.procfs import proc_start_time

    registry = work / "holder-registry"
    (registry / "held").mkdir(parents=True, exist_ok=True)
    path = registry / "held" / "engine-0.json"
    seed = {"descriptor": _seed_descriptor(), "request": {"op": "hold", "name": "engine-0"}, "since": 1.0,
            "holder_pid": os.getpid(), "holder_start": proc_start_time(os.getpid()),
            "image": {"path": "/images/m", "rank": 0, "metadata_sha256": "0" * 64}, "protocol": HOLDER_PROTOCOL}

    def feed(data: bytes):
        path.write_bytes(data)
        return held_descriptor("engine-0", registry=registry)

    return Reader("holder registry record (held_descriptor)", [json.dumps(seed).encode()], feed,
                  lambda d, data: _check_descriptor(d))
