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
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from flashboot.errors import CapabilityError, WaitTimeoutError
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
        self.w_kc = torch.empty(4, 8)
        self.post_load_weights()
        self.kv_cache = torch.empty(0)

    def _apply(self, fn, recurse=True):  # .to(device) moves the tensor attributes too, as an engine's would be
        super()._apply(fn, recurse)
        self.w_kc, self.kv_cache = fn(self.w_kc), fn(self.kv_cache)
        return self

    def post_load_weights(self):  # as SGLang's MLA models derive w_kc: written into the bound tensor in place
        self.w_kc.copy_(self.qkv.weight[:4, :8] * 2)

    def forward(self, ids):
        return self.lm_head(self.qkv(self.embed(ids))[:, :16])


def _key(**changes) -> EngineKey:
    import dataclasses

    base = EngineKey(engine="vllm", engine_version="0.0.test", model_id="org/tiny", revision="abc123",
                     config_hash="sha256:" + "1" * 64, architecture="TinyEngineModel", dtype="float32",
                     quantization=None, tp_size=1, ep_size=1, dp_size=1, pp_size=1, gpu_arch="cpu")
    return dataclasses.replace(base, **changes)


def _prepack(model, out, key, device="cpu"):
    prepack_engine_model(model, out, key, RankGroup(), device=device, tp_size=1, ep_size=1,
                         source_path="/models/tiny", model_type="tiny", chunk_bytes=4096)
    return out


def _serve(out, shm, key, device="cpu"):
    """An engine's model as the loaders leave it: built on meta, bound to the arena's views."""
    weights = load_engine_weights(LoaderOptions(image_dir=str(out), shm_dir=str(shm)), key, 0, device,
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_engine_refit_gives_a_fresh_load_of_the_new_weights_bitwise(tmp_path, store, device):
    from _engine_helpers import _shm_dir

    address, _ = store
    shm = _shm_dir(tmp_path)  # /dev/shm where there is one: the driver pins only shared memory there
    old, new = TinyEngineModel(0).to(device), TinyEngineModel(1).to(device)
    image = _prepack(old, tmp_path / "img", _key(), device)
    model, weights = _serve(image, shm, _key(), device)
    ptrs = {n: t.data_ptr() for n, t in _tensors(model).items()}
    reprocessed = []
    try:
        with engine_publisher(image, 0, store=address, device=device) as pub:
            trainer = dict(engine_tensors_to_publish(new, device))
            assert "lm_head.weight" not in trainer and "rope_again.cos_sin_cache" not in trainer  # aliases, once
            assert "w_kc" not in trainer  # a tensor attribute: the engine derives it
            pub.publish(trainer, version=1)
            assert pub.name == refit_name("refit", 0)
            report = refit_engine_model(model, address, 1, what="test refit", reprocess=lambda: reprocessed.append(1),
                                        derive=model.post_load_weights, timeout_s=30)
        assert report.version == 1 and report.atomic and reprocessed == [1] and weights.handle.version == 1
        assert report.details["derived"] == ["w_kc"]
        assert {n: t.data_ptr() for n, t in _tensors(model).items()} == ptrs  # the same views, new bytes
        fresh_image = _prepack(new, tmp_path / "img-new", _key(), device)
        fresh, fresh_weights = _serve(fresh_image, shm, _key(), device)
        try:
            got, want = _tensors(model), _tensors(fresh)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[n], want[n]) for n in want)
            ids = torch.tensor([1, 5, 7], device=device)
            assert torch.equal(model(ids), fresh(ids)) and not torch.equal(model(ids), old(ids))
            # a level-1 sleep keeps the refit's version in its backup
            weights.handle.sleep(1)
            woke = weights.handle.wake()
            assert woke.source == "backup" and weights.handle.version == 1 and torch.equal(model(ids), fresh(ids))
        finally:
            fresh_weights.close()
        # a level-2 sleep keeps nothing: the wake brings the image's weights (version 0) back and says so
        weights.handle.sleep(2)
        woke = weights.handle.wake()
        assert woke.source == "disk" and woke.details["refit_version_lost"] == 1 and weights.handle.version == 0
        assert "the image's weights (version 0) replace refit version 1: refit again" in woke.summary()
        assert torch.equal(model.qkv.weight, old.qkv.weight) and torch.equal(model.w_kc, old.w_kc)
    finally:
        weights.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_engine_refit_refusals_leave_the_served_weights(tmp_path, store):
    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay, wake_engine_weights

    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    other = _prepack(TinyEngineModel(0), tmp_path / "img-other", _key(model_id="org/other"))
    older = _prepack(TinyEngineModel(0), tmp_path / "img-older", _key(engine_version="0.0.older"))  # same layouts key
    model, weights = _serve(image, tmp_path / "shm", _key())
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
        with engine_publisher(older, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=2)
            with pytest.raises(RefitError, match=r"version 2 was published for vllm 0.0.older: .*, this engine is "
                                                 r"vllm 0.0.test: .* \(engine_version: engine '0.0.test', published "
                                                 r"'0.0.older'\); nothing was copied"):
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
            with pytest.raises(RefitError, match=r"version 3 leaves 1 tensor attribute\(s\) to the engine \(w_kc\), "
                                                 "which this engine's integration cannot derive; publish them too"):
                refit_engine_model(model, address, 3, what="test refit", timeout_s=30)
            assert all(torch.equal(t, before[n]) for n, t in _tensors(model).items())
            refit_engine_model(model, address, 3, what="test refit", derive=model.post_load_weights, timeout_s=30)
            with pytest.raises(RefitError, match="version 3 is not newer than the live version 3; refused"):
                refit_engine_model(model, address, 3, what="test refit", timeout_s=30)
            assert torch.equal(model.w_kc, new["qkv.weight"][:4, :8] * 2)
        assert torch.equal(model.qkv.weight, new["qkv.weight"])
        with pytest.raises(WaitTimeoutError, match=r"the trainer's publish of version 4 \(org/tiny rank 0, namespace "
                                                   r"'refit-rank0.v4'\)"):
            # a trainer that never publishes (8 s: the bound covers the store join too, and under CI load
            # torch's connect to a live store once failed for 3 s)
            refit_engine_model(model, address, 4, what="test refit", timeout_s=8)
        assert weights.handle.version == 3 and torch.equal(model.qkv.weight, new["qkv.weight"])
        with pytest.raises(RefitError, match=r"unknown refit option\(s\) \['atomicity'\]"):
            refit_engine_model(model, address, 4, what="test refit", atomicity=False)
    finally:
        weights.close()
    with pytest.raises(CapabilityError, match="TinyEngineModel was not loaded by the flashboot loader"):
        refit_engine_model(TinyEngineModel(), address, 1, what="test refit")


