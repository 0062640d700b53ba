"""FlashBoot as an SGLang model loader.

Selecting it, without patching SGLang:

* ``Engine(model_path=..., load_format=FlashBootModelLoader, model_loader_extra_config=...)``:
  SGLang's ``get_model_loader`` instantiates a loader *class* given as ``load_format`` directly.
* ``python -m sglang.launch_server ... --load-format flashboot``: the ``sglang.srt.plugins``
  entry point (:func:`flashboot.integrations.sglang_plugin` -> :func:`register`) adds
  ``flashboot`` to ``--load-format``'s choices and teaches ``LoadConfig`` to turn that name into
  :class:`FlashBootModelLoader`. SGLang runs general plugins in every process it starts.

What :meth:`FlashBootModelLoader.load_model` does (SGLang calls it inside its memory-saver
region, with the parallel groups built):

1. computes this engine's :class:`~flashboot.integrations.engine_prepack.EngineKey` (SGLang
   version, model, revision, config hash, architecture, dtype, quantization, tp/ep/attention-dp,
   GPU architecture, MoE backend);
2. ``mode="prepack"`` (or ``"auto"`` without an image): runs SGLang's own loader (the one
   ``--load-format auto`` would pick), then dumps every parameter, buffer and tensor attribute --
   the weights after ``process_weights_after_loading`` -- as this rank of an engine image, and
   serves that model;
3. otherwise builds the model with SGLang's own model class and quantization config on the meta
   device, FlashLoads (or FlashClones from ``seed_store``) this rank's image into one arena after
   checking the key, binds every tensor to its arena view, and runs nothing that re-processes
   weights -- as SGLang's own zero-copy IPC weight-cache loader does. Quantization methods whose
   post-processing leaves Python-side state are refused (SGLang's IPC allowlist).

Memory saver: the arena is one CUDA VMM allocation made through the driver, which
``torch_memory_saver`` never sees. With ``memory_saver="sleep"`` (the default) the loader hands the
bound weights to :mod:`~flashboot.integrations.engine_sleep` and wraps SGLang's memory-saver
adapters (:func:`install_memory_saver_hook`): ``release_memory_occupation`` /
``resume_memory_occupation`` of the weights tag then put the arena to sleep (level 1 with
``--enable-weights-cpu-backup``, else level 2) and wake it at the same addresses. The KV cache and
CUDA graphs stay with the memory saver.

Refit (RL weight sync): :func:`refit_weights`, a ``--custom-weight-loader`` that SGLang's
``update_weights_from_tensor`` dispatches to by ``load_format`` (:func:`refit_request` builds
its one named tensor), refits the arena and repairs the views as the load does.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any

import torch
from torch import nn

from sglang.srt.configs.load_config import LoadConfig, LoadFormat
from sglang.srt.model_loader.loader import BaseModelLoader, _get_quantization_config, _initialize_model, get_model_loader

from flashboot.errors import CapabilityError

from .engine_prepack import (
    LOAD_FORMAT, EngineKey, LoaderOptions, RankGroup, bind_engine_model, check_engine_key, check_no_meta_tensors,
    gpu_arch_of, image_is_complete, load_engine_weights, memory_saver_policy, model_identity, prepack_engine_model,
    prepare_engine_load, read_job_engine_key, stay,
)
from .engine_sleep import WEIGHTS_TAG, sleep_engine_weights, wake_engine_weights

logger = logging.getLogger("flashboot.integrations.sglang")

MEMORY_SAVER_FLAG = "--enable-memory-saver"


# =============================================================================================
# What the running engine is
# =============================================================================================
def _call(path: str, *args) -> Any:
    """``module.attr(*args)`` when it exists in this SGLang version, else None."""
    module, _, attr = path.rpartition(".")
    try:
        fn = getattr(__import__(module, fromlist=[attr]), attr)
        return fn(*args)
    except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError):
        return None


def _parallel_value(name: str) -> Any:
    """A value of SGLang's parallel context (0.5.2x) when it is published, else None."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return getattr(get_parallel(), name)
    except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class SGLangParallel:
    """This process's place in SGLang's layout: the image rank is the TP rank; ``ep_size`` divides
    ``tp_size``; ``attn_dp_size`` (DP attention) changes what a rank holds, plain DP does not."""

    tp_rank: int
    tp_size: int
    ep_size: int
    pp_size: int
    attn_dp_size: int


