"""Shared by the engine integration tests (test_integrations_engine_*, test_integrations_sglang_*,
test_integrations_vllm, test_integrations_refit): ``PlainEngineLikeModel`` and its engine key, the
``packed`` fixture (an engine image of it), the child-process scripts and runners the real-engine
tests use (SGLang's single-process script, SLEEP_CHECKS, ENGINE_CHECKS, ``run_engine_script``,
``run_engine_ranks``, ``make_tiny_model``) and the assertions both engines' tests share. Not a
conftest (tests import it); the session's one real SGLang run, ``sglang_run``, is in conftest.py.
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
from pathlib import Path

import pytest
import torch

from flashboot.integrations.engine_prepack import EngineKey, LoaderOptions, RankGroup, prepack_engine_model

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


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
# Real engines, in child processes: SGLang's single-process script, the checks both engines'
# scripts share, the tiny checkpoints and the runners
# =============================================================================================
RESTART_CHECKS = r'''
def restart_through_holder(held_load, same_as_reference):
    """Two engine loads with the holder option, a holder serving in a thread: what each did."""
    import tempfile, threading
    from flashboot.flashclone.holder import Holder
    registry = tempfile.mkdtemp()
    holder, stop = Holder(registry=registry), threading.Event()
    thread = threading.Thread(target=holder.serve_forever, args=(stop,), kwargs={"handle_signals": False})
    thread.start()
    try:
        first_loader, first = held_load(registry)
        r = {"first_mode": first_loader.weights.report.mode,
             "handed_over_as": first_loader.weights.report.details.get("handed_over_as"),
             "first_same": same_as_reference(first)}
        arena_id = first_loader.weights.arena.arena_id
        first_loader.weights.close()
        loader, model = held_load(registry)
        w = loader.weights
        lo, hi = w.arena.ptr, w.arena.ptr + w.arena.nbytes
        r.update(second_mode=w.report.mode, same_arena=w.arena.arena_id == arena_id, imported=w.arena.imported,
                 second_same=same_as_reference(model),
                 in_held_arena=all(lo <= t.data_ptr() < hi for t in list(model.parameters()) + list(model.buffers())))
        w.close()
        return r
    finally:
        stop.set()
        thread.join(30)
'''

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

# 6. restart without a reload (the holder option): the first load is handed to a holder, the
# restarted one maps it (the first's weights closed in between, as its process would exit). Last:
# each bind repoints SGLang's rotary cache, one module shared by every model of the process.
def held_load(registry):
    loader = get_model_loader(LoadConfig(load_format="flashboot", model_loader_extra_config=json.dumps(
        {"image_dir": image_dir, "shm_dir": shm, "holder": registry})), mc)
    return loader, loader.load_model(model_config=mc, device_config=dc)
out["restart"] = restart_through_holder(held_load, lambda model: same(ref, model))
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


# =============================================================================================
# What the real-engine tests of both engines assert
# =============================================================================================
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


def assert_same_as_default_loader(r: dict) -> None:
    """Our load equals the engine's default loader: every parameter, buffer and tensor attribute,
    all of them views into the one arena."""
    assert r["names_same"] and r["unequal"] == [], r["unequal"]
    assert r["compared"] == len(r["param_names"]) + len(r["buffer_names"]) + len(r["extras"])
    assert r["outside_arena"] == []
    assert all(f["equal"] and f["abs_sum"] > 0 for f in r["forward"].values()), r["forward"]


def assert_restarted_from_the_holder(r: dict) -> None:
    """RESTART_CHECKS' result: the first engine loaded and handed its arena over, the restarted one
    mapped that very arena (no copy) and bound the engine's model to it, equal to the default loader's."""
    assert r["first_mode"] != "held" and r["handed_over_as"] and r["first_same"], r
    assert r["second_mode"] == "held" and r["same_arena"] and r["imported"], r
    assert r["second_same"] and r["in_held_arena"], r


def assert_refused_before_staging(refusal: dict, *needles: str) -> None:
    assert refusal is not None, "loaded an image it should have refused"
    assert refusal["type"] == "LayoutError", refusal
    assert all(n in refusal["msg"] for n in needles), refusal["msg"]
    assert refusal["staged"] == [], refusal  # refused before anything was staged or allocated
