"""Hardening of the engine integrations and the refit path (host backend): post-processing
failures after a refit, engine keys of local checkpoints, the vLLM loader's copy, seed ranks, meta
tensor checks, publish aliases, option validation, engine sections."""

from __future__ import annotations

import dataclasses
import re
from pathlib import PurePosixPath

import pytest
import torch

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _engine_helpers import packed  # noqa: F401  (fixture)
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


def _checkpoint(path, fill: float):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "tiny", "hidden_size": 16}')
    save_file({"w": torch.full((4,), fill)}, str(path / "model.safetensors"))
    return path


def test_engine_key_tells_local_checkpoints_with_one_config_and_name_apart(tmp_path):
    """Two checkpoints with one config.json and one directory name (ckpts/step-1000/hf and
    ckpts/step-2000/hf) had one key: an image of one was served for the other. A local
    directory's revision is now a fingerprint of its weights (names, sizes, sampled bytes):
    the same for a copy of it (new mtimes, another node), absent where no weights are."""
    import shutil

    from flashboot.errors import LayoutError
    from flashboot.integrations.engine_key import model_identity
    from flashboot.integrations.engine_prepack import LoaderOptions, load_engine_weights

    a = _checkpoint(tmp_path / "ckpts" / "step-1000" / "hf", 1.0)
    b = _checkpoint(tmp_path / "ckpts" / "step-2000" / "hf", 2.0)  # same size, other bytes
    ida, idb = model_identity(str(a)), model_identity(str(b))
    assert ida[0] == idb[0] == "hf" and ida[2] == idb[2]  # same name, same config
    assert ida[1].startswith("local-sha256:") and ida[1] != idb[1]
    copy = shutil.copytree(a, tmp_path / "node2" / "hf", copy_function=shutil.copyfile)  # new mtimes
    assert model_identity(str(copy)) == ida and model_identity(str(a), "main")[1] == "main"
    weightless = tmp_path / "node3" / "hf"
    weightless.mkdir(parents=True)
    shutil.copy(a / "config.json", weightless)
    assert model_identity(str(weightless)) == ("hf", None, ida[2])
    # a hub snapshot keeps its commit as the revision
    snap = _checkpoint(tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc1234", 1.0)
    assert model_identity(str(snap))[:2] == ("org/tiny", "abc1234")
    # an image of the other checkpoint, or one packed before the fingerprint, is refused naming both;
    # the image of this one loads on a node with the weights, and on one without them
    for packed_rev in (None, idb[1]):
        out = _prepack(TinyEngineModel(0), tmp_path / f"img-{packed_rev}", _key(model_id="hf", revision=packed_rev))
        with pytest.raises(LayoutError, match=rf"revision: engine '{ida[1]}', image {packed_rev!r}"):
            load_engine_weights(LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm")),
                                _key(model_id="hf", revision=ida[1]), 0, "cpu", tp_size=1, ep_size=1)
    out = _prepack(TinyEngineModel(0), tmp_path / "img-a", _key(model_id="hf", revision=ida[1]))
    for engine_rev in (ida[1], None):
        load_engine_weights(LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm")),
                            _key(model_id="hf", revision=engine_rev), 0, "cpu", tp_size=1, ep_size=1).close()
    assert dataclasses.replace(_key(), revision=ida[1]).digest != dataclasses.replace(_key(), revision=idb[1]).digest


def test_copy_into_a_built_model_refuses_broadcast_and_cast_before_copying(packed, tmp_path):
    from _engine_helpers import PlainEngineLikeModel, _assert_same_tensors
    from _engine_helpers import _key as plain_key
    from flashboot.errors import LayoutError
    from flashboot.integrations.engine_bind import copy_engine_weights_into
    from flashboot.integrations.engine_prepack import LoaderOptions, load_engine_weights

    ref, out, _ = packed
    weights = load_engine_weights(LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm")), plain_key(), 0,
                                  "cpu", tp_size=1, ep_size=1)
    try:
        model = PlainEngineLikeModel(1)
        model.proj.bias = torch.nn.Parameter(torch.zeros(4, 24))  # the image's [24] would broadcast into it
        model.embed.weight = model.lm_head.weight = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.float16))
        before = model.proj.weight.clone()
        with pytest.raises(LayoutError, match=r"2 tensor\(s\) differ in shape or dtype: embed.weight \(image \[32, 16\] "
                                              r"torch.float32, model \[32, 16\] torch.float16\), proj.bias \(image "
                                              r"\[24\] torch.float32, model \[4, 24\] torch.float32\); nothing was"):
            copy_engine_weights_into(model, weights)
        assert torch.equal(model.proj.weight, before)  # refused before a byte moved
        model = PlainEngineLikeModel(1)
        ptr = model.proj.weight.data_ptr()
        copy_engine_weights_into(model, weights)
        assert model.proj.weight.data_ptr() == ptr  # in place
        _assert_same_tensors(ref, model)
    finally:
        weights.close()


