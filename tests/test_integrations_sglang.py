"""FlashBoot as an SGLang model loader (flashboot.integrations.sglang) and the engine-image
machinery both engine loaders share (flashboot.integrations.engine_prepack).

Two layers:

* Engine-agnostic tests run everywhere: they write real engine images from plain torch modules
  (``PlainEngineLikeModel`` is a plain ``torch.nn.Module``, not an engine model), load them with
  FlashLoad on the host backend (and FlashClone from an in-process seed), bind them onto a
  meta-built copy, and check keys, refusals and the job protocol.
* ``test_real_sglang_*`` run SGLang's own code in a child process (SGLang patches transformers on
  import, so it never enters this process): its ``DefaultModelLoader``, ``LoadConfig``,
  ``ModelConfig``, ``DeviceConfig``, model classes, ``get_model_loader``, plugin loader and
  command-line parser. They are skipped only where SGLang is not installed (the CPU CI venv);
  docs/engines.md says how to build the venv they run in.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from _image_helpers import rewrite_metadata
from flashboot.errors import CapabilityError, FlashBootError, LayoutError
from flashboot.integrations.engine_prepack import (
    EngineKey, LoaderOptions, RankGroup, bind_engine_model, check_engine_key, check_no_meta_tensors,
    collect_engine_tensors, load_engine_weights, memory_saver_policy, prepack_engine_model, read_engine_section,
    prepare_engine_load, read_job_engine_key,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
TOKEN = "engine-integration-test-token-0123456789"


# =============================================================================================
# A plain torch model with every kind of tensor an engine model holds
# =============================================================================================
class _Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(48.0).reshape(12, 4), persistent=False)


class PlainEngineLikeModel(torch.nn.Module):
    """Tied embedding/lm_head, a strided (transposed) weight, a persistent and a shared
    non-persistent buffer, a tensor attribute (like MLA's ``w_kc``) and a dtype the image format
    does not name (float8_e8m0fnu block scales)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 16)
        self.embed.weight.data = torch.randn(32, 16, generator=g)
        self.lm_head = torch.nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed.weight
        self.proj = torch.nn.Linear(16, 24, bias=True)
        self.proj.weight.data = torch.randn(24, 16, generator=g)
        self.proj.bias.data = torch.randn(24, generator=g)
        self.w_t = torch.nn.Parameter(torch.randn(16, 24, generator=g).t().contiguous().t(), requires_grad=False)
        self.w_t.weight_loader = "kept"  # engines hang loaders and shard dims on parameters
        self.rope = _Rotary()
        self.rope_again = self.rope  # engines share one cached rotary module between layers
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))
        self.w_kc = torch.randn(4, 8, generator=g)
        self.scale = torch.nn.Parameter(torch.randint(0, 200, (8,), generator=g, dtype=torch.uint8)
                                        .view(torch.float8_e8m0fnu), requires_grad=False)


def _key(**changes) -> EngineKey:
    base = EngineKey(engine="sglang", engine_version="0.0.test", model_id="org/plain", revision="abc123",
                     config_hash="sha256:" + "0" * 64, architecture="PlainEngineLikeModel", dtype="float32",
                     quantization=None, tp_size=1, ep_size=1, dp_size=1, pp_size=1, gpu_arch="cpu")
    return dataclasses.replace(base, **changes)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def _assert_same_tensors(ref: torch.nn.Module, got: torch.nn.Module) -> None:
    for kind in ("named_parameters", "named_buffers"):
        a, b = dict(getattr(ref, kind)()), dict(getattr(got, kind)())
        assert set(a) == set(b), kind
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
            assert torch.equal(_bytes(a[name]), _bytes(b[name])), name


@pytest.fixture
def packed(tmp_path):
    model = PlainEngineLikeModel()
    out = tmp_path / "img"
    report = prepack_engine_model(model, out, _key(), RankGroup(), device="cpu", tp_size=1, ep_size=1,
                                  source_path="/models/plain", model_type="plain", chunk_bytes=4096)
    return model, out, report


def _options(out: Path, tmp_path: Path, **kw) -> LoaderOptions:
    return LoaderOptions(image_dir=str(out), shm_dir=str(tmp_path / "shm"), **kw)


# =============================================================================================
# Engine-agnostic: image, key, load, bind
# =============================================================================================
def test_collect_finds_every_kind_of_tensor_once():
    got = collect_engine_tensors(PlainEngineLikeModel(), "cpu")
    kinds = {n: t.kind for n, t in got.tensors.items()}
    assert kinds == {"embed.weight": "param", "proj.weight": "param", "proj.bias": "param", "w_t": "param",
                     "scale": "param", "rope.cos_sin_cache": "buffer", "step": "buffer", "w_kc": "extra"}
    assert got.tensors["rope.cos_sin_cache"].persistent is False and got.tensors["step"].persistent is True
    assert got.aliases == {"lm_head.weight": {"of": "embed.weight", "kind": "param", "persistent": True},
                           "rope_again.cos_sin_cache": {"of": "rope.cos_sin_cache", "kind": "buffer",
                                                        "persistent": False}}


def test_collect_refuses_weights_on_another_device():
    with pytest.raises(LayoutError, match=r"9 parameter\(s\)/buffer\(s\) are not on cuda.*without CPU offload"):
        collect_engine_tensors(PlainEngineLikeModel(), "cuda")