# =============================================================================================
# The real engines (child processes): load A with our loader, a trainer publishes B, the engine's
# own update entry point refits, its modules' forward equals a fresh load of B, bitwise.
# =============================================================================================
REFIT_CHECKS = r'''
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
model_a, model_b, image_a, image_b, shm, port, store_port = sys.argv[1:8]
store = f"127.0.0.1:{store_port}"
# Hosted now, before the engine starts: the parent only found the port free, and the engine's own
# listeners (gloo's) take ephemeral ports later and once took this one. The trainers join this store.
from flashboot.flashclone.rendezvous import Rendezvous
store_host = Rendezvous.connect(store, host=True, timeout_s=60)
device = "cuda" if torch.cuda.is_available() else "cpu"
out = {"device": device}
FORWARD = ("model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp", "model.layers.1.mlp",
           "model.norm", "lm_head")

def _attr(model, name):
    for part in name.split("."):
        model = getattr(model, part)
    return model

def tensors(m):
    got = dict(m.named_parameters())
    got.update(m.named_buffers())
    return got

def forwards(m):
    # the engine modules' own forward (lm_head: the logits' matmul, as the engines' logits processor runs it)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(device)
    got = {}
    with torch.no_grad():
        for name in FORWARD:
            module = _attr(m, name)
            if name == "lm_head":
                y = torch.nn.functional.linear(hidden, module.weight)
            else:
                y = module(torch.tensor([1, 5, 7], device=device) if "embed" in name else hidden.clone())
            got[name] = (y[0] if isinstance(y, tuple) else y).clone()
    return got

def compare(m, fresh, old_outputs):
    a, b = tensors(m), tensors(fresh)
    fa, fb = forwards(m), forwards(fresh)
    return {"names_same": sorted(a) == sorted(b), "compared": len(b),
            "unequal": sorted(n for n in b if n not in a or not torch.equal(a[n], b[n])),
            "forward_equal": sorted(n for n in fb if torch.equal(fa[n], fb[n])),
            "forward_changed": sorted(n for n in fb if not torch.equal(fa[n], old_outputs[n]))}

def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None

def digest(m):
    return sorted((n, float(t.double().abs().sum())) for n, t in tensors(m).items())
'''

