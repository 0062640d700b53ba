"""Loading an engine image and binding it onto the engine's model, engine-agnostic
(flashboot.integrations.engine_prepack): FlashLoad on the host backend (and once on CUDA) onto a
meta-built ``PlainEngineLikeModel``, the early call at engine start, bind's refusals and the
references it repoints, FlashClone from an in-process engine seed, and the loader options.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from _engine_helpers import (  # noqa: F401  (packed: a fixture)
    PlainEngineLikeModel, _assert_same_tensors, _key, _options, packed,
)
from flashboot.errors import FlashBootError, LayoutError
from flashboot.integrations.engine_prepack import (
    LoaderOptions, RankGroup, bind_engine_model, check_no_meta_tensors, load_engine_weights, prepack_engine_model,
    prepare_engine_load,
)

TOKEN = "engine-integration-test-token-0123456789"


def test_load_and_bind_onto_a_meta_model_serves_the_packed_bytes_from_one_arena(packed, tmp_path):
    model, out, _ = packed
    weights = load_engine_weights(_options(out, tmp_path, verify=True), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            target = PlainEngineLikeModel()
        report = bind_engine_model(target, weights)
        check_no_meta_tensors(target, "plain")
        _assert_same_tensors(model, target)
        assert torch.equal(target.w_kc, model.w_kc) and not target.w_kc.is_meta
        assert target.lm_head.weight is target.embed.weight  # tied stays tied
        assert target.rope_again is target.rope and target.rope.cos_sin_cache.data_ptr() != 0
        assert "cos_sin_cache" in target.rope._non_persistent_buffers_set
        assert target.w_t.stride() == (1, 16) and target.w_t.weight_loader == "kept"
        assert target.scale.dtype == torch.float8_e8m0fnu
        lo, hi = weights.arena.ptr, weights.arena.ptr + weights.arena.nbytes
        assert all(lo <= t.data_ptr() < hi for t in list(target.parameters()) + list(target.buffers()) + [target.w_kc])
        assert sorted(report.aliases) == ["lm_head.weight", "rope_again.cos_sin_cache"] and report.added == []
        assert weights.how == "load" and weights.report.verify_ms > 0
        assert not any((tmp_path / "shm").rglob("rank-0.img"))  # the copy staged for this load is gone
    finally:
        weights.close()


@pytest.mark.gpu
def test_engine_image_round_trip_on_cuda(tmp_path):
    from flashboot.integrations.engine_prepack import gpu_arch_of

    model = PlainEngineLikeModel().to("cuda:0")
    model.w_kc = model.w_kc.to("cuda:0")  # .to() moves parameters and buffers, not plain attributes
    key = _key(gpu_arch=gpu_arch_of("cuda:0"))
    assert key.gpu_arch.startswith("sm_")
    out = tmp_path / "img"
    prepack_engine_model(model, out, key, RankGroup(), device="cuda:0", tp_size=1, ep_size=1,
                         source_path="/models/plain", model_type="plain")
    # Staged pages are pinned for the H2D: they must be tmpfs-backed (the driver refuses disk files).
    shm = Path(tempfile.mkdtemp(prefix="flashboot-test-", dir="/dev/shm"))
    options = LoaderOptions(image_dir=str(out), shm_dir=str(shm), verify=True)
    try:
        weights = load_engine_weights(options, key, 0, "cuda:0", tp_size=1, ep_size=1)
    except BaseException:
        shutil.rmtree(shm, ignore_errors=True)
        raise
    try:
        with torch.device("meta"):
            target = PlainEngineLikeModel()
        bind_engine_model(target, weights)
        check_no_meta_tensors(target, "plain on cuda")
        _assert_same_tensors(model, target)
        assert torch.equal(target.w_kc, model.w_kc) and target.w_kc.device == torch.device("cuda", 0)
        lo, hi = weights.arena.ptr, weights.arena.ptr + weights.arena.nbytes
        assert all(lo <= t.data_ptr() < hi for t in list(target.parameters()) + list(target.buffers()))
        x = torch.randint(0, 32, (3,), device="cuda:0")
        assert torch.equal(target.lm_head(target.embed(x)), model.lm_head(model.embed(x)))  # serves from the arena
    finally:
        weights.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_the_early_call_prepares_at_engine_start_and_the_load_is_the_copy(packed, tmp_path):
    """What both loaders do: prepare_engine_load before building the model, the handle into
    load_engine_weights. No preloader runs here, so the prepared load streams from disk."""
    model, out, _ = packed
    prepared = prepare_engine_load(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    assert prepared.wait().mode == "stream" and prepared.tensors is None  # the load makes the views
    weights = load_engine_weights(_options(out, tmp_path, verify=True), _key(), 0, "cpu", tp_size=1, ep_size=1,
                                  prepared=prepared)
    try:
        assert weights.how == "load" and weights.report.mode == "streamed from disk, prepared"
        assert weights.report.metadata_ms == 0 < weights.report.bind_ms and weights.report.verify_ms > 0
        with torch.device("meta"):
            target = PlainEngineLikeModel()
        bind_engine_model(target, weights)
        _assert_same_tensors(model, target)
    finally:
        weights.close()
    # a wrong key is refused by the early call itself, before any arena exists
    with pytest.raises(LayoutError, match="dtype: engine 'bfloat16', image 'float32'"):
        prepare_engine_load(_options(out, tmp_path), _key(dtype="bfloat16"), 0, "cpu", tp_size=1, ep_size=1)
    assert prepare_engine_load(_options(out, tmp_path, staging="inline"), _key(), 0, "cpu", tp_size=1,
                               ep_size=1) is None  # staging in this process first: nothing to prepare


def test_bind_refuses_other_shapes_and_leftover_meta_tensors(packed, tmp_path):
    _, out, _ = packed
    weights = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            wider = PlainEngineLikeModel()
            wider.proj = torch.nn.Linear(16, 48)  # another "quantization layout" of the same name
        with pytest.raises(LayoutError, match=r"proj.weight \(image \[24, 16\] torch.float32, model \[48, 16\]"):
            bind_engine_model(wider, weights)
        with torch.device("meta"):
            extra = PlainEngineLikeModel()
            extra.gate = torch.nn.Linear(16, 2)  # something the image does not hold
        bind_engine_model(extra, weights)
        with pytest.raises(LayoutError, match=r"2 tensor\(s\) .* would be uninitialised: gate.weight, gate.bias"):
            check_no_meta_tensors(extra, "plain")
    finally:
        weights.close()


@dataclasses.dataclass(frozen=True)
class _RoutingConfig:
    correction_bias: torch.Tensor


class _Router(torch.nn.Module):
    """Holds a reference to another module's parameter in a frozen dataclass, as SGLang's TopK
    holds the gate's ``e_score_correction_bias`` in its TopKConfig."""

    def __init__(self, bias):
        super().__init__()
        self.config = _RoutingConfig(bias)
        self.held = [bias]