def test_engine_image_is_a_valid_layouts_image_with_an_engine_section(packed):
    from flashboot.layouts import read_job, verify_image

    model, out, report = packed
    assert report.tensors == 8 and report.aliases == 2 and report.dir == out / "rank-0"
    section, meta = read_engine_section(out, 0)
    assert section.key == _key() and read_job_engine_key(out) == _key()
    assert meta.key.family == "sglang-engine" and meta.key.target == "sglang"
    assert meta.tensors["w_t"].stride == (1, 16) and meta.tensors["w_t"].shape == (16, 24)  # strides kept
    assert meta.tensors["scale"].dtype == "uint8" and section.tensors["scale"]["dtype"] == "float8_e8m0fnu"
    assert section.tensors["w_kc"]["kind"] == "extra"
    assert read_job(out).world_size == 1
    assert [r.chunks for r in verify_image(out)] == [-(-meta.image_nbytes // 4096)]
    assert not list(out.glob(".tmp-*"))


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
    assert prepared.wait().mode == "stream" and prepared.tensors  # views exist before the engine's model
    weights = load_engine_weights(_options(out, tmp_path, verify=True), _key(), 0, "cpu", tp_size=1, ep_size=1,
                                  prepared=prepared)
    try:
        assert weights.how == "load" and weights.report.mode == "streamed from disk, prepared"
        assert weights.report.metadata_ms == weights.report.bind_ms == 0 and weights.report.verify_ms > 0
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


def test_a_different_engine_key_is_refused_naming_both_keys(packed, tmp_path):
    _, out, _ = packed
    expected = _key(tp_size=1, dtype="bfloat16", gpu_arch="sm_90")
    with pytest.raises(LayoutError) as err:
        load_engine_weights(_options(out, tmp_path), expected, 0, "cpu", tp_size=1, ep_size=1)
    msg = str(err.value)
    assert _key().digest[:19] in msg and expected.digest[:19] in msg
    assert "dtype: engine 'bfloat16', image 'float32'" in msg and "gpu_arch: engine 'sm_90', image 'cpu'" in msg
    assert not (tmp_path / "shm").exists()  # refused before staging anything


def test_a_missing_image_says_how_to_make_one(tmp_path):
    with pytest.raises(LayoutError, match=r"no complete engine image here \(no prepack.json\). Pre-pack it first"):
        load_engine_weights(_options(tmp_path / "nothing", tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)


def test_an_edited_engine_key_is_caught(packed):
    _, out, _ = packed
    path = out / "rank-0" / "metadata.json"
    meta = json.loads(path.read_text())
    meta["engine"]["key"]["tp_size"] = 2
    path.write_text(json.dumps(meta))
    with pytest.raises(LayoutError, match="rank 0's metadata has sha256 .* records .* edited or damaged"):
        read_engine_section(out, 0)  # the job's digest of metadata.json catches it first
    rewrite_metadata(path.parent, meta)  # and behind it, the engine key's own digest
    with pytest.raises(LayoutError, match="engine key digest .* does not match its fields"):
        read_engine_section(out, 0)


def test_a_layouts_image_without_an_engine_section_is_refused(tmp_path):
    import numpy as np
    from safetensors.torch import save_file

    import flashboot

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.from_numpy(np.arange(64, dtype=np.float32))}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "tiny_bag"}))
    flashboot.prepack(ckpt, tmp_path / "img", progress=False)
    with pytest.raises(LayoutError, match="no engine section: this is not an engine image"):
        read_engine_section(tmp_path / "img", 0)
    with pytest.raises(LayoutError, match="not an engine image"):
        read_job_engine_key(tmp_path / "img")


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
                                              r"router.config\['correction_bias'\], router.held\[0\]"):
            check_no_meta_tensors(stale, "plain")
    finally:
        weights.close()


def _run_two_ranks(out: Path, models) -> tuple[dict, dict]:
    """prepack_engine_model on two threads (ranks 0 and 1 of tp=2); (reports, errors) by rank."""
    box, barrier, errors, reports = {}, threading.Barrier(2, timeout=30), {}, {}

    def broadcast(value, r):  # rank 0's value to both, like the engines' broadcast_object(src=0)
        if r == 0:
            box["v"] = value
        barrier.wait()
        got = box["v"]
        barrier.wait()  # nobody overwrites the box before both have read it
        return got

    def rank(r):
        try:
            group = RankGroup(r, 2, broadcast=lambda v: broadcast(v, r), barrier=barrier.wait)
            reports[r] = prepack_engine_model(models[r], out, _key(tp_size=2), group, device="cpu", tp_size=2,
                                              ep_size=1, source_path="/m", model_type="p")
        except BaseException as exc:  # returned to the test
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return reports, errors


def test_two_ranks_write_one_job_and_rank_zero_commits_it(tmp_path):
    out = tmp_path / "img"
    reports, errors = _run_two_ranks(out, [PlainEngineLikeModel(seed=0), PlainEngineLikeModel(seed=1)])
    assert not errors, errors
    from flashboot.layouts import read_image_metadata, read_job

    job = read_job(out)
    assert job.world_size == 2 and job.tp_size == 2 and sorted(job.ranks) == [0, 1]
    for r in range(2):
        meta = read_image_metadata(out, r, tp=2)
        assert meta.job_id == job.job_id and meta.parallel.tp_rank == r
        section, _ = read_engine_section(out, r)
        assert section.rank == r and section.key == _key(tp_size=2)
    with pytest.raises(LayoutError, match="tp=2, ep=1 make 2 ranks but the job's group has 1"):
        prepack_engine_model(PlainEngineLikeModel(), out, _key(tp_size=2), RankGroup(), device="cpu", tp_size=2,
                             ep_size=1, source_path="/m", model_type="p")