VLLM_REFIT_SCRIPT = r'''
if device == "cpu":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins

load_general_plugins()  # vLLM's plugin loader: our entry point registers the load format and the backend
from flashboot.integrations.vllm_weight_transfer import EngineModuleSource, FlashBootTrainerInitInfo

mc_a = ModelConfig(model=model_a, dtype="float32", skip_tokenizer_init=True)
mc_b = ModelConfig(model=model_b, dtype="float32", skip_tokenizer_init=True)
def config(mc, extra):
    return VllmConfig(model_config=mc, load_config=LoadConfig(load_format="flashboot", model_loader_extra_config=extra),
                      device_config=DeviceConfig(device))
def load(mc, extra):
    vc = config(mc, extra)
    with set_current_vllm_config(vc):
        loader = get_model_loader(vc.load_config)
        return vc, loader, loader.load_model(vllm_config=vc, model_config=mc)

with set_current_vllm_config(config(mc_a, {})):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)
load(mc_a, {"image_dir": image_a, "mode": "prepack", "shm_dir": shm})
_, _, trainer_model = load(mc_b, {"image_dir": image_b, "mode": "prepack", "shm_dir": shm})  # B by vLLM's loader
mc_a.sleep_mode_backend = "flashboot"
vc, ld, m = load(mc_a, {"image_dir": image_a, "shm_dir": shm})
old_outputs = forwards(m)
ptrs = {n: t.data_ptr() for n, t in tensors(m).items()}

# the worker's engine as vLLM's worker builds it, and a control-plane client that calls it as the worker does
wt = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="flashboot"), vc, torch.device(device), m)
out["engine_class"] = type(wt).__name__
class Client:
    def init_weight_transfer_engine(self, init_info):
        with set_current_vllm_config(vc):
            wt.init_transfer_engine(wt.parse_init_info(init_info))
    def start_weight_update(self):
        wt.start_weight_update()
    def update_weights(self, update_info):
        with set_current_vllm_config(vc):
            wt.update_weights(update_info)
    def finish_weight_update(self, weight_version=None):
        wt.finish_weight_update()
client = Client()
trainer = WeightTransferTrainerFactory.trainer_init(
    FlashBootTrainerInitInfo(image=image_a, store=store, device=device, timeout_s=60, rank=0), client=client,
    source=EngineModuleSource(trainer_model))
out["trainer_class"] = type(trainer).__name__
trainer.send_weights()
out["report"] = wt.last_report.summary()
out["version"] = ld.weights.handle.version
out["same_addresses"] = {n: t.data_ptr() for n, t in tensors(m).items()} == ptrs
_, _, fresh = load(mc_b, {"image_dir": image_b, "shm_dir": shm})
out["after_refit"] = compare(m, fresh, old_outputs)

# bad input, each through the engine's route, the served weights unchanged
served = digest(m)
out["older"] = error_of(lambda: client.update_weights({"version": 1}))
from flashboot.integrations.engine_refit import engine_publisher
other = engine_publisher(image_b, 0, store=store, device=device)  # B's image: another key (another model path)
other.publish(EngineModuleSource(trainer_model).iter_full(), version=2)
out["other_key"] = error_of(lambda: client.update_weights({"version": 2}))
other.close()
out["unchanged_after_refusals"] = digest(m) == served
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
backend = SleepModeBackendFactory.create_backend(mc_a)
# published while the engine is awake: in this one process vLLM's cached rotary module is shared by
# every model built with its config, so the trainer's model holds the engine arena's cache
trainer.publisher.publish(EngineModuleSource(trainer_model).iter_full(), version=3)
backend.suspend(1)  # vLLM's sleep(level=1) through the flashboot sleep-mode backend
out["asleep"] = error_of(lambda: client.update_weights({"version": 3}))
backend.resume(None)
out["after_wake"] = {"version": ld.weights.handle.version, "same_as_served": digest(m) == served}
client.update_weights({"version": 3})  # awake: the version published above is taken
out["version_after_update"] = ld.weights.handle.version
out["after_second_refit"] = compare(m, fresh, old_outputs)
trainer.shutdown()
print("RESULT " + json.dumps(out))
'''

