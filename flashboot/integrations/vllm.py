"""FlashBoot as a vLLM model loader: ``vllm serve MODEL --load-format flashboot``.

The ``vllm.general_plugins`` entry point (:func:`flashboot.integrations.vllm_plugin` ->
:func:`register`) registers :class:`FlashBootModelLoader` under the load format ``flashboot``
with vLLM's ``register_model_loader``; vLLM runs general plugins in every process, before
arguments are parsed. Options come from ``--model-loader-extra-config`` (see
:class:`~flashboot.integrations.engine_prepack.LoaderOptions`).

:meth:`FlashBootModelLoader.load_model` follows vLLM's own zero-copy path for weights that are
already post-processed (its weight-cache IPC loader): build the model on the meta device with
vLLM's model class, refuse quantization methods that cannot load pre-processed weights
(``supports_pre_processed_weights``), bind every tensor of the engine image to its arena view, then
run ``process_weights_after_loading`` under ``weights_already_processed()`` so quantization methods
only rebuild their Python-side state. ``mode="prepack"`` runs vLLM's own loader for
``--load-format auto`` and dumps the result as this rank of an engine image.

Sleep mode: vLLM's ``CuMemAllocator`` offloads and discards only what torch allocated inside its
pools; the arena (a driver VMM allocation) is not in them. :func:`register` adds the ``flashboot``
sleep-mode backend (:class:`FlashBootSleepBackend`: vLLM's ``cumem`` backend plus the arena) to
vLLM's ``SleepModeBackendFactory``; with ``--enable-sleep-mode --sleep-mode-backend flashboot``,
``sleep(level)`` puts the arena to sleep at that level and ``wake_up(tags)`` wakes it at the same
addresses when the tags name ``weights`` (or none): right weights without ``reload_weights``.

Weight transfer (RL weight sync): :func:`register` also adds the ``flashboot`` backend of vLLM's
weight-transfer interface (:mod:`flashboot.integrations.vllm_weight_transfer`): a refit of the
arena, then :func:`finish_bound_model` again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn

from vllm.device_allocator.sleep_mode_backend import CuMemBackend
from vllm.model_executor.model_loader import get_model_loader, register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from flashboot.errors import CapabilityError

from .engine_prepack import (
    LOAD_FORMAT, EngineKey, LoaderOptions, RankGroup, bind_engine_model, check_engine_key, check_no_meta_tensors,
    gpu_arch_of, image_is_complete, load_engine_weights, memory_saver_policy, model_identity, prepack_engine_model,
    prepare_engine_load, read_job_engine_key, stay,
)
from .engine_bind import copy_engine_weights_into
from .engine_sleep import WEIGHTS_TAG, check_awake, sleep_engine_weights, wake_engine_weights

logger = logging.getLogger("flashboot.integrations.vllm")

SLEEP_MODE_FLAG = "--enable-sleep-mode"


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@dataclasses.dataclass(frozen=True)
class VLLMParallel:
    """This worker's place in vLLM's layout. With expert parallelism the experts are spread over
    the DP x TP ranks (image rank = the EP rank, ``ep_size = dp * tp``); without it every DP
    replica holds the same bytes (image rank = the TP rank)."""

    rank: int
    tp_size: int
    ep_size: int
    dp_size: int
    pp_size: int


def vllm_parallel(vllm_config) -> VLLMParallel:
    from vllm.distributed import get_pp_group, get_tp_group

    tp = get_tp_group()
    pp_size = get_pp_group().world_size
    pc = vllm_config.parallel_config
    if getattr(pc, "enable_expert_parallel", False):
        from vllm.distributed import get_ep_group

        ep = get_ep_group()
        return VLLMParallel(ep.rank_in_group, tp.world_size, ep.world_size, ep.world_size // tp.world_size, pp_size)
    return VLLMParallel(tp.rank_in_group, tp.world_size, 1, 1, pp_size)


def _key_extra(vllm_config, model_config, parallel: VLLMParallel) -> tuple[tuple[str, Any], ...]:
    """vLLM's own fingerprint of processed weights (its weight cache key: kernel backends, KV
    cache dtype, quant and rope config hashes...) minus rank fields, where this vLLM has it."""
    try:
        from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey
    except ImportError:
        return ()
    key = WeightCacheKey.from_model_config(
        model_config, tp_size=parallel.tp_size, tp_rank=0, cache_config=vllm_config.cache_config,
        pp_size=parallel.pp_size, dp_size=parallel.dp_size,
        enable_expert_parallel=bool(getattr(vllm_config.parallel_config, "enable_expert_parallel", False)),
        kernel_config=getattr(vllm_config, "kernel_config", None))
    skip = {"tp_rank", "pp_rank", "dp_rank", "tp_size", "pp_size", "dp_size", "dtype", "quantization", "revision",
            "vllm_version", "is_draft"}
    return tuple(sorted((k, v if isinstance(v, (str, int, float, bool, type(None))) else repr(v))
                        for k, v in dataclasses.asdict(key).items() if k not in skip))


def target_device(vllm_config) -> torch.device:
    load_device = vllm_config.load_config.device or vllm_config.device_config.device
    dev = torch.device(load_device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def engine_key(vllm_config, model_config, device: torch.device, parallel: VLLMParallel) -> EngineKey:
    model_id, revision, chash = model_identity(model_config.model, model_config.revision)
    archs = getattr(model_config.hf_config, "architectures", None) or [type(model_config.hf_config).__name__]
    return EngineKey(
        engine="vllm", engine_version=vllm_version(), model_id=model_id, revision=revision, config_hash=chash,
        architecture=",".join(archs), dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=model_config.quantization, tp_size=parallel.tp_size, ep_size=parallel.ep_size,
        dp_size=parallel.dp_size, pp_size=parallel.pp_size, gpu_arch=gpu_arch_of(device),
        extra=_key_extra(vllm_config, model_config, parallel))


def check_quantization(model) -> None:
    """Refuse a model with a quantization method that cannot load pre-processed weights."""
    try:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and not getattr(method, "supports_pre_processed_weights", False):
            raise CapabilityError(
                f"layer {name or '<root>'}: {type(method).__name__} does not support loading pre-processed weights in "
                f"vLLM {vllm_version()} (supports_pre_processed_weights is false); use another --load-format")


def _model_attrs(model) -> dict:
    try:
        from vllm.model_executor.model_loader.weight_cache.utils import export_model_attrs
    except ImportError:
        return {}
    return export_model_attrs(model)


def finish_bound_model(model, model_config, device) -> None:
    """vLLM's post-load step for a model bound to weights already in final form (after a load,
    and again after a refit): ``process_weights_after_loading`` under ``weights_already_processed``,
    so quantization methods rebuild their Python-side state only."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed

    with weights_already_processed():
        process_weights_after_loading(model, model_config, device)