def sglang_parallel() -> SGLangParallel:
    from sglang.srt.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    tp_rank, tp_size = tp.rank_in_group, tp.world_size
    pp_size = get_pp_group().world_size
    ep_size = _call("sglang.srt.distributed.parallel_state.get_moe_expert_parallel_world_size") or 1
    attn_dp = _parallel_value("attn_dp_size") or _call("sglang.srt.layers.dp_attention.get_attention_dp_size") or 1
    return SGLangParallel(int(tp_rank), int(tp_size), int(ep_size), int(pp_size), int(attn_dp))


def _key_extra() -> tuple[tuple[str, Any], ...]:
    """SGLang settings that change the processed bytes (where this version exposes them)."""
    extra = {}
    backend = _call("sglang.srt.layers.moe.utils.get_moe_runner_backend")
    if backend is not None:
        extra["moe_runner_backend"] = str(getattr(backend, "value", backend))
    for name in ("moe_dense_tp_size", "enable_dp_lm_head"):
        value = _parallel_value(name)
        if value is not None:
            extra[name] = value
    return tuple(sorted(extra.items()))


def sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def target_device(device_config) -> torch.device:
    """The device SGLang loads onto: ``device_config.device`` with its ``gpu_id``."""
    dev = torch.device(device_config.device)
    gpu_id = getattr(device_config, "gpu_id", -1)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", gpu_id if gpu_id is not None and gpu_id >= 0 else torch.cuda.current_device())
    return dev


def engine_key(model_config, device: torch.device, parallel: SGLangParallel) -> EngineKey:
    """The key of the image this SGLang process needs."""
    model_id, revision, chash = model_identity(model_config.model_path, model_config.revision)
    archs = getattr(model_config.hf_config, "architectures", None) or [type(model_config.hf_config).__name__]
    return EngineKey(
        engine="sglang", engine_version=sglang_version(), model_id=model_id, revision=revision, config_hash=chash,
        architecture=",".join(archs), dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=model_config.quantization, tp_size=parallel.tp_size, ep_size=parallel.ep_size,
        dp_size=parallel.attn_dp_size, pp_size=parallel.pp_size, gpu_arch=gpu_arch_of(device), extra=_key_extra())


def memory_saver_enabled() -> bool:
    """Whether SGLang runs with its memory saver (flag, or an initialised torch_memory_saver)."""
    for probe in ("features.enable_memory_saver", "features.enable_weights_cpu_backup"):
        try:
            from sglang.srt.runtime_context import get_exec

            value = get_exec()
            for part in probe.split("."):
                value = getattr(value, part)
            if value:
                return True
        except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError):
            pass
    args = _call("sglang.srt.server_args.get_global_server_args")
    if args is not None and getattr(args, "enable_memory_saver", False):
        return True
    tms = sys.modules.get("torch_memory_saver")
    # The real adapter enters torch_memory_saver's region around load_model, which initialises it.
    return bool(tms is not None and getattr(getattr(tms, "torch_memory_saver", None), "_impl", None) is not None)


def weights_cpu_backup_enabled() -> bool:
    """Whether SGLang keeps a CPU backup of paused weights (``--enable-weights-cpu-backup``): its
    pause of the weights tag is then FlashBoot's level 1, else level 2."""
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().features.enable_weights_cpu_backup)
    except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError):
        args = _call("sglang.srt.server_args.get_global_server_args")
        return bool(getattr(args, "enable_weights_cpu_backup", False))


def _with_weights(pause, resume):
    """An adapter's ``pause``/``resume`` that also put FlashBoot's weights to sleep and wake them
    for the weights tag (``GPU_MEMORY_TYPE_WEIGHTS``)."""

    def pause_weights(self, tag):
        if tag == WEIGHTS_TAG:
            sleep_engine_weights(1 if weights_cpu_backup_enabled() else 2)
        return pause(self, tag)

    def resume_weights(self, tag):
        result = resume(self, tag)
        if tag == WEIGHTS_TAG:
            wake_engine_weights()
        return result

    pause_weights.__wrapped__, resume_weights.__wrapped__ = pause, resume
    pause_weights._flashboot = resume_weights._flashboot = True
    return pause_weights, resume_weights


def install_memory_saver_hook() -> None:
    """Hand the weights tag of SGLang's memory saver to FlashBoot's sleep and wake (idempotent).

    SGLang has no pluggable sleep backend: ``release_memory_occupation`` /
    ``resume_memory_occupation`` pause and resume each tag through the scheduler's
    ``TorchMemorySaverAdapter``, so each adapter class (the torch_memory_saver one and the no-op
    one used without ``--enable-memory-saver``) gets ``pause``/``resume`` that also sleep and wake
    the arenas :func:`~flashboot.integrations.engine_sleep.stay` holds. Other tags (KV cache, CUDA
    graphs) and what torch allocated in the weights region stay with the adapter.
    """
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    for cls in TorchMemorySaverAdapter.__subclasses__():
        if not getattr(cls.pause, "_flashboot", False):
            cls.pause, cls.resume = _with_weights(cls.pause, cls.resume)