def test_a_rank_that_fails_stops_the_job_without_leaving_anyone_waiting(tmp_path):
    out = tmp_path / "img"
    with torch.device("meta"):
        broken = PlainEngineLikeModel()  # its weights are not on the job's device
    reports, errors = _run_two_ranks(out, [PlainEngineLikeModel(), broken])
    assert not reports
    assert isinstance(errors[1], LayoutError) and "are not on cpu" in str(errors[1])
    assert isinstance(errors[0], LayoutError) and "ranks [1] of 2 did not write their image" in str(errors[0])
    assert not (out / "prepack.json").exists()


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


def test_memory_saver_policy_hands_the_weights_to_flashboot_or_says_why_not():
    image = LoaderOptions(image_dir="/img")
    assert image.memory_saver == "sleep"
    assert memory_saver_policy(True, "--enable-memory-saver", image) is True
    assert memory_saver_policy(False, "--enable-memory-saver", image) is True
    for options, why in ((LoaderOptions(seed_store="h:1"), "the weights are cloned from a seed .seed_store.: there is no image"),
                         (LoaderOptions(image_dir="/img", publish_store="h:1"), "the arena is published as a FlashClone seed")):
        with pytest.raises(CapabilityError, match=f"--enable-memory-saver is on, but FlashBoot cannot put these "
                                                  f"weights to sleep: {why}.*\"resident\""):
            memory_saver_policy(True, "--enable-memory-saver", options)
        assert memory_saver_policy(False, "--enable-memory-saver", options) is False
    assert memory_saver_policy(True, "--enable-sleep-mode", LoaderOptions(image_dir="/img", memory_saver="resident")) \
        is False
    with pytest.raises(CapabilityError, match="--enable-sleep-mode is on and the flashboot option memory_saver is "
                                              "'refuse'"):
        memory_saver_policy(True, "--enable-sleep-mode", LoaderOptions(image_dir="/img", memory_saver="refuse"))
    assert memory_saver_policy(False, "--enable-sleep-mode", LoaderOptions(image_dir="/img", memory_saver="refuse")) \
        is False
    with pytest.raises(FlashBootError, match="memory_saver='offload'; known: sleep, resident, refuse"):
        LoaderOptions(image_dir="/img", memory_saver="offload")


def test_weights_handed_to_the_engine_sleep_wake_bitwise_at_the_same_addresses(packed, tmp_path):
    """What the engines' hooks call (SGLang's adapters, vLLM's sleep-mode backend): every arena
    handed over in the process sleeps at the level asked and wakes from the backup (level 1) or
    the disk (level 2), the bound model unchanged; asleep weights refuse an in-place reload."""
    from flashboot.integrations.engine_sleep import (
        check_awake, sleep_engine_weights, stay, staying_weights, wake_engine_weights,
    )

    model, out, _ = packed
    weights = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            target = PlainEngineLikeModel()
        bind_engine_model(target, weights)
        target._flashboot_weights = weights  # as both loaders keep it
        stay(weights, shm_dir=str(tmp_path / "shm"))
        assert staying_weights() == [weights]
        ptrs = {n: t.data_ptr() for n, t in list(target.named_parameters()) + list(target.named_buffers())}
        x = torch.tensor([1, 5, 7])
        before = target.proj(target.embed(x))
        for level, source in ((1, "backup"), (2, "disk")):
            [slept] = sleep_engine_weights(level)
            assert slept.level == level and weights.arena.asleep
            assert [r.level for r in sleep_engine_weights(level)] == [0]  # asleep already: a no-op
            with pytest.raises(FlashBootError, match=r"load_weights: the model's [\d,]+-byte weight arena is asleep"):
                check_awake(target, "load_weights")
            [woke] = wake_engine_weights()
            assert woke.source == source and not weights.arena.asleep
            assert [r.source for r in wake_engine_weights()] == ["awake"]
            _assert_same_tensors(model, target)
            assert torch.equal(target.proj(target.embed(x)), before)
            assert {n: t.data_ptr() for n, t in list(target.named_parameters()) + list(target.named_buffers())} == ptrs
        check_awake(target, "load_weights")
        with pytest.raises(FlashBootError, match="sleep level must be 1 .* or 2 .*, got 3"):
            sleep_engine_weights(3)
    finally:
        weights.close()
    assert staying_weights() == []  # closed weights are not put to sleep any more
    assert sleep_engine_weights(2) == [] and wake_engine_weights() == []


def test_check_engine_key_accepts_the_same_key():
    check_engine_key(_key(), _key(), "x")
    with pytest.raises(LayoutError, match="ep_size: engine 2, image 1"):
        check_engine_key(_key(), _key(ep_size=2), "x")


# =============================================================================================
# Plugin entry point
# =============================================================================================
def test_sglang_entry_point_resolves_to_the_plugin():
    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "flashboot"]
    assert [e.value for e in eps] == ["flashboot.integrations:sglang_plugin"]
    from flashboot.integrations import sglang_plugin

    assert eps[0].load() is sglang_plugin


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed: the plugin runs in test_real_sglang_*")
def test_sglang_plugin_without_sglang_says_so():
    from flashboot.integrations import sglang_plugin

    with pytest.raises(CapabilityError, match="the flashboot sglang plugin needs sglang importable"):
        sglang_plugin()


