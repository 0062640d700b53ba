"""Engine images: an inference engine's own post-processed weights in the FlashBoot image format.

An engine (SGLang, vLLM) does more to a checkpoint than shard it: ``process_weights_after_loading``
fuses, re-quantises, transposes and adds tensors (scales, rotary caches, MLA's ``w_kc``). The only
image that serves such an engine without redoing that work is a dump of what the engine itself
holds after its own loader ran. This module is the engine-agnostic half of that:

* :class:`EngineKey`: what an engine image was made by and for (engine and version, model,
  revision, config hash, tp/ep/dp, dtype, quantization, GPU architecture). A load whose key
  differs is refused with :class:`~flashboot.errors.LayoutError` naming both keys.
* :func:`collect_engine_tensors` + :func:`prepack_engine_model`: every parameter, buffer
  (persistent or not) and tensor attribute of a loaded engine model, written through the layouts
  writer API (:class:`~flashboot.layouts.writer.ImageWriter`) as one rank of an image, with an
  ``engine`` section in ``metadata.json`` (kinds, aliases, the key). All ranks of a job write under
  ``OUT/.tmp-<job>``; rank 0 commits (``prepack.json`` last), as ``layouts/FORMAT.md`` prescribes.
* :func:`load_engine_weights`: FlashLoad (or FlashClone from a seed) of one rank, key checked first.
* :func:`bind_engine_model`: point a meta-initialised engine model at the arena views; nothing is
  re-processed, nothing is left on the meta device (LayoutError listing what would be).

The engine adapters (:mod:`flashboot.integrations.sglang`, :mod:`flashboot.integrations.vllm`)
build the model, compute the key and call these. Nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from flashboot.errors import CapabilityError, FlashBootError, LayoutError, WaitTimeoutError

logger = logging.getLogger("flashboot.integrations")

ENGINE_SECTION = "engine"
ENGINE_FORMAT = "flashboot-engine/1"
ENGINES = ("sglang", "vllm")
MODES = ("load", "prepack", "auto")
STAGING = ("auto", "require", "inline")
MEMORY_SAVER_POLICIES = ("refuse", "resident")
LOAD_FORMAT = "flashboot"
"""The ``--load-format`` name both engine plugins register."""


# =============================================================================================
# Options
# =============================================================================================
@dataclass
class LoaderOptions:
    """What ``--model-loader-extra-config`` may say to the FlashBoot loader (both engines).

    ``image_dir``: the engine image (a pre-pack job directory). ``mode``: ``"load"`` (default;
    refuse when no image with this engine's key exists), ``"prepack"`` (run the engine's own
    loader, dump its post-processed weights into ``image_dir``, serve them) or ``"auto"`` (load
    when a complete image exists, else prepack). ``seed_store``: ``HOST:PORT`` of a FlashClone
    rendezvous store: clone the weights from a running seed instead of loading the image.
    ``schedule``: the clone schedule (``chain``, ``star``). ``publish_store``: after loading,
    publish this engine's arena as a seed at ``HOST:PORT`` (kept for the engine's lifetime).
    ``seed_name``: the rendezvous namespace prefix (one namespace per rank). ``verify``: recompute
    the image checksums on the device after the copy. ``timeout_s``: every wait (preloader,
    rendezvous, ranks of a pre-pack). ``staging``: ``"auto"`` (use a preloader's staged copy when
    one is there or running, else stage in this process), ``"require"`` (wait for ``flashboot
    preload``) or ``"inline"``. ``served``: let a running ``flashboot preload --serve`` daemon copy
    the image in. ``shm_dir``: the staging root. ``memory_saver``: what to do when the engine's
    memory saver / sleep mode is on (``"refuse"``, or ``"resident"``: load anyway; the arena is not
    released by a pause).
    """

    image_dir: str | None = None
    mode: str = "load"
    seed_store: str | None = None
    schedule: str = "chain"
    publish_store: str | None = None
    seed_name: str = "flashboot"
    verify: bool = False
    timeout_s: float = 300.0
    staging: str = "auto"
    served: bool = False
    shm_dir: str | None = None
    memory_saver: str = "refuse"

    def __post_init__(self):
        if self.image_dir is not None:
            self.image_dir = str(self.image_dir)
        if self.mode not in MODES:
            raise FlashBootError(f"flashboot option mode={self.mode!r}; known: {', '.join(MODES)}")
        if self.staging not in STAGING:
            raise FlashBootError(f"flashboot option staging={self.staging!r}; known: {', '.join(STAGING)}")
        if self.memory_saver not in MEMORY_SAVER_POLICIES:
            raise FlashBootError(f"flashboot option memory_saver={self.memory_saver!r}; known: "
                                 f"{', '.join(MEMORY_SAVER_POLICIES)}")
        if self.schedule not in ("chain", "star"):
            raise FlashBootError(f"flashboot option schedule={self.schedule!r}; an engine clones with 'chain' or "
                                 "'star' (a ring needs every member's host image: use flashboot.clone directly)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise FlashBootError(f"flashboot option timeout_s must be a positive number, got {self.timeout_s!r}")
        for name in ("verify", "served"):
            if not isinstance(getattr(self, name), bool):
                raise FlashBootError(f"flashboot option {name} must be true or false, got {getattr(self, name)!r}")
        if self.seed_store is None and self.image_dir is None:
            raise FlashBootError("the flashboot loader needs image_dir (a pre-packed engine image) or seed_store "
                                 "(HOST:PORT of a FlashClone seed): pass them in --model-loader-extra-config, e.g. "
                                 "'{\"image_dir\": \"/images/model-tp8\"}'")
        if self.mode != "load" and self.image_dir is None:
            raise FlashBootError(f"flashboot option mode={self.mode!r} writes an image: image_dir is required")
        if self.mode == "prepack" and self.seed_store is not None:
            raise FlashBootError("mode='prepack' runs the engine's own loader; it cannot clone from seed_store")
        if not self.seed_name or "/" in self.seed_name:
            raise FlashBootError(f"flashboot option seed_name must be a non-empty name without '/', got {self.seed_name!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | str | None) -> "LoaderOptions":
        """From the engine's ``model_loader_extra_config`` (a dict, or its JSON text)."""
        if extra is None:
            extra = {}
        if isinstance(extra, str):
            try:
                extra = json.loads(extra or "{}")
            except ValueError as exc:
                raise FlashBootError(f"--model-loader-extra-config is not JSON: {exc}") from None
        if not isinstance(extra, Mapping):
            raise FlashBootError(f"--model-loader-extra-config must be a JSON object, got {type(extra).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise FlashBootError(f"unknown flashboot loader option(s) {unknown}; known: {', '.join(known)}")
        return cls(**dict(extra))


# =============================================================================================
# The key
# =============================================================================================
@dataclass(frozen=True)
class EngineKey:
    """What an engine image was made by and for; the digest covers every field.

    ``dp_size`` is the data-parallel width that changes what a rank holds (SGLang's DP attention,
    vLLM's data parallel with expert parallelism); plain data-parallel replicas share one image.
    ``gpu_arch`` is ``sm_XY`` (or ``cpu``): kernels pick weight layouts per architecture.
    ``extra``: engine-specific fields that also decide the processed bytes (kernel backends...).
    """

    engine: str
    engine_version: str
    model_id: str
    revision: str | None
    config_hash: str
    architecture: str
    dtype: str
    quantization: str | None
    tp_size: int
    ep_size: int
    dp_size: int
    pp_size: int
    gpu_arch: str
    format: str = ENGINE_FORMAT
    extra: tuple[tuple[str, Any], ...] = ()

    FIELDS = ("engine", "engine_version", "model_id", "revision", "config_hash", "architecture", "dtype",
              "quantization", "tp_size", "ep_size", "dp_size", "pp_size", "gpu_arch", "format", "extra")

    def fields(self) -> dict:
        d = {k: getattr(self, k) for k in self.FIELDS}
        d["extra"] = {k: v for k, v in self.extra}
        return d

    @property
    def digest(self) -> str:
        blob = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"), default=str).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    def to_dict(self) -> dict:
        return {**self.fields(), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "EngineKey":
        if not isinstance(d, Mapping):
            raise LayoutError(f"{where}: engine key must be an object, found {type(d).__name__}")
        missing = [k for k in cls.FIELDS if k not in d]
        if missing:
            raise LayoutError(f"{where}: engine key lacks {missing}")
        extra = d["extra"]
        if not isinstance(extra, Mapping):
            raise LayoutError(f"{where}: engine key extra must be an object, found {extra!r}")
        try:
            key = cls(**{k: d[k] for k in cls.FIELDS if k != "extra"}, extra=tuple(sorted(extra.items())))
        except TypeError as exc:
            raise LayoutError(f"{where}: malformed engine key ({exc})") from None
        if d.get("digest") != key.digest:
            raise LayoutError(f"{where}: engine key digest {d.get('digest')} does not match its fields "
                              f"({key.digest}); the key was edited or damaged")
        return key

    def describe(self) -> str:
        q = self.quantization or "unquantized"
        return (f"{self.engine} {self.engine_version}: {self.model_id}@{self.revision or '?'} "
                f"({self.config_hash[:19]}, {self.architecture}, {self.dtype}, {q}, tp={self.tp_size}, "
                f"ep={self.ep_size}, dp={self.dp_size}, pp={self.pp_size}, {self.gpu_arch}) [{self.digest[:19]}]")

    def mismatches(self, other: "EngineKey") -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for every field that differs."""
        a, b = self.fields(), other.fields()
        return [(k, a[k], b[k]) for k in self.FIELDS if a[k] != b[k]]


def check_engine_key(recorded: EngineKey, expected: EngineKey, where: str) -> None:
    """Refuse an image whose key is not ``expected``: LayoutError naming both keys and the fields."""
    diffs = expected.mismatches(recorded)
    if diffs:
        detail = "; ".join(f"{k}: engine {want!r}, image {have!r}" for k, want, have in diffs)
        raise LayoutError(
            f"{where}: the image was packed for {recorded.describe()}, but this engine is "
            f"{expected.describe()} ({detail}); refused before loading. Re-run the pre-pack with this "
            f"engine's arguments (--model-loader-extra-config '{{\"mode\": \"prepack\", ...}}').")


def gpu_arch_of(device: Any) -> str:
    """``sm_XY`` of a CUDA device (torch's view of it), ``cpu`` for the host."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    major, minor = torch.cuda.get_device_capability(dev.index if dev.index is not None else torch.cuda.current_device())
    return f"sm_{major}{minor}"


def model_identity(model_path: str, revision: str | None = None) -> tuple[str, str | None, str]:
    """``(model_id, revision, config_hash)`` of a local model directory or a cached hub id.

    ``config_hash`` is the layouts' hash of ``config.json`` (without ``transformers_version`` and
    ``_``-prefixed keys), so an engine image and a FlashBoot pre-pack of one checkpoint agree.
    """
    import re

    from flashboot.layouts.format import config_hash

    path = Path(model_path)
    config_file = path / "config.json" if path.is_dir() else None
    model_id, rev = str(model_path), revision
    if config_file is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(model_path), "config.json", revision=revision)
        except Exception:  # noqa: BLE001 - any hub failure means: not resolvable locally
            cached = None
        if not isinstance(cached, str):
            raise LayoutError(f"cannot find config.json of {model_path!r} (neither a directory nor in the hub cache); "
                              "the engine key needs it")
        config_file = Path(cached)
    resolved = str(config_file.parent.resolve())
    m = re.search(r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]{7,64})$", resolved)
    if m:
        model_id, rev = f"{m.group(1)}/{m.group(2)}", rev or m.group(3)
    elif path.is_dir():
        model_id = path.resolve().name
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{config_file}: unreadable config ({exc})") from None
    chash = config_hash({k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"})
    return model_id, rev, chash


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

    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, p in mod._parameters.items():
            if p is None:
                continue
            if not same_device(p):
                off_device.append(f"{prefix}{leaf} ({p.device})")
                continue
            add(prefix + leaf, p, "param")
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, b in mod._buffers.items():
            if b is None:
                continue
            if not same_device(b):
                off_device.append(f"{prefix}{leaf} ({b.device})")
                continue
            add(prefix + leaf, b, "buffer", leaf not in mod._non_persistent_buffers_set)
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
    family = f"{key.engine}-engine"
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
    try:
        if failure is not None:
            raise failure
        collected = collect_engine_tensors(model, device, attrs=attrs)
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
    report.dir = out_dir / rank_dir_name(group.rank)
    return report


def _commit_engine_job(out_dir: Path, tmp: Path, job_id: str, key: EngineKey, world: int, tp_size: int,
                       ep_size: int, timeout_s: float) -> None:
    from flashboot import __version__
    from flashboot.layouts.format import FORMAT_VERSION, JOB_FORMAT_NAME, METADATA_FILE
    from flashboot.layouts.image import rank_dir_name
    from flashboot.layouts.writer import commit_job

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
        for stale in out_dir.glob(".tmp-*"):  # left by interrupted jobs; we hold the lock
            if stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)
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


# =============================================================================================
# Reading
# =============================================================================================
@dataclass(frozen=True)
class EngineSection:
    """The ``engine`` section of one rank's metadata: the key and how to bind each tensor."""

    key: EngineKey
    rank: int
    tensors: dict[str, dict]
    aliases: dict[str, dict]
    attrs: dict[str, Any]
    skipped: dict[str, str]

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "EngineSection":
        if not isinstance(d, Mapping):
            raise LayoutError(f"{where}: no engine section: this is not an engine image (pre-pack it with the "
                              "engine's loader: mode 'prepack'), or it was written by another tool")
        if d.get("format") != ENGINE_FORMAT:
            raise LayoutError(f"{where}: engine section format {d.get('format')!r}; this flashboot reads {ENGINE_FORMAT!r}")
        for name in ("tensors", "aliases", "attrs", "skipped"):
            if not isinstance(d.get(name), Mapping):
                raise LayoutError(f"{where}: engine section field {name!r} must be an object")
        for name, info in d["tensors"].items():
            if not isinstance(info, Mapping) or info.get("kind") not in ("param", "buffer", "extra"):
                raise LayoutError(f"{where}: engine tensor {name!r} has no valid kind (param, buffer, extra): {info!r}")
        for name, info in d["aliases"].items():
            if not isinstance(info, Mapping) or info.get("of") not in d["tensors"]:
                raise LayoutError(f"{where}: alias {name!r} names {info!r}, not a tensor of the image")
        rank = d.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise LayoutError(f"{where}: engine section rank must be an int, found {rank!r}")
        return cls(EngineKey.from_dict(d.get("key"), where), rank, dict(d["tensors"]), dict(d["aliases"]),
                   dict(d["attrs"]), dict(d["skipped"]))


def read_engine_section(image_dir: str | os.PathLike, rank: int) -> tuple[EngineSection, Any]:
    """``(section, metadata)`` of rank ``rank`` of an engine image, through the strict reader
    (everything but the image bytes checked) plus the engine section."""
    from flashboot.layouts.image import read_image

    image = read_image(image_dir, rank)
    where = str(image.dir / "metadata.json")
    try:
        raw = json.loads((image.dir / "metadata.json").read_text())
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{where}: unreadable ({exc})") from None
    section = EngineSection.from_dict(raw.get(ENGINE_SECTION), where)
    if section.rank != rank:
        raise LayoutError(f"{where}: engine section is for rank {section.rank}, rank {rank} was requested")
    missing = sorted(set(section.tensors) - set(image.metadata.tensors))
    if missing:
        raise LayoutError(f"{where}: engine section names tensors the image lacks: {missing[:8]}")
    return section, image.metadata


def image_is_complete(image_dir: str | os.PathLike | None) -> bool:
    """Whether ``image_dir`` holds a committed job (``prepack.json``)."""
    from flashboot.layouts.format import JOB_FILE

    return image_dir is not None and (Path(image_dir) / JOB_FILE).is_file()


def read_job_engine_key(image_dir: str | os.PathLike) -> EngineKey:
    """The engine key recorded in a job's ``prepack.json``."""
    from flashboot.layouts.format import JOB_FILE
    from flashboot.layouts.image import read_job

    job = read_job(image_dir)
    where = str(Path(image_dir) / JOB_FILE)
    section = job.raw.get(ENGINE_SECTION)
    if not isinstance(section, Mapping):
        raise LayoutError(f"{where}: not an engine image (no engine section); pre-pack it with the engine "
                          "(mode 'prepack')")
    return EngineKey.from_dict(section.get("key"), where)


# =============================================================================================
# Loading and binding
# =============================================================================================
@dataclass
class EngineWeights:
    """One rank's weights in an arena: ``tensors`` (name -> view), the engine ``section``,
    ``handle`` (the LoadedImage or CloneResult that owns the arena), ``seed`` (when published),
    ``how`` ("load" or "clone") and ``report`` (its timing report)."""

    tensors: dict
    section: EngineSection
    handle: Any
    how: str
    report: Any
    seed: Any = None

    @property
    def arena(self):
        return self.handle.arena

    def early_call(self) -> str:
        """What the early call (:func:`prepare_engine_load`) won, for the engine's log line: how long
        the weights were in place before the engine asked for them, or how long it waited."""
        details = getattr(self.report, "details", {}) or {}
        if "prepared_before_load" not in details:
            return "no early call"
        if details["prepared_before_load"]:
            return f"weights ready {details['ready_before_load_ms']:.1f} ms before the engine asked"
        return f"the engine waited {self.report.wait_ms:.1f} ms for the early copy to end"

    def close(self) -> None:
        """Withdraw the seed (if any) and release the arena. Views must not be used afterwards."""
        if self.seed is not None:
            self.seed.close()
            self.seed = None
        self.handle.close()


ENGINE_RECORD = "flashboot-engine"
"""Rendezvous record (next to FlashClone's own) holding a seed's engine section."""


def _rank_namespace(options: LoaderOptions, rank: int) -> str:
    return f"{options.seed_name}-rank{rank}"


def _stage_if_needed(options: LoaderOptions, rank: int, dev) -> bool:
    """Make sure the preloader's ``.ready`` exists (or will): returns True when we staged inline."""
    from flashboot.flashload.service import service_status
    from flashboot.flashload.shm import staged_paths
    from flashboot.flashload.staging import stage_rank

    if options.served or options.staging == "require":
        return False
    ready = staged_paths(options.image_dir, rank, options.shm_dir).ready
    if options.staging == "auto" and (ready.exists() or service_status(options.image_dir, options.shm_dir).running):
        return False
    logger.warning("flashboot: staging rank %d of %s in this process (disk -> shared memory). Run `flashboot preload "
                   "%s` before starting the engine to take this off the critical path.", rank, options.image_dir,
                   options.image_dir)
    stage_rank(options.image_dir, rank, shm_dir=options.shm_dir, device=str(dev) if dev.is_cuda else "cpu")
    return True


def prepare_engine_load(options: LoaderOptions, expected: EngineKey, rank: int, device: Any, *, tp_size: int,
                        ep_size: int):
    """The early call (:func:`flashboot.prepare`) for an engine's image load, made before the engine
    builds its model on the meta device: the engine keys are checked at once (a refusal allocates
    nothing), then the metadata is read, the arena created and attached to a served-load daemon
    (``served``), the staged copy pinned, or a load streamed from disk readied, and the views built,
    while the engine builds its model. Returns the handle for :func:`load_engine_weights`, or None
    where there is nothing to prepare: a clone (``seed_store``), an incomplete image (pre-pack or a
    clear refusal follow), ``staging="inline"`` (this process stages the image first)."""
    if options.seed_store is not None or options.staging == "inline" or not image_is_complete(options.image_dir):
        return None
    import flashboot
    from flashboot.memory import Device

    _check_image_keys(options, expected, rank)
    mode = "served" if options.served else ("staged" if options.staging == "require" else "auto")
    return flashboot.prepare(options.image_dir, rank, Device.parse(device), mode=mode, timeout_s=options.timeout_s,
                             shm_dir=options.shm_dir, tp=tp_size, ep=ep_size, verify=options.verify)


def _check_image_keys(options: LoaderOptions, expected: EngineKey, rank: int) -> "EngineSection":
    """The job's key first: a rank the image does not have (another TP size) is refused by the key,
    naming both tp sizes, rather than by a missing rank directory; then the rank's own."""
    check_engine_key(read_job_engine_key(options.image_dir), expected, str(options.image_dir))
    section, _ = read_engine_section(options.image_dir, rank)
    check_engine_key(section.key, expected, f"{options.image_dir} (rank {rank})")
    return section


def load_engine_weights(options: LoaderOptions, expected: EngineKey, rank: int, device: Any, *, tp_size: int,
                        ep_size: int, prepared=None) -> EngineWeights:
    """Bring rank ``rank``'s engine weights onto ``device``: clone them from ``options.seed_store``
    when set, else FlashLoad them from ``options.image_dir`` (with ``prepared``, the handle of
    :func:`prepare_engine_load` made at engine start, the load is the copy). The engine key is
    checked first (LayoutError naming both keys; nothing allocated). With ``publish_store``, the
    arena is then published as a FlashClone seed for other engines.
    """
    from flashboot.memory import Device

    dev = Device.parse(device)
    if options.seed_store is not None:
        weights = _clone_engine_weights(options, expected, rank, dev)
    else:
        weights = _load_engine_image(options, expected, rank, dev, tp_size=tp_size, ep_size=ep_size, prepared=prepared)
    if options.publish_store is not None:
        try:
            weights.seed = publish_engine_weights(weights, options, rank)
        except BaseException:
            weights.close()
            raise
    return weights


def _load_engine_image(options: LoaderOptions, expected: EngineKey, rank: int, dev, *, tp_size: int,
                       ep_size: int, prepared=None) -> EngineWeights:
    import flashboot
    from flashboot.flashload.staging import unstage

    if prepared is not None:  # keys checked and everything one-time paid by prepare_engine_load
        section, _ = read_engine_section(options.image_dir, rank)
        loaded = flashboot.load(options.image_dir, rank, dev, prepared=prepared, verify=options.verify, tp=tp_size,
                                ep=ep_size)
        return EngineWeights(loaded.tensors, section, loaded, "load", loaded.report)

    if not image_is_complete(options.image_dir):
        raise LayoutError(
            f"{options.image_dir}: no complete engine image here (no prepack.json). Pre-pack it first: start the "
            "engine once with --model-loader-extra-config '{\"image_dir\": ..., \"mode\": \"prepack\"}' (or "
            "\"auto\": pre-pack when missing, load otherwise)")
    section = _check_image_keys(options, expected, rank)
    staged_here = _stage_if_needed(options, rank, dev)
    try:
        loaded = flashboot.load(options.image_dir, rank, dev, timeout_s=options.timeout_s, served=options.served,
                                verify=options.verify, shm_dir=options.shm_dir, tp=tp_size, ep=ep_size)
        if staged_here and loaded.release_thread is not None:
            loaded.release_thread.join(options.timeout_s)  # its unmap of the staged copy, before we remove it
    finally:
        if staged_here:  # a copy we made only for this load: give the shared memory back
            unstage(options.image_dir, [rank], shm_dir=options.shm_dir)
    return EngineWeights(loaded.tensors, section, loaded, "load", loaded.report)


def _engine_rendezvous(options: LoaderOptions, rank: int, *, host: bool):
    from flashboot.flashclone.rendezvous import Rendezvous

    return Rendezvous.connect(options.publish_store if host else options.seed_store, None,
                              namespace=_rank_namespace(options, rank), host=host, timeout_s=options.timeout_s)


def _clone_engine_weights(options: LoaderOptions, expected: EngineKey, rank: int, dev) -> EngineWeights:
    import flashboot

    where = f"seed at {options.seed_store} (rank {rank}, namespace {_rank_namespace(options, rank)})"
    rdv = _engine_rendezvous(options, rank, host=False)
    try:
        record = rdv.read(ENGINE_RECORD, what=f"the engine record of the {where}", timeout_s=options.timeout_s)
    finally:
        rdv.close()
    section = EngineSection.from_dict(record.body.get("section"), where)
    check_engine_key(section.key, expected, where)
    result = flashboot.clone(options.seed_store, dev, options.schedule, verify=options.verify,
                             timeout_s=options.timeout_s, name=_rank_namespace(options, rank),
                             expect={"key_digest": record.body.get("image_key_digest")}, rank=rank)
    if not result.tensors:
        result.close()
        raise LayoutError(f"{where}: the seed published no image metadata, so there are no tensors to bind")
    missing = sorted(set(section.tensors) - set(result.tensors))
    if missing:
        result.close()
        raise LayoutError(f"{where}: the seed's image lacks tensors its engine section names: {missing[:8]}")
    return EngineWeights(result.tensors, section, result, "clone", result.report)


def publish_engine_weights(weights: EngineWeights, options: LoaderOptions, rank: int):
    """Publish ``weights`` as a FlashClone seed at ``options.publish_store`` (namespace per rank),
    plus the engine record a cloning engine checks its key against. Returns the Seed (keep it
    open as long as the engine serves)."""
    import flashboot

    seed = flashboot.seed(options.publish_store, weights.handle, weights.arena.device,
                          name=_rank_namespace(options, rank), rank=rank, timeout_s=options.timeout_s)
    try:
        metadata = weights.handle.metadata
        section = {"format": ENGINE_FORMAT, "key": weights.section.key.to_dict(), "rank": weights.section.rank,
                   "tensors": weights.section.tensors, "aliases": weights.section.aliases,
                   "attrs": weights.section.attrs, "skipped": weights.section.skipped}
        seed.rendezvous.publish(ENGINE_RECORD, {"section": section, "image_key_digest": metadata.key.digest})
    except BaseException:
        seed.close()
        raise
    return seed


@dataclass
class EngineBindReport:
    """What :func:`bind_engine_model` did."""

    bound: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    """Names the meta model did not have (tensors the engine's post-processing created)."""
    attrs: list[str] = field(default_factory=list)
    repointed: list[str] = field(default_factory=list)
    """References held in module containers (dataclass fields, lists, dicts) moved to the bound tensor."""


def _materialize(view, info: Mapping[str, Any]):
    """The engine's tensor from an image view: raw (uint8) entries are re-typed and re-strided."""
    import torch

    if "dtype" not in info:
        return view
    dtype = getattr(torch, info["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CapabilityError(f"this torch has no dtype {info['dtype']!r} (the image was packed with another torch)")
    typed = view.view(dtype)
    return typed.as_strided(tuple(info["shape"]), tuple(info["stride"]), typed.storage_offset())


def bind_engine_model(model, weights: EngineWeights) -> EngineBindReport:
    """Point ``model`` (built on the meta device by the engine's own model class) at the views.

    Parameters keep their class and attributes (``weight_loader``, shard dims...) on a new
    Parameter over the arena; buffers keep their persistence; tensor attributes are set. Tied
    names share one object. A tensor whose shape or dtype differs from the meta model's is
    refused (LayoutError listing them). Leftover meta tensors are checked by
    :func:`check_no_meta_tensors` once the engine's own hooks ran.
    """
    import torch

    section = weights.section
    modules = dict(model.named_modules(remove_duplicate=False))
    report = EngineBindReport()
    registered: dict[str, Any] = {}
    replaced: dict[int, tuple[Any, Any]] = {}
    no_module, mismatched = [], []

    def register(name: str, value, kind: str, persistent: bool) -> None:
        mod_name, _, leaf = name.rpartition(".")
        mod = modules.get(mod_name)
        if mod is None:
            no_module.append(name)
            return
        old = mod._parameters.get(leaf) if leaf in mod._parameters else mod._buffers.get(leaf)
        if old is None and leaf in vars(mod) and isinstance(vars(mod)[leaf], torch.Tensor):
            old = vars(mod)[leaf]
        if old is not None and (tuple(old.shape) != tuple(value.shape) or old.dtype != value.dtype):
            mismatched.append(f"{name} (image {list(value.shape)} {value.dtype}, model {list(old.shape)} {old.dtype})")
            return
        if old is None:
            report.added.append(name)
        mod._parameters.pop(leaf, None)
        mod._buffers.pop(leaf, None)
        mod._non_persistent_buffers_set.discard(leaf)
        if leaf in vars(mod):
            delattr(mod, leaf)
        if kind == "param":
            if not isinstance(value, torch.nn.Parameter):
                cls = type(old) if isinstance(old, torch.nn.Parameter) else torch.nn.Parameter
                param = torch.Tensor._make_subclass(cls, value, False)
                if isinstance(old, torch.nn.Parameter):
                    param.__dict__.update(old.__dict__)  # weight_loader, output_dim... set by the layer
                value = param
            mod._parameters[leaf] = value
        elif kind == "buffer":
            mod.register_buffer(leaf, value, persistent=persistent)
        else:
            object.__setattr__(mod, leaf, value)
        registered[name] = value
        if old is not None:
            replaced[id(old)] = (old, value)  # old kept alive: its id must not be reused meanwhile

    for name, info in section.tensors.items():
        value = _materialize(weights.tensors[name], info)
        register(name, value, info["kind"], bool(info.get("persistent", True)))
        report.bound.append(name)
    for name, info in section.aliases.items():
        canonical = registered.get(info["of"])
        if canonical is None:
            continue  # its canonical tensor was refused above; reported there
        value = canonical
        if info["kind"] != "param" and isinstance(value, torch.nn.Parameter):
            value = value.detach()
        register(name, value, info["kind"], bool(info.get("persistent", True)))
        report.aliases.append(name)
    problems = []
    if no_module:
        problems.append(f"{len(no_module)} tensor(s) name modules the model does not have: {', '.join(no_module[:6])}")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) differ in shape or dtype from the engine's model (the image "
                        f"was packed with another quantization or kernel layout): {', '.join(mismatched[:6])}")
    if problems:
        raise LayoutError(f"cannot bind {type(model).__name__} to the engine image: " + "; ".join(problems))
    for name, value in section.attrs.items():
        setattr(model, name, value)
        report.attrs.append(name)
    report.repointed = _repoint_held_references(model, replaced)
    return report


def _held_containers(mod):
    """(attribute, container) for a module's plain attributes that hold tensors one level down: a
    dataclass instance, list, tuple or dict (e.g. SGLang's TopK keeps the gate's
    ``e_score_correction_bias`` in its ``TopKConfig``)."""
    for attr, value in vars(mod).items():
        if attr in ("_parameters", "_buffers", "_modules") or isinstance(value, type):
            continue
        if dataclasses.is_dataclass(value) or isinstance(value, (list, tuple, dict)):
            yield attr, value


def _repoint_held_references(model, replaced: dict[int, tuple[Any, Any]]) -> list[str]:
    """Point references that modules hold in containers at the bound tensors instead of the meta
    tensors they replaced; the names of the entries re-pointed."""
    import torch

    done = []
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, held in _held_containers(mod):
            if dataclasses.is_dataclass(held):
                for f in dataclasses.fields(held):
                    value = getattr(held, f.name)
                    if isinstance(value, torch.Tensor) and id(value) in replaced:
                        object.__setattr__(held, f.name, replaced[id(value)][1])  # frozen dataclasses too
                        done.append(f"{prefix}{attr}.{f.name}")
            elif isinstance(held, (list, dict)):
                keys = held.keys() if isinstance(held, dict) else range(len(held))
                for k in list(keys):
                    if isinstance(held[k], torch.Tensor) and id(held[k]) in replaced:
                        held[k] = replaced[id(held[k])][1]
                        done.append(f"{prefix}{attr}[{k!r}]")
            elif any(isinstance(v, torch.Tensor) and id(v) in replaced for v in held):
                setattr(mod, attr, type(held)(replaced[id(v)][1] if isinstance(v, torch.Tensor) and id(v) in replaced
                                              else v for v in held))
                done.append(f"{prefix}{attr}")
    return done


def check_no_meta_tensors(model, where: str) -> None:
    """Refuse a model that still holds meta tensors (parameters, buffers or tensor attributes the
    image did not provide): they would be uninitialised memory at serving time."""
    import torch

    left = []
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is not None and t.is_meta:
                left.append(prefix + leaf)
        for leaf, t in vars(mod).items():
            if not leaf.startswith("_") and isinstance(t, torch.Tensor) and t.is_meta:
                left.append(prefix + leaf)
        for attr, held in _held_containers(mod):
            values = ([(f.name, getattr(held, f.name)) for f in dataclasses.fields(held)]
                      if dataclasses.is_dataclass(held) else held.items() if isinstance(held, dict) else enumerate(held))
            left += [f"{prefix}{attr}[{k!r}]" for k, t in values if isinstance(t, torch.Tensor) and t.is_meta]
    if left:
        shown = ", ".join(left[:8]) + (f" ... and {len(left) - 8} more" if len(left) > 8 else "")
        raise LayoutError(f"{where}: {len(left)} tensor(s) of the model are not in the engine image and would be "
                          f"uninitialised: {shown}. Re-run the pre-pack with this engine version.")


def memory_saver_policy(enabled: bool, flag: str, options: LoaderOptions, nbytes: int | None = None) -> None:
    """Refuse (CapabilityError naming ``flag``) or warn when the engine's memory saver is on.

    The arena is one CUDA VMM allocation made through the driver, outside the engine's hooked
    allocator, so a memory-saver pause of the weights does not release it.
    """
    if not enabled:
        return
    if options.memory_saver == "refuse":
        raise CapabilityError(
            f"{flag} is on, but FlashBoot's weights live in one CUDA VMM arena allocated through the driver, which "
            f"the engine's memory saver cannot pause or release. Start the engine without {flag}, or pass "
            "'\"memory_saver\": \"resident\"' in --model-loader-extra-config to keep the weights resident across "
            "pauses.")
    logger.warning("flashboot: %s is on; the %s weight arena stays resident when the engine pauses its weights "
                   "(memory_saver=resident)", flag, f"{nbytes:,}-byte" if nbytes else "")


__all__ = [
    "ENGINE_FORMAT", "ENGINE_SECTION", "LOAD_FORMAT", "EngineBindReport", "EngineKey", "EngineRankReport",
    "EngineSection", "EngineTensor", "EngineTensors", "EngineWeights", "LoaderOptions", "RankGroup",
    "bind_engine_model", "check_engine_key", "check_no_meta_tensors", "collect_engine_tensors", "gpu_arch_of",
    "image_is_complete", "load_engine_weights", "memory_saver_policy", "model_identity", "prepack_engine_model",
    "prepare_engine_load", "publish_engine_weights", "read_engine_section", "read_job_engine_key", "write_engine_rank",
]
