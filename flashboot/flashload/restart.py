"""Restart without a reload: ``flashboot.load(..., holder=...)``.

The first engine loads as usual and then hands its arena to the holder
(:func:`flashboot.flashclone.holder.hand_over`) with the image's identity: rank, size, the sha256
of its ``metadata.json`` (a re-pack changes it), the image key's digest and format version, the
device and the physical GPU (its PCI address: engines with their own ``CUDA_VISIBLE_DEVICES`` each
call their GPU ``cuda:0``). A restarted engine asks the holder for that name first: when the identity matches, it
maps the held arena (no copy), builds the views and returns; the report's mode says ``held``.
When it does not match (another image, another pre-pack, another device), or the holder is gone,
or nothing is held, it warns naming why and loads normally, then hands the new arena over.

An arena handed over refuses :meth:`flashboot.Arena.sleep` (the holder maps it); an arena opened
from the holder is an importer, which sleep refuses too. Either may be refit in place
(``atomic=False``), into the holder's memory: the refit records what it makes of the bytes beside
the held record (:mod:`flashboot.flashclone.holder_refit`), and a restart binds them as that
(``loaded.version`` N, or ``refit_torn`` for a refit that did not finish), never as the image's.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import FlashBootError
from ..memory import Device
from ..units import check_timeout

IDENTITY_FIELDS = ("rank", "nbytes", "metadata_sha256", "key_digest", "format_version", "device", "gpu")
"""What a held arena's identity must equal for a restarted engine to bind it (``gpu``: the
physical GPU, see :func:`physical_gpu`)."""


def physical_gpu(device: Any) -> str | None:
    """The GPU behind ``device`` as the machine names it (its PCI address, ``0000:18:00.0``), or
    None on the host backend. ``cuda:N`` is this process's numbering: engines started with
    different ``CUDA_VISIBLE_DEVICES`` (one per GPU, a common data-parallel set-up) each call
    their own GPU ``cuda:0``."""
    dev = Device.parse(device)
    if not dev.is_cuda:
        return None
    from ..pinning import gpu_pci_bus_id

    return gpu_pci_bus_id(dev)


def device_tag(device: Any) -> str:
    """``device`` as a held-arena name spells it: ``cpu``, or ``gpu`` and the GPU's PCI address
    (``gpu0000-18-00.0``), not ``cuda0``: by this process's numbering, the engines of one image
    on different GPUs, each started with its own ``CUDA_VISIBLE_DEVICES``, each replaced the
    others' held arena under one name."""
    gpu = physical_gpu(device)
    return "cpu" if gpu is None else "gpu" + gpu.replace(":", "-")


