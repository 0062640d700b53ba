"""FlashBoot as a vLLM model loader (flashboot.integrations.vllm).

The engine-image machinery both loaders share is tested in test_integrations_engine_image.py and
test_integrations_engine_load.py. Here:
the ``vllm.general_plugins`` entry point, and ``test_real_vllm_*``, which run vLLM's own code in
a child process (``VLLM_TARGET_DEVICE=cpu`` on a machine without CUDA): its plugin loader,
argument parser, ``register_model_loader``/``get_model_loader``, ``DefaultModelLoader``,
``VllmConfig``/``ModelConfig``/``LoadConfig``, model classes and ``process_weights_after_loading``
under ``weights_already_processed``. They are skipped only where vLLM is not installed (the CPU CI
venv); docs/engines.md says how to build the venv they run in.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points

import pytest

from flashboot.errors import CapabilityError

from _engine_helpers import (  # sglang_run, a fixture used here, is in conftest.py
    RESTART_CHECKS, SLEEP_CHECKS, assert_refused_before_staging, assert_restarted_from_the_holder,
    assert_same_as_default_loader, assert_slept_and_woke, run_engine_ranks, run_engine_script,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_vllm_entry_point_resolves_to_the_plugin():
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "flashboot"]
    assert [e.value for e in eps] == ["flashboot.integrations:vllm_plugin"]
    from flashboot.integrations import vllm_plugin

    assert eps[0].load() is vllm_plugin


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed: the plugin runs in test_real_vllm_*")
def test_vllm_plugin_without_vllm_says_so():
    from flashboot.integrations import vllm_plugin

    with pytest.raises(CapabilityError, match="the flashboot vllm plugin needs vllm importable"):
        vllm_plugin()


VLLM_SCRIPT = r'''
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
model_path, image_dir, shm, port = sys.argv[1:5]
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
out = {"device": device}
import vllm
out["vllm_version"] = vllm.__version__
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser

# vLLM's own plugin loader finds our entry point and registers the load format
load_general_plugins()
from flashboot.integrations.vllm import FlashBootModelLoader
args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
    ["--model", model_path, "--load-format", "flashboot", "--model-loader-extra-config",
     json.dumps({"image_dir": image_dir})])
cli_load_config = EngineArgs.from_cli_args(args).create_load_config()
out["cli_load_format"] = cli_load_config.load_format
out["cli_loader_class"] = type(get_model_loader(cli_load_config)).__name__

mc = ModelConfig(model=model_path, dtype="float32", skip_tokenizer_init=True)
def config(fmt, extra, model_config=mc):
    return VllmConfig(model_config=model_config, load_config=LoadConfig(load_format=fmt, model_loader_extra_config=extra),
                      device_config=DeviceConfig(device))

def same(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    return (sorted(pa) == sorted(pb) and sorted(ba) == sorted(bb)
            and all(torch.equal(pa[k], pb[k]) for k in pa) and all(torch.equal(ba[k], bb[k]) for k in ba))

vc = config("auto", {})
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    ref_loader = get_model_loader(vc.load_config)
    out["reference_loader"] = type(ref_loader).__name__
    ref = ref_loader.load_model(vllm_config=vc, model_config=mc)

vc1 = config("flashboot", {"image_dir": image_dir, "mode": "prepack", "shm_dir": shm})
with set_current_vllm_config(vc1):
    pre = get_model_loader(vc1.load_config)
    m_pre = pre.load_model(vllm_config=vc1, model_config=mc)
out["prepack_same_as_reference"] = same(ref, m_pre)
out["prepack_tensors"] = pre.prepack_report.tensors
from flashboot.integrations.engine_prepack import read_engine_section
section, _ = read_engine_section(image_dir, 0)
out["extras"] = sorted(n for n, info in section.tensors.items() if info["kind"] == "extra")
out["param_names"] = sorted(n for n, _ in ref.named_parameters())
out["buffer_names"] = sorted(n for n, _ in ref.named_buffers())

vc2 = config("flashboot", {"image_dir": image_dir, "shm_dir": shm, "verify": True})
with set_current_vllm_config(vc2):
    ld = get_model_loader(vc2.load_config)
    m = ld.load_model(vllm_config=vc2, model_config=mc)
out["load_same_as_reference"] = same(ref, m)
lo, hi = ld.weights.arena.ptr, ld.weights.arena.ptr + ld.weights.arena.nbytes
out["all_in_one_arena"] = all(lo <= t.data_ptr() < hi for t in list(m.parameters()) + list(m.buffers()))
out["model_class"] = type(m).__name__
out["key"] = ld.key.to_dict()
out["attrs"] = ld.bind_report.attrs
out["how"] = ld.weights.how

# in-place reload (vLLM's load_weights): scribble over the served weights, reload them from the image
with set_current_vllm_config(vc2):
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    ld.load_weights(m, mc)
out["reload_same_as_reference"] = same(ref, m)

def error_of(extra, model_config):
    try:
        v = config("flashboot", extra, model_config)
        with set_current_vllm_config(v):
            get_model_loader(v.load_config).load_model(vllm_config=v, model_config=model_config)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None
mc16 = ModelConfig(model=model_path, dtype="bfloat16", skip_tokenizer_init=True)
out["mismatch"] = error_of({"image_dir": image_dir, "shm_dir": shm}, mc16)
mc.enable_sleep_mode = True  # what --enable-sleep-mode sets (this platform's config check would refuse it first)
out["sleep_mode"] = error_of({"image_dir": image_dir, "shm_dir": shm}, mc)  # with the default cumem backend

# vLLM's sleep mode with the flashboot backend: the worker resolves its backend from the model config
# (SleepModeBackendFactory) and calls suspend(level) / resume(tags) / discard(tags) from its own
# sleep / wake_up / discard (whose CPU worker ignores them, so they are called here as it does)
mc.sleep_mode_backend = "flashboot"
vc3 = config("flashboot", {"image_dir": image_dir, "shm_dir": shm})
with set_current_vllm_config(vc3):
    ls = get_model_loader(vc3.load_config)
    ms = ls.load_model(vllm_config=vc3, model_config=mc)
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
backend = SleepModeBackendFactory.create_backend(mc)
out["sleep_backend"] = type(backend).__name__
hidden = torch.randn(3, mc.hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
def outputs():
    with set_current_vllm_config(vc3):
        return module_outputs(ms, ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "model.norm"),
                              lambda name: torch.tensor([1, 5, 7]) if "embed" in name else hidden.clone())
arena = ls.weights.arena
def kv_cache_only_then_weights():
    backend.resume(["kv_cache"])  # a selective wake: the weights stay asleep
    out["asleep_after_kv_cache_wake"] = arena.asleep
    backend.resume(["weights"])
def reload_while_asleep():
    backend.suspend(1)
    try:
        with set_current_vllm_config(vc3):
            ls.load_weights(ms, mc)
    except Exception as exc:
        out["reload_while_asleep"] = [type(exc).__name__, str(exc)]
    backend.resume(None)
out["sleep_level1"] = sleep_cycle(ms, arena, lambda: backend.suspend(1), kv_cache_only_then_weights, outputs)
out["sleep_level2"] = sleep_cycle(ms, arena, lambda: backend.suspend(2), lambda: backend.resume(None), outputs)
out["discard"] = sleep_cycle(ms, arena, lambda: backend.discard(("weights",)), lambda: backend.resume(["weights"]),
                             outputs)
reload_while_asleep()
out["backend_state"] = backend.state()

# restart without a reload (the holder option): the first load is handed to a holder, the
# restarted one maps it (the first's weights closed in between, as its process would exit). Last:
# each bind repoints the rotary cache, one module shared by every model of the process.
def held_load(registry):
    v = config("flashboot", {"image_dir": image_dir, "shm_dir": shm, "holder": registry})
    with set_current_vllm_config(v):
        loader = get_model_loader(v.load_config)
        return loader, loader.load_model(vllm_config=v, model_config=mc)
mc.enable_sleep_mode = False
out["restart"] = restart_through_holder(held_load, lambda model: same(ref, model))
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed here (see docs/engines.md for the engine test venv)")
    return run_engine_script(SLEEP_CHECKS + RESTART_CHECKS + VLLM_SCRIPT, tmp_path_factory.mktemp("vllm"))


def test_real_vllm_plugin_registers_load_format_flashboot(vllm_run):
    r = vllm_run
    assert r["cli_load_format"] == "flashboot" and r["cli_loader_class"] == "FlashBootModelLoader"


def test_real_vllm_prepack_runs_its_own_loader_and_dumps_every_tensor(vllm_run):
    r = vllm_run
    assert r["reference_loader"] == "DefaultModelLoader" and r["prepack_same_as_reference"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in r["param_names"]
    # plus vLLM's per-layer KV-cache placeholder attributes (empty until the runner binds the cache)
    assert r["extras"] == ["model.layers.0.self_attn.attn.kv_cache", "model.layers.1.self_attn.attn.kv_cache"]
    assert r["prepack_tensors"] == len(r["param_names"]) + len(r["buffer_names"]) + len(r["extras"])


def test_real_vllm_load_binds_the_engine_model_to_one_arena(vllm_run):
    r = vllm_run
    assert r["model_class"] == "LlamaForCausalLM" and r["how"] == "load"
    assert r["load_same_as_reference"] and r["all_in_one_arena"]
    assert set(r["attrs"]) >= {"has_own_lm_head", "has_own_embed_tokens"}  # vLLM's exported model flags
    key = r["key"]
    assert key["engine"] == "vllm" and key["engine_version"] == r["vllm_version"] and key["dtype"] == "float32"
    assert key["extra"]["model_arch"] == "LlamaForCausalLM" and "kv_cache_dtype" in key["extra"]


def test_real_vllm_restarts_from_a_holder_without_a_copy(vllm_run):
    assert_restarted_from_the_holder(vllm_run["restart"])


def test_real_vllm_load_weights_reloads_in_place(vllm_run):
    assert vllm_run["reload_same_as_reference"]


def test_real_vllm_refuses_an_image_of_another_key_and_sleep_mode_with_the_cumem_backend(vllm_run):
    kind, msg = vllm_run["mismatch"]
    assert kind == "LayoutError" and "dtype: engine 'bfloat16', image 'float32'" in msg
    kind, msg = vllm_run["sleep_mode"]
    assert kind == "CapabilityError" and "--enable-sleep-mode with --sleep-mode-backend cumem" in msg
    assert "Add --sleep-mode-backend flashboot" in msg


def test_real_vllm_sleep_and_wake_up_put_the_arena_to_sleep_and_wake_it(vllm_run):
    r = vllm_run
    assert r["sleep_backend"] == "FlashBootSleepBackend"  # resolved by vLLM's factory from the model config
    # sleep(level=1): the pinned backup; wake_up(tags=["kv_cache"]) leaves the weights asleep
    assert_slept_and_woke(r["sleep_level1"], 1, "backup")
    assert r["asleep_after_kv_cache_wake"] is True
    # sleep(level=2) then wake_up(): from the disk, right without reload_weights
    assert_slept_and_woke(r["sleep_level2"], 2, "disk")
    assert_slept_and_woke(r["discard"], 2, "disk")  # discard(("weights",)): nothing kept
    kind, msg = r["reload_while_asleep"]
    assert kind == "FlashBootError" and "load_weights: the model's" in msg and "wake_up(tags=['weights'])" in msg
    assert r["backend_state"] == "RUNNING"


# =============================================================================================
# Real vLLM: tensor parallelism, forwards, refusals (one process per rank, gloo)
# =============================================================================================
# One rank of a vLLM job (after ENGINE_CHECKS): the default loader, our pre-pack through vLLM's own
# loader, our load, then the comparisons and refusals.
VLLM_RANK_SCRIPT = r"""
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import vllm
out["engine_version"] = vllm.__version__
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins
load_general_plugins()
mc = ModelConfig(model=model_path, dtype="float32", skip_tokenizer_init=True)
def config(fmt, extra):
    return VllmConfig(model_config=mc, load_config=LoadConfig(load_format=fmt, model_loader_extra_config=extra),
                      device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig(tensor_parallel_size=world))
