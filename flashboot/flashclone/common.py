"""Helpers shared by seed, clone and ring: record keys, the step hook, movers, tensor views,
checksum verification."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Mapping

from ..errors import ChecksumMismatchError, FlashBootError
from ..memory import Device
from ..schedulers import Step
from .manifest import Manifest
from .report import CloneReport


SEED_KEY = "seed"


METADATA_KEY = "metadata"


SCHEDULES = ("chain", "star", "ring")


ENV_STEP_DELAY = "FLASHBOOT_TEST_STEP_DELAY_S"


"""Test hook: seconds to sleep before each step (slows a transfer so a test can kill a peer mid-way)."""


_SEED_INDEX = 0


_FALLBACK_INDEX = 10_000


"""Participant index given to a retry source outside the plan (another clone's full copy)."""


def _gkey(generation: str, *parts: Any) -> str:
    return "/".join(["g", generation, *map(str, parts)])


PG_STORE_KEYS = ("0", "0/0", "0/1")
"""What the broadcast fallback's 2-rank process group (transports/nccl.py) writes under its prefix
``g/GEN/nccl/pg/N``: NCCL's unique id of its one communicator (its first, "0"), or each gloo rank's
address (of its one device's context, "0/")."""


MAX_FORGOTTEN_READERS = 4096
"""Positions of one schedule read back by :func:`forget_generation`: the join counter is anyone's
to bump (store.add needs no token), and a forged 10**9 must not make it loop."""


def forget_generation(rdv, generation: str, force: bool) -> bool:
    """Delete the keys that clones of seed ``generation`` wrote in ``rdv``'s namespace (the chain
    and star records, counters and barriers of cloning.py, sources.py and session.py, the broadcast
    requests and process groups of transports/nccl.py) when every one of them has left, or
    ``force``; returns whether it deleted them. A refit's publisher forgets each version it
    withdrew so (:mod:`flashboot.weight_update.publish`)."""
    keys, left, readers = [], True, 0
    for schedule in ("chain", "star"):
        join = _gkey(generation, schedule, "join")
        if not rdv.has(join):  # asked first: add(join, 0) had made the key of a schedule nobody used
            continue
        n = min(rdv.add(join, 0), MAX_FORGOTTEN_READERS)
        keys.append(join)
        readers += max(n, 0)
        start = _gkey(generation, schedule, "start")
        keys += [_gkey(generation, schedule, "plan"), f"barrier/{start}/count", f"barrier/{start}/go"]
        for p in range(1, n + 1):
            status = _gkey(generation, schedule, "status", p)
            left = left and rdv.has(f"{status}/left")  # a clone's last word, as it closes
            keys += [_gkey(generation, schedule, "joined", p), _gkey(generation, schedule, "member", p), status,
                     f"{status}/left", _gkey(generation, schedule, "nixl", "held", p)]
    if not left and not force:
        return False
    if readers:
        for what, record in (("done", ()), ("nccl", ("req",))):  # one of each per reader at most
            count = _gkey(generation, what, "count")
            n = min(rdv.add(count, 0), readers)
            keys += [count] + [_gkey(generation, what, *record, k) for k in range(1, n + 1)]
        # n broadcasts asked for (the count above): each one's process group too, whose keys torch
        # wrote under its prefix had stayed for good
        keys += [f"{_gkey(generation, 'nccl', 'pg', k)}/{key}" for k in range(1, n + 1) for key in PG_STORE_KEYS]
    for key in keys:
        rdv.delete(key)
    return True


def _agree_chunk(rdv, key: str, chunk_bytes: int, who: str, **fixed) -> tuple[int, str]:
    """The chunk size every member of one chain, star or ring follows, and a warning ('' when
    ours holds): the first member to ask sets it (an atomic compare-and-set), later ones adopt
    it. Step ranges and flag numbers follow from the chunk, so members that planned with
    different ones waited on flags never raised or copied ranges their source did not hold yet.
    ``fixed``: fields that must match exactly (a ring's member count); RendezvousError if not."""
    from ..errors import RendezvousError

    rec = rdv.agree(key, {"chunk_bytes": chunk_bytes, **fixed})
    agreed = rec.body.get("chunk_bytes")
    if type(agreed) is not int or agreed <= 0:
        raise RendezvousError(f"{who}: the agreed plan at {key!r} has chunk_bytes {agreed!r}, not a positive int")
    for name, want in fixed.items():
        if rec.body.get(name) != want:
            raise RendezvousError(f"{who}: this gathering was set up with {name} {rec.body.get(name)!r}, "
                                  f"we were given {want!r}")
    if agreed == chunk_bytes:
        return agreed, ""
    return agreed, (f"{who} planned {chunk_bytes:,}-byte chunks; the first member had set {agreed:,}: "
                    "following it (all members must copy by the same chunks)")


def _descriptor_from(d: Mapping[str, Any]):
    from ..arena import ArenaDescriptor

    return ArenaDescriptor.from_dict(dict(d))


def _same_host(desc) -> bool:
    return desc.hostname in ("", socket.gethostname())


def _step_hook(step_delay_s: float | None) -> Callable[[Step], None] | None:
    if step_delay_s is None:
        env = os.environ.get(ENV_STEP_DELAY)
        step_delay_s = float(env) if env else None
    if not step_delay_s:
        return None
    return lambda _step: time.sleep(step_delay_s)


def _default_mover(dev: Device, mover: Any) -> Any:
    if mover is not None:
        return mover
    return "copy_engine" if dev.is_cuda else "host"


def _check_mover(dev: Device, mover: Any, *, create: bool = True):
    """The mover, checked against ``dev`` before anything is published: created now, or with
    ``create=False`` a registered name checked on its class alone (nothing of what it runs on is
    imported: a clone creates it once its warm-up has imported that, off its own thread)."""
    from flashboot.movers import create_mover, mover_class

    m = mover_class(mover) if isinstance(mover, str) else mover
    need = "host" if not dev.is_cuda else "d2d"
    if need not in m.paths and not (dev.is_cuda and "p2p" in m.paths):
        raise FlashBootError(f"mover {m.name!r} cannot copy between {dev} arenas (it supports {sorted(m.paths)})")
    if not isinstance(mover, str):
        return mover
    return create_mover(mover) if create else mover


def _views(arena, metadata) -> dict:
    """The clone's tensors as views of its arena, made in bulk (``arena.view`` checks each one
    again: ~25 us a tensor, a second for 40,000)."""
    if metadata is None:
        return {}
    from ..flashload.views import make_views

    return make_views(arena, metadata)


def _parse_metadata(d: Mapping[str, Any] | None, where: str):
    if d is None:
        return None
    from flashboot.layouts import ImageMetadata

    return ImageMetadata.from_dict(d, where)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _note_lazy_mapping(report: CloneReport, sources, before: dict | None = None) -> None:
    """Add the sources' segments mapped on first use during the transfer to ``report``;
    ``before``: :func:`_map_stats_of` the sources as the transfer started (a source held from an
    earlier clone has mapped segments then)."""
    before = before or {}
    for ep in sources:
        for arena in (ep.arena, ep.flags):
            if arena is not None and not arena.closed:
                stats, was = arena.map_stats, before.get(id(arena), {"map_ms": 0.0, "segments": 0})
                report.map_during_copy_ms += stats["map_ms"] - was["map_ms"]
                report.segments_mapped_during_copy += int(stats["segments"] - was["segments"])


def _map_stats_of(sources) -> dict:
    """Each source arena's (and flags arena's) ``map_stats``, by ``id``."""
    return {id(a): a.map_stats for ep in sources for a in (ep.arena, ep.flags) if a is not None and not a.closed}


def _verify(arena, manifest: Manifest, where: str) -> None:
    """Per-chunk checksums of ``arena`` against the manifest; ChecksumMismatchError on the first bad one."""
    from flashboot.kernels.checksum import chunk_checksums

    found = chunk_checksums(arena.span(0, manifest.nbytes), manifest.checksum_chunk_bytes)
    for k, (want, got) in enumerate(zip(manifest.checksums, found)):
        if int(want) != int(got):
            start, n = manifest.chunk_range(k)
            raise ChecksumMismatchError(where, k, start, n, int(want), int(got))