def check_quantization(model_config) -> None:
    """Refuse a quantization whose post-processing a meta-built model cannot reproduce.

    Uses SGLang's own allowlist for zero-copy pre-processed weights (its IPC weight cache);
    without one (older SGLang) only unquantized models are accepted.
    """
    quant_cfg = getattr(model_config.hf_config, "quantization_config", None)
    try:
        from sglang.srt.weight_cache.protocol import IPC_QUANT_ALLOWLIST, get_quant_method_name, is_ipc_quant_supported
    except ImportError:
        if model_config.quantization is None and quant_cfg is None:
            return
        raise CapabilityError(f"quantization {model_config.quantization!r}: this SGLang ({sglang_version()}) has no "
                              "allowlist of methods that load from pre-processed weights; the flashboot loader "
                              "serves unquantized models only here") from None
    method = get_quant_method_name(model_config.quantization) or get_quant_method_name(quant_cfg)
    if not is_ipc_quant_supported(method, quant_cfg):
        verified = ", ".join(repr(m) if m else "unquantized" for m in IPC_QUANT_ALLOWLIST)
        raise CapabilityError(
            f"quantization {method!r} is not verified for loading pre-processed weights: its "
            f"process_weights_after_loading leaves state a meta-built model cannot reproduce. Verified in SGLang "
            f"{sglang_version()}: {verified} (FP8: block-wise only). Use another --load-format for this model.")


def _clear_meta_rope_cache() -> None:
    """SGLang caches rotary modules by configuration; drop the ones a failed meta build left."""
    try:
        from sglang.srt.layers.rotary_embedding.factory import _ROPE_DICT
    except ImportError:
        return
    for k in [k for k, v in _ROPE_DICT.items()
              if any(t.is_meta for t in list(v.parameters()) + list(v.buffers()))]:
        del _ROPE_DICT[k]


def _rebuild_engine_views(model) -> None:
    """SGLang's own repair of tensor views taken at construction (its IPC loader's)."""
    try:
        from sglang.srt.weight_cache.ipc_loader import IpcModelLoader
    except ImportError:
        return
    rebuild = getattr(IpcModelLoader, "_rebuild_stale_views", None)
    if rebuild is not None:
        rebuild(model)


