"""The load-and-bind side of engine images: one rank's weights in an arena, bound to the engine's model.

* :func:`prepare_engine_load` (the early call, at engine start) and :func:`load_engine_weights`:
  FlashLoad (or FlashClone from a seed) of one rank, the engine key checked first;
* :func:`publish_engine_weights`: the arena as a FlashClone seed for other engines;
* :func:`bind_engine_model`: point a meta-initialised engine model at the arena views; nothing is
  re-processed, nothing is left on the meta device (:func:`check_no_meta_tensors`).

Nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from flashboot.errors import CapabilityError, LayoutError

from .engine_key import (
    ENGINE_FORMAT, EngineKey, EngineSection, LoaderOptions, check_engine_key, image_is_complete, read_engine_section,
    read_job_engine_key,
)

logger = logging.getLogger("flashboot.integrations")


# =============================================================================================
# Loading and binding
# =============================================================================================
@dataclass
class EngineWeights:
    """One rank's weights in an arena: ``tensors`` (name -> view), the engine ``section``,
    ``handle`` (the LoadedImage or CloneResult that owns the arena), ``seed`` (when published),
    ``how`` ("load" or "clone") and ``report`` (its timing report). ``post_refit_pending``: set
    while a refit's bytes are live but the engine's post-processing of them failed (the version
    and the derived names; :func:`~.engine_refit.refit_engine_model` of that version re-runs it)."""

    tensors: dict
    section: EngineSection
    handle: Any
    how: str
    report: Any
    seed: Any = None
    post_refit_pending: dict | None = None

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

    def close(self, *, failed: bool = False) -> None:
        """Withdraw the seed (if any) and release the arena. Views must not be used afterwards;
        ``failed``: the load failed, and the model bound to these views is discarded, so the
        memory goes at once even while they are held (a fallback load needs it)."""
        if self.seed is not None:
            self.seed.close()
            self.seed = None
        self.handle.close(force=failed)


ENGINE_RECORD = "flashboot-engine"
"""Rendezvous record (next to FlashClone's own) holding a seed's engine section."""


def _rank_namespace(options: LoaderOptions, rank: int) -> str:
    return f"{options.seed_name}-rank{rank}"


def _rank_holder(options: LoaderOptions, rank: int, dev):
    """This rank's holder option: a ``name`` in the loader options is the same on every rank and
    replica they start, so each holds its arena as ``NAME.rankR.DEVICE`` (as the default name
    does with the image folder's; DEVICE names the physical GPU, :func:`~flashboot.flashload.restart.device_tag`): under one name, each rank's hand-over replaced the other's and
    every restart of the others reloaded."""
    from flashboot.flashload.restart import HolderOption, device_tag

    if options.holder is None:
        return None
    option = HolderOption.of(options.holder)
    if option.name is None:
        return option
    return dataclasses.replace(option, name=f"{option.name}.rank{rank}.{device_tag(dev)}")


def _stage_if_needed(options: LoaderOptions, rank: int, dev):
    """The staged copy this load reads, where the engine stages it itself (no preloader serves or
    stages the image): an :class:`~flashboot.flashload.staging.InlineCopy` to release after the
    load, or None. Data-parallel replicas of one image on one node share one copy: one stages it,
    the others wait for it, and the last to load it removes it."""
    from flashboot.flashload.shm import service_status
    from flashboot.flashload.staging import stage_for_load

    if options.served or options.staging == "require":
        return None
    if options.staging == "auto" and service_status(options.image_dir, options.shm_dir).running:
        return None
    if options.holder is not None:
        from flashboot.flashload.restart import held_here

        if held_here(_rank_holder(options, rank, dev), options.image_dir, rank, dev):
            return None  # a restart maps the held arena: staging the image from disk would be thrown away
    return stage_for_load(options.image_dir, rank, timeout_s=options.timeout_s, shm_dir=options.shm_dir,
                          device=str(dev) if dev.is_cuda else "cpu", log=lambda m: logger.warning("flashboot: %s", m),
                          check_staged=options.staging == "inline")


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
    if options.holder is not None:
        from flashboot.flashload.restart import held_here

        if held_here(_rank_holder(options, rank, Device.parse(device)), options.image_dir, rank, device):
            return None  # a restart maps the held arena: an early arena and copy would be thrown away
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
            weights.close(failed=True)
            raise
    return weights


def _load_engine_image(options: LoaderOptions, expected: EngineKey, rank: int, dev, *, tp_size: int,
                       ep_size: int, prepared=None) -> EngineWeights:
    import flashboot

    if prepared is not None:  # keys checked and everything one-time paid by prepare_engine_load
        try:
            section, _ = read_engine_section(options.image_dir, rank)
            loaded = flashboot.load(options.image_dir, rank, dev, prepared=prepared, verify=options.verify,
                                    tp=tp_size, ep=ep_size, holder=_rank_holder(options, rank, dev))
        except BaseException:
            # refused before the load took the handle (the image re-packed or damaged while the
            # engine built its model): its arena and copy had stayed held by no one (a no-op once taken)
            prepared.close()
            raise
        return EngineWeights(loaded.tensors, section, loaded, "load", loaded.report)

    if not image_is_complete(options.image_dir):
        raise LayoutError(
            f"{options.image_dir}: no complete engine image here (no prepack.json). Pre-pack it first: start the "
            "engine once with --model-loader-extra-config '{\"image_dir\": ..., \"mode\": \"prepack\"}' (or "
            "\"auto\": pre-pack when missing, load otherwise)")
    section = _check_image_keys(options, expected, rank)
    inline = _stage_if_needed(options, rank, dev)
    loaded = None
    try:
        loaded = flashboot.load(options.image_dir, rank, dev, timeout_s=options.timeout_s, served=options.served,
                                verify=options.verify, shm_dir=options.shm_dir, tp=tp_size, ep=ep_size,
                                holder=_rank_holder(options, rank, dev))
        if inline is not None and loaded.release_thread is not None:
            loaded.release_thread.join(options.timeout_s)  # its unmap of the staged copy, before it is removed
    except BaseException:
        if loaded is not None:  # nobody else holds it: its arena would leak (and a traceback holds its views)
            loaded.close(force=True)
        raise
    finally:
        if inline is not None:  # the last engine to load a copy staged for engines gives the memory back
            inline.release()
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
    if section.rank != rank:  # the key names the TP size, not the rank: a mislabelled seed has the same key
        raise LayoutError(f"{where}: the seed serves rank {section.rank}'s weights, this engine is rank {rank}; "
                          "refused before cloning")
    result = flashboot.clone(options.seed_store, dev, options.schedule, verify=options.verify,
                             timeout_s=options.timeout_s, name=_rank_namespace(options, rank),
                             expect={"key_digest": record.body.get("image_key_digest")}, rank=rank)
    seeded_rank = getattr(getattr(getattr(result, "metadata", None), "parallel", None), "rank", rank)
    if seeded_rank != rank:
        result.close()
        raise LayoutError(f"{where}: the seed's image metadata is rank {seeded_rank}'s, this engine is rank {rank}")
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
    open as long as the engine serves). Raises LayoutError when ``rank`` is not the weights' rank."""
    import flashboot

    if rank != weights.section.rank:
        raise LayoutError(f"cannot publish rank {weights.section.rank}'s engine weights as the seed of rank {rank} "
                          f"at {options.publish_store}: a clone of rank {rank} would serve another rank's shards")
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


def _materialize(view, info: Mapping[str, Any], name: str):
    """The engine's tensor from an image view: raw (uint8) entries are re-typed and re-strided."""
    import torch

    if "dtype" not in info:
        return view
    from flashboot.layouts.format import span_elems

    dtype = getattr(torch, info["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CapabilityError(f"this torch has no dtype {info['dtype']!r} (the image was packed with another torch)")
    shape, stride = tuple(info["shape"]), tuple(info["stride"])
    nbytes = span_elems(shape, stride) * dtype.itemsize
    if nbytes > view.numel() * view.element_size():  # as_strided would read the arena's next entries
        raise LayoutError(f"engine tensor {name!r}: {info['dtype']} shape {list(shape)} stride {list(stride)} spans "
                          f"{nbytes:,} bytes; its image entry holds {view.numel() * view.element_size():,}")
    typed = view.view(torch.uint8)[:nbytes].view(dtype)
    return typed.as_strided(shape, stride, typed.storage_offset())


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
        value = _materialize(weights.tensors[name], info, name)
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


def copy_engine_weights_into(model, weights: EngineWeights) -> list[str]:
    """Copy the image's parameters and buffers into ``model``'s own tensors, in place (their
    storage is kept; tensor attributes are left alone: the runner may have rebound them, KV caches).
    Every name's shape and dtype are compared first, without broadcasting or casting: LayoutError
    listing every mismatch (and every missing name) before a byte is copied. Returns the names."""
    import torch

    current = dict(model.named_parameters(remove_duplicate=False))
    current.update(dict(model.named_buffers(remove_duplicate=False)))
    names = [n for n, info in weights.section.tensors.items() if info["kind"] != "extra"]
    missing = sorted(n for n in names if n not in current)
    if missing:
        raise LayoutError(f"the model has no parameters or buffers {missing[:8]} that the image holds")
    sources = {n: _materialize(weights.tensors[n], weights.section.tensors[n], n) for n in names}
    mismatched = [f"{n} (image {list(src.shape)} {src.dtype}, model {list(current[n].shape)} {current[n].dtype})"
                  for n, src in sources.items()
                  if tuple(src.shape) != tuple(current[n].shape) or src.dtype != current[n].dtype]
    if mismatched:
        raise LayoutError(f"cannot copy the engine image into {type(model).__name__}: {len(mismatched)} tensor(s) "
                          f"differ in shape or dtype: {', '.join(mismatched[:6])}; nothing was copied")
    with torch.no_grad():
        for name, src in sources.items():
            current[name].copy_(src)
    return names


TORCH_REGISTRIES = ("_parameters", "_buffers", "_modules")
"""A module's own registries: walked by named_parameters/named_buffers/named_modules, not here."""
HELD_DEPTH = 4
"""How deep :func:`_held_tensors` follows containers and plain objects below a module attribute."""


def _rebuilt(held, i: int, new):
    items = list(held)
    items[i] = new
    return type(held)(*items) if hasattr(held, "_fields") else type(held)(items)  # namedtuples take fields


def _held_tensors(model):
    """``(name, tensor, replace)`` for every tensor ``model``'s modules hold outside their
    registries: tensor attributes (private ones too: vLLM keeps ``_k_scale``), and tensors in
    lists, tuples, dicts, dataclasses and plain objects, followed :data:`HELD_DEPTH` deep (e.g.
    SGLang's TopK keeps the gate's ``e_score_correction_bias`` in its ``TopKConfig``; an attention
    layer's backend object keeps tensors of its layer). Modules, classes and callables are not
    followed (the module tree covers modules), nor torch's own bookkeeping of a module (its hook
    dicts); each object is followed once. ``replace(new)`` puts ``new`` where the tensor is held
    (a tuple is rebuilt and put back). Where each value is held is kept as a small tuple and a
    ``replace`` made only for the tensors found: 25,000 modules walk in tens of ms, not ~0.5 s."""
    import torch

    internals = _module_internals()
    leaves = (type, torch.nn.Module, str, bytes, int, float, complex)
    seen: set[int] = set()
    found: list = []

    def walk(value, name: str, where: tuple, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append((name, value, _putter(where)))
            return
        if depth == 0 or value is None or isinstance(value, leaves) or id(value) in seen or callable(value):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for k, item in list(value.items()):
                walk(item, f"{name}[{k!r}]", (value, k, "item"), depth - 1)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{name}[{i}]", (value, i, "item"), depth - 1)
        elif isinstance(value, tuple):  # immutable: a replacement rebuilds it where it is held
            for i, item in enumerate(value):
                walk(item, f"{name}[{i}]", (where, i, "tuple"), depth - 1)
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name, None), f"{name}.{f.name}", (value, f.name, "attr"), depth - 1)
        elif isinstance(getattr(value, "__dict__", None), dict):  # its own __dict__: a property would run code
            for f, item in list(vars(value).items()):
                walk(item, f"{name}.{f}", (value, f, "attr"), depth - 1)

    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, value in list(vars(mod).items()):
            if attr not in internals:
                walk(value, prefix + attr, (mod, attr, "attr"), HELD_DEPTH + 1)
    return found


def _module_internals() -> frozenset:
    """What every ``nn.Module`` keeps in its ``__dict__`` (registries, hook dicts, ``training``):
    torch's bookkeeping, never an engine's tensors."""
    import torch

    return frozenset(vars(torch.nn.Module()))


def _getter(where: tuple):
    held, key, how = where
    if how == "item":
        return lambda: held[key]
    if how == "attr":
        return lambda: vars(held)[key] if key in vars(held) else getattr(held, key)
    return lambda: _getter(held)()[key]


def _putter(where: tuple):
    """The call that puts a new value where ``where`` (made by :func:`_held_tensors`) says."""
    held, key, how = where
    if how == "item":
        return lambda new: held.__setitem__(key, new)
    if how == "attr":
        return lambda new: object.__setattr__(held, key, new)  # frozen dataclasses too
    return lambda new: _putter(held)(_rebuilt(_getter(held)(), key, new))


def _repoint_held_references(model, replaced: dict[int, tuple[Any, Any]]) -> list[str]:
    """Point references that modules hold outside their registries (:func:`_held_tensors`) at the
    bound tensors instead of the meta tensors they replaced; the names of the entries re-pointed."""
    done = []
    for name, tensor, put in _held_tensors(model):
        if id(tensor) in replaced and replaced[id(tensor)][1] is not tensor:
            put(replaced[id(tensor)][1])
            done.append(name)
    return done


def check_no_meta_tensors(model, where: str) -> None:
    """Refuse a model that still holds meta tensors (parameters, buffers, tensor attributes, or
    tensors held in its modules' containers and objects: :func:`_held_tensors`) the image did not
    provide: they would be uninitialised memory at serving time. Empty ones hold no bytes and pass
    (vLLM's KV-cache placeholders, bound by the runner later)."""
    left = []
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is not None and t.is_meta and t.numel():
                left.append(prefix + leaf)
    left += [name for name, t, _ in _held_tensors(model) if t.is_meta and t.numel()]
    if left:
        shown = ", ".join(left[:8]) + (f" ... and {len(left) - 8} more" if len(left) > 8 else "")
        raise LayoutError(f"{where}: {len(left)} tensor(s) of the model are not in the engine image and would be "
                          f"uninitialised: {shown}. Re-run the pre-pack with this engine version.")


__all__ = [
    "EngineBindReport", "EngineWeights", "bind_engine_model", "check_no_meta_tensors", "copy_engine_weights_into",
    "load_engine_weights",
    "prepare_engine_load", "publish_engine_weights",
]
