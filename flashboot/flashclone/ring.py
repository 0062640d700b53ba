"""Ring all-gather load: N members each load a 1/N shard of a host image, then gather the rest."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from ..errors import FlashBootError, RendezvousError
from ..memory import CPU, Device
from ..schedulers import HOST, build_plan, shard_bounds
from .executor import Endpoint, Executor, StepFailure, create_flags, rewire
from .manifest import Manifest
from .rendezvous import DEFAULT_TIMEOUT_S, StoreLostError
from .common import _agree_chunk, _alive, _check_mover, _default_mover, _descriptor_from, _note_lazy_mapping, _same_host, _step_hook, _verify, _views
from .report import CloneReport, CloneResult
from .warmup import CloneWarmup
from .session import _Session
from .sources import _HostImage
from .transports.posix_fd import _open_arena
from .transports.nixl import AgentWarmup
from .transports.registry import Seen, choose_transport


def ring_load(store: str, image: Any, device: Any = None, *, members: int, rank: int = 0, verify: bool = False,
              timeout_s: float = DEFAULT_TIMEOUT_S, mover: Any = None, chunk_bytes: int | None = None, token=None,
              token_file=None, name: str = "default", run: str = "ring", expect: Any = None,
              step_delay_s: float | None = None, pin_early: bool = False, transport: str = "auto",
              prepared: CloneWarmup | None = None) -> CloneResult:
    """Load ``image`` on ``members`` processes at once: each loads a 1/N byte shard from the host
    and gathers the rest from its predecessor in a ring (paper §3.6).

    Member positions come by arrival order at the store (the first to arrive hosts it unless one
    listens there already). All members must hold the same image (manifests compared before any
    byte moves). ``run`` names this gathering: the last member to leave (``close()``) frees the name
    for the next load; while a load runs, or after one whose member failed or was killed
    (SIGKILL: it never leaves, so the name stays taken in that store for good), use another.
    A failure to free the name is in ``report.warnings``.
    ``pin_early``: map and pin the shard before the start barrier (off the critical path, as
    FlashLoad's pin-early and served modes do) instead of after it; ``load_ms``/``pin_ms`` say
    what it cost either way. Pinning needs the image in anonymous or tmpfs-backed memory (stage
    it into /dev/shm); a file on disk is refused with a CapabilityError that says so.
    ``transport``: how a member reads its predecessor. ``"auto"`` maps it (``posix_fd`` on the same
    host, ``fabric`` in an NVLink domain), as do those names; ``"nixl"`` READs it through NIXL, on
    any host (every member passes it; each needs its own copy of the image). ``prepared``: the
    early call's warm-up (:func:`~flashboot.flashclone.prepare_clone`), as for :func:`clone`.
    """
    from ..arena import Arena

    if not isinstance(members, int) or members < 1:
        raise FlashBootError(f"members must be a positive int, got {members!r}")
    if not isinstance(run, str) or not run or "/" in run:
        raise FlashBootError(f"run must be a non-empty name without '/', got {run!r}")
    t_start = time.perf_counter()
    dev = Device.parse(device)
    mover_obj = _check_mover(dev, _default_mover(dev, mover))
    if transport not in ("auto", "posix_fd", "fabric", "nixl"):
        raise FlashBootError(f"a ring reads its predecessor through 'auto', 'posix_fd', 'fabric' or 'nixl', "
                             f"not {transport!r}")
    path = Path(image)
    if not path.exists():  # before any store is hosted or joined: it had been a bare FileNotFoundError
        raise FlashBootError(f"ring image {str(path)!r} does not exist (pass a pre-packed image directory or an "
                             "image file)")
    hook = _step_hook(step_delay_s)
    nixl_warm = AgentWarmup.start_for(transport, "ring", timeout_s)
    if prepared is not None:
        prepared.check_device(dev)
    # overlaps connecting; joined before any descriptor is requested
    warm = prepared if prepared is not None else CloneWarmup(dev, verify=verify, mover=mover_obj)
    import torch  # noqa: F401  (before the store's torch.distributed: see clone(), where torch is imported)
    session = _Session.connect(store, token, token_file, name, host=True, timeout_s=timeout_s, keep=nixl_warm)
    rdv = session.rdv
    try:
        warm_report = CloneReport("ring", 0, str(dev), 0)
        warm.join(warm_report, timeout_s)
        t0 = time.perf_counter()
        from flashboot.layouts import read_image_metadata

        meta = read_image_metadata(path, rank) if path.is_dir() else None
        if meta is not None:
            manifest = Manifest.from_metadata(meta)
        else:
            try:
                nbytes = path.stat().st_size
            except OSError as exc:  # removed since the check above, or unreadable
                raise FlashBootError(f"ring image {str(path)!r}: {exc.strerror or exc}") from None
            from flashboot.kernels.checksum import chunk_checksums

            probe = _HostImage(path, CPU)
            try:
                manifest = Manifest(nbytes, -(-nbytes // (2 << 20)) * (2 << 20), 64 << 20,
                                    tuple(chunk_checksums(probe.span(), 64 << 20)))
            finally:
                probe.close()
        manifest.require(expect, f"image {str(path)!r}")
        position = rdv.add(f"{run}/join", 1)
        if position > members:
            raise RendezvousError(f"ring {run!r} already has its {members} members (this is arrival {position}); "
                                  "a load still running, or one whose member failed or was killed, holds the name: "
                                  "use another "
                                  "(`flashboot clone --run NAME`, run= in Python)")
        me = position - 1
        report = CloneReport("ring", position, str(dev), manifest.nbytes, mover=mover_obj.name,
                             connect_ms=(t0 - t_start) * 1e3, warm_ms=warm_report.warm_ms,
                             warm_note=warm_report.warm_note, pin_early=pin_early)
        plan = build_plan("ring", members, manifest.nbytes, chunk_bytes)
        # one chunk size and member count per run: members that differ waited on flags never raised
        agreed, why = _agree_chunk(rdv, f"{run}/plan", plan.chunk_bytes, f"ring member {me}", members=members)
        if agreed != plan.chunk_bytes:
            plan = build_plan("ring", members, manifest.nbytes, agreed)
            if chunk_bytes is not None:
                report.warnings.append(why)
        report.chunk_bytes = plan.chunk_bytes
        shard_off, shard_n = shard_bounds(manifest.nbytes, members)[me]

        def map_shard() -> _HostImage:
            tl = time.perf_counter()
            img = _HostImage(path, dev, rank=rank, pin=(shard_off, shard_n))
            session.extra.append(img)
            report.load_ms = (time.perf_counter() - tl) * 1e3  # mapping (and pinning the shard)
            report.pin_ms = img.pin_ms
            return img

        img = map_shard() if pin_early else None
        ta = time.perf_counter()
        session.arena = Arena.create(manifest.arena_nbytes, dev)
        if nixl_warm is not None:
            rdv.bounded = True  # the store may sit across the same link as the peers: no call may hang on it
            agent = nixl_warm.join(timeout_s)
            session.extra.append(agent)
            sealed = {"nixl": agent.register(session.arena)}
        else:
            session.flags = create_flags(plan.flag_count(me), dev)
            sealed = {"arena": session.arena.export().to_dict(), "flags": session.flags.export().to_dict()}
        rdv.publish(f"{run}/member/{me}", {"member": me, "pid": os.getpid(), "host": socket.gethostname(),
                                           "device": str(dev), "manifest_digest": manifest.digest,
                                           "transport": transport, "chunk_bytes": plan.chunk_bytes}, sealed=sealed)
        session.status_key = f"{run}/status/{me}"
        report.alloc_ms = (time.perf_counter() - ta) * 1e3
        report.barrier_ms = rdv.barrier(f"{run}/start", members, timeout_s=timeout_s)
        # every member must hold the same image before any byte moves
        tx = time.perf_counter()
        pred = (me - 1) % members
        endpoints = {me: Endpoint(me, f"member {me}", session.arena, session.flags)}
        for j in range(members):
            if j == me:
                continue
            rec = rdv.read(f"{run}/member/{j}", what=f"ring member {j}'s descriptors", timeout_s=timeout_s)
            if rec.body.get("manifest_digest") != manifest.digest:
                raise RendezvousError(f"ring member {j} holds another image (manifest {rec.body.get('manifest_digest')}, "
                                      f"ours {manifest.digest}); refused before any byte moved")
            if rec.body.get("chunk_bytes") != plan.chunk_bytes:
                raise RendezvousError(f"ring member {j} copies by {rec.body.get('chunk_bytes')!r}-byte chunks, we by "
                                      f"{plan.chunk_bytes:,}; refused before any byte moved")
            _check_present(rdv, run, j, rec)  # after those: a member that refused our image left for that
            if j == pred and nixl_warm is None:
                arena_desc = _descriptor_from(rec.sealed["arena"])
                try:  # the ring maps its predecessor: only a mapping transport will do
                    cls, _ = choose_transport(Seen(arena_desc, {"nccl": False, "nixl": False}), dev, transport)
                except RendezvousError as exc:
                    raise RendezvousError(f"ring member {j} on {arena_desc.hostname!r} cannot be mapped from here "
                                          f"({exc}); across hosts run the ring with transport='nixl'") from None
                transport = cls.name
                opened = [_open_arena(arena_desc, dev, transport)]
                session.opened[j] = opened
                opened.append(_open_arena(_descriptor_from(rec.sealed["flags"]), dev, transport))
                report.transport = transport
                endpoints[j] = Endpoint(j, f"member {j}", opened[0], opened[1],
                                        int(rec.body["pid"]) if _same_host(arena_desc) else None)
        report.exchange_ms = (time.perf_counter() - tx) * 1e3
        if img is None:
            img = map_shard()
        tt = time.perf_counter()
        if nixl_warm is not None:
            from .transports.nixl import ring_member

            report.transport, report.mover = "nixl", "nixl/UCX"
            used = ring_member(rdv=rdv, agent=agent, run=run, plan=plan, me=me, manifest=manifest, dev=dev,
                               arena=session.arena, image=img.span(), mover=mover_obj, report=report,
                               timeout_s=timeout_s, hook=hook)
        else:
            used = _executor_ring(plan, endpoints, me, mover_obj, img, timeout_s, hook, report, session, members)
        report.transfer_ms = (time.perf_counter() - tt) * 1e3
        report.ready_ms = (time.perf_counter() - t_start) * 1e3
        report.ready_unix = time.time()
        report.source = f"host shard {shard_off:,}..{shard_off + shard_n:,} + member {pred}"
        if members > 1 and pred not in used:
            report.source = f"host image (member {pred} was not read)"
        if verify:
            tv = time.perf_counter()
            _verify(session.arena, manifest, f"ring member {me} on {dev}")
            report.verify_ms = (time.perf_counter() - tv) * 1e3
            report.verified = True
        try:
            rdv.publish(session.status_key, {"state": "done", "pid": os.getpid()})
        except StoreLostError as exc:  # every byte is in place: the weights are kept
            report.warnings.append(f"{exc}; kept the weights ({manifest.nbytes:,} bytes"
                                   f"{', verified' if report.verified else ''})")
        session.dependents = [f"{run}/status/{(me + 1) % members}"] if members > 1 else []
        session.on_leave = lambda r: _clear_run(r, run, members, report.warnings)
        session.close_opened()
        img.close()
        session.extra.remove(img)
        report.total_ms = (time.perf_counter() - t_start) * 1e3
        report.finished_unix = time.time()
        return CloneResult(session.arena, _views(session.arena, meta), report, metadata=meta, _session=session)
    except BaseException:
        session.close(keep_arena=False)
        raise


def _check_present(rdv, run: str, j: int, rec) -> None:
    """RendezvousError where member ``j``'s record is of a member that is gone: it left (failed, or
    finished and gave up waiting for us) or, on this host, its process is dead. An earlier load under
    ``run`` that failed at its start barrier left such records and its arrivals counted: the
    members of a later load that still fit passed that count's barrier (the last one alone) and
    had read the dead member's record, failing with the bare ArenaError of an exited pid."""
    pid, host = rec.body.get("pid"), rec.body.get("host")
    if rdv.has(f"{run}/status/{j}/left"):
        why = "has left"
    elif host == socket.gethostname() and type(pid) is int and not _alive(pid):
        why = "has exited"
    else:
        return
    raise RendezvousError(f"ring {run!r}: member {j} (pid {pid} on {host}) {why} before this member read its "
                          "descriptors; a load whose member failed or was killed holds the name for good, or "
                          "this member came after its ring had started: refused before any byte moved, use "
                          "another name (`flashboot clone --run NAME`, run= in Python)")


