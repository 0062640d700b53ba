"""Hardening of the engine integrations and the refit path (host backend): post-processing
failures after a refit, engine keys of local checkpoints, the vLLM loader's copy, seed ranks, meta
tensor checks, publish aliases, option validation, engine sections."""

from __future__ import annotations

import pytest
import torch

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish, refit_engine_model
from flashboot.weight_update import RefitError
from test_integrations_refit import TinyEngineModel, _key, _prepack, _serve


@pytest.mark.parametrize("step", ["reprocess", "derive"])
def test_refit_post_processing_failure_names_the_live_version_and_a_retry_finishes_it(tmp_path, store, step):
    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path / "shm", _key())
    new = dict(engine_tensors_to_publish(TinyEngineModel(1), "cpu"))
    calls, failed = [], []

    def flaky(name):
        def run():
            calls.append(name)
            if name == step and not failed:
                failed.append(name)
                raise RuntimeError("CUDA error: out of memory")
            if name == "derive":
                model.post_load_weights()
        return run

    try:
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=1)
            with pytest.raises(RefitError, match=rf"version 1's bytes are live but the engine's post-processing "
                                                 rf"failed at {step} \(RuntimeError: CUDA error: out of memory\); the "
                                                 r"weights are not servable until it succeeds: refit to version 1 "
                                                 "again"):
                refit_engine_model(model, address, 1, what="test refit", reprocess=flaky("reprocess"),
                                   derive=flaky("derive"), timeout_s=30)
            assert weights.handle.version == 1 and torch.equal(model.qkv.weight, new["qkv.weight"])
            assert weights.post_refit_pending == {"version": 1, "derived": ["w_kc"]}
            calls.clear()
            report = refit_engine_model(model, address, 1, what="test refit", reprocess=flaky("reprocess"),
                                        derive=flaky("derive"), timeout_s=30)
            assert calls == ["reprocess", "derive"] and report.nbytes == 0  # nothing copied again
            assert report.details["post_processing_only"] and report.details["derived"] == ["w_kc"]
            assert torch.equal(model.w_kc, new["qkv.weight"][:4, :8] * 2) and weights.post_refit_pending is None
            with pytest.raises(RefitError, match="version 1 is not newer than the live version 1"):
                refit_engine_model(model, address, 1, what="test refit", derive=model.post_load_weights, timeout_s=30)
    finally:
        weights.close()