# =============================================================================================
# Real SGLang, in a child process
# =============================================================================================
SGLANG_SCRIPT = r'''
import json, os, sys, tempfile, warnings
warnings.simplefilter("ignore")
import torch
model_path, image_dir, shm = sys.argv[1], sys.argv[2], sys.argv[3]
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.cuda.set_device(0)
out = {"device": device}
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", sys.argv[4])
import sglang
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context, get_context
from sglang.srt.server_args import ServerArgs, prepare_server_args
out["sglang_version"] = sglang.__version__
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
reset_context()
publish(ServerArgs(model_path=model_path, device=device, tp_size=1, dtype="float32"), role="test",
        ranks=SpawnRanks(world_rank=0))
get_parallel().override_permanently(world_group=parallel_state._WORLD)
initialize_model_parallel(backend="gloo")
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

# SGLang's own plugin loader finds our entry point and runs it
from sglang.srt.plugins import load_plugins
load_plugins()
try:
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
except ImportError:
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES
out["choices_have_flashboot"] = "flashboot" in LOAD_FORMAT_CHOICES
cli = prepare_server_args(["--model-path", model_path, "--load-format", "flashboot", "--device", device,
                           "--model-loader-extra-config", json.dumps({"image_dir": image_dir})])
from flashboot.integrations.sglang import FlashBootModelLoader
out["cli_load_format"] = str(cli.load_format)
out["cli_loader_class"] = LoadConfig(load_format=cli.load_format,
                                     model_loader_extra_config=cli.model_loader_extra_config).load_format is FlashBootModelLoader

mc = ModelConfig(model_path, dtype="float32")
dc = DeviceConfig(device, 0)
ref_loader = get_model_loader(LoadConfig(load_format="auto"), mc)
out["reference_loader"] = type(ref_loader).__name__
ref = ref_loader.load_model(model_config=mc, device_config=dc)

def same(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    return (sorted(pa) == sorted(pb) and sorted(ba) == sorted(bb)
            and all(torch.equal(pa[k], pb[k]) for k in pa) and all(torch.equal(ba[k], bb[k]) for k in ba))

# 1. pre-pack through the plugin's load-format name: SGLang's own loader, then the dump
pre = get_model_loader(LoadConfig(load_format="flashboot", model_loader_extra_config=json.dumps(
    {"image_dir": image_dir, "mode": "prepack", "shm_dir": shm})), mc)
out["prepack_loader"] = type(pre).__name__
m_pre = pre.load_model(model_config=mc, device_config=dc)
out["prepack_tensors"] = pre.prepack_report.tensors
out["prepack_aliases"] = pre.prepack_report.aliases
out["prepack_same_as_reference"] = same(ref, m_pre)
out["param_names"] = sorted(n for n, _ in ref.named_parameters())
out["buffer_names"] = sorted(n for n, _ in ref.named_buffers())

# 2. load through the class passed as load_format (Engine(load_format=FlashBootModelLoader))
ld = get_model_loader(LoadConfig(load_format=FlashBootModelLoader, model_loader_extra_config=json.dumps(
    {"image_dir": image_dir, "shm_dir": shm, "verify": True})), mc)
m = ld.load_model(model_config=mc, device_config=dc)
out["load_same_as_reference"] = same(ref, m)
lo, hi = ld.weights.arena.ptr, ld.weights.arena.ptr + ld.weights.arena.nbytes
out["all_in_one_arena"] = all(lo <= t.data_ptr() < hi for t in list(m.parameters()) + list(m.buffers()))
out["no_meta"] = not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
w = m.model.layers[0].self_attn.qkv_proj.weight
out["weight_loader_kept"] = getattr(w, "weight_loader", None) is not None
out["model_class"] = type(m).__name__
out["key"] = ld.key.to_dict()
out["report"] = ld.weights.report.summary()
out["how"] = ld.weights.how

# 3. another dtype is another key: refused naming both
def error_of(extra, config):
    try:
        get_model_loader(LoadConfig(load_format="flashboot", model_loader_extra_config=json.dumps(extra)),
                         config).load_model(model_config=config, device_config=dc)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None
mc16 = ModelConfig(model_path, dtype="bfloat16")
out["mismatch"] = error_of({"image_dir": image_dir, "shm_dir": shm}, mc16)
out["auto_mismatch"] = error_of({"image_dir": image_dir, "shm_dir": shm, "mode": "auto"}, mc16)
out["mismatch_engine_key"] = ld.key.__class__.__name__

# 4. memory saver on: what FlashBoot cannot put to sleep is refused, naming the flag
override = get_context().override_server_args(enable_memory_saver=True)
override.install()
try:
    out["memory_saver_refuse"] = error_of({"image_dir": image_dir, "shm_dir": shm, "memory_saver": "refuse"}, mc)
    out["memory_saver_published"] = error_of({"image_dir": image_dir, "shm_dir": shm,
                                              "publish_store": "127.0.0.1:9"}, mc)
finally:
    override.restore()

# 5. SGLang's own release/resume of the weights tag: its scheduler's weight updater and memory-saver
# adapter (the no-op one: torch_memory_saver needs CUDA's LD_PRELOAD), FlashBoot's sleep beneath.
# The level is SGLang's: 1 with --enable-weights-cpu-backup, else 2.
from types import SimpleNamespace
from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
updater = SchedulerWeightUpdaterManager(
    tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=m)), draft_worker=None,
    memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False), flush_cache=lambda: True,
    is_fully_idle=lambda **kw: True)
hidden = torch.randn(3, mc.hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
outputs = lambda: module_outputs(m, ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "model.norm"),
                                 lambda name: torch.tensor([1, 5, 7]) if "embed" in name else hidden.clone())
if device == "cpu":
    # torch here is a CUDA build on a machine without a driver: release_memory_occupation's closing
    # torch.get_device_module().synchronize() would pick torch.cuda; the device is the CPU
    _device_module = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else _device_module(device)
release = lambda: updater.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=["weights"]))
resume = lambda: updater.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["weights"]))
override = get_context().override_server_args(enable_weights_cpu_backup=True)
override.install()
try:
    out["sleep_level1"] = sleep_cycle(m, ld.weights.arena, release, resume, outputs)
finally:
    override.restore()
out["sleep_level2"] = sleep_cycle(m, ld.weights.arena, release, resume, outputs)
print("RESULT " + json.dumps(out))
'''