def test_bind_repoints_references_held_in_module_containers(packed, tmp_path):
    model, out, _ = packed
    weights = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            target = PlainEngineLikeModel()
        target.router = _Router(target.proj.bias)
        report = bind_engine_model(target, weights)
        assert sorted(report.repointed) == ["router.config.correction_bias", "router.held[0]"]
        assert target.router.config.correction_bias is target.proj.bias is target.router.held[0]
        assert torch.equal(target.router.config.correction_bias, model.proj.bias)
        check_no_meta_tensors(target, "plain")
        with torch.device("meta"):
            stale = PlainEngineLikeModel()
        stale.router = _Router(torch.empty(3, device="meta"))  # a held tensor the image cannot provide
        bind_engine_model(stale, weights)
        with pytest.raises(LayoutError, match=r"2 tensor\(s\) .* uninitialised: "
                                              r"router.config.correction_bias, router.held\[0\]"):
            check_no_meta_tensors(stale, "plain")
    finally:
        weights.close()


def test_clone_from_an_engine_seed_binds_the_same_bytes(packed, tmp_path, monkeypatch):
    from flashboot.flashclone.rendezvous import free_port

    monkeypatch.setenv("FLASHBOOT_TOKEN", TOKEN)
    model, out, _ = packed
    address = f"127.0.0.1:{free_port()}"
    seed = load_engine_weights(_options(out, tmp_path, publish_store=address, timeout_s=20), _key(), 0, "cpu",
                               tp_size=1, ep_size=1)
    try:
        assert seed.seed is not None
        with pytest.raises(LayoutError, match="dtype: engine 'bfloat16', image 'float32'"):
            load_engine_weights(LoaderOptions(seed_store=address, timeout_s=20), _key(dtype="bfloat16"), 0, "cpu",
                                tp_size=1, ep_size=1)
        clone = load_engine_weights(LoaderOptions(seed_store=address, timeout_s=20, verify=True), _key(), 0, "cpu",
                                    tp_size=1, ep_size=1)
        try:
            assert clone.how == "clone" and clone.report.verified and clone.arena.ptr != seed.arena.ptr
            with torch.device("meta"):
                target = PlainEngineLikeModel()
            bind_engine_model(target, clone)
            check_no_meta_tensors(target, "clone")
            _assert_same_tensors(model, target)
            assert torch.equal(target.w_kc, model.w_kc)
        finally:
            clone.close()
    finally:
        seed.close()


def test_loader_options_validate_themselves():
    o = LoaderOptions.from_extra_config('{"image_dir": "/img", "verify": true, "mode": "auto"}')
    assert o.image_dir == "/img" and o.verify and o.mode == "auto" and o.staging == "auto"
    with pytest.raises(FlashBootError, match=r"unknown flashboot loader option\(s\) \['imagedir'\]; known: image_dir"):
        LoaderOptions.from_extra_config({"imagedir": "/img"})
    with pytest.raises(FlashBootError, match="needs image_dir .* or seed_store"):
        LoaderOptions.from_extra_config({})
    with pytest.raises(FlashBootError, match="mode='copy'; known: load, prepack, auto"):
        LoaderOptions(image_dir="/img", mode="copy")
    with pytest.raises(FlashBootError, match="a ring needs every member's host image"):
        LoaderOptions(seed_store="h:1", schedule="ring")
    with pytest.raises(FlashBootError, match="mode='prepack' writes an image: image_dir is required"):
        LoaderOptions(seed_store="h:1", mode="prepack")
    with pytest.raises(FlashBootError, match="not JSON"):
        LoaderOptions.from_extra_config("{image_dir: /img}")
