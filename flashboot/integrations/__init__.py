"""Engine integrations: FlashBoot as a model loader inside SGLang and vLLM.

``--load-format flashboot`` in either engine (registered by the entry points below) loads the
engine's own post-processed weights from a pre-packed engine image (or clones them from a running
seed) into one arena and binds the meta-initialised model to it. The engine-agnostic machinery
(key, pre-pack writer, reader, binder, the engines' sleep of the weights, refit through their
update calls: :mod:`flashboot.integrations.engine_refit`) is
:mod:`flashboot.integrations.engine_prepack` and the modules it re-exports; the adapters are :mod:`flashboot.integrations.sglang` and :mod:`flashboot.integrations.vllm` (each
imports its engine; importing this package imports neither).
"""

from __future__ import annotations

import importlib

from flashboot._lazy import lazy_getattr

_LAZY = {
    "EngineKey": "flashboot.integrations.engine_prepack",
    "LoaderOptions": "flashboot.integrations.engine_prepack",
    "check_engine_key": "flashboot.integrations.engine_prepack",
    "read_engine_section": "flashboot.integrations.engine_prepack",
    "read_job_engine_key": "flashboot.integrations.engine_prepack",
    "LOAD_FORMAT": "flashboot.integrations.engine_prepack",
}


__getattr__ = lazy_getattr('flashboot.integrations', _LAZY, globals())


def _require(engine: str, module: str):
    from flashboot.errors import CapabilityError

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CapabilityError(f"the flashboot {engine} plugin needs {engine} importable ({exc})") from None


def _warm_imports() -> None:
    """Import what the loader's early call and load use, in a background thread, as the engine
    process starts (plugins run at its start): the first load does not pay for these imports."""
    import threading

    def run() -> None:
        try:
            from flashboot.flashload.warm import import_loader

            import_loader()
        except Exception:  # a warm-up only: the load imports them again and reports what fails
            return

    threading.Thread(target=run, name="flashboot-warm-imports", daemon=True).start()


def sglang_plugin() -> None:
    """Entry point of ``sglang.srt.plugins``: makes ``--load-format flashboot`` valid in SGLang."""
    _require("sglang", "flashboot.integrations.sglang").register()
    _warm_imports()


def vllm_plugin() -> None:
    """Entry point of ``vllm.general_plugins``: registers the ``flashboot`` load format in vLLM."""
    _require("vllm", "flashboot.integrations.vllm").register()
    _warm_imports()


__all__ = ["sglang_plugin", "vllm_plugin", *_LAZY]
