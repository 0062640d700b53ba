"""FlashBoot as a vLLM weight-transfer backend: ``weight_transfer_config={"backend": "flashboot"}``.

vLLM's RL weight sync (``vllm/distributed/weight_transfer``) drives a worker-side
``WeightTransferEngine`` (``init_transfer_engine``, then per update ``start_weight_update``,
``update_weights(update_info)``, ``finish_weight_update``) from a trainer-side
``TrainerWeightTransferEngine`` through the engine's control plane (``LLM`` methods, the HTTP
RLHF routes, Ray actors). :func:`register` adds ``flashboot`` to both of vLLM's factories
(called by the ``vllm.general_plugins`` entry point with the load format, so every vLLM process
knows it):

* :class:`FlashBootWeightTransferEngine` (worker): ``update_weights({"version": N})`` refits the
  arena the model serves from (it must have been loaded with ``--load-format flashboot``) to
  the version the trainer published for this worker's image rank, atomically by default, then
  reruns ``process_weights_after_loading`` under ``weights_already_processed`` as the loader
  does at load (:func:`flashboot.integrations.vllm.finish_bound_model`).
* :class:`FlashBootTrainerWeightTransferEngine` (trainer): packs the trainer's tensors into the
  engine image's layout for its rank and publishes them
  (:func:`~flashboot.integrations.engine_refit.engine_publisher`), then drives the update round
  trip with ``{"version": N}``. The payload is a version number: the bytes move GPU to GPU
  through FlashClone, not through the control plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo, TrainerWeightTransferEngine, WeightSource, WeightTransferEngine, WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from flashboot.flashclone.rendezvous import DEFAULT_TIMEOUT_S
from flashboot.weight_update import RefitError
from flashboot.weight_update.publish import DEFAULT_NAME

from .engine_refit import engine_publisher, refit_engine_model, served_weights

BACKEND = "flashboot"
"""The ``weight_transfer_config.backend`` name :func:`register` gives this backend."""


@dataclass
class FlashBootInitInfo(WeightTransferInitInfo):
    """The worker's side of ``init_weight_transfer_engine``: the rendezvous ``store`` the trainer
    publishes at, the publish ``name``, and how to refit (see :func:`flashboot.weight_update.refit`)."""

    store: str
    name: str = DEFAULT_NAME
    atomic: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    schedule: str = "chain"
    clones: int | None = None
    transport: str = "auto"
    token_file: str | None = None

    def __post_init__(self):
        # it arrives as JSON through vLLM's control plane: "false" or null must not pick a mode
        from flashboot.weight_update.engine import check_refit_values

        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if not isinstance(self.store, str) or not self.store:
            raise RefitError(f"init_weight_transfer_engine ({BACKEND}): store must be 'HOST:PORT', got {self.store!r}")
        check_refit_values(f"init_weight_transfer_engine ({BACKEND})", name=self.name, atomic=self.atomic,
                           timeout_s=self.timeout_s, schedule=self.schedule, clones=self.clones,
                           transport=self.transport, token_file=self.token_file)


@dataclass
class FlashBootUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version the trainer published."""

    version: int


class FlashBootWeightTransferEngine(WeightTransferEngine[FlashBootInitInfo, FlashBootUpdateInfo]):
    """Worker side (see module doc). ``last_report``: the last refit's RefitReport."""

    init_info_cls = FlashBootInitInfo
    update_info_cls = FlashBootUpdateInfo
    supports_draft_weight_update = False  # the draft model is not loaded by the flashboot loader

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init_info: FlashBootInitInfo | None = None
        self.last_report = None

    def _what(self) -> str:
        return f"vLLM weight transfer ({BACKEND}) of {type(self.model).__name__}"

    def init_transfer_engine(self, init_info: FlashBootInitInfo) -> None:
        served_weights(self.model, self._what())
        self.init_info = init_info

    def start_weight_update(self) -> None:
        if self.init_info is None:
            raise RefitError(f"{self._what()}: init_weight_transfer_engine(init_info={{'store': 'HOST:PORT'}}) was "
                             "not called")

    def finish_weight_update(self) -> None:
        """Nothing to do: :meth:`receive_weights` made the version live and reprocessed the model."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # No device synchronize after it (the base class's): the refit waited for its copy, and an
        # atomic one for the device's work before its remap.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FlashBootUpdateInfo) -> None:
        from .vllm import finish_bound_model

        self.start_weight_update()
        info = self.init_info
        self.last_report = refit_engine_model(
            self.model, info.store, update_info.version, what=self._what(), name=info.name,
            reprocess=lambda: finish_bound_model(self.model, self.model_config, self.device), atomic=info.atomic,
            timeout_s=info.timeout_s, schedule=info.schedule, clones=info.clones, transport=info.transport,
            token_file=info.token_file)

    def shutdown(self) -> None:
        """Nothing to release: the trainer's mapping belongs to the loaded weights (their close releases it)."""