SGLANG_SETUP = r'''
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", port)
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import SpawnRanks, get_model, get_parallel, publish, reset_context
from sglang.srt.server_args import ServerArgs
from flashboot.integrations.sglang import FlashBootModelLoader, REFIT_LOADER, refit_request

init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
reset_context()
publish(ServerArgs(model_path=model_a, device=device, tp_size=1, dtype="float32", custom_weight_loader=[REFIT_LOADER]),
        role="test", ranks=SpawnRanks(world_rank=0))
get_parallel().override_permanently(world_group=parallel_state._WORLD)
initialize_model_parallel(backend="gloo")
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import get_model_loader

mc_a, mc_b, dc = ModelConfig(model_a, dtype="float32"), ModelConfig(model_b, dtype="float32"), DeviceConfig(device, 0)
def load(mc, **extra):
    config = LoadConfig(load_format=FlashBootModelLoader, model_loader_extra_config=json.dumps(extra))
    loader = get_model_loader(config, mc)
    return loader, loader.load_model(model_config=mc, device_config=dc)
load(mc_a, image_dir=image_a, mode="prepack", shm_dir=shm)
_, trainer_model = load(mc_b, image_dir=image_b, mode="prepack", shm_dir=shm)  # B by SGLang's own loader
ld, m = load(mc_a, image_dir=image_a, shm_dir=shm)
'''

SGLANG_REFIT_SCRIPT = SGLANG_SETUP + r'''
old_outputs = forwards(m)
ptrs = {n: t.data_ptr() for n, t in tensors(m).items()}

# SGLang's model-runner weight updater: update_weights_from_tensor dispatches on load_format to the
# --custom-weight-loader functions the server was started with
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
updater = WeightUpdater(tp_rank=0, device=device, gpu_id=0, model_config=mc_a,
                        custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: m,
                        update_model_fields=lambda **kw: None, recapture_cuda_graph=lambda: None,
                        get_model_runner=lambda: None)
update = lambda version: updater.update_weights_from_tensor(refit_request(store, version, timeout_s=60),
                                                             load_format=REFIT_LOADER)

from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish
trainer = engine_publisher(image_a, 0, store=store, device=device)  # the trainer, publishing B's tensors
trainer.publish(engine_tensors_to_publish(trainer_model, device), version=1)
out["update"] = list(update(1))
out["version"] = ld.weights.handle.version
out["same_addresses"] = {n: t.data_ptr() for n, t in tensors(m).items()} == ptrs
_, fresh = load(mc_b, image_dir=image_b, shm_dir=shm)
out["after_refit"] = compare(m, fresh, old_outputs)

served = digest(m)
out["older"] = error_of(lambda: update(1))
other = engine_publisher(image_b, 0, store=store, device=device)
other.publish(engine_tensors_to_publish(trainer_model, device), version=2)
out["other_key"] = error_of(lambda: update(2))
other.close()
out["unchanged_after_refusals"] = digest(m) == served
# SGLang's own release of the weights tag (the scheduler's updater, the no-op memory-saver adapter)
from types import SimpleNamespace
from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
scheduler = SchedulerWeightUpdaterManager(
    tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=m)), draft_worker=None,
    memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False), flush_cache=lambda: True,
    is_fully_idle=lambda **kw: True)
if device == "cpu":  # as in _engine_helpers.SGLANG_SCRIPT: the closing synchronize must pick the CPU
    _device_module = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else _device_module(device)
trainer.publish(engine_tensors_to_publish(trainer_model, device), version=3)
# without --enable-weights-cpu-backup SGLang's release is a level-2 sleep: the wake reads the image (version 0)
scheduler.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=["weights"]))
out["asleep"] = error_of(lambda: update(3))
scheduler.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["weights"]))
woken = forwards(m)
out["after_wake"] = {"version": ld.weights.handle.version,
                     "image_weights": sorted(n for n in woken if torch.equal(woken[n], old_outputs[n]))}
update(3)
out["version_after_update"] = ld.weights.handle.version
out["after_second_refit"] = compare(m, fresh, old_outputs)
trainer.close()
print("RESULT " + json.dumps(out))
'''

