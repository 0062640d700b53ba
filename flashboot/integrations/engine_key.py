"""What an engine image is for: the loader's options, the engine key, and the image's engine section.

* :class:`LoaderOptions`: what ``--model-loader-extra-config`` may say to the FlashBoot loader.
* :class:`EngineKey`: what an engine image was made by and for (engine and version, model,
  revision, config hash, tp/ep/dp, dtype, quantization, GPU architecture). A load whose key
  differs is refused with :class:`~flashboot.errors.LayoutError` naming both keys.
* :class:`EngineSection` and its readers: the ``engine`` section of one rank's ``metadata.json``
  (kinds, aliases, the key) and the job's key in ``prepack.json``.

Shared by the dump side (:mod:`.engine_dump`) and the load-and-bind side (:mod:`.engine_bind`).
Nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flashboot._json import loads
from flashboot.errors import FlashBootError, LayoutError
from flashboot.layouts.checkpoint import FINGERPRINT_PREFIX, checkpoint_fingerprint
from flashboot.units import check_timeout

ENGINE_SECTION = "engine"
ENGINE_FORMAT = "flashboot-engine/1"
ENGINE_FAMILY_SUFFIX = "-engine"
"""An engine image's layouts family is ``<engine>-engine`` (its tensors are the engine's own)."""


def engine_family(engine: str) -> str:
    return f"{engine}{ENGINE_FAMILY_SUFFIX}"


def is_engine_family(family: str) -> bool:
    """Whether a layouts family name is an engine image's (no checkpoint family rule plans it)."""
    return family.endswith(ENGINE_FAMILY_SUFFIX)
ENGINES = ("sglang", "vllm")
MODES = ("load", "prepack", "auto")
STAGING = ("auto", "require", "inline")
MEMORY_SAVER_POLICIES = ("sleep", "resident", "refuse")
LOAD_FORMAT = "flashboot"
"""The ``--load-format`` name both engine plugins register."""