def test_a_seed_of_another_rank_is_neither_published_nor_cloned(packed, tmp_path, store):
    from _engine_helpers import _key as plain_key
    from flashboot.errors import LayoutError
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.integrations.engine_bind import ENGINE_RECORD, publish_engine_weights
    from flashboot.integrations.engine_prepack import LoaderOptions, load_engine_weights

    address, _ = store
    _, out, _ = packed
    options = LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm"), publish_store=address, timeout_s=20)
    weights = load_engine_weights(dataclasses.replace(options, publish_store=None), plain_key(), 0, "cpu",
                                  tp_size=1, ep_size=1)
    try:
        with pytest.raises(LayoutError, match=r"cannot publish rank 0's engine weights as the seed of rank 1 at "):
            publish_engine_weights(weights, options, 1)
        assert weights.seed is None
        # a record planted under rank 1's namespace that carries rank 0's section
        seed = publish_engine_weights(weights, options, 0)
        try:
            body = Rendezvous.connect(address, namespace="flashboot-rank0", host=False, timeout_s=20)
            try:
                record = body.read(ENGINE_RECORD, what="rank 0's engine record", timeout_s=20).body
            finally:
                body.close()
            planted = Rendezvous.connect(address, namespace="flashboot-rank1", host=False, timeout_s=20)
            try:
                planted.publish(ENGINE_RECORD, record)
            finally:
                planted.close()
            with pytest.raises(LayoutError, match=r"namespace flashboot-rank1\): the seed serves rank 0's weights, "
                                                  "this engine is rank 1; refused before cloning"):
                load_engine_weights(LoaderOptions(seed_store=address, timeout_s=20), plain_key(), 1, "cpu",
                                    tp_size=1, ep_size=1)
        finally:
            seed.close()
    finally:
        weights.close()


class _Backend:
    """A plain object, as an attention layer's backend ``impl``, holding a layer's tensor."""

    def __init__(self, sinks):
        self.sinks = sinks
        self.nested = {"cache": [torch.empty(0)]}  # an empty placeholder (a KV cache) holds no bytes


class _Attention(torch.nn.Module):
    def __init__(self, sinks):
        super().__init__()
        self._k_scale = torch.tensor(2.5)  # a private tensor attribute, as vLLM's attention keeps it
        self.impl = _Backend(sinks)

    def after_load(self):  # the engine makes its private tensors again once the weights are in
        self._k_scale = torch.tensor(2.5)