# What both engines' single-process scripts use to check a sleep and wake through the engine's own
# entry points, prepended to them: the arena's pages, module outputs, addresses, the reports logged.
SLEEP_CHECKS = r'''
import logging, os
import torch

class _Logged(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

_logged = _Logged()
logging.getLogger("flashboot.integrations").addHandler(_logged)
logging.getLogger("flashboot.integrations").setLevel(logging.INFO)

def arena_pages(arena):
    # this process's fds and mappings of the arena's segments (host backend: a memfd each)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += arena.arena_id in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return {"fds": fds, "maps": sum(arena.arena_id in line for line in open("/proc/self/maps"))}

def module_outputs(model, names, inputs):
    got = {}
    with torch.no_grad():
        for name in names:
            module = model
            for part in name.split("."):
                module = getattr(module, part)
            y = module(inputs(name))
            got[name] = (y[0] if isinstance(y, tuple) else y).clone()
    return got

def sleep_cycle(model, arena, release, resume, outputs):
    # the engine's own release and resume; what FlashBoot's sleep and wake did beneath them
    def pointers():
        return {n: t.data_ptr() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    ptrs, before, pages_awake = pointers(), outputs(), arena_pages(arena)
    _logged.lines.clear()
    release()
    got = {"asleep": arena.asleep, "pages_awake": pages_awake, "pages_asleep": arena_pages(arena)}
    resume()
    after = outputs()
    got.update(awake=not arena.asleep, pages_woken=arena_pages(arena), same_addresses=pointers() == ptrs,
               compared=sorted(before), bitwise_equal=sorted(n for n in before if torch.equal(before[n], after[n])),
               logged=list(_logged.lines))
    return got
'''


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    """A tiny checkpoint of ``kind`` written by transformers from a config (random weights from ``seed``):
    ``llama``, ``qwen3_moe`` (FusedMoE: 8 experts, top-2) or ``deepseek_v3`` (MLA attention,
    one dense layer then an MoE layer with a shared expert)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **common)
        arch = "LlamaForCausalLM"
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, **common)
        arch = "Qwen3MoeForCausalLM"
    elif kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}, **common)
        # fields of DeepSeek-V3's own config.json that the engines read and transformers does not write
        cfg.moe_layer_freq, cfg.topk_method, cfg.scoring_func = 1, "noaux_tc", "sigmoid"
        arch = "DeepseekV3ForCausalLM"
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    getattr(transformers, arch)(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _shm_dir(tmp_path: Path) -> Path:
    # On CUDA the staged image is pinned for the H2D, and the driver refuses a shared mapping of a
    # file on disk: stage in /dev/shm (tmpfs) where there is one, as `flashboot preload` does.
    if os.path.isdir("/dev/shm"):
        return Path(tempfile.mkdtemp(prefix="flashboot-test-", dir="/dev/shm"))
    return Path(tempfile.mkdtemp(prefix="shm-", dir=tmp_path))


def _result_of(proc: subprocess.CompletedProcess, what: str) -> dict:
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, \
        f"{what}: rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def run_engine_script(script: str, tmp_path: Path, env: dict | None = None) -> dict:
    """Run ``script`` with this interpreter in a child process on a tiny Llama; its ``RESULT {json}``
    line, plus ``image_dir`` (the image it wrote, kept for other tests)."""
    from flashboot.flashclone.rendezvous import free_port

    model = make_tiny_model("llama", tmp_path / "tiny-llama")
    path = tmp_path / "engine_script.py"
    path.write_text(script)
    shm = _shm_dir(tmp_path)
    try:
        proc = subprocess.run([sys.executable, str(path), str(model), str(tmp_path / "image"), str(shm),
                               str(free_port())], capture_output=True, text=True, timeout=280,
                              env={**os.environ, **(env or {})}, cwd=tmp_path)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {**_result_of(proc, "engine script"), "image_dir": str(tmp_path / "image")}


def run_engine_ranks(script: str, tmp_path: Path, kind: str, world: int, *, refuse=(), forward=()) -> list[dict]:
    """Run ``ENGINE_CHECKS + script`` as ``world`` processes (the ranks of one engine job, gloo) on
    a tiny ``kind`` model; each rank's ``RESULT`` in rank order. ``refuse``: (label, image_dir)
    pairs each rank must refuse to load; ``forward``: module names whose forward is compared."""
    from flashboot.flashclone.rendezvous import free_port

    model = make_tiny_model(kind, tmp_path / f"tiny-{kind}")
    path = tmp_path / "engine_ranks.py"
    path.write_text(ENGINE_CHECKS + script)
    shm, port = _shm_dir(tmp_path), free_port()
    args = [str(model), str(tmp_path / "image"), str(shm), str(port), str(world), json.dumps(list(refuse)),
            json.dumps(list(forward))]
    procs = [subprocess.Popen([sys.executable, str(path), *args, str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path) for rank in range(world)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        shutil.rmtree(shm, ignore_errors=True)
    return [{**_result_of(subprocess.CompletedProcess(p.args, p.returncode, o, e), f"rank {r} of {world}"),
             "image_dir": str(tmp_path / "image")} for r, (p, (o, e)) in enumerate(zip(procs, outs))]


# What both engines' rank scripts check, prepended to them: every parameter, buffer and tensor
# attribute of our load against the engine's default loader, the arena, module forwards, refusals.
ENGINE_CHECKS = r"""
import hashlib, json, os, shutil, sys, warnings
warnings.simplefilter("ignore")
import torch
model_path, image_dir, shm, port, world, refuse, forward, rank = sys.argv[1:9]
world, rank, refuse, forward = int(world), int(rank), json.loads(refuse), json.loads(forward)
out = {"rank": rank, "world": world}

