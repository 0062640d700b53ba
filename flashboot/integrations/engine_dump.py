"""The dump side of engine images: an engine's own post-processed weights written as one rank.

An engine (SGLang, vLLM) does more to a checkpoint than shard it: ``process_weights_after_loading``
fuses, re-quantises, transposes and adds tensors (scales, rotary caches, MLA's ``w_kc``). The only
image that serves such an engine without redoing that work is a dump of what the engine itself
holds after its own loader ran:

* :func:`collect_engine_tensors`: every parameter, buffer (persistent or not) and tensor
  attribute of a loaded engine model, tied names as aliases;
* :func:`write_engine_rank`: one rank through the layouts writer API
  (:class:`~flashboot.layouts.writer.ImageWriter`), with an ``engine`` section in ``metadata.json``;
* :func:`prepack_engine_model`: one job over ranks. All ranks write under ``OUT/.tmp-<job>``;
  rank 0 commits (``prepack.json`` last), as ``layouts/FORMAT.md`` prescribes.

Nothing here imports an engine.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from flashboot.errors import FlashBootError, LayoutError, WaitTimeoutError

from .engine_key import ENGINE_FORMAT, ENGINE_SECTION, EngineKey, engine_family


# =============================================================================================
# Collecting what an engine holds
# =============================================================================================
@dataclass
class EngineTensor:
    """One tensor to write: its name, the tensor, ``kind`` (param, buffer, extra) and, for a
    buffer, whether it is persistent."""

    name: str
    tensor: Any
    kind: str
    persistent: bool = True


@dataclass
class EngineTensors:
    """Everything :func:`collect_engine_tensors` found: canonical tensors, aliases (another name
    of the same tensor: tied weights, shared rotary caches), what was skipped and why, and
    boolean model attributes the loader must restore."""

    tensors: dict[str, EngineTensor] = field(default_factory=dict)
    aliases: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _tensor_identity(t) -> tuple | None:
    if t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def collect_engine_tensors(model, device: Any, *, extras: bool = True,
                           attrs: Mapping[str, Any] | None = None) -> EngineTensors:
    """Every parameter, buffer (non-persistent included: rotary caches) and, with ``extras``,
    tensor attribute of ``model``'s modules (tensors ``process_weights_after_loading`` or a
    model's ``post_load_weights`` stored outside the parameter registry, e.g. MLA's ``w_kc``).

    Tensors that are the same tensor under another name (tied weights) become aliases. Tensor
    attributes that are views into a parameter's or buffer's storage are skipped (the engine
    rebuilds them from the bound tensor). Parameters or buffers not on ``device`` are refused
    (LayoutError: CPU offload cannot be served from one arena); extras elsewhere are skipped.
    """
    import torch

    want = torch.device(device)
    out = EngineTensors(attrs=dict(attrs or {}))
    by_identity: dict[tuple, str] = {}
    by_id: dict[int, str] = {}
    off_device = []

    def same_device(t) -> bool:
        return t.device.type == want.type and (want.index is None or t.device.index in (None, want.index))

    def add(name: str, t, kind: str, persistent: bool = True) -> None:
        canonical = by_id.get(id(t))
        ident = _tensor_identity(t)
        if canonical is None and ident is not None:
            canonical = by_identity.get(ident)
        if canonical is not None:
            out.aliases[name] = {"of": canonical, "kind": kind, "persistent": persistent}
            return
        by_id[id(t)] = name
        if ident is not None:
            by_identity[ident] = name
        out.tensors[name] = EngineTensor(name, t, kind, persistent)

    for kind in ("param", "buffer"):  # every parameter first: a buffer aliasing one is named as its alias
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            prefix = f"{mod_name}." if mod_name else ""
            for leaf, t in (mod._parameters if kind == "param" else mod._buffers).items():
                if t is None:
                    continue
                if not same_device(t):
                    off_device.append(f"{prefix}{leaf} ({t.device})")
                    continue
                add(prefix + leaf, t, kind, kind == "param" or leaf not in mod._non_persistent_buffers_set)
    if off_device:
        shown = ", ".join(off_device[:6]) + (f" ... and {len(off_device) - 6} more" if len(off_device) > 6 else "")
        raise LayoutError(f"{len(off_device)} parameter(s)/buffer(s) are not on {want} ({shown}): an engine image "
                          "holds one device's weights; pre-pack without CPU offload")
    if extras:
        storages = {(t.tensor.device, t.tensor.untyped_storage().data_ptr())
                    for t in out.tensors.values() if t.tensor.numel() > 0}
        for mod_name, mod in model.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            for leaf, value in list(vars(mod).items()):
                # not private ones: the engine makes and derives them itself (vLLM's attention keeps
                # _k_scale_cpu, _v_scale_cpu beside its k_scale); a load checks that none is left on meta
                if leaf.startswith("_") or not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
                    continue
                name = prefix + leaf
                if name in out.tensors or name in out.aliases:
                    continue
                if id(value) in by_id or (_tensor_identity(value) in by_identity):
                    add(name, value, "extra")
                    continue
                if not same_device(value):
                    out.skipped[name] = f"tensor attribute on {value.device}, not {want}"
                    continue
                if value.numel() > 0 and (value.device, value.untyped_storage().data_ptr()) in storages:
                    out.skipped[name] = "view into a parameter's or buffer's storage (rebuilt by the engine)"
                    continue
                add(name, value, "extra")
    # Distinct tensors over one storage are written separately: say so (the bytes are duplicated).
    seen_storage: dict[tuple, str] = {}
    for t in out.tensors.values():
        if t.tensor.numel() == 0:
            continue
        sk = (t.tensor.device, t.tensor.untyped_storage().data_ptr())
        if sk in seen_storage:
            out.warnings.append(f"{t.name} shares storage with {seen_storage[sk]}; written as a separate copy")
        else:
            seen_storage[sk] = t.name
    return out


# =============================================================================================
# Writing one rank
# =============================================================================================
def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_expert(name: str) -> bool:
    # FusedMoE keeps every routed expert in `...experts.w13_weight` / `w2_weight` (and scales).
    return ".experts." in name or name.startswith("experts.")


@dataclass(frozen=True)
class _Planned:
    name: str
    kind: str
    persistent: bool
    shape: tuple
    stride: tuple
    dtype: str
    raw: bool  # stored as uint8 bytes (a dtype the image format does not name)
    span_elems: int
    itemsize: int


def _plan_tensor(t: EngineTensor) -> _Planned:
    from flashboot.layouts.format import DTYPES, span_elems

    x = t.tensor
    shape, stride = tuple(int(s) for s in x.shape), tuple(int(s) for s in x.stride())
    dtype = _dtype_name(x.dtype)
    return _Planned(t.name, t.kind, t.persistent, shape, stride, dtype, dtype not in DTYPES,
                    span_elems(shape, stride), x.element_size())


def _span_bytes(tensor, planned: _Planned):
    """The bytes a (possibly strided) tensor spans, from its first to one past its last element,
    as a host numpy uint8 array."""
    import torch

    x = tensor.detach()
    if planned.span_elems == 0:
        return None
    flat = x.as_strided((planned.span_elems,), (1,), x.storage_offset())
    return flat.contiguous().cpu().view(torch.uint8).numpy()


def _layout_for(planned: list[_Planned], tensor_alignment: int):
    """Image layout: each tensor occupies its span at an aligned offset, experts first. Typed
    tensors keep their real shape and stride (strided ones included); raw ones are uint8 bytes."""
    from flashboot.layouts.format import Layout, LayoutSlot, TensorEntry, compute_layout

    slots = []
    for p in planned:
        region = "experts" if _is_expert(p.name) else "non_experts"
        if p.raw:
            slots.append(LayoutSlot(p.name, "uint8", (p.span_elems * p.itemsize,), region))
        else:
            slots.append(LayoutSlot(p.name, p.dtype, (p.span_elems,), region))
    base = compute_layout(slots, tensor_alignment=tensor_alignment)
    tensors = {}
    for p in planned:
        e = base.tensors[p.name]
        if p.raw:
            tensors[p.name] = e
        else:
            tensors[p.name] = TensorEntry(p.name, e.offset, p.shape, p.stride, p.dtype, e.region)
    return Layout(tensors, base.regions, base.image_nbytes, base.expert_nbytes)


def _engine_metadata_class():
    from flashboot.layouts.format import ImageMetadata

    @dataclass(frozen=True)
    class EngineImageMetadata(ImageMetadata):
        """ImageMetadata plus the ``engine`` section (the strict reader ignores it)."""

        engine: dict = field(default_factory=dict)

        def to_dict(self) -> dict:
            d = super().to_dict()
            d[ENGINE_SECTION] = self.engine
            return d

    return EngineImageMetadata


@dataclass
class EngineRankReport:
    """One written rank: where, how many bytes and tensors, how long."""

    rank: int
    dir: Path
    image_nbytes: int
    tensors: int
    aliases: int
    skipped: dict[str, str]
    seconds: float


def write_engine_rank(rank_dir: Path, collected: EngineTensors, key: EngineKey, *, rank: int, tp_size: int,
                      ep_size: int, job_id: str, source_path: str, model_type: str | None,
                      chunk_bytes: int | None = None) -> EngineRankReport:
    """Write one rank's image (``image.bin`` + ``metadata.json`` with the engine section) into
    ``rank_dir`` with the layouts writer: tensors at their final offsets, checksums, metadata last."""
    from flashboot import __version__
    from flashboot.layouts.format import (
        DEFAULT_CHUNK_BYTES, TENSOR_ALIGNMENT, TARGETS, FamilyInfo, ImageKey, ImageMetadata, ParallelLayout,
        SourceInfo,
    )
    from flashboot.layouts.writer import ImageWriter

    t0 = time.perf_counter()
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    planned = [_plan_tensor(t) for t in collected.tensors.values()]
    layout = _layout_for(planned, TENSOR_ALIGNMENT)
    if layout.image_nbytes == 0:
        raise LayoutError(f"{rank_dir}: the model holds no tensor bytes; nothing to pre-pack")
    parallel = ParallelLayout(rank, tp_size, ep_size)
    # The layouts format names whose tensor names an image follows; an engine's are its own.
    target = key.engine if key.engine in TARGETS else "sglang"
    family = engine_family(key.engine)
    dtypes = tuple(sorted({e.dtype for e in layout.tensors.values()}))
    image_key = ImageKey(key.model_id, key.revision, key.config_hash, family, target, tp_size, ep_size, dtypes)
    source = SourceInfo(source_path, key.model_id, key.revision, key.config_hash, model_type)
    section = {
        "format": ENGINE_FORMAT,
        "key": key.to_dict(),
        "rank": rank,
        "tensors": {p.name: ({"kind": p.kind, "persistent": p.persistent} if not p.raw else
                             {"kind": p.kind, "persistent": p.persistent, "dtype": p.dtype,
                              "shape": list(p.shape), "stride": list(p.stride)})
                    for p in planned},
        "aliases": collected.aliases,
        "attrs": collected.attrs,
        "skipped": collected.skipped,
    }
    writer = ImageWriter(rank_dir, layout, chunk_bytes)
    try:
        for p in planned:
            raw = _span_bytes(collected.tensors[p.name].tensor, p)
            if raw is not None:
                writer.write(layout.tensors[p.name], 0, raw)
        meta_cls = _engine_metadata_class()
        meta = meta_cls(
            flashboot_version=__version__, job_id=job_id, source=source,
            family=FamilyInfo(family, model_type, False, None), target=target, parallel=parallel, experts=None,
            image_file=writer.path.name, image_nbytes=layout.image_nbytes, regions=layout.regions,
            tensors=layout.tensors, checksums=writer.checksums(chunk_bytes), key=image_key,
            warnings=tuple(collected.warnings), engine=section)
        # What we write must be what the strict reader accepts: check here, not at load.
        ImageMetadata.from_dict(json.loads(meta.to_json()), str(rank_dir / "metadata.json"))
        writer.finish(meta)
    finally:
        writer.close()
    return EngineRankReport(rank, rank_dir, layout.image_nbytes, len(planned), len(collected.aliases),
                            dict(collected.skipped), time.perf_counter() - t0)


# =============================================================================================
# A job over ranks
# =============================================================================================
class RankGroup:
    """The ranks of one pre-pack job: this rank, the world, and two collectives. An engine adapter
    wraps its group coordinator (``broadcast_object``, ``barrier``); one rank needs neither."""

    def __init__(self, rank: int = 0, world_size: int = 1, *, broadcast: Callable[[Any], Any] | None = None,
                 barrier: Callable[[], None] | None = None):
        if not 0 <= rank < world_size:
            raise FlashBootError(f"rank {rank} outside 0..{world_size - 1}")
        if world_size > 1 and (broadcast is None or barrier is None):
            raise FlashBootError(f"a {world_size}-rank pre-pack needs the engine's broadcast and barrier")
        self.rank, self.world_size = rank, world_size
        self._broadcast, self._barrier = broadcast, barrier

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        return value if self.world_size == 1 else self._broadcast(value)

    def barrier(self) -> None:
        if self.world_size > 1:
            self._barrier()


def prepack_engine_model(model, out_dir: str | os.PathLike, key: EngineKey, group: RankGroup, *, device: Any,
                         tp_size: int, ep_size: int, source_path: str, model_type: str | None,
                         attrs: Mapping[str, Any] | None = None, timeout_s: float = 300.0,
                         chunk_bytes: int | None = None) -> EngineRankReport:
    """Dump this rank of a loaded engine model into ``out_dir`` as part of one job.

    Rank 0 chooses the job id (broadcast); every rank writes ``OUT/.tmp-<job>/rank-R``; after a
    barrier rank 0 takes ``OUT/.lock``, checks every rank is there, swaps the rank directories in
    and writes ``prepack.json`` last. A crash leaves no ``prepack.json`` for this job (the reader
    refuses: re-run). ``max(tp, ep)`` must equal the group's world size.
    """
    from flashboot.layouts.format import ParallelLayout
    from flashboot.layouts.image import rank_dir_name
    from flashboot.layouts.writer import make_job_tmp

    world = ParallelLayout(group.rank, tp_size, ep_size).world_size
    if world != group.world_size:
        raise LayoutError(f"tp={tp_size}, ep={ep_size} make {world} ranks but the job's group has {group.world_size}")
    out_dir = Path(out_dir)
    # Every rank reaches every collective even when its own part failed, so a rank that gives up
    # never leaves the others waiting; rank 0's commit then names what is missing.
    job_id = group.broadcast(uuid.uuid4().hex if group.rank == 0 else None)
    tmp = out_dir / f".tmp-{job_id[:12]}"
    report, failure = None, None
    try:
        if group.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
    except BaseException as exc:
        failure = exc
    group.barrier()
    rank_dir = tmp / rank_dir_name(group.rank)
    claim = None  # held until the commit: a prepack into OUT meanwhile had swept this job's ranks as stale
    try:
        try:
            if failure is not None:
                raise failure
            collected = collect_engine_tensors(model, device, attrs=attrs)
            claim = make_job_tmp(out_dir, job_id)
            if rank_dir.exists():
                shutil.rmtree(rank_dir)
            report = write_engine_rank(rank_dir, collected, key, rank=group.rank, tp_size=tp_size, ep_size=ep_size,
                                       job_id=job_id, source_path=source_path, model_type=model_type,
                                       chunk_bytes=chunk_bytes)
        except BaseException as exc:
            failure = exc
        group.barrier()
        status = None
        if group.rank == 0:
            try:
                _commit_engine_job(out_dir, tmp, job_id, key, world, tp_size, ep_size, timeout_s)
            except BaseException as exc:
                failure = failure or exc
                status = f"{type(exc).__name__}: {exc}"
        status = group.broadcast(status)
        if failure is not None:
            raise failure
        if status is not None:
            raise LayoutError(f"{out_dir}: rank 0 could not commit pre-pack job {job_id}: {status}")
    finally:
        if claim is not None:
            claim.close()
    report.dir = out_dir / rank_dir_name(group.rank)
    return report


def _commit_engine_job(out_dir: Path, tmp: Path, job_id: str, key: EngineKey, world: int, tp_size: int,
                       ep_size: int, timeout_s: float) -> None:
    from flashboot import __version__
    from flashboot.layouts.format import FORMAT_VERSION, JOB_FORMAT_NAME, METADATA_FILE
    from flashboot.layouts.image import rank_dir_name
    from flashboot.layouts.writer import commit_job, sweep_stale_jobs

    deadline = time.monotonic() + timeout_s
    lock = open(out_dir / ".lock", "a+")
    try:
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise WaitTimeoutError(f"{out_dir}: waited {timeout_s:g} s for {out_dir / '.lock'} (another "
                                           "pre-pack is writing here)") from None
                time.sleep(0.05)
        missing = [r for r in range(world) if not (tmp / rank_dir_name(r) / METADATA_FILE).is_file()]
        if missing:
            raise LayoutError(f"{tmp}: ranks {missing} of {world} did not write their image; job {job_id} not committed")
        metas = [json.loads((tmp / rank_dir_name(r) / METADATA_FILE).read_text()) for r in range(world)]
        image_key = metas[0]["key"]
        for r, m in enumerate(metas):
            if m["key"]["digest"] != image_key["digest"]:
                raise LayoutError(f"{tmp}: rank {r}'s image key {m['key']['digest'][:19]} (dtypes {m['key']['dtypes']}) "
                                  f"differs from rank 0's {image_key['digest'][:19]} (dtypes {image_key['dtypes']}); "
                                  "one job needs one key for all ranks")
        sweep_stale_jobs(out_dir, keep=tmp)  # left by interrupted jobs; we hold the lock
        job = {
            "format": JOB_FORMAT_NAME, "format_version": FORMAT_VERSION, "flashboot_version": __version__,
            "job_id": job_id, "created_unix": time.time(), "world_size": world, "tp_size": tp_size,
            "ep_size": ep_size, "target": metas[0]["target"], "family": metas[0]["family"],
            "source": metas[0]["source"], "key": image_key, "warnings": metas[0]["warnings"],
            "skipped": metas[0][ENGINE_SECTION]["skipped"],
            "ranks": [{"rank": r, "dir": rank_dir_name(r), "image_nbytes": m["image"]["nbytes"],
                       "tensors": len(m["tensors"])} for r, m in enumerate(metas)],
            ENGINE_SECTION: {"format": ENGINE_FORMAT, "key": key.to_dict()},
        }
        commit_job(tmp, out_dir, job, list(range(world)))
    finally:
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        lock.close()


__all__ = [
    "EngineRankReport", "EngineTensor", "EngineTensors", "RankGroup", "collect_engine_tensors", "prepack_engine_model",
    "write_engine_rank",
]