def test_meta_check_sees_private_deep_and_object_held_tensors(tmp_path):
    from _engine_helpers import PlainEngineLikeModel
    from _engine_helpers import _key as plain_key
    from flashboot.errors import LayoutError
    from flashboot.integrations.engine_prepack import (
        LoaderOptions, RankGroup, bind_engine_model, check_no_meta_tensors, load_engine_weights, prepack_engine_model,
    )

    def build():
        model = PlainEngineLikeModel()
        model.attn = _Attention(model.proj.bias)
        return model

    ref = build()
    prepack_engine_model(ref, tmp_path / "img", plain_key(), RankGroup(), device="cpu", tp_size=1, ep_size=1,
                         source_path="/models/plain", model_type="plain", chunk_bytes=4096)
    weights = load_engine_weights(LoaderOptions(image_dir=str(tmp_path / "img"), shm_dir=str(tmp_path / "shm")),
                                  plain_key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            target = build()
        report = bind_engine_model(target, weights)
        assert "attn.impl.sinks" in report.repointed and target.attn.impl.sinks is target.proj.bias
        assert target.attn._k_scale.is_meta  # not dumped: the engine's own, made again after the load
        with pytest.raises(LayoutError, match=r"attn._k_scale"):
            check_no_meta_tensors(target, "plain")
        target.attn.after_load()
        check_no_meta_tensors(target, "plain")
        with torch.device("meta"):
            stale = build()
        bind_engine_model(stale, weights)
        stale.attn._k_scale = torch.empty((), device="meta")
        stale.attn.impl.other = torch.empty(3, device="meta")
        stale.attn.impl.nested["cache"].append((torch.empty(2, device="meta"),))
        with pytest.raises(LayoutError, match=r"3 tensor\(s\) of the model are not in the engine image and would be "
                                              r"uninitialised: attn._k_scale, attn.impl.nested\['cache'\]\[1\]\[0\], "
                                              r"attn.impl.other\."):
            check_no_meta_tensors(stale, "plain")
    finally:
        weights.close()


def test_publish_refuses_an_untied_alias_and_accepts_the_tied_one(tmp_path, store):
    from flashboot.weight_update import PublishError

    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    new = dict(engine_tensors_to_publish(TinyEngineModel(1), "cpu"))
    with engine_publisher(image, 0, store=address, device="cpu") as pub:
        with pytest.raises(PublishError, match=r"tensor 'lm_head.weight' is float16 \[32, 16\] from the tensors given; "
                                               r"in the image it is another name of 'embed.weight', float32 \[32, 16\]"):
            pub.publish(dict(new, **{"lm_head.weight": new["embed.weight"].half()}), version=1)
        with pytest.raises(PublishError, match=r"tensor 'lm_head.weight' is float32 \[16, 32\] from"):
            pub.publish(dict(new, **{"lm_head.weight": new["embed.weight"].t().contiguous()}), version=1)
        with pytest.raises(PublishError, match=r"tensor 'lm_head.weight' is another name of image tensor "
                                               r"'embed.weight' \(tied when pre-packed\), but the tensors given differ"):
            pub.publish(dict(new, **{"lm_head.weight": new["embed.weight"] + 1}), version=1)
        assert pub.version == 0 and pub.seed is None  # nothing published
        pub.publish(dict(new, **{"lm_head.weight": new["embed.weight"].clone()}), version=1)  # equal: a copy of it
        pub.publish(dict(new, **{"lm_head.weight": new["embed.weight"][:]}), version=2)  # a view of it


class _ScaledTiny(TinyEngineModel):
    """With block scales in a dtype the image format stores as raw bytes."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        g = torch.Generator().manual_seed(seed + 100)
        self.scale = torch.nn.Parameter(torch.randint(0, 200, (8,), generator=g, dtype=torch.uint8)
                                        .view(torch.float8_e8m0fnu), requires_grad=False)


def test_publish_packs_tensors_the_image_stores_as_raw_bytes(tmp_path, store):
    from flashboot.integrations.engine_prepack import LoaderOptions, bind_engine_model, load_engine_weights
    from flashboot.weight_update import PublishError

    address, _ = store
    image = _prepack(_ScaledTiny(0), tmp_path / "img", _key())
    weights = load_engine_weights(LoaderOptions(image_dir=str(image), shm_dir=str(tmp_path / "shm")), _key(), 0,
                                  "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            model = _ScaledTiny()
        bind_engine_model(model, weights)
        model._flashboot_weights = weights
        new = dict(engine_tensors_to_publish(_ScaledTiny(1), "cpu"))
        assert new["scale"].dtype == torch.float8_e8m0fnu  # the image holds it as uint8 [8]
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            with pytest.raises(PublishError, match=r"tensor 'scale' is float8_e8m0fnu \[7\] from the tensors given, "
                                                   r"float8_e8m0fnu \[8\] in the image"):
                pub.publish(dict(new, scale=new["scale"][:7]), version=1)
            pub.publish(new, version=1)
            refit_engine_model(model, address, 1, what="test refit", derive=model.post_load_weights, timeout_s=30)
        assert model.scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(model.scale.view(torch.uint8), new["scale"].view(torch.uint8))
        assert torch.equal(model.qkv.weight, new["qkv.weight"])
    finally:
        weights.close()


@pytest.mark.parametrize("changes, message", [
    ({"timeout_s": float("nan")}, r"timeout_s must be a finite number of seconds in \(0, 1e\+06\], got nan"),
    ({"timeout_s": float("inf")}, r"timeout_s must be a finite number .* got inf"),
    ({"timeout_s": 1e12}, r"timeout_s must be a finite number .* got 1000000000000.0"),
    ({"image_dir": ["/a"]}, r"image_dir must be a non-empty path, got \['/a'\]"),
    ({"image_dir": ""}, r"image_dir must be a non-empty path, got ''"),
    ({"shm_dir": 7}, r"shm_dir must be a non-empty path, got 7"),
    ({"seed_store": ""}, r"seed_store must be 'HOST:PORT' \(port 1-65535\), got ''"),
    ({"seed_store": 1234}, r"seed_store must be 'HOST:PORT' .* got 1234"),
    ({"publish_store": "host"}, r"publish_store must be 'HOST:PORT' .* got 'host'"),
    ({"seed_name": 5}, r"seed_name must be a non-empty name without '/', got 5"),
    # the engine's own loader serves a pre-pack: publish_store had been skipped silently
    ({"mode": "prepack", "publish_store": "h:1"}, r"mode='prepack' serves the model the engine's own loader built, "
                                                  r"not an arena: there is no seed to publish at publish_store"),
])
def test_loader_options_refuse_bad_types_and_non_finite_timeouts(changes, message):
    from flashboot.errors import FlashBootError
    from flashboot.integrations.engine_prepack import LoaderOptions

    with pytest.raises(FlashBootError, match=message):
        LoaderOptions(**{"image_dir": "/img", **changes})


def test_loader_options_from_json_refuse_nan_and_infinity():
    from flashboot.errors import FlashBootError
    from flashboot.integrations.engine_prepack import LoaderOptions

    for text in ('{"image_dir": "/img", "timeout_s": NaN}', '{"image_dir": "/img", "timeout_s": Infinity}'):
        with pytest.raises(FlashBootError, match="timeout_s must be a finite number"):
            LoaderOptions.from_extra_config(text)
    assert LoaderOptions(image_dir=PurePosixPath("/img"), seed_store="[::1]:29500").image_dir == "/img"


def test_a_load_failing_after_the_copy_releases_its_arena(packed, tmp_path, monkeypatch):
    import flashboot
    from _engine_helpers import _key as plain_key
    from flashboot.integrations.engine_prepack import LoaderOptions, load_engine_weights

    _, out, _ = packed
    loads = []
    real_load = flashboot.load

    class _Joining:
        def join(self, timeout=None):
            raise RuntimeError("join failed")

    def load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        loaded.release_thread = _Joining()  # the wait on the staged copy's unmap fails after the copy
        loads.append(loaded)
        return loaded

    monkeypatch.setattr(flashboot, "load", load)
    with pytest.raises(RuntimeError, match="join failed"):
        load_engine_weights(LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm"), staging="inline"),
                            plain_key(), 0, "cpu", tp_size=1, ep_size=1)
    assert len(loads) == 1 and loads[0].arena.closed


@pytest.mark.parametrize("options, message", [
    ({"timeout_s": float("nan")}, r"refit option timeout_s must be a finite number of seconds in \(0, 1e\+06\], got nan"),
    ({"timeout_s": float("inf")}, r"timeout_s must be a finite number .* got inf"),
    ({"timeout_s": "30"}, r"timeout_s must be a finite number .* got '30'"),
    ({"timeout_s": -1}, r"timeout_s must be a finite number .* got -1"),
    ({"atomic": None}, r"refit option atomic must be true or false, got None"),
    ({"atomic": "false"}, r"refit option atomic must be true or false, got 'false'"),
    ({"clones": 1.5}, r"refit option clones must be a positive integer or None, got 1.5"),
    ({"chunk_bytes": 0}, r"refit option chunk_bytes must be a positive integer or None, got 0"),
    ({"schedule": 3}, r"refit option schedule must be a non-empty string, got 3"),
])
def test_refit_options_are_checked_by_value_everywhere(tmp_path, store, options, message):
    import json

    from flashboot.integrations.engine_refit import check_refit_options
    from flashboot.weight_update import refit

    address, _ = store
    with pytest.raises(RefitError, match=message):  # SGLang's update request (JSON)
        check_refit_options(json.loads(json.dumps(options)), "refit_request")
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path / "shm", _key())
    try:
        with pytest.raises(RefitError, match=message):
            refit_engine_model(model, address, 1, what="test refit", **options)
        with pytest.raises(RefitError, match=message):
            refit(weights.handle, address, 1, **options)
        assert weights.handle.version == 0
    finally:
        weights.close()


def _stub_vllm(monkeypatch):
    """Just enough of vLLM's weight-transfer interface to import the flashboot backend."""
    import sys
    import types
    from dataclasses import dataclass
    from typing import Generic, TypeVar

    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    T, U = TypeVar("T"), TypeVar("U")

    @dataclass
    class WeightTransferInitInfo:
        pass

    @dataclass
    class TrainerInitInfo:
        pass

    class WeightTransferEngine(Generic[T, U]):
        pass

    class TrainerWeightTransferEngine(Generic[T]):
        pass

    base.WeightTransferInitInfo, base.TrainerInitInfo = WeightTransferInitInfo, TrainerInitInfo
    base.WeightTransferUpdateInfo = WeightTransferInitInfo
    base.WeightTransferEngine, base.TrainerWeightTransferEngine = WeightTransferEngine, TrainerWeightTransferEngine
    base.WeightSource = object
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.delitem(sys.modules, "flashboot.integrations.vllm_weight_transfer", raising=False)


def test_vllm_init_info_checks_its_values(monkeypatch):
    import importlib

    _stub_vllm(monkeypatch)
    transfer = importlib.import_module("flashboot.integrations.vllm_weight_transfer")
    try:
        assert transfer.FlashBootInitInfo(store="h:1").atomic is True
        for bad, message in (({"atomic": "false"}, "atomic must be true or false, got 'false'"),
                             ({"atomic": None}, "atomic must be true or false, got None"),
                             ({"timeout_s": float("nan")}, "timeout_s must be a finite number"),
                             ({"clones": "2"}, "clones must be a positive integer or None"),
                             ({"store": None}, "store must be 'HOST:PORT', got None")):
            with pytest.raises(RefitError, match=rf"init_weight_transfer_engine \(flashboot\).*{message}"):
                transfer.FlashBootInitInfo(**{"store": "h:1", **bad})
    finally:
        import sys

        sys.modules.pop("flashboot.integrations.vllm_weight_transfer", None)  # built over the stub


def _stub_sglang(monkeypatch, quantization_config):
    """Just enough of SGLang to import the flashboot loader; ``_get_quantization_config`` is
    ``quantization_config``."""
    import contextlib
    import sys
    import types

    modules = {}
    for name in ("sglang", "sglang.srt", "sglang.srt.configs", "sglang.srt.configs.load_config",
                 "sglang.srt.model_loader", "sglang.srt.model_loader.loader", "sglang.srt.model_loader.utils"):
        modules[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, modules[name])

    class BaseModelLoader:
        def __init__(self, load_config):
            self.load_config = load_config

    loader = modules["sglang.srt.model_loader.loader"]
    loader.BaseModelLoader, loader._get_quantization_config = BaseModelLoader, quantization_config
    loader._initialize_model = loader.get_model_loader = None
    modules["sglang.srt.configs.load_config"].LoadConfig = modules["sglang.srt.configs.load_config"].LoadFormat = object
    modules["sglang.srt.model_loader.utils"].set_default_torch_dtype = lambda dtype: contextlib.nullcontext()
    monkeypatch.delitem(sys.modules, "flashboot.integrations.sglang", raising=False)


def test_sglang_load_releases_the_early_call_when_the_quantization_config_fails(monkeypatch, tmp_path):
    import importlib
    import sys
    import types

    def quantization_config(model_config, load_config):
        raise ValueError("unknown quantization method 'fp3'")

    _stub_sglang(monkeypatch, quantization_config)
    sglang_loader = importlib.import_module("flashboot.integrations.sglang")
    try:
        prepared = []

        class _Prepared:
            closed = False

            def close(self):
                self.closed = True

        def prepare(*args, **kwargs):
            prepared.append(_Prepared())
            return prepared[-1]

        monkeypatch.setattr(sglang_loader, "prepare_engine_load", prepare)
        monkeypatch.setattr(sglang_loader, "memory_saver_enabled", lambda: False)
        loader = sglang_loader.FlashBootModelLoader(types.SimpleNamespace(
            model_loader_extra_config={"image_dir": str(tmp_path / "img")}))
        loader.key = _key(engine="sglang")
        model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(), quantization=None, dtype=torch.float32)
        parallel = types.SimpleNamespace(tp_rank=0, tp_size=1, ep_size=1)
        with pytest.raises(ValueError, match="unknown quantization method 'fp3'"):
            loader._load(model_config, torch.device("cpu"), parallel)
        assert all(p.closed for p in prepared)  # none made, or made and released
    finally:
        sys.modules.pop("flashboot.integrations.sglang", None)  # built over the stub