# DeepSeek-V3 (MLA): the trainer publishes parameters and buffers; w_kc / w_vc (tensor attributes SGLang's
# post_load_weights derives from kv_b_proj, stored strided) are derived by the engine into their arena views
SGLANG_MLA_REFIT_SCRIPT = SGLANG_SETUP + r'''
FORWARD = ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "model.norm", "lm_head")
old_outputs = forwards(m)
from flashboot.integrations.engine_prepack import read_engine_section
extras = sorted(n for n, info in read_engine_section(image_a, 0)[0].tensors.items() if info["kind"] == "extra")
views = {n: _attr(m, n).data_ptr() for n in extras}
old_extras = {n: _attr(m, n).clone() for n in extras}
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
updater = WeightUpdater(tp_rank=0, device=device, gpu_id=0, model_config=mc_a,
                        custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: m,
                        update_model_fields=lambda **kw: None, recapture_cuda_graph=lambda: None,
                        get_model_runner=lambda: None)
from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish
trainer = engine_publisher(image_a, 0, store=store, device=device)
published = dict(engine_tensors_to_publish(trainer_model, device))
out["published_extras"] = sorted(n for n in extras if n in published)
trainer.publish(published, version=1)
out["update"] = list(updater.update_weights_from_tensor(refit_request(store, 1, timeout_s=60), load_format=REFIT_LOADER))
_, fresh = load(mc_b, image_dir=image_b, shm_dir=shm)
out["extras"] = extras
out["extras_equal_fresh"] = sorted(n for n in extras if torch.equal(_attr(m, n), _attr(fresh, n)))
out["extras_changed"] = sorted(n for n in extras if not torch.equal(_attr(m, n), old_extras[n]))
out["extras_same_views"] = all(_attr(m, n).data_ptr() == views[n] for n in extras)
out["after_refit"] = compare(m, fresh, old_outputs)
trainer.close()
print("RESULT " + json.dumps(out))
'''


def _run_refit(script: str, tmp_path, kind: str = "llama") -> dict:
    from _clone_helpers import TOKEN
    from flashboot.flashclone.rendezvous import free_port
    from _engine_helpers import _result_of, _shm_dir, make_tiny_model

    model_a = make_tiny_model(kind, tmp_path / f"tiny-{kind}-a", seed=0)
    model_b = make_tiny_model(kind, tmp_path / f"tiny-{kind}-b", seed=1)
    path = tmp_path / "refit_script.py"
    path.write_text(REFIT_CHECKS + script)
    shm = _shm_dir(tmp_path)
    try:
        proc = subprocess.run([sys.executable, str(path), str(model_a), str(model_b), str(tmp_path / "image-a"),
                               str(tmp_path / "image-b"), str(shm), str(free_port()), str(free_port())],
                              capture_output=True, text=True, timeout=400, cwd=tmp_path,
                              env={**os.environ, "FLASHBOOT_TOKEN": TOKEN})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result = _result_of(proc, "refit script")
    print(json.dumps(result, indent=1))
    return result