@dataclass(frozen=True)
class HolderOption:
    """Where the holder keeps arenas (``registry`` directory or ``store`` HOST:PORT, one of them),
    the ``name`` of this engine's (default: from the image directory, rank and device), and how
    long the hand-over after a fresh load may wait for the holder (``handover_timeout_s``)."""

    registry: str | None = None
    store: str | None = None
    name: str | None = None
    handover_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if (self.registry is None) == (self.store is None):
            raise FlashBootError(f"holder= needs exactly one of registry and store, got registry={self.registry!r}, "
                                 f"store={self.store!r}")
        if isinstance(self.registry, os.PathLike):
            object.__setattr__(self, "registry", os.fspath(self.registry))
        for key in ("registry", "store"):  # "" had been the current directory as the registry
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise FlashBootError(f"holder {key} must be a non-empty {'path' if key == 'registry' else 'HOST:PORT'} "
                                     f"string, got {value!r}")
        # NaN had passed (no deadline is ever reached: a load waited forever for a dead holder)
        check_timeout(self.handover_timeout_s, "holder handover_timeout_s")
        if self.name is not None:  # a name no holder takes had meant a normal load and two warnings at every start
            from ..flashclone.holder import _check_name

            _check_name(self.name)

    @classmethod
    def of(cls, value: Any) -> "HolderOption":
        """A HolderOption from itself, a registry path, or a dict of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(registry=os.fspath(value))
        if isinstance(value, dict):
            unknown = set(value) - {"registry", "store", "name", "handover_timeout_s"}
            if unknown:
                raise FlashBootError(f"unknown holder option(s) {sorted(unknown)}; known: registry, store, name, "
                                     "handover_timeout_s")
            return cls(**value)
        raise FlashBootError(f"holder= takes a registry path, a dict or a HolderOption, got {type(value).__name__}")

    def where(self, timeout_s: float | None = None) -> dict:
        """Where the holder keeps arenas, as the holder functions take it; ``timeout_s`` bounds
        the connection to a store (a store that does not answer had blocked each ask 31 s)."""
        if self.registry is not None:
            return {"registry": self.registry}
        return {"store": self.store} if timeout_s is None else {"store": self.store, "timeout_s": timeout_s}

    def name_for(self, image_dir, rank: int, device: Device) -> str:
        """``name``, or ``FOLDER-TAG.rankR.DEVICE``: the tag keys the image folder's real path, as
        the staging folder's does (images are often packed into folders of one name, ``.../image``:
        by the folder's name alone, two images' engines each replaced the other's held arena and
        neither ever restarted from it)."""
        if self.name is not None:
            return self.name
        real = os.path.realpath(image_dir)
        # cut: the registry's file names add 14 bytes, and a long folder name had made every
        # hand-over fail (ENAMETOOLONG)
        base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(real)).lstrip(".")[:NAME_BASE_MAX] or "image"
        tag = hashlib.sha256(real.encode()).hexdigest()[:12]
        return f"{base}-{tag}.rank{rank}.{device_tag(device)}"

    def older_names_for(self, image_dir, rank: int, device: Device) -> list[str]:
        """The default names older FlashBoots gave this arena, where not :meth:`name_for`'s: the
        folder's name alone (before 2026-12-05), then with its tag and ``cudaN`` (until the PCI
        address, 2026-12-05)."""
        if self.name is not None:
            return []
        real = os.path.realpath(image_dir)
        base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(real)).lstrip(".")
        tag = hashlib.sha256(real.encode()).hexdigest()[:12]
        dev = str(device).replace(":", "")
        names = [f"{base or 'image'}.rank{rank}.{dev}", f"{base[:NAME_BASE_MAX] or 'image'}-{tag}.rank{rank}.{dev}"]
        return [n for n in dict.fromkeys(names) if n != self.name_for(image_dir, rank, device)]


def held_here(holder: Any, image_dir, rank: int, device: Any) -> bool:
    """Whether the holder keeps an arena of rank ``rank`` of ``image_dir`` on ``device`` under this
    load's name, from the same pre-pack, by its record and the image's job file (the load checks
    the whole identity): an engine's early call then allocates and copies nothing that the restart
    would throw away. False where the holder cannot be asked (the load says why)."""
    from ..flashclone import holder as holders

    option, dev = HolderOption.of(holder), Device.parse(device)
    try:
        record = holders.held_record(option.name_for(image_dir, rank, dev),
                                     **option.where(min(HELD_PROBE_S, option.handover_timeout_s)))
    except FlashBootError:
        return False
    held = (record or {}).get("image") or {}
    return ("descriptor" in (record or {}) and held.get("image_dir") == os.path.realpath(image_dir)
            and (held.get("rank"), held.get("device"), held.get("gpu")) == (rank, str(dev), physical_gpu(dev))
            and holders.holder_gone(record) is None and holders.protocol_refused(record) is None
            and _same_pack(image_dir, rank, held))


def _same_pack(image_dir, rank: int, held: dict) -> bool:
    """Whether the image is still the pre-pack the held arena was loaded from, by the digest of
    the rank's ``metadata.json`` that the job file records (a small read; the load checks the
    file's own bytes): an image re-packed since had skipped the early call and the staging, and
    its load then streamed from disk. True for a lone rank directory (no job file to ask)."""
    from ..layouts.image import resolve_rank

    try:
        _, job = resolve_rank(image_dir, rank)
    except FlashBootError:
        return False
    return job is None or job.metadata_sha256.get(rank) == held.get("metadata_sha256")


NAME_BASE_MAX = 64
"""The most of the image folder's name a default held-arena name keeps."""

HELD_PROBE_S = 2.0
"""How long the early call's look at the holder's record may wait for a store."""