@pytest.mark.parametrize("edit, message", [
    (lambda info: info.pop("shape"), r"engine tensor 'scale' stored as bytes needs shape and stride as equal-length "
                                     r"lists of non-negative ints, found shape None, stride \[1\]"),
    (lambda info: info.update(dtype=5), r"engine tensor 'scale' stored as bytes has dtype 5, not a dtype name"),
    (lambda info: info.update(stride=[-1]), r"found shape \[8\], stride \[-1\]"),
    (lambda info: info.update(stride=[1, 1]), r"found shape \[8\], stride \[1, 1\]"),
    (lambda info: info.update(shape=[64]), r"engine tensor 'scale': float8_e8m0fnu shape \[64\] stride \[1\] spans 64 "
                                           r"bytes; its image entry holds 8"),
])
def test_engine_section_raw_entries_are_checked_before_binding(packed, tmp_path, edit, message):
    import json

    from _engine_helpers import PlainEngineLikeModel
    from _engine_helpers import _key as plain_key
    from _image_helpers import rewrite_metadata
    from flashboot.errors import LayoutError
    from flashboot.integrations.engine_prepack import LoaderOptions, bind_engine_model, load_engine_weights

    _, out, _ = packed
    rank_dir = next(p for p in out.iterdir() if p.is_dir() and (p / "metadata.json").is_file())
    meta = json.loads((rank_dir / "metadata.json").read_text())
    assert meta["engine"]["tensors"]["scale"]["dtype"] == "float8_e8m0fnu"
    edit(meta["engine"]["tensors"]["scale"])
    rewrite_metadata(rank_dir, meta)
    options = LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm"))
    with pytest.raises(LayoutError, match=message):
        weights = load_engine_weights(options, plain_key(), 0, "cpu", tp_size=1, ep_size=1)
        try:
            with torch.device("meta"):
                model = PlainEngineLikeModel()
            bind_engine_model(model, weights)
        finally:
            weights.close()