@pytest.fixture(scope="module")
def vllm_refit(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed here (see docs/engines.md for the engine test venv)")
    return _run_refit(VLLM_REFIT_SCRIPT, tmp_path_factory.mktemp("vllm-refit"))


@pytest.fixture(scope="module")
def sglang_refit(tmp_path_factory):
    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed here (see docs/engines.md for the engine test venv)")
    return _run_refit(SGLANG_REFIT_SCRIPT, tmp_path_factory.mktemp("sglang-refit"))


def _assert_refit_equals_a_fresh_load(r: dict) -> None:
    got = r["after_refit"]
    assert got["names_same"] and got["compared"] > 10 and got["unequal"] == []
    forward = ["lm_head", "model.embed_tokens", "model.layers.0.mlp", "model.layers.0.self_attn.qkv_proj",
               "model.layers.1.mlp", "model.norm"]
    assert got["forward_equal"] == forward  # bitwise equal to a fresh load of the new weights
    assert set(got["forward_changed"]) >= set(forward) - {"model.norm"}  # and not the old ones (norms start at 1)
    assert r["version"] == 1 and r["same_addresses"]


def _assert_refusals(r: dict) -> None:
    assert r["older"][0] == "RefitError" and "version 1 is not newer than the live version 1" in r["older"][1]
    assert r["other_key"][0] == "RefitError" and "was published for image key" in r["other_key"][1]
    assert "nothing was copied" in r["other_key"][1]
    assert r["asleep"][0] == "RefitError" and "weight arena is asleep; wake its weights first" in r["asleep"][1]
    assert "nothing was copied" in r["asleep"][1] and r["unchanged_after_refusals"]
    assert r["version_after_update"] == 3 and r["after_second_refit"]["unequal"] == []


def test_real_vllm_weight_transfer_backend_refits_to_a_fresh_load_of_the_new_weights(vllm_refit):
    r = vllm_refit
    assert r["engine_class"] == "FlashBootWeightTransferEngine"
    assert r["trainer_class"] == "FlashBootTrainerWeightTransferEngine"
    assert "refit v0 -> v1 (atomic" in r["report"]
    _assert_refit_equals_a_fresh_load(r)


def test_real_vllm_weight_transfer_refuses_bad_updates_before_a_byte_moves(vllm_refit):
    r = vllm_refit
    _assert_refusals(r)
    assert r["after_wake"] == {"version": 1, "same_as_served": True}  # level 1: the backup held version 1


def test_real_sglang_update_weights_from_tensor_refits_to_a_fresh_load_of_the_new_weights(sglang_refit):
    r = sglang_refit
    assert r["update"] == [True, "Success"]
    _assert_refit_equals_a_fresh_load(r)


def test_real_sglang_update_route_refuses_bad_updates_before_a_byte_moves(sglang_refit):
    r = sglang_refit
    _assert_refusals(r)
    # level 2 (no CPU backup): the wake brought the image's weights back, version 0, and the refit after it took v3
    assert r["after_wake"]["version"] == 0 and len(r["after_wake"]["image_weights"]) == 6


@pytest.fixture(scope="module")
def sglang_mla_refit(tmp_path_factory):
    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed here (see docs/engines.md for the engine test venv)")
    return _run_refit(SGLANG_MLA_REFIT_SCRIPT, tmp_path_factory.mktemp("sglang-mla-refit"), "deepseek_v3")


def test_real_sglang_mla_refit_derives_w_kc_w_vc_into_their_arena_views(sglang_mla_refit):
    r = sglang_mla_refit
    assert r["update"] == [True, "Success"] and r["published_extras"] == []
    mla = ["model.layers.0.self_attn.w_kc", "model.layers.0.self_attn.w_vc", "model.layers.1.self_attn.w_kc",
           "model.layers.1.self_attn.w_vc"]
    assert set(mla) <= set(r["extras"])
    assert set(mla) <= set(r["extras_equal_fresh"]) and set(mla) <= set(r["extras_changed"])
    assert r["extras_same_views"]
    got = r["after_refit"]
    assert got["names_same"] and got["unequal"] == []
    assert got["forward_equal"] == ["lm_head", "model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp",
                                    "model.norm"]


def test_engine_publish_refuses_a_tensor_the_image_stores_strided(tmp_path):
    """A transposed parameter (dense, but not in C order) is the engine's layout, not a C-order
    tensor: the trainer cannot fill it by name; refused before anything is written, naming it."""
    from _engine_helpers import PlainEngineLikeModel
    from _engine_helpers import _key as sglang_key

    image = tmp_path / "img"
    prepack_engine_model(PlainEngineLikeModel(), image, sglang_key(), RankGroup(), device="cpu", tp_size=1, ep_size=1,
                         source_path="/models/plain", model_type="plain", chunk_bytes=4096)
    new = dict(engine_tensors_to_publish(PlainEngineLikeModel(1), "cpu"))
    with engine_publisher(image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, host_store=False) as pub:
        with pytest.raises(PublishError, match=r"image tensor 'w_t' is stored strided \(shape \[16, 24\], stride "
                                               r"\[1, 16\]\): publish fills C-order tensors only"):
            pub.publish({"w_t": new["w_t"]}, version=1)
        assert pub.version == 0 and pub.seed is None
