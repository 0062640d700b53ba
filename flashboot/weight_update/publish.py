"""Publish (trainer side): named tensors -> an arena in the engine image's layout -> a FlashClone
seed record carrying the version, the image key and the rank.

The record lives in namespace ``NAME.vN`` of the rendezvous store, so engines refitting to
version N find it (or wait for it, bounded) and chain or star from it like clones. Its manifest
holds the chunk checksums of the packed arena, computed on the device right after the pack;
engines verify against them before the new version goes live.

A version number names one set of bytes: a publisher claims ``claim/vN`` in namespace ``NAME``
(an atomic compare-and-set) before it packs, and another publisher's publish of a version
claimed is refused by name (two trainers publishing one number had given engines different
weights under it, the last writer winning silently). A withdrawn version's keys (the engines'
clone records under ``NAME.vN``) and its claim are deleted once its readers have left, or
:data:`SPENT_KEPT` publishes later: the store holds about one version's keys, not every
version's of a long run, and a number is free again once no engine can be taking it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import FlashBootError
from ..flashclone.rendezvous import DEFAULT_TIMEOUT_S
from ..memory import Device
from .plan import DERIVED, PackPlan, PublishError, check_aliases, dtype_name, plan_engine_pack, plan_pack

DEFAULT_NAME = "refit"

LATEST_KEY = "latest"
"""The version a publisher of namespace ``NAME`` published last (and its id), while it is open:
an engine that asks for an older one that is no longer out is told so at once (it had waited
its whole timeout for a publish that would never come)."""

SPENT_KEPT = 2
"""Withdrawn versions whose readers (engines' clones) have not all left keep their store keys
(deleting them under a reader still copying made it wait out its timeout); older ones lose them
regardless: their readers copied from an arena repacked twice since (they failed, or died)."""


def version_namespace(name: str, version: int) -> str:
    """The store namespace of one published version."""
    return f"{name}.v{version}"


def check_version(version: Any, what: str, error: type[FlashBootError] = FlashBootError) -> int:
    """``version`` when it is a positive int; else ``error`` (the caller's: PublishError, RefitError) naming it."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise error(f"{what}: version must be a positive int, got {version!r}")
    return version


@dataclass
class PublishReport:
    """One publish: ``pack_ms`` (one launch, or numpy on the host backend), ``checksum_ms`` (on the
    device), ``publish_ms`` (the version's claim, ``details["claim_ms"]``, and the seed record),
    ``nbytes`` packed, ``tensors`` given, ``rows`` of the table."""

    version: int
    nbytes: int
    tensors: int
    rows: int
    plan_ms: float = 0.0
    pack_ms: float = 0.0
    checksum_ms: float = 0.0
    publish_ms: float = 0.0
    details: dict = field(default_factory=dict)

    @property
    def pack_gbps(self) -> float:
        return self.nbytes / self.pack_ms / 1e6 if self.pack_ms > 0 else 0.0

    def summary(self) -> str:
        return (f"published v{self.version}: {self.tensors} tensors, {self.nbytes:,} bytes packed in {self.pack_ms:.2f} ms "
                f"({self.pack_gbps:.1f} GB/s, {self.rows} table rows), checksums {self.checksum_ms:.2f} ms, "
                f"record {self.publish_ms:.2f} ms")


def _engine_section(image: Any, rank: int, metadata):
    """An engine image's engine section (its key, aliases; :mod:`flashboot.integrations.engine_dump`),
    None for a checkpoint image."""
    from ..integrations.engine_key import is_engine_family, read_engine_section

    if not is_engine_family(metadata.family.name):
        return None
    return read_engine_section(image, rank)[0]


def _named(tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
    import torch

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: dict[str, Any] = {}
    for item in items:
        try:
            name, t = item
        except (TypeError, ValueError):
            raise PublishError(f"publish takes (name, tensor) pairs; got {type(item).__name__}") from None
        if not isinstance(name, str):
            raise PublishError(f"publish: tensor names are strings, got {name!r}; nothing was written")
        if not isinstance(t, torch.Tensor):  # the plan reads .dtype and .shape, the pack the data's address
            raise PublishError(f"publish: {name!r} is a {type(t).__name__}, not a torch.Tensor; nothing was written")
        if name in out:
            raise PublishError(f"publish: tensor {name!r} is given twice; nothing was written")
        out[name] = t
    return out


class Publisher:
    """A trainer rank's publishing arena for one image rank: pack, checksum, publish, again.

    ``image``: the engines' pre-packed image directory (its manifest is the contract; no image
    byte is read); ``rank``: the image rank this trainer process publishes. ``store``: the
    rendezvous store (``HOST:PORT``; hosted here, from the first publish to :meth:`close`, unless
    one listens). ``config``: the model config, when the checkpoint's ``config.json`` recorded at
    pre-pack is not on this machine. ``nixl``: also offer the arena to NIXL READs (engines on other hosts,
    ``refit(transport="nixl")``); ``serve_nccl``: answer the broadcast fallback (``transport="nccl"``).
    The arena (one image) is allocated once; :meth:`publish` withdraws the previous
    version's record before packing the next into it, so publish a new version once the engines
    have taken the last one (a refit that is still copying then fails its checksums: refused,
    old weights kept).
    """

    def __init__(self, image: Any, rank: int = 0, *, store: str, device: Any = None, name: str = DEFAULT_NAME,
                 token=None, token_file=None, config: Mapping[str, Any] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, host_store: bool = True, nixl: bool = False,
                 serve_nccl: bool = False):
        from ..arena import Arena
        from ..flashclone.records import resolve_token
        from ..layouts import read_image_metadata
        from ..units import check_timeout

        # before the arena: None or NaN had been a raw TypeError/ValueError, 0 a store "Bad file
        # descriptor", each at the first publish, after the pack
        timeout_s = check_timeout(timeout_s, "Publisher timeout_s", PublishError)
        if not isinstance(name, str) or not name or "/" in name:  # the store's namespace: 3 had been a raw TypeError
            raise PublishError(f"Publisher name must be a non-empty string without '/' (the engines refit with the "
                               f"same name=), got {name!r}")
        self.metadata = read_image_metadata(image, rank)
        self.engine_section = _engine_section(image, rank, self.metadata)
        self.rank, self.store, self.name, self.config = rank, store, name, config
        self.token = resolve_token(token, token_file)
        self.timeout_s, self.host_store, self.nixl, self.serve_nccl = timeout_s, host_store, nixl, serve_nccl
        self.device = Device.parse(device)
        self.arena = Arena.create(self.metadata.image_nbytes, self.device)
        if self.device.is_cuda:  # padding reads as zeros, as in the image (cuMemCreate does not clear)
            self.arena.bytes().zero_()
        self.version = 0
        self.seed = None
        self.report: PublishReport | None = None
        self._plans: dict[tuple, PackPlan] = {}
        self._table = None  # (plan, tensors' addresses and strides, PackTable) of the last publish; no tensors
        self._lock = threading.Lock()  # one publish (or close) at a time
        self._store_host = None  # the store's Rendezvous where this publisher looked to host it
        self._store_client = None  # or its connection to the store another process hosts
        self.publisher_id = secrets.token_hex(6)
        """Names this publisher in its version claims (two in one process have one pid)."""
        self._spent: list[tuple[int, int, str]] = []  # (withdrawal, version, seed generation): keys not yet deleted
        self._withdrawals = 0

    def plan(self, tensors: Mapping[str, Any]) -> PackPlan:
        """The checked plan for tensors of these names, dtypes and shapes (cached per header set)."""
        headers = {n: (dtype_name(t), tuple(t.shape)) for n, t in tensors.items()}
        key = tuple(sorted((n, d, s) for n, (d, s) in headers.items()))
        plan = self._plans.get(key)
        if plan is None:
            where = f"publish to {self.metadata.key.model_id} rank {self.rank}"
            if self.engine_section is not None:
                section = self.engine_section
                aliases = {alias: info["of"] for alias, info in section.aliases.items()}
                attributes = [n for n, info in section.tensors.items() if info["kind"] == "extra"]
                raw = {n: info for n, info in section.tensors.items() if "dtype" in info}  # stored as bytes
                plan = plan_engine_pack(self.metadata, headers, aliases, attributes, raw=raw, where=where)
            else:
                plan = plan_pack(self.metadata, headers, config=self.config, where=where)
            self._plans = {key: plan}
        return plan

    def publish(self, tensors: Iterable[tuple[str, Any]] | Mapping[str, Any], version: int) -> PublishReport:
        """Pack ``tensors`` ((HF name, tensor) pairs in any order, on this publisher's device),
        checksum them and publish version ``version`` (greater than the last one published).

        PublishError naming the tensor (a name the manifest lacks, a wrong shape or dtype, a
        missing tensor) before anything is written. One publish at a time: a second one (another
        thread) waits up to ``timeout_s`` for the first, then checks its version."""
        check_version(version, "publish", PublishError)
        # two at once packed into the one arena together: each version's record then vouched for
        # the other's bytes (checksums taken after both packs), and one seed was never withdrawn
        self._acquire(f"publish of version {version}")
        try:
            return self._publish(tensors, version)
        finally:
            self._lock.release()

    def _acquire(self, what: str) -> None:
        if not self._lock.acquire(timeout=self.timeout_s):
            raise PublishError(f"{what} to {self.metadata.key.model_id} rank {self.rank}: another publish from this "
                               f"Publisher was still running after {self.timeout_s} s; nothing was written")

    def _publish(self, tensors, version: int) -> PublishReport:
        from .pack import PackTable, _data_ptr

        if self.arena.closed:  # it had been "arena <id> is closed", an arena the trainer never saw
            raise PublishError(f"publish of version {version}: this Publisher was closed (its arena released); "
                               "make a new one; nothing was written")
        if version <= self.version:
            raise PublishError(f"publish: version {version} is not newer than version {self.version}, published "
                               "last; nothing was written")
        named = _named(tensors)
        t0 = time.perf_counter()
        plan = self.plan(named)
        check_aliases(plan, named, f"publish to {self.metadata.key.model_id} rank {self.rank}")
        # a trainer updates its parameters in place: the same addresses reuse the device table
        # (a lazy neg view has its tensor's address and strides: a reused table skipped PackTable's refusal of it)
        where = tuple((n, _data_ptr(t), t.stride(), t.device, t.is_neg() or t.is_conj())  # 0: PackTable says why
                      for n, t in named.items())
        if self._table is None or self._table[0] is not plan or self._table[1] != where:
            self._table = (plan, where, PackTable(plan, named, self.arena))
        table = self._table[2]
        tc = time.perf_counter()
        try:
            claim = self._claim(version)  # before a byte is written: a version taken by another is refused
            try:
                return self._pack_and_seed(table, plan, named, version, t0, tc)
            except BaseException:
                self._release(claim)  # nothing was published under it: free for a retry from anyone
                raise
        finally:
            # a refused or failed publish too: the table had held the trainer's per-publish copies
            # (see _pack_and_seed) until the next publish, through a trainer's error handling
            table.tensors = None

    def _pack_and_seed(self, table, plan: PackPlan, named: dict, version: int, t0: float,
                       tc: float) -> PublishReport:
        import torch

        from ..flashclone.manifest import Manifest
        from ..flashclone.seeding import seed

        t1 = time.perf_counter()
        self.withdraw()
        stream = None
        if self.device.is_cuda:  # after the trainer's own work on these tensors (its current stream)
            stream = torch.cuda.Stream(device=self.device.index)
            stream.wait_stream(torch.cuda.current_stream(self.device.index))
        table.launch(stream=stream)
        if stream is not None:
            stream.synchronize()
        # packed: the cached rows are addresses, reused only where the next tensors have the same
        # ones; holding these tensors would keep a trainer's per-publish copies (a dtype cast, a
        # full_tensor() gather) alive through its next training step
        table.tensors = None
        t2 = time.perf_counter()
        meta = self.metadata
        manifest = Manifest.of_arena(self.arena, meta.image_nbytes, meta.checksums.chunk_bytes, key=meta.key.to_dict())
        t3 = time.perf_counter()
        self.seed = seed(self.store, self.arena, self.device, token=self.token,
                         name=version_namespace(self.name, version), timeout_s=self.timeout_s,
                         serve_nccl=self.serve_nccl, nixl=self.nixl, manifest=manifest, host_store=self.host_store,
                         extra=self._record_extra(version, plan))
        # the claim says so from now on: a refusal then tells a published version from one whose
        # trainer died mid-publish (only that: the version is out, whatever this costs)
        rdv = self._live_rdv()
        if rdv is not None:
            with contextlib.suppress(FlashBootError):
                rdv.publish(f"claim/v{version}", {**self._claim_body, "published": self.seed.generation})
                rdv.publish(LATEST_KEY, {"version": version, "publisher": self.publisher_id})
        t4 = time.perf_counter()
        self.version = version
        claim_ms = (t1 - tc) * 1e3  # a store round trip: part of publishing the record
        self.report = PublishReport(version, table.nbytes, len(named), len(table.rows), (tc - t0) * 1e3,
                                    (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3 + claim_ms,
                                    details={"claim_ms": claim_ms})
        return self.report

    def _record_extra(self, version: int, plan: PackPlan) -> dict:
        extra = {"refit_version": version, "refit_rank": self.rank}
        if self.engine_section is not None:  # the engine's whole key: its version, GPU, kernels...
            extra["refit_engine_key"] = self.engine_section.key.to_dict()
            extra["refit_derived"] = sorted(n for n, why in plan.skipped.items() if why == DERIVED)
        return extra

    def _store_rdv(self, fresh: bool = False):
        """This publisher's connection to the store, in namespace ``name``: the store it hosts,
        for as long as this publisher, where none listens (``host_store``; a seed that hosted it
        took it down when the next publish withdrew it: every record in it went, other ranks'
        publishes too, and engines waiting for the next version lost it), else a client of the
        one that listens. ``fresh``: the client's store was lost (its host may have left): ask again."""
        from ..flashclone.rendezvous import Rendezvous

        if self._store_host is not None:
            return self._store_host
        if self._store_client is not None and (fresh or self._store_client.lost is not None):
            self._store_client.close()
            self._store_client = None
        if self._store_client is None:
            rdv = Rendezvous.connect(self.store, self.token, namespace=self.name, host=self.host_store,
                                     timeout_s=self.timeout_s)
            if rdv.is_server:
                self._store_host = rdv
            else:
                self._store_client = rdv
        return self._store_host or self._store_client

    def _live_rdv(self):
        """This publisher's store connection where it has one that works, else None (never
        connecting: for what a lost store loses anyway)."""
        rdv = self._store_host or self._store_client
        return rdv if rdv is not None and rdv.lost is None and rdv.store is not None else None

    def _claim(self, version: int) -> str:
        """Claim ``version`` for this publisher (``claim/vN``, first writer wins); PublishError
        naming both publishers when another holds it. Returns the claim's key."""
        from ..errors import StoreLostError

        key = f"claim/v{version}"
        me = self._claim_body = {"publisher": self.publisher_id, "pid": os.getpid(), "host": socket.gethostname(),
                                 "at": time.time(), "rank": self.rank}
        try:
            held = self._store_rdv().agree(key, me).body
        except StoreLostError:  # the store we joined went with its host: host one, or join who listens now
            held = self._store_rdv(fresh=True).agree(key, me).body
        if held.get("publisher") != self.publisher_id and self._free_closed_claim(version, key, held):
            held = self._store_rdv().agree(key, me).body
        if held.get("publisher") != self.publisher_id:
            raise PublishError(f"publish of version {version} to {self.metadata.key.model_id} rank {self.rank}: "
                               f"{self._claimed_by(version, held)}; nothing was written")
        return key

    def _free_closed_claim(self, version: int, key: str, held: dict) -> bool:
        """Delete the claim ``held`` of ``version`` (and the version's keys) when its publisher closed
        while an engine was copying it (:meth:`_leave_claims`) and every engine has left since;
        whether it did. No publish of the closed one would ask again: the number had stayed
        taken for good, refused to a trainer started again as 'already published'."""
        from ..flashclone.common import forget_generation

        generation = held.get("published")
        if not held.get("closed") or not isinstance(generation, str):
            return False
        with self._in_namespace(version_namespace(self.name, version)) as rdv:
            if rdv is None or not forget_generation(rdv, generation, False):
                return False
        return self._store_rdv().delete_if(key, lambda rec: rec.body == held)

    def _claimed_by(self, version: int, held: dict) -> str:
        """Who holds the claim of ``version``, and whether they published it (it had said "already
        published" of a version whose trainer died mid-publish, which no engine could take)."""
        from ..flashclone.common import _alive

        when = time.strftime("%H:%M:%S", time.gmtime(held["at"])) if isinstance(held.get("at"), float) else "?"
        pid, host = held.get("pid"), held.get("host")
        running = ""
        if host == socket.gethostname() and isinstance(pid, int) and pid > 0:
            running = ", still running" if _alive(pid) else ", not running any more"
        who = f"by another Publisher (pid {pid} on {host}{running})"
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        if held.get("rank", self.rank) != self.rank:  # one name for every rank: their records overwrote each other's
            return (f"version {version} under name {self.name!r} was claimed {who} for image rank {held.get('rank')}, "
                    f"and this one ({me}) publishes rank {self.rank}: each rank of an image publishes under its own "
                    "name= (the engine of that rank refits with the same name=; engine_publisher names them so)")
        advice = ("Engines would take different weights under one version: publish a newer version, or give each "
                  "trainer its own name=")
        if held.get("closed"):  # see _free_closed_claim
            return (f"version {version} was published at {self.store} (namespace {self.name!r}) {who}, which closed "
                    f"while an engine was still copying it: the number is free again once every engine that took it "
                    f"has left; this one is {me}. {advice}")
        if held.get("published"):
            return (f"version {version} was already published at {self.store} (namespace {self.name!r}) {who}; this "
                    f"one is {me}. {advice}")
        why = "it died mid-publish" if running.endswith("any more") else "it is publishing it now, or died mid-publish"
        return (f"version {version} was claimed at {when} UTC in {self.store} (namespace {self.name!r}) {who}, which "
                f"never published it: {why} (its claim stays: a trainer on another host cannot be told dead from "
                f"slow); this one is {me}. {advice}")

    def _release(self, claim: str) -> None:
        """Drop our claim of a version no engine can take (any more). Not on a lost connection:
        connecting again had waited ``timeout_s`` for a store that is gone, with the claim."""
        rdv = self._live_rdv()
        if rdv is None:
            return
        try:
            rdv.delete(claim)
        except FlashBootError:
            pass  # the store is gone: so is the claim

    def withdraw(self) -> None:
        """Withdraw the published version's record (engines that already mapped it keep their mapping);
        its store keys and claim go once the engines reading it have left (:meth:`_forget_spent`)."""
        if self.seed is not None:
            seed, self.seed = self.seed, None
            seed.close()
            self._withdrawals += 1
            self._spent.append((self._withdrawals, self.version, seed.generation))
            self._forget_spent()

    @contextlib.contextmanager
    def _in_namespace(self, namespace: str):
        """This publisher's store connection switched to ``namespace`` (a version's) for a few
        calls, or None where it has none that works. The one connection: a Rendezvous of its own
        over the same store, found lost, had left this one live, and every call after it (each
        spent version's, the claims' release) waited out the timeout again on a dead store."""
        rdv = self._live_rdv()
        if rdv is None:
            yield None
            return
        rdv.namespace = namespace
        try:
            yield rdv
        finally:
            rdv.namespace = self.name

    def _forget_spent(self) -> None:
        """Delete the store keys of withdrawn versions once their readers have left (:data:`SPENT_KEPT`):
        about eight per version and engine had stayed in the store for good, a long RL run's
        thousands of versions growing it without bound."""
        from ..flashclone.common import forget_generation

        kept = []
        for withdrawal, version, generation in self._spent:
            force = self._withdrawals - withdrawal >= SPENT_KEPT
            done = force  # without a connection: asked again over the next one, unless too old to keep
            with self._in_namespace(version_namespace(self.name, version)) as rdv:
                if rdv is not None:
                    try:
                        done = forget_generation(rdv, generation, force)
                    except FlashBootError:
                        pass  # done stays ``force``: kept, and asked again over the next connection
            if done:  # its number is free again: no engine is taking it now
                self._release(f"claim/v{version}")
            else:
                kept.append((withdrawal, version, generation))
        self._spent = kept

    def _forget_latest(self) -> None:
        """Take our :data:`LATEST_KEY` out: a trainer started again counts from version 1, and engines
        asking for its versions had been told they were superseded by this one's."""
        rdv = self._live_rdv()
        if rdv is None or not self.version:
            return
        with contextlib.suppress(FlashBootError):  # one read for the check and the delete (rendezvous.delete_if)
            rdv.delete_if(LATEST_KEY, lambda rec: rec.body.get("publisher") == self.publisher_id)

    def _leave_claims(self) -> None:
        """At close: each withdrawn version an engine may still be copying keeps its claim and keys
        (:meth:`_forget_spent`), now marked closed, so that the next publisher of its number frees
        them once the engines have left (:meth:`_free_closed_claim`)."""
        for _, version, generation in self._spent:
            rdv = self._live_rdv()  # each time: one found lost is not waited on again
            if rdv is None:
                return
            key = f"claim/v{version}"
            with contextlib.suppress(FlashBootError):
                held = rdv.try_read(key)
                if held is not None and held.body.get("publisher") == self.publisher_id:
                    rdv.publish(key, {**held.body, "published": generation, "closed": True})

    def close(self) -> None:
        """Withdraw the record and release the arena (idempotent); waits for a publish under way."""
        self._acquire("close")  # not the arena from under a pack
        try:
            self.withdraw()
            self._leave_claims()
            self._forget_latest()
            if self._store_client is not None:
                self._store_client.close()
            if self._store_host is not None:
                self._store_host.close()  # the store goes with the last reference, as with a seed's
            self._table = None  # its rows are addresses of the trainer's tensors
            if not self.arena.closed:
                self.arena.close()
        finally:
            self._lock.release()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def publish(tensors: Iterable[tuple[str, Any]] | Mapping[str, Any], image: Any, rank: int = 0, *, store: str,
            version: int, device: Any = None, **options: Any) -> Publisher:
    """Pack a trainer's named tensors into an arena in ``image``'s layout for ``rank`` and
    publish it at ``store`` as version ``version`` (see :class:`Publisher` for ``options``).

    Returns the :class:`Publisher` (``.report``: pack, checksum and publish ms): keep it open
    while engines refit, then ``close()`` it or :meth:`Publisher.publish` the next version.
    Raises PublishError naming the tensor before anything is written."""
    pub = Publisher(image, rank, store=store, device=device, **options)
    try:
        pub.publish(tensors, version)
    except BaseException:
        pub.close()
        raise
    return pub


__all__ = ["DEFAULT_NAME", "LATEST_KEY", "PublishReport", "Publisher", "publish", "version_namespace"]