def _clear_run(rdv, run: str, members: int, warnings: list | None = None) -> None:
    """The last member of ``run`` to leave deletes its keys, so the next load may use the name
    again (a load with a failed member keeps them: its name stays taken, as the error says).
    A store that fails here is said in ``warnings``: the next load under the name is refused."""
    try:
        if rdv.add(f"{run}/left", 1) != members:
            return
        keys = [f"{run}/plan", f"barrier/{run}/start/go", f"barrier/{run}/start/count"]
        for j in range(members):
            keys += [f"{run}/member/{j}", f"{run}/status/{j}", f"{run}/status/{j}/left", f"{run}/nixl/held/{j}"]
        for key in keys + [f"{run}/left", f"{run}/join"]:  # the arrival counter last: a new load starts from 1
            rdv.delete(key)
    except FlashBootError as exc:
        if warnings is None:
            raise
        warnings.append(f"could not free the ring run name {run!r} in the store at {rdv.address} ({exc}); a "
                        f"later load under it is refused: give it another (--run NAME)")


def _executor_ring(plan, endpoints: dict, me: int, mover, img, timeout_s: float, hook, report, session,
                   members: int) -> set[int]:
    """The ring over mapped arenas: the executor runs our steps (flags in the arenas' flag arrays).
    A lost predecessor: whatever it would have passed on comes from the host image."""
    try:
        rep = session.run(Executor(plan, endpoints, me, mover=mover, host_image=img.span(), timeout_s=timeout_s,
                                   step_hook=hook))
    except StepFailure as failure:
        report.recovered.append(f"member {failure.peer} {'exited' if failure.peer_exited else 'stalled'}")
        remaining = [s for s in plan.steps_into(me) if s.id not in failure.valid_steps]
        new = rewire(plan, remaining, failure.peer, fallback=HOST, dead=set(range(members)) - {me})
        session.close_opened(failure.peer)
        endpoints.pop(failure.peer, None)
        rep = session.run(Executor(plan, endpoints, me, mover=mover, host_image=img.span(), timeout_s=timeout_s,
                                   steps=new))
        report.recovered.append("loaded the rest from the host image")
    report.lanes = [l.__dict__ | {"gbps": l.gbps} for l in rep.lanes]
    _note_lazy_mapping(report, (ep for j, ep in endpoints.items() if j != me))
    return {(me - 1) % members} if members > 1 else set()