class FlashBootModelLoader(BaseModelLoader):
    """vLLM ``BaseModelLoader`` serving an engine image from one FlashBoot arena (see module doc).

    After :meth:`load_model`: ``weights``, ``bind_report`` or ``prepack_report``, ``key``.
    """

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = LoaderOptions.from_extra_config(load_config.model_loader_extra_config)
        self.weights = None
        self.bind_report = None
        self.prepack_report = None
        self.key: EngineKey | None = None

    def _will_prepack(self) -> bool:
        o = self.options
        return o.mode == "prepack" or (o.mode == "auto" and o.seed_store is None and not image_is_complete(o.image_dir))

    def _engine_loader(self):
        config = dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
        return get_model_loader(config)

    def download_model(self, model_config) -> None:
        if self._will_prepack():
            self._engine_loader().download_model(model_config)

    def load_weights(self, model: nn.Module, model_config) -> None:
        """Reload the image's parameters and buffers into an already-built model, in place (e.g.
        after a weight update went wrong). The model's tensors keep their storage; the image is
        copied into it; tensor attributes are left as they are."""
        from vllm.config import get_current_vllm_config

        check_awake(model, "load_weights")
        vllm_config = get_current_vllm_config()
        parallel = vllm_parallel(vllm_config)
        device = target_device(vllm_config)
        key = engine_key(vllm_config, model_config, device, parallel)
        # a fresh copy of the image, neither published nor held: with the holder option the load
        # mapped the held arena (the one the model is bound to) and copied the bad bytes onto themselves
        weights = load_engine_weights(dataclasses.replace(self.options, publish_store=None, holder=None), key,
                                      parallel.rank, device, tp_size=parallel.tp_size, ep_size=parallel.ep_size)
        try:
            copy_engine_weights_into(model, weights)
        finally:
            weights.close()
        served = getattr(model, "_flashboot_weights", None)
        if served is not None and hasattr(served.handle, "refit"):
            # the image's bytes are in the served arena now, as a wake from disk leaves them: a
            # refit's version (and any post-processing it left pending) is gone; it had kept
            # saying so, and a retry of that version was refused as not newer
            served.handle.version, served.handle.refit_torn = 0, None
            served.post_refit_pending = None

    def load_model(self, vllm_config, model_config, prefix: str = "") -> nn.Module:
        device = target_device(vllm_config)
        parallel = vllm_parallel(vllm_config)
        if parallel.pp_size != 1:
            raise CapabilityError(f"pipeline parallelism (pp={parallel.pp_size}): engine images hold one pipeline "
                                  "stage; run with --pipeline-parallel-size 1")
        if prefix:
            raise CapabilityError(f"the flashboot loader serves the main model only (asked for prefix {prefix!r}); "
                                  "load draft models with another --load-format")
        self.key = engine_key(vllm_config, model_config, device, parallel)
        if self._will_prepack():
            return self._prepack(vllm_config, model_config, device, parallel)
        return self._load(vllm_config, model_config, device, parallel)

    def _prepack(self, vllm_config, model_config, device, parallel: VLLMParallel) -> nn.Module:
        loader = self._engine_loader()
        logger.info("flashboot: pre-packing with vLLM's %s into %s (rank %d of %d)", type(loader).__name__,
                    self.options.image_dir, parallel.rank, max(parallel.tp_size, parallel.ep_size))
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
        if parallel.ep_size == 1:
            from vllm.distributed import get_dp_group

            replica = get_dp_group().rank_in_group
            if replica != 0:  # without expert parallelism every DP replica holds the same bytes
                logger.info("flashboot: data-parallel replica %d serves without writing (replica 0 pre-packs)",
                            replica)
                return model
        world = max(parallel.tp_size, parallel.ep_size)
        group = RankGroup()
        if world > 1:
            from vllm.distributed import get_ep_group, get_tp_group

            coord = get_ep_group() if parallel.ep_size > 1 else get_tp_group()
            group = RankGroup(parallel.rank, world, broadcast=lambda v: coord.broadcast_object(v, src=0),
                              barrier=coord.barrier)
        self.prepack_report = prepack_engine_model(
            model, self.options.image_dir, self.key, group, device=device, tp_size=parallel.tp_size,
            ep_size=parallel.ep_size, source_path=str(model_config.model),
            model_type=getattr(model_config.hf_config, "model_type", None), attrs=_model_attrs(model),
            timeout_s=self.options.timeout_s)
        return model

    def _load(self, vllm_config, model_config, device, parallel: VLLMParallel) -> nn.Module:
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        t0 = time.perf_counter()
        o = self.options
        if o.mode == "auto" and o.seed_store is None:
            check_engine_key(read_job_engine_key(o.image_dir), self.key, str(o.image_dir))
        sleep_mode = bool(getattr(model_config, "enable_sleep_mode", False))
        stays = memory_saver_policy(sleep_mode, SLEEP_MODE_FLAG, o)
        backend = getattr(model_config, "sleep_mode_backend", "cumem")
        if stays and sleep_mode and backend != SLEEP_BACKEND:
            raise CapabilityError(
                f"{SLEEP_MODE_FLAG} with --sleep-mode-backend {backend}: that backend releases what vLLM's allocator "
                "holds, not FlashBoot's weight arena (one VMM allocation made through the driver). Add "
                f"--sleep-mode-backend {SLEEP_BACKEND} (FlashBoot puts the weights to sleep and wakes them; the KV "
                "cache stays with vLLM's cumem pools), or pass '\"memory_saver\": \"resident\"' in "
                "--model-loader-extra-config to keep them resident.")
        try:
            from vllm.model_executor.utils import weights_already_processed
        except ImportError:
            raise CapabilityError(f"vLLM {vllm_version()} cannot rebuild a model from pre-processed weights (no "
                                  "weights_already_processed); the flashboot loader needs vLLM >= 0.2x with it") from None
        # The early call: metadata, arena, the daemon's attachment (or the pin), views, all while
        # vLLM builds the model below; the load after it is the copy.
        prepared = prepare_engine_load(o, self.key, parallel.rank, device, tp_size=parallel.tp_size,
                                       ep_size=parallel.ep_size)
        with set_default_torch_dtype(model_config.dtype):
            try:
                with torch.device("meta"):
                    model = initialize_model(vllm_config=vllm_config, model_config=model_config)
                check_quantization(model)
            except BaseException:
                if prepared is not None:
                    prepared.close()
                raise
            weights = load_engine_weights(o, self.key, parallel.rank, device, tp_size=parallel.tp_size,
                                          ep_size=parallel.ep_size, prepared=prepared)
            try:
                self.bind_report = bind_engine_model(model, weights)
                finish_bound_model(model, model_config, device)
                check_no_meta_tensors(model, f"{type(model).__name__} from {o.image_dir or o.seed_store}")
                if stays:
                    stay(weights, shm_dir=o.shm_dir)
            except BaseException:
                weights.close(failed=True)
                raise
        model._flashboot_weights = weights
        self.weights = weights
        logger.info("flashboot: %s rank %d in %.1f ms (%s; %s)", weights.how, parallel.rank,
                    (time.perf_counter() - t0) * 1e3, weights.early_call(), weights.report.summary())
        return model.eval()