def load(fmt, extra):
    vc = config(fmt, extra)
    with set_current_vllm_config(vc):
        loader = get_model_loader(vc.load_config)
        return loader, loader.load_model(vllm_config=vc, model_config=mc)
vc = config("auto", {})
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    ensure_model_parallel_initialized(world, 1)
ref_loader, ref = load("auto", {})
out["reference_loader"] = type(ref_loader).__name__
pre, _ = load("flashboot", {"image_dir": image_dir, "mode": "prepack", "shm_dir": shm})
out["prepack_tensors"] = pre.prepack_report.tensors
ld, m = load("flashboot", {"image_dir": image_dir, "shm_dir": shm, "verify": True})
out["key"] = ld.key.to_dict()
out["model_class"] = type(m).__name__
compare_with_default(ref, m, ld.weights.arena)
hidden = torch.randn(3, mc.hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
with set_current_vllm_config(vc):
    compare_forwards(ref, m, lambda name: torch.tensor([1, 5, 7]) if "embed" in name else hidden.clone())
refuse.append(["older_engine", older_engine_copy("0.32.0")])
refusals(lambda path, where: load("flashboot", {"image_dir": path, "shm_dir": where}))
print("RESULT " + json.dumps(out))
"""

VLLM_FORWARD = ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "model.norm")


@pytest.fixture(scope="module")
def vllm_tp2(tmp_path_factory, vllm_run, sglang_run):
    return run_engine_ranks(VLLM_RANK_SCRIPT, tmp_path_factory.mktemp("vllm-tp2"), "llama", 2,
                            refuse=[("tp1_image", vllm_run["image_dir"]), ("sglang_image", sglang_run["image_dir"])],
                            forward=VLLM_FORWARD)


@pytest.mark.timeout(900)  # its fixtures run up to three engine jobs in a row
def test_real_vllm_tp2_each_rank_loads_its_own_rank_image(vllm_tp2):
    ranks = vllm_tp2
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["key"]["tp_size"] == 2 for r in ranks)
    for r in ranks:
        assert r["reference_loader"] == "DefaultModelLoader" and r["model_class"] == "LlamaForCausalLM"
        assert_same_as_default_loader(r)
        # vLLM's fused, column-parallel projections: each rank holds half of the heads and of the MLP
        assert r["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == [(64 + 2 * 32) // 2, 64]
        assert r["shapes"]["model.layers.0.mlp.gate_up_proj.weight"] == [128, 64]
    assert ranks[0]["digest"] != ranks[1]["digest"]  # two rank images, not one twice
    # vLLM all-reduces inside the row-parallel layers and the vocab-parallel embedding: both ranks
    # compute the whole result
    for name in VLLM_FORWARD:
        assert ranks[0]["forward"][name]["head"] == ranks[1]["forward"][name]["head"], name


@pytest.mark.timeout(900)  # its fixtures run up to three engine jobs in a row
def test_real_vllm_refuses_an_image_of_another_tp_size_engine_version_or_engine(vllm_tp2, vllm_run, sglang_run):
    for r in vllm_tp2:
        version = r["engine_version"]
        assert_refused_before_staging(r["refused"]["tp1_image"], "tp_size: engine 2, image 1")
        assert_refused_before_staging(r["refused"]["older_engine"], f"engine_version: engine '{version}', image '0.32.0'",
                                      f"vllm {version}", "vllm 0.32.0")
        # an image SGLang made of the same checkpoint: named as SGLang's, refused by vLLM
        assert_refused_before_staging(r["refused"]["sglang_image"], "engine: engine 'vllm', image 'sglang'",
                                      f"sglang {sglang_run['sglang_version']}", f"vllm {version}")