@dataclass
class FlashBootTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: the engine ``image`` (its manifest is the contract; no image byte is
    read), the ``image_rank`` this trainer process publishes, the rendezvous ``store``, the
    trainer's ``device``, the publish ``name``, and the worker's refit options (``atomic``,
    ``timeout_s``) sent with ``init_weight_transfer_engine``."""

    backend: ClassVar[str] = BACKEND

    image: str
    store: str
    image_rank: int = 0
    device: str | None = None
    name: str = DEFAULT_NAME
    atomic: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S


class FlashBootTrainerWeightTransferEngine(TrainerWeightTransferEngine[FlashBootTrainerInitInfo]):
    """Trainer side (see module doc): ``send_weights()`` publishes the source's tensors as the
    next version and drives ``start_weight_update``, ``update_weights({"version": N})``,
    ``finish_weight_update`` on the sender. ``publisher``: its Publisher (``.report``)."""

    init_info_cls = FlashBootTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: FlashBootTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None or not source.implements_iter_full():
            raise RefitError(f"the {BACKEND} weight transfer publishes whole tensors: pass a WeightSource with "
                             "iter_full() (e.g. EngineModuleSource)")
        self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.publisher = engine_publisher(init_info.image, init_info.image_rank, store=init_info.store,
                                          device=init_info.device, name=init_info.name,
                                          timeout_s=init_info.timeout_s)
        if self.is_sender:
            try:
                client.init_weight_transfer_engine({"store": init_info.store, "name": init_info.name,
                                                    "atomic": init_info.atomic, "timeout_s": init_info.timeout_s})
            except BaseException:
                self.publisher.close()
                raise
        return self

    def send_weights(self, version: int | None = None) -> None:
        """Publish the source's tensors as ``version`` (default: the last one plus 1), then, on the
        sender, the engine's update round trip for it."""
        version = self.publisher.version + 1 if version is None else version
        self.publisher.publish(self.source.iter_full(), version)
        if self.is_sender:
            self.client.start_weight_update()
            self.client.update_weights({"version": version})
            self.client.finish_weight_update(str(version))

    def shutdown(self) -> None:
        self.publisher.close()


class EngineModuleSource(WeightSource):
    """A ``WeightSource`` over the parameters and buffers of ``module`` (a model in the engine's
    layout) by the engine's names, as :func:`~flashboot.integrations.engine_refit.engine_tensors_to_publish`
    collects them. vLLM's ``ModuleSource`` yields parameters only; an engine image has buffers too
    (rotary caches)."""

    def __init__(self, module, device: Any = None) -> None:
        self._module, self._device = module, device

    def _tensors(self):
        from .engine_refit import engine_tensors_to_publish

        device = self._device if self._device is not None else next(self._module.parameters()).device
        return engine_tensors_to_publish(self._module, device)

    @cached_property  # vLLM requires it: engines read it repeatedly and it must not change
    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._tensors()]

    def iter_full(self):
        yield from self._tensors()


def register() -> None:
    """Add ``flashboot`` to vLLM's worker and trainer weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, FlashBootWeightTransferEngine),
                         (WeightTransferTrainerFactory, FlashBootTrainerWeightTransferEngine)):
        try:
            factory.register_engine(BACKEND, __name__, cls.__name__)
        except ValueError:  # already registered: register() runs in every vLLM process, maybe twice
            pass


__all__ = ["BACKEND", "EngineModuleSource", "FlashBootInitInfo", "FlashBootTrainerInitInfo",
           "FlashBootTrainerWeightTransferEngine", "FlashBootUpdateInfo", "FlashBootWeightTransferEngine", "register"]
