"""The clone: check the manifest, take a position, map sources, copy by the plan, re-attach on failure."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from .._lazy import EARLY_IMPORTS
from ..errors import ArenaError, FlashBootError, RendezvousError, WaitTimeoutError
from ..memory import Device
from ..units import check_timeout
from ..schedulers import DEFAULT_CHUNK_BYTES, HOST, Plan, Step, build_plan
from ..schedulers.plan import SINGLE_HOP_CHUNK_BYTES
from .executor import Endpoint, Executor, StepFailure, create_flags, rewire
from .manifest import Manifest
from .rendezvous import DEFAULT_TIMEOUT_S, Rendezvous, StoreLostError
from .common import METADATA_KEY, SCHEDULES, SEED_KEY, _FALLBACK_INDEX, _SEED_INDEX, _agree_chunk, _alive, _check_mover, _default_mover, _descriptor_from, _gkey, _map_stats_of, _note_lazy_mapping, _parse_metadata, _step_hook, _verify, _views
from .report import CloneError, CloneReport, CloneResult
from .warmup import CloneWarmup
from .ring import ring_load
from .session import _Session
from .sources import _Sources
from .session import CloneContext
from ..service_loop import serve_until_stopped
from .transports.nixl import AgentWarmup
from .transports.registry import Seen, choose_transport, transport_class, transport_names


def clone(store: str, device: Any = None, schedule: str = "chain", *, verify: bool = False,
          timeout_s: float = DEFAULT_TIMEOUT_S, mover: Any = None, chunk_bytes: int | None = None,
          token=None, token_file=None, name: str = "default", clones: int | None = None, expect: Any = None,
          image: Any = None, rank: int = 0, transport: str = "auto", retry: bool = True,
          step_delay_s: float | None = None, pin_early: bool = False, into: Any = None,
          held_sources: dict | None = None, prepared: CloneWarmup | None = None, run: str = "ring") -> CloneResult:
    """Clone the seed published at ``store`` (``HOST:PORT``) into a new arena on ``device``.

    ``schedule``: ``"chain"`` (default), ``"star"`` or ``"ring"`` (see :func:`ring_load`; needs
    ``image`` and ``clones``). Processes calling ``clone`` on the same store join one chain/star
    in arrival order. ``clones``: how many will join; when given, all start together (a start
    barrier). ``verify``: recompute the per-chunk checksums and compare with the seed's manifest
    (ChecksumMismatchError otherwise). ``mover``: a registry mover name (default ``copy_engine``
    on CUDA, ``host`` on the host backend). ``chunk_bytes``: the pipeline chunk (default the
    schedulers' default). ``expect``: what the caller expects (a Manifest, ImageMetadata, ImageKey
    or dict of key fields / ``nbytes``): a mismatch is refused before any byte moves.
    ``image``: a host image (directory or file) to fall back to when no source is left.
    ``transport``: ``"auto"`` or a registered transport (``posix_fd``, ``fabric``, ``nixl``,
    ``nccl``; see :mod:`flashboot.flashclone.transports`); ``auto`` takes the first that reaches the
    seed in that order, and the report says which and why. ``retry``: re-attach
    to another source when one fails mid-transfer. ``timeout_s`` bounds every wait. ``pin_early``
    (ring): pin the shard before the start barrier (see :func:`ring_load`). ``into``: an open
    arena of the seed's capacity on ``device`` to copy into instead of a new one (a refit's
    staging or live arena); the caller keeps owning it, also when the clone fails. A failure
    raised once connected carries ``into_written``: whether a write into ``into`` had been issued
    (False: its bytes are as they were); one raised before carries none (nor was one).
    ``held_sources``: a dict the caller keeps from one clone to the next (a refit's engine): the
    seed's arena, once mapped here, stays in it, and a later clone of the same exported arena
    (same process, same arena id: a trainer publishing versions from one arena) reads it without
    mapping it again; a seed of another arena closes what it held first. The caller closes what
    it holds (:func:`~flashboot.flashclone.sources.release_held_sources`); a held mapping keeps
    the exporter's memory alive. ``prepared``: the early call's warm-up
    (:func:`~flashboot.flashclone.prepare_clone` for ``device``); without it the clone starts its
    own as it begins, overlapping only the connection to the store. ``run`` (ring only; chain and
    star ignore it, a ``name`` namespace separates those): the name of this gathering in the
    store (see :func:`ring_load`).

    Raises RendezvousError (no store, wrong token, mismatched manifest), WaitTimeoutError naming
    what was awaited, CloneError when a source failed and no other could take over.
    """
    if schedule not in SCHEDULES:
        raise FlashBootError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    check_timeout(timeout_s, "clone timeout_s")  # before any warm-up thread starts waiting by it
    if schedule == "ring":
        if image is None or clones is None:
            raise FlashBootError("schedule 'ring' loads a shard of a host image on each member: pass image= and clones=")
        return ring_load(store, image, device, members=clones, rank=rank, verify=verify, timeout_s=timeout_s,
                         mover=mover, chunk_bytes=chunk_bytes, token=token, token_file=token_file, name=name,
                         expect=expect, step_delay_s=step_delay_s, pin_early=pin_early, transport=transport,
                         prepared=prepared, run=run)
    if clones is not None and (not isinstance(clones, int) or clones < 1):
        raise FlashBootError(f"clones must be a positive int, got {clones!r}")
    t_start = time.perf_counter()
    dev = Device.parse(device)
    if prepared is not None:
        prepared.check_device(dev)
    if transport != "auto" and transport not in transport_names():
        transport_class(transport)  # UnknownNameError listing the registered ones
    # overlaps importing torch, connecting, the exchange and our arena; joined by stage (warmup.STAGES)
    warm = prepared if prepared is not None else CloneWarmup(dev, verify=verify, mover=_default_mover(dev, mover))
    # checked by its class: created (its imports paid) after the warm-up's copy stage
    mover_obj = _check_mover(dev, _default_mover(dev, mover), create=False)
    nixl_warm = AgentWarmup.start_for(transport, "clone", timeout_s)
    t_import = time.perf_counter()
    # the store's client: in a fresh process, torch itself. ``import torch`` first: it waits for an
    # import of torch in progress in another thread (the CLI's import_early), where importing a
    # submodule would run it against a half-imported torch (torch._C._c10d_init aborts the process)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    t_store = time.perf_counter()
    session = _Session.connect(store, token, token_file, name, host=False, timeout_s=timeout_s, keep=nixl_warm)
    t_connected = time.perf_counter()
    connect_detail = {"import_ms": (t_store - t_import) * 1e3, "store_ms": (t_connected - t_store) * 1e3,
                      "before_ms": (t_import - t_start) * 1e3}
    began, ended = EARLY_IMPORTS.get("torch", (0.0, 0.0))
    if ended > t_start:  # the CLI's import of torch, begun before the clone, ran into it: its whole length
        connect_detail["torch_import_early_ms"] = (ended - began) * 1e3
    try:
        return _clone(session, dev, schedule, mover_obj, t_start, verify=verify, timeout_s=timeout_s,
                      chunk_bytes=chunk_bytes, clones=clones, expect=expect, image=image, rank=rank,
                      transport=transport, retry=retry, hook=_step_hook(step_delay_s), warm=warm,
                      nixl_warm=nixl_warm, into=into, held_sources=held_sources, connect_detail=connect_detail)
    except BaseException as exc:
        if into is not None:  # the caller's bytes are as they were until a write into them was issued
            exc.into_written = session.wrote
        try:
            if session.status_key is not None and session.rdv is not None:
                session.rdv.publish(session.status_key, {"state": "failed", "error": _describe(exc)[:2000],
                                                         "pid": os.getpid()})
        except FlashBootError:
            pass
        session.close(keep_arena=False)
        raise


def _describe(exc: BaseException) -> str:
    """What a failed status says: our errors name the problem; anything else (a KeyboardInterrupt
    has no message) is named by its type too."""
    if isinstance(exc, FlashBootError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _clone(session: _Session, dev: Device, schedule: str, mover, t_start: float, *, verify: bool, timeout_s: float,
           chunk_bytes: int | None, clones: int | None, expect: Any, image: Any, rank: int, transport: str,
           retry: bool, hook, warm: CloneWarmup | None = None, nixl_warm=None, into=None,
           held_sources: dict | None = None, connect_detail: dict | None = None) -> CloneResult:
    rdv = session.rdv
    report = CloneReport(schedule, 0, str(dev), 0, mover=getattr(mover, "name", mover))
    if warm is not None:
        warm.join(report, timeout_s, "map")
    if nixl_warm is not None:  # like the driver warm-up: joined before the descriptor is requested
        nixl_warm.join(timeout_s)
    # exchange: from here (descriptor requested) to every source mapped; nothing else in between
    t0 = time.perf_counter()
    # authenticates (a wrong token stops here); rejoins a store restarted meanwhile: nothing of ours is in it yet
    seed_rec = rdv.read(SEED_KEY, what="the seed's manifest and descriptor", rejoin=True)
    manifest = Manifest.from_dict(seed_rec.body["manifest"])
    manifest.require(expect, f"the seed at {rdv.address}")
    gen = str(seed_rec.body["generation"])
    seed_desc = _descriptor_from(seed_rec.sealed["arena"])
    # with the seed's record, not after the copy: a seed that closes in between withdraws it, and
    # the clone finished with no tensors and no word
    meta_rec = rdv.try_read(METADATA_KEY) if seed_rec.body.get("has_metadata", True) else None
    if meta_rec is not None and meta_rec.body.get("generation") != gen:
        meta_rec = None  # another seed's
    if meta_rec is None and seed_rec.body.get("has_metadata"):  # it said it had some, and it is gone
        raise RendezvousError(f"the seed at {rdv.address} (generation {gen}, pid {seed_rec.body.get('pid')}) has no "
                              "image metadata of its generation in the store: it closed or was replaced as we "
                              "read it; clone again")
    metadata = None if meta_rec is None else _parse_metadata(meta_rec.body.get("metadata"),
                                                             f"metadata published at {rdv.address}")
    t1 = time.perf_counter()
    report.nbytes = manifest.nbytes
    report.connect_ms, report.manifest_ms = (t0 - t_start) * 1e3, (t1 - t0) * 1e3
    if connect_detail is not None:
        d = {"start_ms": connect_detail["before_ms"], **{k: connect_detail[k] for k in ("import_ms", "store_ms")}}
        d["warm_wait_ms"] = report.warm_wait_ms
        d["other_ms"] = max(0.0, report.connect_ms - sum(d.values()))
        if "torch_import_early_ms" in connect_detail:  # overlaps the parts above: not in their sum
            d["torch_import_early_ms"] = connect_detail["torch_import_early_ms"]
        report.connect_detail = {k: round(v, 3) for k, v in d.items()}
    offers = {"nccl": bool(seed_rec.body.get("nccl", True)), "nixl": "nixl" in seed_rec.sealed}
    cls, note = choose_transport(Seen(seed_desc, offers), dev, transport)
    chosen = cls.name
    report.transport, report.transport_note = chosen, note

    position = rdv.add(_gkey(gen, schedule, "join"), 1)
    t2 = time.perf_counter()
    report.position = position
    status_key = _gkey(gen, schedule, "status", position)
    session.status_key = status_key
    # before anything that may wait: a successor waiting for our member record tells a live clone
    # (still waiting for its own sources) from one killed after taking its position
    rdv.publish(_gkey(gen, schedule, "joined", position),
                {"position": position, "pid": os.getpid(), "host": socket.gethostname()})

    # a star clone reads the seed alone: its plan is the seed and itself (participant ``slot`` 1)
    # at any position. Planned by position, star clone #N built N clones' steps (N x the image's
    # chunks: 1.1 s of its exchange at #405 of a 3 MB image in 4 KiB chunks, a PlanError past
    # MAX_PLAN_STEPS from #2,581) to run its own N-th share
    slot = position if schedule == "chain" else 1
    n = max(slot, clones or 1) if schedule == "chain" else 1
    if chunk_bytes is None and schedule == "chain":
        # not by position: #1 of a chain started without --clones is a chain of one so far, and
        # the agreement below would fix its single-hop 1 GiB chunk for every clone after it
        chunk_bytes = SINGLE_HOP_CHUNK_BYTES if clones == 1 else DEFAULT_CHUNK_BYTES
        asked = None
    else:
        asked = chunk_bytes
    plan = build_plan(schedule, n, manifest.nbytes, chunk_bytes)
    if schedule == "chain":  # one chunk size per chain (star clones never read each other's flags)
        agreed, why = _agree_chunk(rdv, _gkey(gen, schedule, "plan"), plan.chunk_bytes, f"clone #{position}")
        if agreed != plan.chunk_bytes:
            plan = build_plan(schedule, n, manifest.nbytes, agreed)
            if asked is not None:  # a default the chain overrides is no news
                report.warnings.append(why)
    report.chunk_bytes = plan.chunk_bytes

    def read_metadata():
        return metadata

    if not cls.maps:
        if warm is not None:
            warm.join(report, timeout_s)
        return cls.run(CloneContext(session, dev, schedule, manifest, gen, report, t_start, seed_rec, verify,
                                    timeout_s, plan.chunk_bytes, clones, retry, hook, read_metadata, nixl_warm,
                                    into))

    session.start_arena(into, manifest.arena_nbytes, dev)  # made during the exchange, taken after it
    sources = _Sources(session, dev, gen, schedule, manifest, seed_desc, int(seed_rec.body["pid"]), chosen, timeout_s,
                       rank, held=held_sources, chunk_bytes=plan.chunk_bytes)
    my_steps, departed = _skip_departed(plan, list(plan.steps_into(slot)), sources)
    if departed:  # a clone that failed (its barrier ran out, say) leaves too: not "finished"
        failed = {p for p in departed if _failed_status(rdv, _gkey(gen, schedule, "status", p))}
        report.source_note = ", ".join(f"{_clone_names(ps)} had {how} and exited"
                                       for ps, how in ((departed - failed, "finished"), (failed, "failed")) if ps)
    upstream = {s.src for s in my_steps}
    dead: set[int] = set()
    tx = time.perf_counter()
    for p in sorted(upstream):
        try:
            sources.open(p)
        except (ArenaError, RendezvousError, WaitTimeoutError) as exc:
            if not retry:
                raise CloneError(f"clone #{position}: cannot map its source {'seed' if p == 0 else f'clone #{p}'}: "
                                 f"{exc}") from exc
            dead.add(p)
            report.recovered.append(f"source #{p} could not be mapped ({exc}); re-attaching")
    t3 = time.perf_counter()
    report.exchange_ms = (t3 - t0) * 1e3
    report.exchange_detail = {"seed_record_ms": report.manifest_ms, "join_ms": (t2 - t1) * 1e3,
                              **{k: round(v, 4) for k, v in sources.detail.items()},
                              "open_sources_ms": (t3 - tx) * 1e3}
    ta = time.perf_counter()
    _map_ahead(session, [s for s in my_steps if s.src not in dead], sources, report)
    session.take_arena(into, manifest.arena_nbytes, dev)
    if session.arena.nbytes != manifest.arena_nbytes:
        raise RendezvousError(f"our arena on {dev} rounds to {session.arena.nbytes:,} bytes, the seed's to "
                              f"{manifest.arena_nbytes:,} (different allocation granularity)")
    tf = time.perf_counter()
    session.flags = create_flags(plan.flag_count(slot), dev)
    me = Endpoint(slot, f"clone #{position}", session.arena, session.flags)
    te = time.perf_counter()
    sealed = {"arena": session.arena.export().to_dict(), "flags": session.flags.export().to_dict()}
    tp = time.perf_counter()
    rdv.publish(_gkey(gen, schedule, "member", position),
                {"position": position, "pid": os.getpid(), "host": socket.gethostname(), "device": str(dev),
                 "manifest_digest": manifest.digest, "chunk_bytes": plan.chunk_bytes}, sealed=sealed)
    t_rec = time.perf_counter()  # one clock read ends both the step and its last part
    report.alloc_ms = (t_rec - ta) * 1e3
    report.alloc_detail = {"our_arena_ms": round((tf - ta) * 1e3 - report.map_ahead_ms, 3),
                           "flags_ms": round((te - tf) * 1e3, 3), "export_ms": round((tp - te) * 1e3, 3),
                           "record_ms": round((t_rec - tp) * 1e3, 3)}
    if clones is not None:
        report.barrier_ms = rdv.barrier(_gkey(gen, schedule, "start"), clones, timeout_s=timeout_s)

    if warm is not None:
        warm.join(report, timeout_s, "copy")
    mover = _check_mover(dev, mover)
    steps = my_steps
    fallback: int | None = None
    for p in sorted(dead):
        steps, fallback = _reroute(plan, steps, p, dead, sources, image, report, fallback)
    done_ids: set[int] = set()
    tainted: set[int] = set()
    ran: dict[int, Step] = {}  # the version of each step that put its bytes in place
    mapped_before = _map_stats_of(sources.endpoints.values())
    ttx = time.perf_counter()
    lanes = []
    for attempt in range(len(plan.participants) + 4):
        endpoints = dict(sources.endpoints)
        endpoints[slot] = me
        host_span = sources.host_image.span() if sources.host_image is not None else None
        try:
            ex = Executor(plan, endpoints, slot, mover=mover, host_image=host_span, timeout_s=timeout_s,
                          steps=steps, skip=done_ids, step_hook=hook)
            rep = session.run(ex)
            lanes += [l.__dict__ | {"gbps": l.gbps} for l in rep.lanes]
            ran.update({s.id: s for s in steps if s.id not in done_ids})
            done_ids |= {s.id for s in steps}
            break
        except StepFailure as failure:
            ran.update({s.id: s for s in steps if s.id in failure.valid_steps and s.id not in done_ids})
            done_ids |= failure.valid_steps
            tainted |= failure.tainted_steps
            if not retry or failure.peer is None:
                raise CloneError(f"clone #{position} on {dev}: {failure}") from failure
            lost = failure.peer
            dead.add(lost)
            what = "seed" if lost == _SEED_INDEX else sources.endpoints[lost].name if lost in sources.endpoints \
                else f"source #{lost}"
            if sources.pids.get(lost):
                what += f" (pid {sources.pids[lost]})"
            report.recovered.append(f"{what} {'exited' if failure.peer_exited else 'stalled'} at step "
                                    f"{failure.step.id if failure.step else '?'}")
            sources.drop(lost)
            steps, fallback = _reroute(plan, [s for s in steps if s.id not in done_ids], lost, dead, sources, image,
                                       report, fallback)
    else:
        raise CloneError(f"clone #{position}: gave up after {len(plan.participants) + 4} attempts ({report.recovered})")
    report.transfer_ms = (time.perf_counter() - ttx) * 1e3
    report.lanes = lanes
    _note_lazy_mapping(report, sources.endpoints.values(), mapped_before)

    # Upstream clones that released blocked streams (CUDA) may have let us copy bytes they later redid.
    try:
        redone = _repair_from_upstream(plan, position, list(ran.values()), sources, session, mover, timeout_s,
                                       report, dead)
    except StoreLostError as exc:
        # their final status is out of reach: the seed's checksums are the proof left
        report.warnings.append(f"{exc}; verifying against the seed's manifest instead")
        redone, verify = set(), True
    redone |= tainted
    report.redone_bytes = sum(plan.steps[i].nbytes for i in redone)
    report.ready_ms = (time.perf_counter() - t_start) * 1e3
    report.ready_unix = time.time()
    if verify:
        tv = time.perf_counter()  # the wait for the checksum kernel counts in verify_ms
        if warm is not None:
            warm.join(report, timeout_s)
        _verify(session.arena, manifest, f"clone #{position} on {dev}")
        report.verify_ms = (time.perf_counter() - tv) * 1e3
        report.verified = True
    used = sorted({s.src for s in ran.values()})
    report.source = ", ".join("the host image" if p == HOST else sources.endpoints[p].name if p in sources.endpoints
                              else ("seed" if p == _SEED_INDEX else f"clone #{p}") for p in used)
    lost_before = rdv.lost
    try:
        _publish_done(rdv, gen, schedule, position, manifest, session, redone, plan)
    except StoreLostError as exc:
        # every byte is in place (and verified when asked): losing the store costs later clones a
        # source, not this clone its weights
        why = exc if lost_before is None else f"the store at {rdv.address} is gone (see above)"
        report.warnings.append(f"{why}; kept the weights ({manifest.nbytes:,} bytes"
                               f"{', verified' if report.verified else ''}), not announced as a source")
    if schedule == "chain":
        def successors() -> list[str]:
            joined = max(session.rdv.add(_gkey(gen, schedule, "join"), 0), clones or 0)
            return [_gkey(gen, schedule, "status", position + 1)] if joined > position else []
        session.dependents_of = successors
    # mappings of our sources are no longer needed; our own arena and flags stay exported
    session.close_opened()
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    report.finished_unix = time.time()
    return CloneResult(session.arena, _views(session.arena, metadata), report, metadata=metadata, _session=session)


def _map_ahead(session: _Session, steps: list[Step], sources: _Sources, report: CloneReport) -> None:
    """Map the segments ``steps`` read from their sources, in the order they read them, while our
    own arena is still being made in the background (its driver calls: ~20 ms for 13.8 GB on an
    H200), and stop as soon as it is done: the rest are mapped during the copy, as before. Mapped
    there, one group just ahead of its copies, the host's mapping paced a same-GPU clone at
    0.55-0.6x the copy rate. A segment that fails to map is left to the copy, which names its
    source and re-attaches elsewhere (as for any segment mapped on first use)."""
    if not session.arena_in_progress:
        return
    t0 = time.perf_counter()
    arenas = {id(ep.arena): ep.arena for ep in sources.endpoints.values() if ep.arena is not None}
    before = {k: a.map_stats["segments"] for k, a in arenas.items()}
    order: dict[tuple[int, int], Any] = {}  # (arena, segment) in the order the steps read them
    for s in steps:
        ep = sources.endpoints.get(s.src)
        if s.kind == "copy" and ep is not None and ep.arena is not None and not ep.arena.closed:
            seg = ep.arena.segment_bytes
            order.update(((id(ep.arena), i), ep.arena) for i in range(s.offset // seg, -(-s.end // seg)))
    for (_, i), arena in order.items():
        if not session.arena_in_progress:
            break
        seg = arena.segment_bytes
        try:
            arena.map_range(i * seg, min(seg, arena.nbytes - i * seg))
        except FlashBootError:
            break  # the copy maps it again and fails over from there
    report.map_ahead_ms = (time.perf_counter() - t0) * 1e3
    report.segments_mapped_ahead = sum(a.map_stats["segments"] - before[k] for k, a in arenas.items()
                                       if not a.closed)


def _clone_names(positions: set[int]) -> str:
    """``clone #3``, ``clones #1..#3`` or ``clones #1, #3``."""
    lo, hi = min(positions), max(positions)
    return f"clone #{lo}" if lo == hi else f"clones #{lo}..#{hi}" if len(positions) == hi - lo + 1 else \
        "clones " + ", ".join(f"#{p}" for p in sorted(positions))


def _failed_status(rdv: Rendezvous, status_key: str) -> bool:
    """Whether the clone of ``status_key`` said it failed (a status unreadable here: not known to)."""
    try:
        status = rdv.try_read(status_key)
    except StoreLostError:
        raise
    except RendezvousError:
        return False
    return status is not None and status.body.get("state") == "failed"


def _skip_departed(plan: Plan, steps: list[Step], sources: _Sources) -> tuple[list[Step], set[int]]:
    """``steps`` re-wired past upstream clones that finished and exited (a chain run one clone after
    another: each predecessor is gone by the time its successor joins), and those clones. Not a
    failure: they said they left, so nothing is tried on them."""
    departed: set[int] = set()
    while True:
        gone = {p for p in {s.src for s in steps} if p not in departed and sources.left(p)}
        if not gone:
            return steps, departed
        departed |= gone
        steps = rewire(plan, steps, min(gone), dead=departed)


def _reroute(plan: Plan, steps: list[Step], lost: int, dead: set, sources: _Sources, image: Any,
             report: CloneReport, fallback: int | None) -> tuple[list[Step], int | None]:
    """Re-attach ``steps`` that read from ``lost``: upstream first, then a full copy elsewhere,
    then the host image. Opens whatever new source that needs."""
    for _ in range(len(plan.participants) + 2):
        try:
            new = rewire(plan, steps, lost, fallback=fallback, dead={d for d in dead if isinstance(d, int)})
        except FlashBootError:
            if fallback is None:
                try:
                    found = sources.full_copy(set())
                except StoreLostError as exc:  # the clones that finished cannot be found without it
                    found = None
                    report.recovered.append(f"no other full copy can be found: {exc}")
                    report.warnings.append(str(exc))
                if found is not None:
                    fallback, who = found
                    report.recovered.append(f"re-attached to {who}")
                    continue
                if image is not None:
                    fallback, who = sources.image(image)
                    report.recovered.append(f"loading the rest from {who}")
                    continue
            found_none = "the store is lost" if sources.rdv.lost else "no finished clone alive"
            raise CloneError(f"clone #{report.position}: its source {'seed' if lost == 0 else f'#{lost}'} is gone "
                             f"and no other holds the bytes ({found_none}, no image=); "
                             f"history: {'; '.join(report.recovered)}") from None
        # open any new upstream participant the rewired steps read from or wait on
        need = {s.src for s in new if s.src != HOST} | {plan.flag_of(w)[0] for s in new for w in s.waits}
        need.discard(report.position)
        failed = None
        for p in sorted(need):
            if p in sources.endpoints:
                continue
            try:
                sources.open(p)
            except (ArenaError, RendezvousError, WaitTimeoutError) as exc:
                failed = (p, exc)
                break
        if failed is None:
            srcs = sorted({s.src for s in new})
            names = [sources.endpoints[p].name if p in sources.endpoints else "the host image" for p in srcs]
            report.recovered.append(f"re-attached to {', '.join(names)}")
            return new, fallback
        p, exc = failed
        dead.add(p)
        report.recovered.append(f"{'seed' if p == 0 else f'source #{p}'} could not be mapped ({exc})")
        steps, lost = new, p
        if p == fallback:
            fallback = None
    raise CloneError(f"clone #{report.position}: no source left ({'; '.join(report.recovered)})")


def _repair_from_upstream(plan: Plan, position: int, run_steps: list[Step], sources: _Sources,
                          session: _Session, mover, timeout_s: float, report: CloneReport, dead: set[int]) -> set[int]:
    """Re-copy ranges an upstream clone reports as redone (after it released blocked CUDA streams).

    Waits (bounded, and only while it lives) for the final status of each clone we read from; a
    clone that was killed never released a stream, so the flags it raised were honest. Returns our
    step ids redone."""
    rdv = session.rdv
    gen, schedule = sources.gen, sources.schedule
    redone: set[int] = set()
    read_from: dict[int, list[Step]] = {}
    for s in run_steps:
        if s.kind == "copy" and 0 < s.src < _FALLBACK_INDEX and s.src not in dead:
            read_from.setdefault(s.src, []).append(s)
    for p, steps in read_from.items():
        key = _gkey(gen, schedule, "status", p)
        pid = sources.pids.get(p)
        deadline = time.monotonic() + timeout_s
        rec = None
        while rec is None:
            try:
                rec = rdv.read(key, what=f"the final status of clone #{p}", timeout_s=0.25)
            except WaitTimeoutError:
                if pid is not None and not _alive(pid):
                    break
                if time.monotonic() > deadline:
                    raise WaitTimeoutError(f"clone #{position}: waited {timeout_s:g} s for the final status of its "
                                           f"source clone #{p} (pid {pid})") from None
        if rec is None:
            continue
        if rec.body.get("state") != "done":
            raise CloneError(f"clone #{position}: its source clone #{p} failed after we copied from it "
                             f"({rec.body.get('error', '?')}); its bytes cannot be trusted")
        ranges = [tuple(r) for r in rec.body.get("redone", [])]
        bad = [s for s in steps if any(lo < s.end and s.offset < lo + n for lo, n in ranges)]
        if bad:
            fixes = [replace(s, waits=()) for s in bad]
            session.run(Executor(plan, {**sources.endpoints, position: Endpoint(position, "self", session.arena,
                                                                                session.flags)},
                                 position, mover=mover, timeout_s=timeout_s, steps=fixes))
            redone |= {s.id for s in bad}
            report.recovered.append(f"re-copied {len(bad)} chunk(s) clone #{p} redid")
    return redone


def _publish_done(rdv: Rendezvous, gen: str, schedule: str, position: int, manifest: Manifest, session: _Session,
                  redone: set[int], plan: Plan) -> None:
    ranges = [[plan.steps[i].offset, plan.steps[i].nbytes] for i in sorted(redone)]
    rdv.publish(_gkey(gen, schedule, "status", position), {"state": "done", "redone": ranges, "pid": os.getpid()})
    k = rdv.add(_gkey(gen, "done", "count"), 1)
    rdv.publish(_gkey(gen, "done", k), {"schedule": schedule, "position": position, "pid": os.getpid(),
                                        "host": socket.gethostname(), "manifest_digest": manifest.digest},
                sealed={"arena": session.arena.export().to_dict()})


def linger(result: CloneResult, *, timeout_s: float = DEFAULT_TIMEOUT_S, forever: bool = False,
           stop: threading.Event | None = None) -> None:
    """Keep a finished clone available to those who read from it.

    ``forever``: until SIGTERM/SIGINT, or until ``stop`` is set where one is given (its caller then
    owns the signals) (the clone serves as a source, e.g. for retries). Otherwise
    until the participants that read from it (a chain successor, a ring successor) have reported
    a final status, at most ``timeout_s``; returns quietly when nobody depends on it.
    """
    session = result._session
    if session is None or session.rdv is None:
        return
    lost_before = session.rdv.lost
    if forever:
        serve_until_stopped(stop or threading.Event(), None, handle_signals=stop is None)
        return
    try:
        keys = list(session.dependents) + (session.dependents_of() if session.dependents_of else [])
        if keys:
            session.rdv.wait_keys(keys, what="the participants reading from this clone to finish", timeout_s=timeout_s)
    except StoreLostError as exc:  # nobody can report to us any more; readers hold their own mappings
        why = exc if lost_before is None else f"the store at {session.rdv.address} is gone"
        result.report.warnings.append(f"{why}; stopped lingering (readers of this clone cannot report to it)")
    except WaitTimeoutError:
        pass  # they hold their own mapping by now or will re-attach upstream; we only waited to be polite