# =============================================================================================
# The loader
# =============================================================================================
class FlashBootModelLoader(BaseModelLoader):
    """SGLang ``BaseModelLoader`` serving an engine image from one FlashBoot arena.

    Options come from ``load_config.model_loader_extra_config`` (:class:`LoaderOptions`):
    ``image_dir``, ``mode`` (load, prepack, auto), ``seed_store``, ``schedule``,
    ``publish_store``, ``verify``, ``timeout_s``, ``staging``, ``served``, ``shm_dir``,
    ``memory_saver``. After :meth:`load_model`: ``weights`` (the arena and its report),
    ``bind_report`` or ``prepack_report``, ``key``.
    """

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoaderOptions.from_extra_config(load_config.model_loader_extra_config)
        self.weights = None
        self.bind_report = None
        self.prepack_report = None
        self.key: EngineKey | None = None

    # -- SGLang's interface ----------------------------------------------------------------------
    def download_model(self, model_config) -> None:
        if self._will_prepack():
            self._engine_loader(model_config).download_model(model_config)

    def load_model(self, *, model_config, device_config) -> nn.Module:
        device = target_device(device_config)
        parallel = sglang_parallel()
        if parallel.pp_size != 1:
            raise CapabilityError(f"pipeline parallelism (pp={parallel.pp_size}): engine images hold one rank per "
                                  "TP rank of a single stage; run with --pp-size 1")
        self.key = engine_key(model_config, device, parallel)
        if self._will_prepack():
            return self._prepack(model_config, device_config, device, parallel)
        return self._load(model_config, device, parallel)

    # -- the two paths ----------------------------------------------------------------------------
    def _will_prepack(self) -> bool:
        o = self.options
        return o.mode == "prepack" or (o.mode == "auto" and o.seed_store is None and not image_is_complete(o.image_dir))

    def _engine_loader(self, model_config):
        """The loader SGLang picks for ``--load-format auto`` with the same settings."""
        config = dataclasses.replace(self.load_config, load_format=LoadFormat.AUTO, model_loader_extra_config={})
        return get_model_loader(config, model_config)

    def _prepack(self, model_config, device_config, device: torch.device, parallel: SGLangParallel) -> nn.Module:
        loader = self._engine_loader(model_config)
        logger.info("flashboot: pre-packing with SGLang's %s into %s (rank %d of %d)", type(loader).__name__,
                    self.options.image_dir, parallel.tp_rank, parallel.tp_size)
        model = loader.load_model(model_config=model_config, device_config=device_config)
        replica = _parallel_value("dp_rank") or 0
        if replica != 0:  # plain data-parallel replicas hold the same bytes: replica 0 writes them
            logger.info("flashboot: data-parallel replica %d serves without writing (replica 0 pre-packs)", replica)
            return model
        group = RankGroup()
        if parallel.tp_size > 1:
            from sglang.srt.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            group = RankGroup(parallel.tp_rank, parallel.tp_size, broadcast=lambda v: tp.broadcast_object(v, src=0),
                              barrier=tp.barrier)
        self.prepack_report = prepack_engine_model(
            model, self.options.image_dir, self.key, group, device=device, tp_size=parallel.tp_size,
            ep_size=parallel.ep_size, source_path=str(model_config.model_path),
            model_type=getattr(model_config.hf_config, "model_type", None), timeout_s=self.options.timeout_s)
        logger.info("flashboot: wrote rank %d: %s bytes, %d tensors in %.1f s", parallel.tp_rank,
                    f"{self.prepack_report.image_nbytes:,}", self.prepack_report.tensors, self.prepack_report.seconds)
        return model

    def _load(self, model_config, device: torch.device, parallel: SGLangParallel) -> nn.Module:
        t0 = time.perf_counter()
        o = self.options
        if o.mode == "auto" and o.seed_store is None:
            # an existing image for another configuration is not silently overwritten
            check_engine_key(read_job_engine_key(o.image_dir), self.key, str(o.image_dir))
        check_quantization(model_config)
        stays = memory_saver_policy(memory_saver_enabled(), MEMORY_SAVER_FLAG, o)
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        # before the early call: a failure here has nothing to release
        quant_config = _get_quantization_config(model_config, self.load_config)
        # The early call: metadata, arena, the daemon's attachment (or the pin), views, all while
        # SGLang builds the model below; the load after it is the copy.
        prepared = prepare_engine_load(o, self.key, parallel.tp_rank, device, tp_size=parallel.tp_size,
                                       ep_size=parallel.ep_size)
        t_build = time.perf_counter()  # the log's build time is the build's alone (not the early call's wait)
        try:
            with set_default_torch_dtype(model_config.dtype):
                with torch.device("meta"):
                    model = _initialize_model(model_config, self.load_config, quant_config)
        except BaseException:
            _clear_meta_rope_cache()
            if prepared is not None:
                prepared.close()
            raise
        t1 = time.perf_counter()
        weights = None
        try:
            weights = load_engine_weights(o, self.key, parallel.tp_rank, device, tp_size=parallel.tp_size,
                                          ep_size=parallel.ep_size, prepared=prepared)
            self.bind_report = bind_engine_model(model, weights)
            _rebuild_engine_views(model)
            check_no_meta_tensors(model, f"{type(model).__name__} from {o.image_dir or o.seed_store}")
            if stays:
                install_memory_saver_hook()
                stay(weights, shm_dir=o.shm_dir)
        except BaseException:
            if weights is not None:
                weights.close(failed=True)
            _clear_meta_rope_cache()  # no meta rotary module may outlive this failed load in SGLang's cache
            raise
        # The model holds the arena (and the seed, when published) for as long as the engine serves.
        model._flashboot_weights = weights
        self.weights = weights
        logger.info("flashboot: %s rank %d in %.1f ms (build on meta %.1f ms; %s; %s)", weights.how, parallel.tp_rank,
                    (time.perf_counter() - t0) * 1e3, (t1 - t_build) * 1e3, weights.early_call(),
                    weights.report.summary())
        return model.eval()


# =============================================================================================
# Refit through SGLang's weight-update entry point
# =============================================================================================
REFIT_LOADER = "flashboot.integrations.sglang.refit_weights"
"""The ``--custom-weight-loader`` (and ``load_format`` of ``update_weights_from_tensor``) that refits."""
REFIT_REQUEST = "flashboot.refit"
"""The name prefix of :func:`refit_request`'s one entry; the rest of the name is the request as JSON."""