@pytest.mark.parametrize("text, said", [("[1, 2]", "a config is a JSON object, found a JSON list"),
                                         ("[" * 100_000, "not JSON (nested deeper than this reader accepts)")])
def test_an_engine_key_of_a_config_that_is_no_json_object_is_refused_by_name(tmp_path, text, said):
    """The engine's model directory with a config.json that is a list raised AttributeError, and
    one nested too deeply RecursionError (no ValueError), out of the loader's first step."""
    from flashboot.errors import LayoutError
    from flashboot.integrations.engine_key import model_identity

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(LayoutError, match=re.escape(said)):
        model_identity(str(tmp_path))


@pytest.mark.parametrize("key", ["what", "reprocess", "derive", "model"])
def test_sglang_refit_request_with_an_unknown_key_is_refused_naming_it(monkeypatch, key):
    """``refit_weights`` passed the request's keys on to refit_engine_model beside its own ``what``,
    ``reprocess`` and ``derive``: such a key in the request raised a raw TypeError ("got multiple
    values for keyword argument"). Now a RefitError names the key and the keys a request takes."""
    import importlib
    import json
    import sys

    _stub_sglang(monkeypatch, None)
    sglang_loader = importlib.import_module("flashboot.integrations.sglang")
    try:
        (entry, tensor), = sglang_loader.refit_request("127.0.0.1:1", 3)
        request = {**json.loads(entry[len(sglang_loader.REFIT_REQUEST):]), key: "x"}
        with pytest.raises(RefitError) as info:
            sglang_loader.refit_weights(torch.nn.Linear(2, 2), [(sglang_loader.REFIT_REQUEST + json.dumps(request),
                                                                 tensor)])
        msg = str(info.value)
        assert f"update_weights_from_tensor (load_format={sglang_loader.REFIT_LOADER}) of Linear" in msg
        assert f"unknown key(s) [{key!r}]" in msg
        assert "accepted: ['store', 'version', 'name', 'atomic', 'timeout_s'" in msg
    finally:
        sys.modules.pop("flashboot.integrations.sglang", None)  # built over the stub