def image_identity(source, device: Device) -> dict:
    """What a held arena must be for this load: see :data:`IDENTITY_FIELDS` (plus the image
    directory and the key in words, for people reading ``flashboot hold --list``)."""
    key = source.metadata.key
    return {"image_dir": os.path.realpath(source.image_dir), "rank": source.rank, "nbytes": source.nbytes,
            "metadata_sha256": source.metadata_sha256, "key": key.describe(), "key_digest": key.digest,
            "format_version": key.format_version, "device": str(device), "gpu": physical_gpu(device)}


def _why_not_held(record: dict | None, identity: dict, name: str, where: str) -> str | None:
    if record is None:
        return f"nothing is held as {name!r} in {where}"
    if "error" in record:
        return f"the holder's last adoption of {name!r} failed: {record['error']}"
    held = record.get("image") or {}
    diffs = [f"{k}: held {held.get(k)!r}, wanted {identity[k]!r}" for k in IDENTITY_FIELDS if held.get(k) != identity[k]]
    if diffs:
        return f"the arena held as {name!r} is another image or version ({'; '.join(diffs)}): refused before binding"
    from ..flashclone.holder import holder_gone, protocol_refused

    refused = protocol_refused(record)
    if refused is not None and holder_gone(record) is None:  # an older holder's: it had been used unsaid
        return f"the arena held as {name!r} in {where} is refused: {refused}"
    return None


def _held_by_older_name(option: HolderOption, image_dir, rank: int, dev: Device) -> str:
    """What the holder keeps of this image, rank and device under a name an older FlashBoot gave
    it (an engine upgraded across a rename), for the warning: it stays held beside the load that
    follows, which had doubled its memory without a word ('nothing is held')."""
    from ..flashclone import holder as holders

    real = os.path.realpath(image_dir)
    for old in option.older_names_for(image_dir, rank, dev):
        try:
            record = holders.held_record(old, **option.where(option.handover_timeout_s))
        except FlashBootError:
            continue
        held = (record or {}).get("image") or {}
        if "descriptor" in (record or {}) and (held.get("image_dir"), held.get("rank")) == (real, rank) \
                and holders.holder_gone(record) is None:
            where = f"--registry {option.registry}" if option.registry else f"--store {option.store}"
            return (f"; an arena of this image is held as {old!r}, the name an older FlashBoot gave it, and stays "
                    f"held beside this load until released: `flashboot hold {where} --release {old}`")
    return ""


def _map_held(record: dict, dev: Device):
    """The held arena, opened and mapped (the caller closes it where it is not this image)."""
    from ..arena import Arena, ArenaDescriptor

    desc = ArenaDescriptor.from_dict(record["descriptor"])
    arena = Arena.open(desc) if desc.backend == "host" else Arena.open(desc, dev)
    try:
        arena.map_range()
    except BaseException:
        arena.close()
        raise
    return arena


def _bind_held(arena, record: dict, source, dev: Device, name: str, t_start: float, map_ms: float,
               metadata_ms: float):
    """The views of the mapped held arena; a LoadedImage whose report's mode is ``held``."""
    from .landing import make_views
    from .report import LoadedImage, LoadReport

    t1 = time.perf_counter()
    try:
        tensors = make_views(arena, source.metadata)
    except BaseException:
        arena.close()
        raise
    t2 = time.perf_counter()
    report = LoadReport(mode="held", device=str(dev), rank=source.rank, nbytes=source.nbytes,
                        tensors=len(source.metadata.tensors), alloc_ms=map_ms, bind_ms=(t2 - t1) * 1e3)
    report.metadata_ms = metadata_ms
    report.details = {"holder_name": name, "holder_pid": record["descriptor"].get("pid"), "map_ms": map_ms,
                      "held_since": record.get("since")}
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    return LoadedImage(arena, tensors, source.metadata, report, source)


def _held_version(loaded, refit: dict | None) -> None:
    """What in-place refits made of the held bytes (:mod:`flashboot.flashclone.holder_refit`),
    as ``loaded.version`` / ``loaded.refit_torn`` and the report say it: they had claimed version
    0, the image's, over a refit's bytes or a failed refit's mix.

    A torn record is bound as an in-process failed refit leaves the engine: no version claimed,
    ``refit_torn`` naming the mix, and a refit to a version newer than the last whole one
    repairs it. A restart is that engine going on over the same memory; reloading from the
    image instead would throw away the one copy a crashed refit's retry could write into."""
    from ..weight_update.engine import torn_note

    if refit is None:
        return
    details = loaded.report.details
    if "torn" in refit:
        loaded.version, loaded.refit_torn = None, dict(refit["torn"])
        details["refit_torn"] = dict(refit["torn"])
        details["note"] = f"not whole: {torn_note(refit['torn'])}"
    else:
        loaded.version = refit["version"]
        details["refit_version"] = refit["version"]
        details["note"] = f"the held bytes are refit version {refit['version']}, not the image's"


