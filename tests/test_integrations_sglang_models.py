"""Real SGLang on the model kinds and parallelism that stress an engine loader, one child process
per rank (gloo): Qwen3-MoE's fused experts, tensor parallelism (TP=2, one rank image each), DeepSeek-V3's
MLA tensor attributes; every tensor and module forward against SGLang's default loader, and the
refusals (an older SGLang's image, a TP=1 image on TP=2 ranks). Skipped only where SGLang is not
installed.
"""

from __future__ import annotations

import pytest
import torch

from _engine_helpers import HAVE_SGLANG, assert_refused_before_staging, assert_same_as_default_loader, run_engine_ranks


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
