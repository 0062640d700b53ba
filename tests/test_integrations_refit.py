"""Refit inside the engines (flashboot.integrations.engine_refit, the vLLM weight-transfer backend,
SGLang's update route): a trainer publishes an engine image's tensors by the engine's names, the
engine's own entry point refits the arena its model serves from.

Two layers, as the loader tests: engine-agnostic tests on the host backend with a plain torch
model standing in for the engine's (here, everywhere), and ``test_real_*`` running vLLM's and
SGLang's own code in a child process (skipped only where the engine is not installed; run by
``make test-engines``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from flashboot.errors import CapabilityError
from flashboot.integrations.engine_prepack import (
    EngineKey, LoaderOptions, RankGroup, bind_engine_model, load_engine_weights, prepack_engine_model,
)
from flashboot.integrations.engine_refit import (
    engine_publisher, engine_tensors_to_publish, refit_engine_model, refit_name,
)
from flashboot.weight_update import PublishError, RefitError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


class TinyEngineModel(torch.nn.Module):
    """What an engine model holds, in C order: fused weights, a tied head, a shared rotary
    buffer (one tensor, two names), a tensor attribute, an empty placeholder (vLLM's KV cache)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 16)
        self.embed.weight.data = torch.randn(32, 16, generator=g)
        self.qkv = torch.nn.Linear(16, 48, bias=True)
        self.qkv.weight.data, self.qkv.bias.data = torch.randn(48, 16, generator=g), torch.randn(48, generator=g)
        self.lm_head = torch.nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed.weight
        self.rope = torch.nn.Module()
        self.rope.register_buffer("cos_sin_cache", torch.arange(48.0).reshape(12, 4), persistent=False)
        self.rope_again = self.rope
        self.w_kc = torch.randn(4, 8, generator=g)
        self.kv_cache = torch.empty(0)

    def forward(self, ids):
        return self.lm_head(self.qkv(self.embed(ids))[:, :16])


def _key(**changes) -> EngineKey:
    import dataclasses

    base = EngineKey(engine="vllm", engine_version="0.0.test", model_id="org/tiny", revision="abc123",
                     config_hash="sha256:" + "1" * 64, architecture="TinyEngineModel", dtype="float32",
                     quantization=None, tp_size=1, ep_size=1, dp_size=1, pp_size=1, gpu_arch="cpu")
    return dataclasses.replace(base, **changes)


def _prepack(model, out, key):
    prepack_engine_model(model, out, key, RankGroup(), device="cpu", tp_size=1, ep_size=1,
                         source_path="/models/tiny", model_type="tiny", chunk_bytes=4096)
    return out


def _serve(out, tmp_path, key):
    """An engine's model as the loaders leave it: built on meta, bound to the arena's views."""
    weights = load_engine_weights(LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm")), key, 0, "cpu",
                                  tp_size=1, ep_size=1)
    with torch.device("meta"):
        model = TinyEngineModel()
    bind_engine_model(model, weights)
    model._flashboot_weights = weights
    return model, weights


def _tensors(model):
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    named["w_kc"] = model.w_kc
    return named


def test_engine_refit_gives_a_fresh_load_of_the_new_weights_bitwise(tmp_path, store):
    address, _ = store
    old, new = TinyEngineModel(0), TinyEngineModel(1)
    image = _prepack(old, tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path, _key())
    ptrs = {n: t.data_ptr() for n, t in _tensors(model).items()}
    reprocessed = []
    try:
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            trainer = dict(engine_tensors_to_publish(new, "cpu"))
            assert "lm_head.weight" not in trainer and "rope_again.cos_sin_cache" not in trainer  # aliases, once
            pub.publish(trainer, version=1)
            assert pub.name == refit_name("refit", 0)
            report = refit_engine_model(model, address, 1, what="test refit", reprocess=lambda: reprocessed.append(1),
                                        timeout_s=30)
        assert report.version == 1 and report.atomic and reprocessed == [1] and weights.handle.version == 1
        assert {n: t.data_ptr() for n, t in _tensors(model).items()} == ptrs  # the same views, new bytes
        fresh_image = _prepack(new, tmp_path / "img-new", _key())
        fresh, fresh_weights = _serve(fresh_image, tmp_path, _key())
        try:
            got, want = _tensors(model), _tensors(fresh)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[n], want[n]) for n in want)
            ids = torch.tensor([1, 5, 7])
            assert torch.equal(model(ids), fresh(ids)) and not torch.equal(model(ids), old(ids))
        finally:
            fresh_weights.close()
    finally:
        weights.close()


def test_engine_refit_refusals_leave_the_served_weights(tmp_path, store):
    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay, wake_engine_weights

    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    other = _prepack(TinyEngineModel(0), tmp_path / "img-other", _key(model_id="org/other"))
    model, weights = _serve(image, tmp_path, _key())
    before = {n: t.clone() for n, t in _tensors(model).items()}
    new = dict(engine_tensors_to_publish(TinyEngineModel(2), "cpu"))
    try:
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            with pytest.raises(PublishError, match=r"tensor 'qkv.weight' is float32 \[47, 16\] from the tensors given, "
                                                   r"float32 \[48, 16\] in the image"):
                pub.publish(dict(new, **{"qkv.weight": new["qkv.weight"][:-1]}), version=1)
            with pytest.raises(PublishError, match="tensor 'mlp.weight' is not in the manifest of org/tiny rank 0"):
                pub.publish(dict(new, **{"mlp.weight": torch.zeros(4)}), version=1)
            with pytest.raises(PublishError, match=r"image tensor\(s\) 'rope.cos_sin_cache' get no bytes"):
                pub.publish({n: t for n, t in new.items() if n != "rope.cos_sin_cache"}, version=1)
            pub.publish(dict(new, **{"lm_head.weight": new["embed.weight"]}), version=1)  # an alias: skipped
            assert pub.report.tensors == len(new) + 1
        with engine_publisher(other, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=2)
            with pytest.raises(RefitError, match=r"version 2 was published for image key .* \(org/other\); this engine "
                                                 r"serves .* \(org/tiny\); nothing was copied"):
                refit_engine_model(model, address, 2, what="test refit", timeout_s=30)
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=3)
            stay(weights, shm_dir=str(tmp_path / "shm"))
            sleep_engine_weights(1)
            with pytest.raises(RefitError, match=r"test refit: refused, nothing was copied: the model's [\d,]+-byte "
                                                 r"weight arena is asleep; wake its weights first \(SGLang: "
                                                 r"resume_memory_occupation"):
                refit_engine_model(model, address, 3, what="test refit", timeout_s=30)
            wake_engine_weights()
            assert all(torch.equal(t, before[n]) for n, t in _tensors(model).items())
            refit_engine_model(model, address, 3, what="test refit", timeout_s=30)
            with pytest.raises(RefitError, match="version 3 is not newer than the live version 3; refused"):
                refit_engine_model(model, address, 3, what="test refit", timeout_s=30)
        assert torch.equal(model.qkv.weight, new["qkv.weight"])
        with pytest.raises(RefitError, match=r"unknown refit option\(s\) \['atomicity'\]"):
            refit_engine_model(model, address, 4, what="test refit", atomicity=False)
    finally:
        weights.close()
    with pytest.raises(CapabilityError, match="TinyEngineModel was not loaded by the flashboot loader"):
        refit_engine_model(TinyEngineModel(), address, 1, what="test refit")