def _verify_held(loaded, name: str, dev: Device, verify: bool | None, refit: dict | None = None) -> None:
    """Check the held arena's bytes against the image's checksums where ``verify`` asks (or, left
    None, where a load would by default); otherwise the report says why not. A held arena may
    have been written to since it was handed over: ``verify=True`` had been skipped unsaid.
    ``refit``: what in-place refits made of it (:func:`_held_version`): refit version N is checked
    against its publish's checksums; bytes no checksums describe (a torn refit) are refused by
    name, not failed against the image's."""
    from .landing import verify_loaded
    from .want import verify_default

    why = "verify=False"
    if verify is None:
        verify, why = verify_default(dev, by_daemon=False)
    where = f"the arena held as {name!r}"
    if not verify:
        loaded.report.details["verify_skipped"] = why
    elif refit is None:
        verify_loaded(loaded.arena, loaded.metadata, where, loaded.report)
    elif refit.get("manifest") is None:
        what = (_torn_what(refit["torn"]) if "torn" in refit else
                f"refit version {refit['version']}, whose checksums were not recorded")
        raise FlashBootError(f"{where} holds {what}, not the image's bytes: nothing to verify it against (verify=False "
                             "binds it)")
    else:
        _verify_refit(loaded, refit, where)


def _torn_what(torn: dict) -> str:
    """A torn held arena in words, with what to do."""
    return (f"a torn in-place refit ({', '.join(map(str, torn['versions']))} mixed, version {torn['last_whole']} the "
            f"last whole one: {torn['error']}; refit to a version newer than {torn['last_whole']}, or release it and "
            "restart to reload from the image)")


def _verify_refit(loaded, refit: dict, where: str) -> None:
    """The held bytes against the chunk checksums of refit version N's publish."""
    import numpy as np

    from flashboot.kernels.checksum import chunk_checksums

    from ..errors import ChecksumMismatchError
    from ..flashclone.manifest import Manifest

    t0 = time.perf_counter()
    manifest, version = Manifest.from_dict(refit["manifest"]), refit["version"]
    if manifest.nbytes != loaded.metadata.image_nbytes:
        raise FlashBootError(f"{where}: refit version {version}'s checksums cover {manifest.nbytes:,} bytes; the "
                             f"image is {loaded.metadata.image_nbytes:,}")
    found = chunk_checksums(loaded.arena.span(0, manifest.nbytes), manifest.checksum_chunk_bytes)
    bad = np.flatnonzero(np.asarray(manifest.checksums, dtype=np.uint64) != np.asarray(found, dtype=np.uint64))
    if len(bad):
        k = int(bad[0])
        raise ChecksumMismatchError(f"{where} (refit version {version})", k, *manifest.chunk_range(k),
                                    manifest.checksums[k], int(found[k]))
    loaded.report.verify_ms = (time.perf_counter() - t0) * 1e3
    loaded.report.details["verified"] = f"{len(found)} chunks match refit version {version}'s checksums"