def _attr(model, name):
    for part in name.split("."):
        model = getattr(model, part)
    return model

def compare_with_default(ref, m, arena):
    from flashboot.integrations.engine_prepack import read_engine_section
    section, _ = read_engine_section(image_dir, rank)
    pa, pb = dict(ref.named_parameters()), dict(m.named_parameters())
    ba, bb = dict(ref.named_buffers()), dict(m.named_buffers())
    extras = sorted(n for n, info in section.tensors.items() if info["kind"] == "extra")
    out["param_names"], out["buffer_names"], out["extras"] = sorted(pa), sorted(ba), extras
    out["names_same"] = sorted(pa) == sorted(pb) and sorted(ba) == sorted(bb)
    ours = {**pb, **bb, **{n: _attr(m, n) for n in extras}}
    theirs = {**pa, **ba, **{n: _attr(ref, n) for n in extras}}
    out["compared"] = len(ours)
    out["unequal"] = sorted(n for n in theirs if n not in ours or not torch.equal(theirs[n], ours[n]))
    lo, hi = arena.ptr, arena.ptr + arena.nbytes
    out["outside_arena"] = sorted(n for n, t in ours.items() if t.numel() and not lo <= t.data_ptr() < hi)
    out["kinds"] = {n: info["kind"] for n, info in section.tensors.items()}
    out["shapes"] = {n: list(t.shape) for n, t in ours.items()}
    # what this rank holds, to tell the ranks' images apart
    out["digest"] = hashlib.sha256(b"".join(ours[n].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                           for n in sorted(ours) if ours[n].numel())).hexdigest()

def compare_forwards(ref, m, inputs):
    # The engine modules' own forward on this CPU, ours against the default loader's, same input.
    got = {}
    for name in forward:
        with torch.no_grad():
            a, b = _attr(ref, name)(inputs(name)), _attr(m, name)(inputs(name))
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        got[name] = {"equal": bool(torch.equal(a, b)), "abs_sum": float(a.abs().sum()), "shape": list(a.shape),
                     "head": a.flatten()[:8].tolist()}
    out["forward"] = got

def older_engine_copy(version):
    # The same image as an older engine version would have written it: its key says so (digest
    # recomputed, so it is a valid key, not an edited one).
    from flashboot.integrations.engine_prepack import EngineKey
    dst = image_dir + "-older"
    if rank == 0:
        shutil.copytree(image_dir, dst)
        for path in [os.path.join(dst, "prepack.json")] + [os.path.join(dst, f"rank-{r}", "metadata.json")
                                                           for r in range(world)]:
            raw = json.load(open(path))
            key = EngineKey.from_dict(raw["engine"]["key"], path)
            key = EngineKey(**{**{k: getattr(key, k) for k in EngineKey.FIELDS}, "engine_version": version})
            raw["engine"]["key"] = key.to_dict()
            json.dump(raw, open(path, "w"))
    if world > 1:
        torch.distributed.barrier()  # every rank sees the copy
    return dst

def refusals(load):
    # Each case must be refused before anything is staged or allocated: nothing lands in its shm.
    got = {}
    for label, path in refuse:
        where = os.path.join(shm, "refuse-" + label)
        try:
            load(path, where)
            got[label] = None
        except Exception as exc:
            got[label] = {"type": type(exc).__name__, "msg": str(exc),
                          "staged": sorted(os.listdir(where)) if os.path.isdir(where) else []}
    out["refused"] = got
"""


# One rank of an SGLang job (after ENGINE_CHECKS): the default loader, our pre-pack through SGLang's
# own loader, our load, then the comparisons and refusals.
SGLANG_RANK_SCRIPT = r"""
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
from sglang.srt.server_args import ServerArgs
import sglang
out["engine_version"] = sglang.__version__
# SGLang gives every group of more than one rank a PyNccl communicator unless its platform says
# otherwise; this process has no CUDA, so the groups run on gloo alone.
_group = parallel_state.init_model_parallel_group
def _gloo_group(*args, **kwargs):
    kwargs["use_pynccl"] = False
    return _group(*args, **kwargs)
parallel_state.init_model_parallel_group = _gloo_group
init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                             distributed_init_method=f"tcp://127.0.0.1:{port}")
reset_context()
publish(ServerArgs(model_path=model_path, device="cpu", tp_size=world, dtype="float32"), role="test",
        ranks=SpawnRanks(world_rank=rank))
get_parallel().override_permanently(world_group=parallel_state._WORLD)
initialize_model_parallel(backend="gloo")
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import get_model_loader
from flashboot.integrations.sglang import FlashBootModelLoader

mc, dc = ModelConfig(model_path, dtype="float32"), DeviceConfig("cpu", 0)
def flashboot_loader(**extra):
    return get_model_loader(LoadConfig(load_format=FlashBootModelLoader, model_loader_extra_config=json.dumps(extra)), mc)