# =============================================================================================
# Sleep mode: the "flashboot" sleep-mode backend
# =============================================================================================
SLEEP_BACKEND = "flashboot"
"""The ``--sleep-mode-backend`` name :func:`register` gives :class:`FlashBootSleepBackend`."""


def _platform_allocator() -> bool:
    """Whether this platform has vLLM's sleep allocator (CUDA, ROCm, XPU): the torch memory the
    cumem backend releases. The CPU platform has none (vLLM refuses sleep mode there)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


class FlashBootSleepBackend(CuMemBackend):
    """vLLM's ``cumem`` sleep-mode backend plus the FlashBoot arena of this worker.

    ``suspend(level)``: the arena sleeps at ``level`` (1: a pinned host backup; 2: nothing kept,
    its wake reads the preloader daemon's copy or the disk), then the cumem pools as vLLM does
    (the KV cache discarded, the rest by its tags). ``resume(tags)``: the arena wakes at the same
    addresses when ``tags`` is None or names ``weights``, then the cumem pools. ``discard(tags)``
    naming ``weights``: a level-2 sleep of the arena. Selected by ``--sleep-mode-backend flashboot``.
    """

    def suspend(self, level: int = 1) -> None:
        sleep_engine_weights(level)
        if _platform_allocator():
            super().suspend(level)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        if tags is None or WEIGHTS_TAG in tags:
            wake_engine_weights()
        if _platform_allocator():
            super().resume(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        if WEIGHTS_TAG in tags:
            sleep_engine_weights(2)
        if _platform_allocator():
            super().discard(tags)
        self._state = "SUSPENDED"


def _register_sleep_backend() -> None:
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    try:
        SleepModeBackendFactory.get_backend_class(SLEEP_BACKEND)
    except ValueError:
        SleepModeBackendFactory.register_backend(SLEEP_BACKEND, __name__, FlashBootSleepBackend.__name__)


def register() -> None:
    """Register :class:`FlashBootModelLoader` as vLLM's ``flashboot`` load format,
    :class:`FlashBootSleepBackend` as its ``flashboot`` sleep-mode backend and the ``flashboot``
    weight-transfer backend (:mod:`flashboot.integrations.vllm_weight_transfer`) (idempotent)."""
    import vllm.model_executor.model_loader as loaders

    from .vllm_weight_transfer import register as register_weight_transfer

    _register_sleep_backend()
    register_weight_transfer()
    if getattr(loaders, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(LOAD_FORMAT) is FlashBootModelLoader:
        return
    register_model_loader(LOAD_FORMAT)(FlashBootModelLoader)


__all__ = ["FlashBootModelLoader", "FlashBootSleepBackend", "SLEEP_BACKEND", "VLLMParallel", "check_quantization",
           "engine_key", "finish_bound_model", "register", "target_device", "vllm_parallel"]
