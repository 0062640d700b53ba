"""A clone's report (where its time went, which transport and why) and its result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import RendezvousError


class CloneError(RendezvousError):
    """A clone could not finish: names the step, the peer and what was tried."""


@dataclass
class CloneReport:
    """Where one clone's time went (milliseconds) and how it got its bytes.

    ``transport``: a registered transport (``posix_fd``, ``fabric``, ``nixl``, ``nccl``;
    ``transport_note`` says why ``auto`` took it, naming each one passed over). ``exchange_ms``: from requesting the seed's record (descriptor) to every
    source's arena (and flags) opened, its first segment mapped and readable: store get +
    authentication + decryption, taking a position, and per source its record, ``pidfd_getfd`` of
    every segment, reserve, and the first segment's import, map and set access, and the flags arena
    (``exchange_detail`` splits it; ``manifest_ms`` is its first part). It is the part NCCL's
    communicator setup would replace; our own arena is made in the background during it, and
    ``alloc_ms`` (after it) is what is left of that, with our flags and our record. While our arena
    is still being made, the sources' other segments are mapped in the order the copy reads them
    (``map_ahead_ms``, within ``alloc_ms``, and ``segments_mapped_ahead``); those still unmapped when it is done are mapped
    during the transfer, each just ahead of its first copy: ``map_during_copy_ms`` (host time,
    overlapped with copies already issued) and ``segments_mapped_during_copy``. ``warm_ms``: the one-time warm-up (:mod:`~flashboot.flashclone.warmup`), overlapped with
    connecting and the exchange: the driver's (:func:`flashboot.arena.warm_import`), the copy
    engine's first stream and copy and torch's on CUDA, the host mover's compilation on the host backend (``warm_note`` says which;
    :func:`~flashboot.flashclone.prepare_clone` starts it earlier; ``warm_waits`` is what the clone
    waited for it, by stage). ``transfer_ms``: the copy
    (from the first step issued to the last byte in place, pipeline fill included).
    ``setup_ms`` (nixl): the transport's
    setup on the critical path (waiting for the agent created while connecting, registering our
    arena, adding the sources' agents; ``exchange_detail`` splits it, ``agent_create_ms`` is the
    agent's creation, overlapped with connecting). ``ready_ms``: from the call to the weights in place (verification not included; ``verify_ms``
    is separate, ``total_ms`` includes it). ``recovered``: what happened when a source failed.
    ``warnings``: what went wrong without costing the clone its bytes (the rendezvous store lost
    after the copy: the weights are kept, but later clones cannot find this one as a source).
    """

    schedule: str
    position: int
    device: str
    nbytes: int
    transport: str = "posix_fd"
    transport_note: str = ""
    source: str = ""
    source_note: str = ""
    """Why the source is not the plan's first choice, when that is not a failure (the upstream clones
    of a chain run one after another had finished and exited)."""
    mover: str = ""
    chunk_bytes: int = 0
    connect_ms: float = 0.0
    connect_detail: dict = field(default_factory=dict)
    """``connect_ms`` split: ``start_ms`` (starting the warm-up's threads, checking the mover and
    the transport, starting NIXL's agent where asked), ``import_ms`` (importing torch's store
    client, in a fresh process torch itself), ``store_ms`` (reaching the store), ``warm_wait_ms``
    (waiting for the warm-up), ``other_ms`` (the rest)."""
    warm_ms: float = 0.0
    warm_wait_ms: float = 0.0
    warm_waits: dict = field(default_factory=dict)
    """``warm_wait_ms`` by stage of :data:`~flashboot.flashclone.warmup.STAGES`: ``map`` (in
    ``connect_ms``), ``copy`` (before the transfer, after our arena) and ``verify`` (in ``verify_ms``)."""
    warm_detail: dict = field(default_factory=dict)
    """The warm-up's parts, ms each (the CUDA context, the peer import, the checksum kernel, ...)."""
    warm_note: str = ""
    manifest_ms: float = 0.0
    alloc_ms: float = 0.0
    alloc_detail: dict = field(default_factory=dict)
    """``alloc_ms`` but ``map_ahead_ms`` split: ``our_arena_ms`` (waiting for our arena, made in the
    background), ``flags_ms`` (our flags), ``export_ms`` (our arena and flags exported for later
    clones: each segment's first export costs the driver time), ``record_ms`` (our record published)."""
    exchange_ms: float = 0.0
    exchange_detail: dict = field(default_factory=dict)
    setup_ms: float = 0.0
    barrier_ms: float = 0.0
    load_ms: float = 0.0
    pin_ms: float = 0.0
    pin_early: bool = False
    """Ring: the shard was mapped and pinned before the start barrier (off the critical path)."""
    transfer_ms: float = 0.0
    map_ahead_ms: float = 0.0
    segments_mapped_ahead: int = 0
    map_during_copy_ms: float = 0.0
    segments_mapped_during_copy: int = 0
    ready_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    verified: bool | None = None
    recovered: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    redone_bytes: int = 0
    lanes: list[dict] = field(default_factory=list)
    ready_unix: float = 0.0
    """Wall clock (``time.time()``) when the weights were in place (before verification), for
    "from process start" timings."""
    finished_unix: float = 0.0
    """Wall clock when the call returned (after verification, if asked)."""

    @property
    def gbps(self) -> float:
        """Bytes over the transfer time as the host saw it (issue to last completion), GB/s (1e9)."""
        return self.nbytes / (self.transfer_ms * 1e-3) / 1e9 if self.transfer_ms > 0 else 0.0

    @property
    def stream_gbps(self) -> float:
        """Bytes over the slowest lane's own time (CUDA events from the lane's start to its last
        copy, pipeline fill included), GB/s; 0 when the transfer was not a plan run (broadcast)."""
        seconds = max((l.get("seconds", 0.0) for l in self.lanes), default=0.0)
        return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        d["stream_gbps"] = self.stream_gbps
        return d

    def phases(self) -> dict[str, float]:
        """Where ``ready_ms`` went, in order, ms each: the parts of connecting (importing torch,
        the store, the wait for the warm-up with the warm-up's largest part named), the exchange,
        our arena, the start barrier, the wait for the warm-up's copy parts (the mover's imports),
        the transfer and what is left (``other``)."""
        d = self.connect_detail
        wait = "warm-up wait"
        if self.warm_detail:
            top = max(self.warm_detail, key=self.warm_detail.get)
            wait += f" (of its {self.warm_ms:.0f} ms: {top} {self.warm_detail[top]:.0f})"
        out = {"start": d.get("start_ms", 0.0), "import torch": d.get("import_ms", 0.0), "store": d.get("store_ms", 0.0),
               wait: d.get("warm_wait_ms", 0.0),
               "connect, other": d.get("other_ms", 0.0) if d else self.connect_ms,
               "exchange+map": self.exchange_ms, "setup": self.setup_ms,
               "map ahead (our arena still being made)": self.map_ahead_ms, "alloc": self.alloc_ms - self.map_ahead_ms,
               "barrier": self.barrier_ms, "warm-up wait before the copy": self.warm_waits.get("copy", 0.0),
               "load": self.load_ms, "transfer": self.transfer_ms}
        out["other"] = max(0.0, self.ready_ms - sum(out.values()))
        return out

    def summary(self) -> str:
        """One line; names every phase over 5 % of ``ready`` (the exchange and the transfer always)."""
        big = [f"{name} {ms:.1f} ms" for name, ms in self.phases().items()
               if name not in ("exchange+map", "transfer") and ms > 0.05 * self.ready_ms]
        parts = [f"{self.schedule} #{self.position} on {self.device}: {self.nbytes / 1e9:.3f} GB via {self.transport}",
                 f"from {self.source}" + (f" ({self.source_note})" if self.source_note else "") if self.source else "",
                 f"exchange+map {self.exchange_ms:.2f} ms, transfer {self.transfer_ms:.1f} ms ({self.gbps:.1f} GB/s)",
                 f"ready {self.ready_ms:.1f} ms" + (f" ({', '.join(big)})" if big else "")
                 + (f" + verify {self.verify_ms:.1f} ms" if self.verify_ms else ""),
                 f"total {self.total_ms:.1f} ms"]
        if self.verified is not None:
            parts.append("verified byte-exact" if self.verified else "NOT verified")
        if self.recovered:
            parts.append("recovered: " + "; ".join(self.recovered))
        if self.warnings:
            parts.append("WARNING: " + "; ".join(self.warnings))
        return ", ".join(p for p in parts if p)


class CloneResult:
    """A finished clone: ``arena`` (the weights), ``tensors`` (name -> zero-copy view, when the seed
    published its image metadata), ``report`` (:class:`CloneReport`).

    While it is open, this process keeps serving as a source (later clones may read from it).
    :meth:`close` withdraws it and releases the arena, its flags and every mapping it made.
    """

    def __init__(self, arena, tensors: dict, report: CloneReport, *, metadata=None, _session=None):
        self.arena, self.tensors, self.report, self.metadata = arena, tensors, report, metadata
        self._session = _session

    def close(self, *, force: bool = False) -> None:
        """Release everything (idempotent). Views still held elsewhere (a model's parameters) keep
        the arena's memory until they are dropped, with a ResourceWarning, as a loaded image's do;
        ``force``: release it at once all the same (a failed load's half-bound model)."""
        self.tensors = {}
        if self._session is not None:
            self._session.close(keep_arena=False, keep_viewed=not force)
            self._session = None
        elif not self.arena.closed:
            self.arena.close(keep_viewed=not force)

    def __enter__(self) -> "CloneResult":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CloneResult({self.report.summary()})"