ref_loader = get_model_loader(LoadConfig(load_format="auto"), mc)
out["reference_loader"] = type(ref_loader).__name__
ref = ref_loader.load_model(model_config=mc, device_config=dc)
pre = flashboot_loader(image_dir=image_dir, mode="prepack", shm_dir=shm)
pre.load_model(model_config=mc, device_config=dc)
out["prepack_tensors"] = pre.prepack_report.tensors
ld = flashboot_loader(image_dir=image_dir, shm_dir=shm, verify=True)
m = ld.load_model(model_config=mc, device_config=dc)
out["key"] = ld.key.to_dict()
out["model_class"] = type(m).__name__
compare_with_default(ref, m, ld.weights.arena)
hidden = torch.randn(3, mc.hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
compare_forwards(ref, m, lambda name: torch.tensor([1, 5, 7]) if "embed" in name else hidden.clone())
if world == 1:
    refuse.append(["older_engine", older_engine_copy("0.5.22")])
refusals(lambda path, where: flashboot_loader(image_dir=path, shm_dir=where).load_model(model_config=mc, device_config=dc))
print("RESULT " + json.dumps(out))
"""

SGLANG_FORWARD = ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "model.norm")


def _sglang_job(tmp_path_factory, kind: str, world: int = 1, **kw) -> list[dict]:
    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed here (see docs/engines.md for the engine test venv)")
    return run_engine_ranks(SGLANG_RANK_SCRIPT, tmp_path_factory.mktemp(f"sglang-{kind}-tp{world}"), kind, world,
                            forward=SGLANG_FORWARD, **kw)


@pytest.fixture(scope="module")
def sglang_moe(tmp_path_factory):
    return _sglang_job(tmp_path_factory, "qwen3_moe")[0]


@pytest.fixture(scope="module")
def sglang_moe_tp2(tmp_path_factory, sglang_moe):
    return _sglang_job(tmp_path_factory, "qwen3_moe", 2, refuse=[("tp1_image", sglang_moe["image_dir"])])


@pytest.fixture(scope="module")
def sglang_mla(tmp_path_factory):
    return _sglang_job(tmp_path_factory, "deepseek_v3")[0]


@pytest.fixture(scope="session")
def sglang_run(tmp_path_factory):
    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed here (see docs/engines.md for the engine test venv)")
    return run_engine_script(SLEEP_CHECKS + SGLANG_SCRIPT, tmp_path_factory.mktemp("sglang"))


def test_real_sglang_plugin_makes_load_format_flashboot_valid(sglang_run):
    r = sglang_run
    assert r["choices_have_flashboot"] and r["cli_load_format"] == "flashboot" and r["cli_loader_class"]
    assert r["prepack_loader"] == "FlashBootModelLoader"


def test_real_sglang_prepack_runs_its_own_loader_and_dumps_every_tensor(sglang_run):
    r = sglang_run
    assert r["reference_loader"] == "DefaultModelLoader" and r["prepack_same_as_reference"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in r["param_names"]  # SGLang's fused names
    # named_buffers() lists the rotary cache both layers share once; the image writes it once and
    # keeps the second layer's name as an alias
    assert r["prepack_tensors"] == len(r["param_names"]) + len(r["buffer_names"]) and r["prepack_aliases"] == 1


def test_real_sglang_load_binds_the_engine_model_to_one_arena(sglang_run):
    r = sglang_run
    assert r["model_class"] == "LlamaForCausalLM" and r["how"] == "load"
    assert r["load_same_as_reference"] and r["all_in_one_arena"] and r["no_meta"] and r["weight_loader_kept"]
    key = r["key"]
    assert key["engine"] == "sglang" and key["engine_version"] == r["sglang_version"]
    assert key["dtype"] == "float32" and key["tp_size"] == 1 and key["architecture"] == "LlamaForCausalLM"
    assert key["gpu_arch"] == ("cpu" if r["device"] == "cpu" else key["gpu_arch"])


def test_real_sglang_refuses_an_image_of_another_key(sglang_run):
    r = sglang_run
    for case in ("mismatch", "auto_mismatch"):
        kind, msg = r[case]
        assert kind == "LayoutError", msg
        assert "dtype: engine 'bfloat16', image 'float32'" in msg and r["key"]["digest"][:19] in msg


def test_real_sglang_memory_saver_refuses_what_flashboot_cannot_put_to_sleep(sglang_run):
    kind, msg = sglang_run["memory_saver_refuse"]
    assert kind == "CapabilityError" and "--enable-memory-saver is on and the flashboot option memory_saver" in msg
    kind, msg = sglang_run["memory_saver_published"]
    assert kind == "CapabilityError" and "published as a FlashClone seed (publish_store)" in msg


def assert_slept_and_woke(cycle: dict, level: int, source: str) -> None:
    """One sleep_cycle (SLEEP_CHECKS) through an engine's own entry points: the arena released
    (asleep, no fd or mapping of its segments left), woken at the same addresses from ``source``,
    and the engine modules' outputs bitwise equal to before."""
    assert cycle["asleep"] and cycle["pages_asleep"] == {"fds": 0, "maps": 0}, cycle
    assert cycle["pages_awake"]["fds"] > 0 and cycle["pages_woken"] == cycle["pages_awake"], cycle
    assert cycle["awake"] and cycle["same_addresses"]
    assert cycle["compared"] and cycle["bitwise_equal"] == cycle["compared"]
    assert any(line.startswith(f"flashboot: sleep level {level} of ") for line in cycle["logged"]), cycle["logged"]
    assert any(f" from {source}: " in line for line in cycle["logged"]), cycle["logged"]


def test_real_sglang_release_and_resume_of_the_weights_put_the_arena_to_sleep_and_wake_it(sglang_run):
    # --enable-weights-cpu-backup: level 1, back from the pinned backup
    assert_slept_and_woke(sglang_run["sleep_level1"], 1, "backup")
    # without it: level 2, back from the disk (no preloader runs here), no weight update needed
    cycle = sglang_run["sleep_level2"]
    assert_slept_and_woke(cycle, 2, "disk")
    assert any("not backup: sleep(level=2) kept no backup" in line for line in cycle["logged"]), cycle["logged"]


# =============================================================================================
# Real SGLang: MoE, tensor parallelism, MLA, forwards, refusals (one process per rank, gloo)
# =============================================================================================
def assert_same_as_default_loader(r: dict) -> None:
    """Our load equals the engine's default loader: every parameter, buffer and tensor attribute,
    all of them views into the one arena."""
    assert r["names_same"] and r["unequal"] == [], r["unequal"]
    assert r["compared"] == len(r["param_names"]) + len(r["buffer_names"]) + len(r["extras"])
    assert r["outside_arena"] == []
    assert all(f["equal"] and f["abs_sum"] > 0 for f in r["forward"].values()), r["forward"]


def assert_refused_before_staging(refusal: dict, *needles: str) -> None:
    assert refusal is not None, "loaded an image it should have refused"
    assert refusal["type"] == "LayoutError", refusal
    assert all(n in refusal["msg"] for n in needles), refusal["msg"]
    assert refusal["staged"] == [], refusal  # refused before anything was staged or allocated


def test_real_sglang_qwen3_moe_serves_its_fused_experts_from_the_image(sglang_moe):
    r = sglang_moe
    assert r["reference_loader"] == "DefaultModelLoader" and r["model_class"] == "Qwen3MoeForCausalLM"
    assert_same_as_default_loader(r)
    for layer in (0, 1):  # FusedMoE after SGLang's post-processing: experts stacked, gate and up fused
        w13, w2 = f"model.layers.{layer}.mlp.experts.w13_weight", f"model.layers.{layer}.mlp.experts.w2_weight"
        assert r["kinds"][w13] == r["kinds"][w2] == "param"
        assert r["shapes"][w13] == [8, 2 * 32, 64] and r["shapes"][w2] == [8, 64, 32]


def test_real_sglang_refuses_an_image_of_an_older_sglang(sglang_moe):
    r = sglang_moe
    assert_refused_before_staging(r["refused"]["older_engine"],
                                  f"engine_version: engine '{r['engine_version']}', image '0.5.22'",
                                  f"sglang {r['engine_version']}", "sglang 0.5.22")


@pytest.mark.timeout(900)  # its fixtures run up to three engine jobs in a row
def test_real_sglang_tp2_each_rank_loads_its_own_rank_image(sglang_moe_tp2, sglang_moe):
    ranks = sglang_moe_tp2
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["key"]["tp_size"] == 2 for r in ranks)
    for r in ranks:
        assert_same_as_default_loader(r)
        # each rank holds its half of every expert's intermediate dimension
        assert r["shapes"]["model.layers.0.mlp.experts.w13_weight"] == [8, 32, 64]
        assert r["shapes"]["model.layers.0.mlp.experts.w2_weight"] == [8, 64, 16]
    assert ranks[0]["digest"] != ranks[1]["digest"]  # two rank images, not one twice
    # each rank's MoE block gives its partial sum (SGLang all-reduces after the block): together
    # they are the TP=1 model's result
    for name in ("model.layers.0.mlp", "model.layers.1.mlp"):
        tp1, parts = sglang_moe["forward"][name], [r["forward"][name] for r in ranks]
        assert parts[0]["shape"] == tp1["shape"]
        summed = torch.tensor(parts[0]["head"]) + torch.tensor(parts[1]["head"])
        assert torch.allclose(summed, torch.tensor(tp1["head"]), rtol=1e-4, atol=1e-6), (summed, tp1["head"])
        assert not torch.allclose(torch.tensor(parts[0]["head"]), torch.tensor(tp1["head"]), rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(900)  # its fixtures run up to three engine jobs in a row
def test_real_sglang_tp2_refuses_a_tp1_image_on_every_rank(sglang_moe_tp2):
    for r in sglang_moe_tp2:
        assert_refused_before_staging(r["refused"]["tp1_image"], "tp_size: engine 2, image 1")


def test_real_sglang_deepseek_v3_mla_tensor_attributes_come_from_the_image(sglang_mla):
    r = sglang_mla
    assert r["model_class"] == "DeepseekV3ForCausalLM"
    assert_same_as_default_loader(r)
    # SGLang's MLA post-processing splits kv_b_proj into w_kc / w_vc: tensor attributes, not
    # parameters, written as extras and bound from the arena
    for layer in (0, 1):
        for name in ("w_kc", "w_vc"):
            assert r["kinds"][f"model.layers.{layer}.self_attn.{name}"] == "extra"
    assert r["shapes"]["model.layers.0.self_attn.w_kc"] == [4, 16, 32]  # heads, qk_nope_head_dim, kv_lora_rank
    assert r["shapes"]["model.layers.0.self_attn.w_vc"] == [4, 32, 16]  # heads, kv_lora_rank, v_head_dim
    assert r["shapes"]["model.layers.1.mlp.experts.w13_weight"] == [8, 64, 64]