@pytest.mark.parametrize("body, said", [("[1]", "a JSON list, not an object"), ("5", "a JSON int, not an object")])
def test_sglang_refit_request_that_is_no_json_object_is_refused_as_malformed(monkeypatch, body, said):
    """A request whose JSON is a list raised a raw TypeError out of ``list.pop("store")``."""
    import importlib
    import sys

    _stub_sglang(monkeypatch, None)
    sglang_loader = importlib.import_module("flashboot.integrations.sglang")
    try:
        with pytest.raises(RefitError, match=re.escape(f"malformed refit request "
                                                       f"'{sglang_loader.REFIT_REQUEST}{body}' ({said})")):
            sglang_loader.refit_weights(torch.nn.Linear(2, 2), [(sglang_loader.REFIT_REQUEST + body, torch.empty(0))])
    finally:
        sys.modules.pop("flashboot.integrations.sglang", None)  # built over the stub


def test_an_early_call_refused_before_its_load_took_it_releases_its_arena(packed, tmp_path):
    """The image damaged (or re-packed) while the engine built its model: the load's read of the
    engine section is refused before flashboot.load takes the prepared handle, whose arena and
    copy had then stayed held by no one (neither engine's loader closes a handle it passed on)."""
    from _engine_helpers import _key as plain_key, _options
    from flashboot.errors import LayoutError
    from flashboot.integrations.engine_prepack import load_engine_weights, prepare_engine_load

    _, out, _ = packed
    prepared = prepare_engine_load(_options(out, tmp_path), plain_key(), 0, "cpu", tp_size=1, ep_size=1)
    arena = prepared.wait().arena
    meta = out / "rank-0" / "metadata.json"
    meta.write_text(meta.read_text().replace('"engine"', '"engin_"'))
    with pytest.raises(LayoutError, match="rank-0/metadata.json"):
        load_engine_weights(_options(out, tmp_path), plain_key(), 0, "cpu", tp_size=1, ep_size=1, prepared=prepared)
    assert arena.closed and "closed" in repr(prepared)


