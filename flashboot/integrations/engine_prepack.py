"""Engine images: an inference engine's own post-processed weights in the FlashBoot image format.

The engine-agnostic half of the SGLang and vLLM loaders, one module per job, re-exported here
(the import path the adapters, tests and users know):

* :mod:`.engine_key`: the loader's options, the :class:`EngineKey` an image was made for, and the
  image's engine section;
* :mod:`.engine_dump`: collect what an engine holds after its own loader ran and write it as one
  rank of a job (:func:`prepack_engine_model`);
* :mod:`.engine_bind`: load (or clone) one rank into an arena and bind a meta-built engine model
  to its views (:func:`load_engine_weights`, :func:`bind_engine_model`);
* :mod:`.engine_sleep`: the engine's sleep of its weights handed to FlashBoot's sleep and wake
  (:func:`memory_saver_policy`, :func:`stay`).

The engine adapters (:mod:`flashboot.integrations.sglang`, :mod:`flashboot.integrations.vllm`)
build the model, compute the key and call these. Nothing here imports an engine.
"""

from __future__ import annotations

from .engine_bind import (
    EngineBindReport, EngineWeights, bind_engine_model, check_no_meta_tensors, load_engine_weights,
    prepare_engine_load, publish_engine_weights,
)
from .engine_dump import (
    EngineRankReport, EngineTensor, EngineTensors, RankGroup, collect_engine_tensors, prepack_engine_model,
    write_engine_rank,
)
from .engine_key import (
    ENGINE_FORMAT, ENGINE_SECTION, LOAD_FORMAT, EngineKey, EngineSection, LoaderOptions, check_engine_key,
    gpu_arch_of, image_is_complete, model_identity, read_engine_section, read_job_engine_key,
)
from .engine_sleep import memory_saver_policy, stay

__all__ = [
    "ENGINE_FORMAT", "ENGINE_SECTION", "LOAD_FORMAT", "EngineBindReport", "EngineKey", "EngineRankReport",
    "EngineSection", "EngineTensor", "EngineTensors", "EngineWeights", "LoaderOptions", "RankGroup",
    "bind_engine_model", "check_engine_key", "check_no_meta_tensors", "collect_engine_tensors", "gpu_arch_of",
    "image_is_complete", "load_engine_weights", "memory_saver_policy", "model_identity", "prepack_engine_model",
    "prepare_engine_load", "publish_engine_weights", "read_engine_section", "read_job_engine_key", "stay",
    "write_engine_rank",
]