# =============================================================================================
# Options
# =============================================================================================
def _is_host_port(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
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
    the image in. ``shm_dir``: the staging root. ``memory_saver``: what the engine's sleep of its
    weights does with the arena: ``"sleep"`` (FlashBoot's sleep and wake,
    :mod:`flashboot.integrations.engine_sleep`), ``"resident"`` (nothing: it stays resident) or
    ``"refuse"`` (refuse to load with the memory saver / sleep mode on). ``holder``: restart
    without a reload (:mod:`flashboot.flashload.restart`): a ``flashboot hold --registry DIR``
    registry path, or ``{"registry": DIR}`` / ``{"store": "HOST:PORT"}`` with optional ``name`` (each
    rank holds its arena as ``NAME.rankR.DEVICE``) and ``handover_timeout_s``; the first engine hands its arena to the holder after loading, a
    restarted engine of the same image, version and device maps it (no copy) and binds the model
    to it, and any other loads normally with a warning naming why.
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
    memory_saver: str = "sleep"
    holder: Any = None

    def __post_init__(self):
        for name in ("image_dir", "shm_dir"):  # a path: "" would mean the working directory
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                    raise FlashBootError(f"flashboot option {name} must be a non-empty path, got {value!r}")
                setattr(self, name, os.fspath(value))
        for name in ("seed_store", "publish_store"):
            value = getattr(self, name)
            if value is not None and not _is_host_port(value):
                raise FlashBootError(f"flashboot option {name} must be 'HOST:PORT' (port 1-65535), got {value!r}")
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
        # the repo's one bound: NaN and inf had raised raw errors mid-load (and leaked its arena)
        check_timeout(self.timeout_s, "flashboot option timeout_s")
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
        if self.mode == "prepack" and self.publish_store is not None:
            # the engine serves what its own loader built: no arena to publish (it was skipped silently,
            # and engines cloning from publish_store waited out their timeout for a seed that never came)
            raise FlashBootError("mode='prepack' serves the model the engine's own loader built, not an arena: "
                                 "there is no seed to publish at publish_store; pre-pack first, then load with "
                                 "publish_store")
        if self.holder is not None:
            from flashboot.flashload.restart import HolderOption

            if self.seed_store is not None or self.mode == "prepack":
                raise FlashBootError("flashboot option holder keeps an image load's arena across engine restarts; "
                                     f"it does not apply to {'a clone (seed_store)' if self.seed_store else 'mode=prepack'}")
            HolderOption.of(self.holder)  # refused here, naming the problem, not at the load
        if not isinstance(self.seed_name, str) or not self.seed_name or "/" in self.seed_name:
            raise FlashBootError(f"flashboot option seed_name must be a non-empty name without '/', got {self.seed_name!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | str | None) -> "LoaderOptions":
        """From the engine's ``model_loader_extra_config`` (a dict, or its JSON text)."""
        if extra is None:
            extra = {}
        if isinstance(extra, str):
            extra = loads(extra or "{}", "--model-loader-extra-config")
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
        """(field, self's value, other's value) for every field that differs; ``self`` is the
        engine's key and ``other`` an image's (the revision: :func:`same_revision`)."""
        a, b = self.fields(), other.fields()
        return [(k, a[k], b[k]) for k in self.FIELDS
                if (not same_revision(a[k], b[k]) if k == "revision" else a[k] != b[k])]


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




def same_revision(engine: str | None, image: str | None) -> bool:
    """Whether an engine of revision ``engine`` may load an image packed at ``image``: equal, or a
    weights fingerprint in the image where the engine has none (its model directory holds no
    weight files, a load node that ships ``config.json`` alone: nothing there to tell apart). An
    image without one (packed before local checkpoints were fingerprinted) is not taken for a
    fingerprinted engine: it may be another checkpoint's."""
    return engine == image or (engine is None and isinstance(image, str) and image.startswith(FINGERPRINT_PREFIX))


def model_identity(model_path: str, revision: str | None = None) -> tuple[str, str | None, str]:
    """``(model_id, revision, config_hash)`` of a local model directory or a cached hub id.

    ``config_hash`` is the layouts' hash of ``config.json`` (without ``transformers_version`` and
    ``_``-prefixed keys), so an engine image and a FlashBoot pre-pack of one checkpoint agree.
    A local directory (not a hub snapshot) has no commit: unless ``revision`` is given, its
    revision is its :func:`checkpoint_fingerprint`, so an image of another checkpoint with the same
    config and directory name is refused by the key (:func:`same_revision`).
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
        # a local directory has no commit: two checkpoints with one config and one directory name
        # (ckpts/step-1000/hf, ckpts/step-2000/hf) differ only in their weight files
        if revision is None:  # one the engine was given names the checkpoint itself
            rev = checkpoint_fingerprint(path)
    from flashboot.layouts.checkpoint import read_config

    config = read_config(config_file)  # a list had been a raw AttributeError of .items(), deep nesting RecursionError
    chash = config_hash({k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"})
    return model_id, rev, chash

# =============================================================================================
# Reading
# =============================================================================================
def _check_raw_info(name: str, info: Mapping[str, Any], where: str) -> None:
    """A tensor the image stores as bytes records the engine's dtype, shape and stride: a dtype
    name, and equal-length lists of non-negative ints (whether they fit the entry's bytes is
    checked where the entry is at hand, :func:`~.engine_bind._materialize`)."""
    dtype, shape, stride = info.get("dtype"), info.get("shape"), info.get("stride")

    def ints(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    if not isinstance(dtype, str) or not dtype:
        raise LayoutError(f"{where}: engine tensor {name!r} stored as bytes has dtype {dtype!r}, not a dtype name")
    if not ints(shape) or not ints(stride) or len(shape) != len(stride):
        raise LayoutError(f"{where}: engine tensor {name!r} stored as bytes needs shape and stride as equal-length "
                          f"lists of non-negative ints, found shape {shape!r}, stride {stride!r}")


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
            if "dtype" in info:
                _check_raw_info(name, info, where)
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
        raw = json.loads(image.metadata_bytes)  # the bytes the strict reader validated, not a second read
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


__all__ = [
    "engine_family", "is_engine_family",
    "ENGINES", "ENGINE_FORMAT", "ENGINE_SECTION", "LOAD_FORMAT", "MEMORY_SAVER_POLICIES", "MODES", "STAGING",
    "EngineKey", "EngineSection", "LoaderOptions", "check_engine_key", "gpu_arch_of", "image_is_complete",
    "model_identity", "read_engine_section", "read_job_engine_key",
]