def _stub_vllm_loader(monkeypatch):
    """Just enough of vLLM to import the flashboot loader (its load_weights is engine-agnostic
    once the engine key, parallel layout and device are given)."""
    import sys
    import types

    names = ("vllm", "vllm.config", "vllm.device_allocator", "vllm.device_allocator.sleep_mode_backend",
             "vllm.model_executor", "vllm.model_executor.model_loader",
             "vllm.model_executor.model_loader.base_loader")
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)

    class BaseModelLoader:
        def __init__(self, load_config):
            self.load_config = load_config

    modules["vllm.device_allocator.sleep_mode_backend"].CuMemBackend = object
    modules["vllm.model_executor.model_loader"].get_model_loader = None
    modules["vllm.model_executor.model_loader"].register_model_loader = None
    modules["vllm.model_executor.model_loader.base_loader"].BaseModelLoader = BaseModelLoader
    modules["vllm.config"].get_current_vllm_config = lambda: None
    monkeypatch.delitem(sys.modules, "flashboot.integrations.vllm", raising=False)


def test_vllm_load_weights_with_a_holder_reloads_the_image_not_the_held_arena(packed, tmp_path, monkeypatch):
    """load_weights (vLLM's reload after a bad update) with the holder option: the load mapped the
    held arena, the very memory the model is bound to, and copied the bad bytes onto themselves."""
    import importlib
    import sys
    import types
    import warnings

    from _clone_helpers import serving_holder
    from _engine_helpers import PlainEngineLikeModel, _key as plain_key, _options
    from flashboot.flashclone.holder import Holder
    from flashboot.integrations.engine_prepack import bind_engine_model, load_engine_weights

    reference, out, _ = packed
    registry = tmp_path / "registry"
    _stub_vllm_loader(monkeypatch)
    vllm_loader = importlib.import_module("flashboot.integrations.vllm")
    try:
        with serving_holder(Holder(registry=registry)):
            options = _options(out, tmp_path, holder=str(registry))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # nothing held yet: the first load says so
                weights = load_engine_weights(options, plain_key(), 0, "cpu", tp_size=1, ep_size=1)
            try:
                assert weights.report.details["handed_over_as"]  # the holder keeps this arena now
                with torch.device("meta"):
                    model = PlainEngineLikeModel()
                bind_engine_model(model, weights)
                model._flashboot_weights = weights
                with torch.no_grad():
                    model.proj.weight.fill_(0)  # a weight update went wrong
                monkeypatch.setattr(vllm_loader, "vllm_parallel", lambda config: types.SimpleNamespace(
                    rank=0, tp_size=1, ep_size=1))
                monkeypatch.setattr(vllm_loader, "target_device", lambda config: torch.device("cpu"))
                monkeypatch.setattr(vllm_loader, "engine_key", lambda *args: plain_key())
                loader = vllm_loader.FlashBootModelLoader(types.SimpleNamespace(model_loader_extra_config={
                    "image_dir": str(out), "shm_dir": str(tmp_path / "shm"), "holder": str(registry)}))
                loader.load_weights(model, model_config=None)
                assert torch.equal(model.proj.weight, reference.proj.weight)
                lo, hi = weights.arena.ptr, weights.arena.ptr + weights.arena.nbytes
                assert lo <= model.proj.weight.data_ptr() < hi  # copied into the bound views, in place
            finally:
                weights.close()
    finally:
        sys.modules.pop("flashboot.integrations.vllm", None)  # built over the stub