def refit_request(store: str, version: int, *, name: str = "refit", **options: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of an ``update_weights_from_tensor(..., load_format=REFIT_LOADER)``
    call that refits every rank of the engine to ``version`` as published at ``store`` (see
    :func:`refit_weights`): one entry whose name carries the request, with an empty tensor (the
    weights move GPU to GPU through FlashClone, not through SGLang's control plane).
    ``options``: :data:`~flashboot.integrations.engine_refit.REFIT_OPTIONS`."""
    import json

    from .engine_refit import check_refit_options

    request = {"store": store, "version": version, "name": name,
               **check_refit_options(options, "refit_request")}
    return [(REFIT_REQUEST + json.dumps(request, sort_keys=True), torch.empty(0))]


def refit_weights(model, named_tensors) -> None:
    """SGLang custom weight loader (start the engine with ``--custom-weight-loader
    flashboot.integrations.sglang.refit_weights``; SGLang's ``update_weights_from_tensor``
    dispatches to it by ``load_format``): refits the arena ``model`` serves from to the version a
    trainer published for this rank (:func:`~flashboot.integrations.engine_refit.refit_engine_model`),
    then repairs the views taken at construction as the loader does at load, and, when the trainer
    left tensor attributes to the engine (MLA's ``w_kc``/``w_vc``), runs the model's own
    ``post_load_weights``, which writes them into their arena views. ``named_tensors``:
    :func:`refit_request`'s. Raises RefitError for anything else, naming what came."""
    import json

    from flashboot.weight_update import RefitError

    from .engine_refit import REFIT_OPTIONS, refit_engine_model

    what = f"SGLang update_weights_from_tensor (load_format={REFIT_LOADER}) of {type(model).__name__}"
    names = [n for n, _ in named_tensors]
    if len(names) != 1 or not names[0].startswith(REFIT_REQUEST):
        raise RefitError(f"{what}: expects the one entry of flashboot.integrations.sglang.refit_request(...), got "
                         f"{len(names)} named tensor(s) {names[:3]}")
    try:
        request = json.loads(names[0][len(REFIT_REQUEST):])
        if not isinstance(request, dict):  # a list's pop("store") had raised a raw TypeError
            raise ValueError(f"a JSON {type(request).__name__}, not an object")
        store, version, name = request.pop("store"), request.pop("version"), request.pop("name")
    except (ValueError, KeyError, AttributeError) as exc:
        raise RefitError(f"{what}: malformed refit request {names[0]!r} ({exc})") from None
    # "what", "reprocess" or "derive" had reached refit_engine_model twice: a raw TypeError
    unknown = sorted(set(request) - set(REFIT_OPTIONS))
    if unknown:
        raise RefitError(f"{what}: unknown key(s) {unknown} in refit request {names[0]!r}; accepted: "
                         f"{['store', 'version', 'name', *REFIT_OPTIONS]}")
    # SGLang's own post-processing derives tensor attributes (MLA's w_kc/w_vc) into the bound views in place
    derive = getattr(model, "post_load_weights", None)
    refit_engine_model(model, store, version, what=what, name=name, reprocess=lambda: _rebuild_engine_views(model),
                       derive=derive, **request)


# =============================================================================================
# The plugin
# =============================================================================================
def _resolve_load_format(load_config) -> None:
    if isinstance(load_config.load_format, str) and load_config.load_format.lower() == LOAD_FORMAT:
        load_config.load_format = FlashBootModelLoader


def register() -> None:
    """Make ``--load-format flashboot`` valid in this SGLang process (idempotent).

    Adds ``flashboot`` to the ``--load-format`` choices and wraps ``LoadConfig``'s format check
    so the name becomes :class:`FlashBootModelLoader` (a loader class ``get_model_loader``
    instantiates directly). Called by SGLang's ``load_plugins`` in every process.
    """
    try:
        from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    except ImportError:  # SGLang before the arg_groups split keeps the list in server_args
        from sglang.srt.server_args import LOAD_FORMAT_CHOICES

        add_load_format_choices = LOAD_FORMAT_CHOICES.extend
    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    verify = LoadConfig._verify_load_format
    if getattr(verify, "_flashboot", False):
        return

    def _verify_load_format(self) -> None:
        _resolve_load_format(self)
        return verify(self)

    _verify_load_format._flashboot = True
    _verify_load_format.__wrapped__ = verify
    LoadConfig._verify_load_format = _verify_load_format


__all__ = ["FlashBootModelLoader", "REFIT_LOADER", "REFIT_REQUEST", "SGLangParallel", "check_quantization",
           "engine_key", "install_memory_saver_hook", "memory_saver_enabled", "refit_request", "refit_weights", "register",
           "sglang_parallel", "target_device", "weights_cpu_backup_enabled"]
