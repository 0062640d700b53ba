"""The fallback: an NCCL (gloo on the host backend) broadcast from the seed."""

from __future__ import annotations

import os
import time

from ...errors import RendezvousError, WaitTimeoutError
from ...memory import Device
from ..manifest import Manifest
from ..rendezvous import Rendezvous, parse_address
from ..common import _gkey, _verify, _views
from ..report import CloneReport, CloneResult
from ..session import _Session
from .registry import Seen, Transport, register_transport


def _pg_backend(dev: Device) -> str:
    return "nccl" if dev.is_cuda else "gloo"


def _process_group(rdv: Rendezvous, prefix: str, rank: int, dev: Device, timeout_s: float,
                   peer: str = "the clone that asked"):
    """A 2-rank process group (NCCL on CUDA, gloo on the host backend) over the rendezvous store.
    WaitTimeoutError (RendezvousError) naming ``peer`` when it does not form: torch raised a raw
    RuntimeError (DistStoreError) with its C++ frames."""
    try:
        return _make_group(rdv, prefix, rank, dev, timeout_s)
    except RuntimeError as exc:
        why = _first_line(exc)
    raise (WaitTimeoutError if "time" in why.lower() else RendezvousError)(
        f"{peer} did not form the {_pg_backend(dev)} group {prefix!r} with this process (rank {rank}) within "
        f"{timeout_s:g} s ({why}); a seed answers one broadcast at a time, and each side must reach the other")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _make_group(rdv: Rendezvous, prefix: str, rank: int, dev: Device, timeout_s: float):
    import datetime

    import torch.distributed as dist

    store = dist.PrefixStore(rdv.full_key(prefix), rdv.store)  # its keys: common.PG_STORE_KEYS
    if dev.is_cuda:
        import torch

        torch.cuda.set_device(dev.index)
        return dist.ProcessGroupNCCL(store, rank, 2)
    # gloo listens on, and tells its peer, what this host's name resolves to: 127.0.1.1 on Debian
    # and Ubuntu, or loopback when it resolves nowhere, so a clone on another host waited for a
    # connection to its own loopback. The address this host reaches the store from reaches it
    # (unless that is loopback: a store on this host, or a seed hosting it at 0.0.0.0).
    here = None if os.environ.get("GLOO_SOCKET_IFNAME") else _address_towards(rdv.address, rdv.ip)  # else the caller's
    if here is None:
        return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _address_towards(address: str, ip: str | None = None) -> str | None:
    """This host's address on the route to ``address`` (``HOST:PORT``; no packet is sent), or None
    when that is a loopback address or cannot be found. ``ip``: the address its host was joined at
    (the name is not looked up again: unbounded, where a name server had stopped answering)."""
    import ipaddress
    import socket

    host, port = parse_address(address)
    host = ip or host
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(sockaddr)
            here = s.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(here.split("%")[0]).is_loopback else here


def _broadcast(pg, tensor, dev: Device, timeout_s: float, peer: str = "the clone that asked") -> None:
    """Broadcast ``tensor`` from rank 0; WaitTimeoutError (RendezvousError when it broke otherwise)
    naming ``peer`` and the bytes, where gloo raised a raw RuntimeError ("Operation timed out!")."""
    import datetime

    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    t0 = time.monotonic()
    try:
        work = pg.broadcast([tensor], opts)
        finished = work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        why = _first_line(exc)
    else:
        why = None if finished else "unfinished"
    if why is not None:
        raise (WaitTimeoutError if why == "unfinished" or "time" in why.lower() else RendezvousError)(
            f"the broadcast of {tensor.numel():,} bytes with {peer} ended after {time.monotonic() - t0:.1f} s "
            f"({why}; timeout {timeout_s:g} s): is the link between them down, or the other side gone?")
    if dev.is_cuda:
        import torch

        torch.cuda.synchronize(dev.index)


def _shutdown_pg(pg) -> None:
    for name in ("shutdown", "abort"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort: the group is finished either way
                pass
            return


def _clone_nccl(session: _Session, dev: Device, manifest: Manifest, metadata, gen: str, report: CloneReport,
                t_start: float, *, verify: bool, timeout_s: float, into=None, seed: str = "the seed") -> CloneResult:
    """The fallback: ask the seed for a broadcast over a fresh 2-rank process group."""
    rdv = session.rdv
    ta = time.perf_counter()
    session.take_arena(into, manifest.arena_nbytes, dev)
    report.alloc_ms = (time.perf_counter() - ta) * 1e3
    tx = time.perf_counter()
    rid = rdv.add(_gkey(gen, "nccl", "count"), 1)  # the seed reads (and authenticates) the request next
    rdv.publish(_gkey(gen, "nccl", "req", rid), {"pid": os.getpid(), "device": str(dev), "position": report.position})
    pg = _process_group(rdv, _gkey(gen, "nccl", "pg", rid), 1, dev, timeout_s, peer=seed)
    report.exchange_ms = (time.perf_counter() - tx) * 1e3
    tt = time.perf_counter()
    session.wrote = True
    try:
        _broadcast(pg, session.arena.bytes()[: manifest.nbytes], dev, timeout_s, peer=seed)
    finally:
        _shutdown_pg(pg)
    report.transfer_ms = (time.perf_counter() - tt) * 1e3
    report.ready_ms = (time.perf_counter() - t_start) * 1e3
    report.ready_unix = time.time()
    report.source = "seed (broadcast)"
    report.mover = _pg_backend(dev)
    if verify:
        tv = time.perf_counter()
        _verify(session.arena, manifest, f"clone #{report.position} on {dev} (broadcast)")
        report.verify_ms = (time.perf_counter() - tv) * 1e3
        report.verified = True
    rdv.publish(session.status_key, {"state": "done", "redone": [], "pid": os.getpid(), "transport": "nccl"})
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    report.finished_unix = time.time()
    return CloneResult(session.arena, _views(session.arena, metadata), report, metadata=metadata, _session=session)


@register_transport
class Nccl(Transport):
    """A broadcast from the seed over a fresh 2-rank torch.distributed group (NCCL; gloo on the host backend)."""

    name = "nccl"
    order = 30
    reach = "any_host"
    memory = ("host", "device")
    setup = "a communicator per clone (NCCL init: hundreds of ms to seconds), on the critical path"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import torch.distributed as dist
        except ImportError as exc:
            return False, f"torch.distributed is missing ({exc})"
        return (True, "") if dist.is_available() else (False, "torch.distributed is not built in")

    @classmethod
    def usable(cls, seen: Seen, dev: Device) -> tuple[bool, str]:
        if not seen.offers.get("nccl", True):
            return False, "the seed does not answer broadcasts (--no-nccl)"
        ok, why = cls.availability()
        if not ok:
            return False, why
        return True, (f"seed on {seen.desc.hostname!r}: {_pg_backend(dev).upper() if dev.is_cuda else 'gloo'} "
                      f"broadcast")

    @classmethod
    def run(cls, ctx) -> CloneResult:
        return _clone_nccl(ctx.session, ctx.dev, ctx.manifest, ctx.read_metadata(), ctx.gen, ctx.report, ctx.t_start,
                           verify=ctx.verify, timeout_s=ctx.timeout_s, into=ctx.into,
                           seed=f"the seed (pid {ctx.seed_rec.body.get('pid')} on {ctx.seed_rec.body.get('host')})")