def load_or_restore(image_dir, rank: int, device: Any, holder: Any, **load_options):
    """:func:`flashboot.load` with ``holder=``: map the held arena when it is this image (no copy),
    otherwise warn why not, load normally and hand the new arena over (a failed hand-over warns
    too; the load is returned either way). ``load_options`` go to :func:`flashboot.load`.

    The held arena is looked up and mapped while the metadata files are read and hashed (both
    release the GIL); it is bound only once the metadata says it is this image, and closed (the
    holder keeps it) where it is not."""
    from ..flashclone import holder as holders
    from ..flashclone.holder_refit import HeldAs, link, read_refit
    from .pipeline import load
    from .shm import begin_rank_source

    t_start = time.perf_counter()
    option = HolderOption.of(holder)
    dev = Device.parse(device)
    finish_source = begin_rank_source(image_dir, rank, tp=load_options.get("tp"), ep=load_options.get("ep"),
                                      expected_key=load_options.get("expected_key"))
    name = option.name_for(image_dir, rank, dev)
    where = f"{'registry ' + option.registry if option.registry else 'store ' + option.store}"
    record, arena, map_ms, map_error, refit, refit_error = None, None, 0.0, None, None, None
    try:
        record = holders.held_record(name, **option.where(option.handover_timeout_s))
        held = (record or {}).get("image") or {}
        if "descriptor" in (record or {}) and (held.get("rank"), held.get("device"), held.get("gpu")) == \
                (rank, str(dev), physical_gpu(dev)):
            gone = holders.holder_gone(record)
            if gone is not None:  # a reused pid's fds would be another process's, maybe another arena
                raise FlashBootError(gone)
            if holders.protocol_refused(record) is None:  # else not mapped: _why_not_held says why
                t0 = time.perf_counter()
                arena = _map_held(record, dev)
                map_ms = (time.perf_counter() - t0) * 1e3
                try:  # what in-place refits made of its bytes since it was handed over
                    refit = read_refit(name, record.get("request"), **option.where(option.handover_timeout_s))
                except FlashBootError as exc:
                    refit_error = exc
    except FlashBootError as exc:  # the holder was killed: its pid is gone, its fds with it
        map_error = exc
    t0 = time.perf_counter()
    try:
        source = finish_source()
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    metadata_ms = (time.perf_counter() - t0) * 1e3
    identity = image_identity(source, dev)
    why = None if record is None and map_error is not None else _why_not_held(record, identity, name, where)
    if why is None and map_error is not None:  # no record: the holder could not be asked (a store down, a bad file)
        why = (f"the holder cannot be asked for {name!r} ({where}): {map_error}" if record is None else
               f"the arena held as {name!r} cannot be mapped: {map_error}")
    if record is None and map_error is None:
        why += _held_by_older_name(option, image_dir, rank, dev)
    if why is None and refit_error is not None:  # its bytes may be a refit's: not bound as the image's
        why = f"what refits made of the arena held as {name!r} cannot be read: {refit_error}"
    if why is None:
        loaded = None
        try:
            loaded = _bind_held(arena, record, source, dev, name, t_start, map_ms, metadata_ms)
            arena = None
            _held_version(loaded, refit)
            _verify_held(loaded, name, dev, load_options.get("verify"), refit)
        except FlashBootError as exc:
            if loaded is not None:
                loaded.close()  # this process's mapping only: the holder keeps its arena
            why = f"the arena held as {name!r} cannot be bound or does not verify: {exc}"
        else:
            # its in-place refits write the holder's memory: they record what they make of it
            link(loaded.arena, HeldAs(name, option.where(), record.get("request"), refit))
            if refit is not None and "torn" in refit:  # what an in-place refit's RefitError said, said again
                warnings.warn(f"flashboot: restarted from the holder, but the arena held as {name!r} holds "
                              f"{_torn_what(refit['torn'])}: loaded.version is None", RuntimeWarning, stacklevel=3)
            prepared = load_options.get("prepared")
            if prepared is not None:  # not needed: the held arena is bound. Released once its copy
                prepared._release_when_done(0)  # ends, without holding up the restart
            return loaded
    if arena is not None:
        arena.close()  # another image's, or not bound: the holder keeps it
    warnings.warn(f"flashboot: not restarting from the holder ({why}); loading rank {rank} of {image_dir} normally",
                  RuntimeWarning, stacklevel=3)
    loaded = load(image_dir, rank, device, **load_options)
    loaded.report.details["not_restored"] = why
    try:
        holders.hand_over(loaded.arena, name, timeout_s=option.handover_timeout_s, image=identity, **option.where())
        loaded.report.details["handed_over_as"] = name
    except FlashBootError as exc:
        loaded.report.details["hand_over_error"] = str(exc)
        warnings.warn(f"flashboot: loaded rank {rank} of {image_dir}, but could not hand it to the holder as "
                      f"{name!r}: {exc}", RuntimeWarning, stacklevel=3)
    return loaded


__all__ = ["HolderOption", "IDENTITY_FIELDS", "device_tag", "held_here", "image_identity", "load_or_restore",
           "physical_gpu"]