def test_sglang_log_line_times_the_meta_build_alone(monkeypatch, tmp_path, caplog):
    """The load's log line said 'build on meta' for everything from the load's start to the end
    of the build: the key checks, the quantization config and the early call's wait for its copy
    to be issued (up to PREPARE_RETURN_S) were reported as SGLang's build. A clock that moves only
    where each step runs shows what the line attributes to the build."""
    import importlib
    import logging
    import sys
    import types

    clock = [100.0]
    _stub_sglang(monkeypatch, lambda model_config, load_config: None)
    sglang_loader = importlib.import_module("flashboot.integrations.sglang")
    try:
        def prepare(*args, **kwargs):
            clock[0] += 0.25  # the early call's synchronous part
            return None

        def build(*args):
            clock[0] += 0.002  # SGLang's build of the model on meta
            return torch.nn.Linear(2, 2)

        weights = types.SimpleNamespace(how="load", early_call=lambda: "no early call",
                                        report=types.SimpleNamespace(summary=lambda: "summary"))
        monkeypatch.setattr(sglang_loader, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        monkeypatch.setattr(sglang_loader, "prepare_engine_load", prepare)
        monkeypatch.setattr(sglang_loader, "_initialize_model", build)
        monkeypatch.setattr(sglang_loader, "load_engine_weights", lambda *a, **k: weights)
        for name in ("bind_engine_model", "_rebuild_engine_views", "check_no_meta_tensors", "check_quantization"):
            monkeypatch.setattr(sglang_loader, name, lambda *a, **k: None)
        monkeypatch.setattr(sglang_loader, "memory_saver_enabled", lambda: False)
        loader = sglang_loader.FlashBootModelLoader(types.SimpleNamespace(
            model_loader_extra_config={"image_dir": str(tmp_path / "img"), "memory_saver": "resident"}))
        loader.key = _key(engine="sglang")
        model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(), quantization=None, dtype=torch.float32)
        parallel = types.SimpleNamespace(tp_rank=0, tp_size=1, ep_size=1)
        with caplog.at_level(logging.INFO, logger="flashboot.integrations.sglang"):
            loader._load(model_config, torch.device("cpu"), parallel)
        assert "in 252.0 ms (build on meta 2.0 ms; no early call; summary)" in caplog.text
    finally:
        sys.modules.pop("flashboot.integrations.sglang", None)  # built over the stub


def test_vllm_load_weights_after_a_refit_serves_the_image_as_version_zero(tmp_path, store, monkeypatch):
    """vLLM's reload (load_weights) copies the image's bytes into the arena the model serves from:
    a refit's version is gone with it. The arena had kept saying it served the refit's version, so
    a retry of that version was refused as not newer while the engine served the image's weights."""
    import importlib
    import sys
    import types

    from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish

    address, _ = store
    old, new = TinyEngineModel(0), TinyEngineModel(1)
    image = _prepack(old, tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path / "shm", _key())
    _stub_vllm_loader(monkeypatch)
    vllm_loader = importlib.import_module("flashboot.integrations.vllm")
    try:
        with engine_publisher(image, 0, store=address) as pub:
            pub.publish(dict(engine_tensors_to_publish(new, "cpu")), version=1)
            refit_engine_model(model, address, 1, what="test refit", derive=model.post_load_weights, timeout_s=30)
            assert weights.handle.version == 1 and torch.equal(model.qkv.weight, new.qkv.weight)
            monkeypatch.setattr(vllm_loader, "vllm_parallel", lambda config: types.SimpleNamespace(
                rank=0, tp_size=1, ep_size=1))
            monkeypatch.setattr(vllm_loader, "target_device", lambda config: torch.device("cpu"))
            monkeypatch.setattr(vllm_loader, "engine_key", lambda *args: _key())
            loader = vllm_loader.FlashBootModelLoader(types.SimpleNamespace(model_loader_extra_config={
                "image_dir": str(image), "shm_dir": str(tmp_path / "shm")}))
            loader.load_weights(model, model_config=None)
            assert torch.equal(model.qkv.weight, old.qkv.weight)
            assert weights.handle.version == 0  # it said 1: the refit's bytes were gone
            refit_engine_model(model, address, 1, what="test refit", derive=model.post_load_weights, timeout_s=30)
            assert torch.equal(model.qkv.weight, new.qkv.weight) and weights.handle.version == 1
    finally:
        weights.close()
        sys.modules.pop("flashboot.integrations.vllm", None)  # built over the stub
