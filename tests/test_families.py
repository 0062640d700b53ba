"""Family rules on real transformers architectures (tiny, random weights): names and bytes
against the transformers module, tensor-parallel shards put back together, expert-parallel
subsets, SGLang naming, the generic fallback and the registry."""

import json
from dataclasses import replace

import pytest
import torch
from flashboot.layouts import read_image, read_image_metadata, reassemble
from flashboot.layouts.checkpoint import open_checkpoint
from flashboot.layouts.families import (
    Family,
    PlanContext,
    RankPlan,
    check_plan,
    family_for,
    get_family,
    list_families,
    register_family,
)
from flashboot.layouts.families.base import Piece, PlannedTensor
from flashboot.layouts.format import ParallelLayout
from flashboot.layouts.tiny import save_tiny_model
from safetensors.torch import load_file, save_file

from flashboot.errors import LayoutError, UnknownNameError
from flashboot.flashload.prepack import prepack

MOE = ["qwen3_moe", "mixtral", "deepseek_v3"]
FAMILIES = MOE + ["llama"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model_type -> (checkpoint dir, state dict of the transformers model that was saved)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for mt in FAMILIES:
        dtype = torch.bfloat16 if mt == "mixtral" else None  # one family in bf16
        model = save_tiny_model(mt, root / mt, seed=7, dtype=dtype)
        out[mt] = (root / mt, {k: v.detach().clone() for k, v in model.state_dict().items()}, model.config)
    return out


def _pack(models, tmp_path, mt, tp=1, ep=1, target="transformers"):
    out = tmp_path / f"{mt}-tp{tp}-ep{ep}-{target}"
    report = prepack(models[mt][0], out, tp, ep, target=target, chunk_bytes=1 << 16, progress=False)
    return out, report


def _all_ranks(out, world):
    images = [read_image(out, r) for r in range(world)]
    return images, reassemble((e, im.view(n)) for im in images for n, e in im.tensors.items())


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("mt", FAMILIES)
def test_tp1_transformers_image_binds_the_meta_model(models, tmp_path, mt):
    from transformers import AutoModelForCausalLM

    ckpt, state, config = models[mt]
    out, report = _pack(models, tmp_path, mt)
    assert report.family == mt and not report.fallback
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in meta_model.state_dict().items()}
    with read_image(out) as im:
        dtype = next(iter(state.values())).dtype
        got = {k: (e.shape, getattr(torch, e.dtype)) for k, e in im.tensors.items()}
        assert got == {k: (s, dtype) for k, (s, _) in expected.items()}
        for name in im.tensors:
            assert _same_bytes(im.view(name), state[name]), name
        experts = {n for n, e in im.tensors.items() if e.region == "experts"}
        assert experts == {n for n in state if ".experts." in n}
        if mt in MOE:
            assert im.metadata.experts.local_count == im.metadata.experts.num_experts


@pytest.mark.parametrize("mt", FAMILIES)
def test_tp2_shards_reassemble_to_the_original_tensors(models, tmp_path, mt):
    ckpt, state, config = models[mt]
    out, report = _pack(models, tmp_path, mt, tp=2)
    images, full = _all_ranks(out, 2)
    assert set(full) == set(state)
    for name, t in full.items():
        assert _same_bytes(t, state[name]), name
    # the split is real: attention and expert shards are half the size on each rank
    q = next(n for n in state if n.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")))
    assert images[1].tensors[q].shape[0] * 2 == state[q].shape[0]
    assert not torch.equal(images[0].view(q), images[1].view(q))
    if mt in MOE:
        gu = next(n for n in state if n.endswith("experts.gate_up_proj"))
        assert images[0].tensors[gu].shape == (state[gu].shape[0], state[gu].shape[1] // 2, state[gu].shape[2])
        inter = state[gu].shape[1] // 2
        # rank 1 holds the second half of gate rows followed by the second half of up rows
        expected = torch.cat([state[gu][:, inter // 2:inter], state[gu][:, inter + inter // 2:]], dim=1)
        assert _same_bytes(images[1].view(gu), expected)
    for im in images:
        assert im.metadata.parallel.tp_size == 2 and im.metadata.parallel.world_size == 2


@pytest.mark.parametrize("mt", MOE)
def test_ep2_each_rank_holds_its_experts(models, tmp_path, mt):
    ckpt, state, config = models[mt]
    out, _ = _pack(models, tmp_path, mt, ep=2)
    images, full = _all_ranks(out, 2)
    for name, t in full.items():
        assert _same_bytes(t, state[name]), name
    for rank, im in enumerate(images):
        em = im.metadata.experts
        n_local = em.num_experts // 2
        assert (em.local_start, em.local_count) == (rank * n_local, n_local)
        assert em.local_index(rank * n_local + 1) == 1
        for name, e in im.tensors.items():
            if e.region == "experts":
                assert _same_bytes(im.view(name), state[name][rank * n_local:(rank + 1) * n_local]), name
            else:  # attention is not split at tp=1: every rank holds it whole
                assert _same_bytes(im.view(name), state[name]), name
    with pytest.raises(LayoutError, match="expert 0 is not on this rank"):
        images[1].metadata.experts.local_index(0)


def test_tp2_ep2_splits_experts_not_intermediates(models, tmp_path):
    ckpt, state, config = models["qwen3_moe"]
    out, _ = _pack(models, tmp_path, "qwen3_moe", tp=2, ep=2)
    images, full = _all_ranks(out, 2)
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    assert images[1].tensors[gu].shape == (4, state[gu].shape[1], 64)
    assert _same_bytes(images[1].view(gu), state[gu][4:])
    assert all(_same_bytes(t, state[n]) for n, t in full.items())


def test_kv_heads_replicated_when_tp_exceeds_them(models, tmp_path):
    ckpt, state, config = models["qwen3_moe"]  # 4 query heads, 2 kv heads
    out, _ = _pack(models, tmp_path, "qwen3_moe", tp=4)
    images, full = _all_ranks(out, 4)
    k = "model.layers.1.self_attn.k_proj.weight"
    assert _same_bytes(images[0].view(k), images[1].view(k))
    assert not torch.equal(images[1].view(k), images[2].view(k))
    assert _same_bytes(images[2].view(k), state[k][16:32])
    assert all(_same_bytes(t, state[n]) for n, t in full.items())


def test_sglang_target_names_and_bytes(models, tmp_path):
    ckpt, state, config = models["qwen3_moe"]
    src = load_file(ckpt / "model.safetensors")
    out, _ = _pack(models, tmp_path, "qwen3_moe", target="sglang")
    with read_image(out) as im:
        a = "model.layers.0.self_attn."
        assert f"{a}qkv_proj.weight" in im.tensors and f"{a}q_proj.weight" not in im.tensors
        qkv = torch.cat([src[f"{a}q_proj.weight"], src[f"{a}k_proj.weight"], src[f"{a}v_proj.weight"]])
        assert _same_bytes(im.view(f"{a}qkv_proj.weight"), qkv)
        w13 = im.view("model.layers.0.mlp.experts.w13_weight")
        gate_up = torch.stack([torch.cat([src[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                                          src[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]]) for e in range(8)])
        assert _same_bytes(w13, gate_up)
        w2 = torch.stack([src[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(8)])
        assert _same_bytes(im.view("model.layers.0.mlp.experts.w2_weight"), w2)
        assert {e.region for n, e in im.tensors.items() if ".experts.w" in n} == {"experts"}


def test_sglang_mixtral_keeps_block_sparse_moe_and_tp2_reassembles(models, tmp_path):
    ckpt, state, config = models["mixtral"]
    src = load_file(ckpt / "model.safetensors")
    out, _ = _pack(models, tmp_path, "mixtral", tp=2, target="sglang")
    images, full = _all_ranks(out, 2)
    assert "model.layers.0.block_sparse_moe.experts.w13_weight" in images[0].tensors
    assert "model.layers.0.block_sparse_moe.gate.weight" in images[0].tensors
    for name, t in full.items():
        if name.endswith("w13_weight"):
            assert _same_bytes(t, state[name.replace("block_sparse_moe", "mlp").replace("w13_weight",
                                                                                        "gate_up_proj")])
        elif name.endswith("w2_weight"):
            assert _same_bytes(t, state[name.replace("block_sparse_moe", "mlp").replace("w2_weight", "down_proj")])
        else:  # stacked q|k|v parts come back under their checkpoint names
            assert _same_bytes(t, src[name]), name
    assert set(full) >= {"model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight"}


def test_sglang_deepseek_fuses_mla_a_projections(models, tmp_path):
    ckpt, state, config = models["deepseek_v3"]
    src = load_file(ckpt / "model.safetensors")
    out, _ = _pack(models, tmp_path, "deepseek_v3", tp=2, target="sglang")
    images, full = _all_ranks(out, 2)
    fused = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
    expected = torch.cat([src["model.layers.0.self_attn.q_a_proj.weight"],
                          src["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]])
    assert _same_bytes(images[1].view(fused), expected)  # replicated, not split
    assert "model.layers.0.mlp.gate_up_proj.weight" in images[0].tensors  # dense layer 0
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in images[0].tensors
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert _same_bytes(full[name], src[name])


def test_deepseek_skips_multi_token_prediction_layers(models, tmp_path):
    ckpt, state, config = models["deepseek_v3"]
    mtp = tmp_path / "with-mtp"
    mtp.mkdir()
    for f in ckpt.iterdir():
        (mtp / f.name).write_bytes(f.read_bytes())
    save_file({"model.layers.2.eh_proj.weight": torch.ones(64, 128)}, mtp / "mtp.safetensors")
    report = prepack(mtp, tmp_path / "out", progress=False)
    assert list(report.skipped) == ["model.layers.2.eh_proj.weight"]
    assert any("not written" in w for w in report.warnings)
    assert "model.layers.2.eh_proj.weight" not in read_image(tmp_path / "out").tensors


# ------------------------------------------------------------------------------ generic & registry
def _synthetic(path, model_type="unknown_arch"):
    path.mkdir()
    save_file({"w.weight": torch.randn(8, 4), "b": torch.arange(5)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def test_unknown_family_falls_back_to_generic_and_says_so(tmp_path):
    ckpt = _synthetic(tmp_path / "ckpt")
    report = prepack(ckpt, tmp_path / "out", progress=False)
    assert report.family == "generic" and report.fallback
    assert "no family rules for model_type 'unknown_arch'" in report.warnings[0]
    meta = read_image_metadata(tmp_path / "out")
    assert meta.family.fallback and meta.family.model_type == "unknown_arch"
    assert meta.family.warning == report.warnings[0] and meta.warnings == (report.warnings[0],)
    assert json.loads((tmp_path / "out" / "prepack.json").read_text())["warnings"] == report.warnings


def test_generic_refuses_tp_and_ep(tmp_path):
    ckpt = _synthetic(tmp_path / "ckpt")
    for tp, ep in ((2, 1), (1, 2)):
        with pytest.raises(LayoutError, match=f"family generic has no sharding rules: tp={tp}, ep={ep} refused"):
            prepack(ckpt, tmp_path / "out", tp, ep, progress=False)
    assert not (tmp_path / "out" / "rank-0").exists()


def test_family_rules_refuse_what_they_cannot_split(models, tmp_path):
    with pytest.raises(LayoutError, match="8 experts over ep=3"):
        _pack(models, tmp_path, "qwen3_moe", tp=1, ep=3)
    with pytest.raises(LayoutError, match="num_attention_heads=4 does not split over tp=8"):
        _pack(models, tmp_path, "qwen3_moe", tp=8)
    ckpt = models["qwen3_moe"][0]
    cp = open_checkpoint(ckpt)
    ctx = PlanContext(cp.config, dict(cp.tensors), ParallelLayout(0, 2), "sglang")
    ctx.sources["model.layers.0.mystery.weight"] = replace(ctx.sources["model.norm.weight"],
                                                           name="model.layers.0.mystery.weight")
    with pytest.raises(LayoutError, match="no tensor-parallel rule for 'model.layers.0.mystery.weight'"):
        get_family("qwen3_moe").plan(ctx)


def test_missing_expert_refused(models, tmp_path):
    ckpt = models["mixtral"][0]
    src = load_file(ckpt / "model.safetensors")
    del src["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(src, bad / "model.safetensors")
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(LayoutError, match=r"model.layers.1.block_sparse_moe.experts.\*.up .*missing \[2\]"):
        prepack(bad, tmp_path / "out", progress=False)


def _bad_moe(models, tmp_path, change_src=None, change_config=None):
    ckpt = models["qwen3_moe"][0]
    src, config = load_file(ckpt / "model.safetensors"), json.loads((ckpt / "config.json").read_text())
    (change_src or (lambda s: None))(src)
    (change_config or (lambda c: None))(config)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(src, bad / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(config))
    return bad


def test_a_config_claiming_a_trillion_experts_is_refused_without_listing_them(models, tmp_path):
    """The set of every expert number the config claims had been built: 10^12 of them exhausted
    memory before any message."""
    bad = _bad_moe(models, tmp_path, change_config=lambda c: c.update(num_experts=10**12))
    with pytest.raises(LayoutError, match=r"config says 1,000,000,000,000 experts, the checkpoint has 8 of them; "
                                          r"missing \[8, 9, 10, 11, 12, 13, 14, 15\]\.\.\."):
        prepack(bad, tmp_path / "out", progress=False)


def test_an_expert_spelled_twice_is_refused_by_both_names(models, tmp_path):
    """experts.7 and experts.07 are one expert: one of them was dropped without a word."""
    name = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    bad = _bad_moe(models, tmp_path, change_src=lambda s: s.__setitem__(name.format("07"), s[name.format(7)] + 1))
    with pytest.raises(LayoutError, match=r"'model.layers.0.mlp.experts.0?7.gate_proj.weight' and "
                                          r"'model.layers.0.mlp.experts.0?7.gate_proj.weight' are both expert 7"):
        prepack(bad, tmp_path / "out", progress=False)


def test_registry():
    fams = list_families()
    assert {"generic", "qwen3_moe", "mixtral", "deepseek_v3", "llama"} <= set(fams)
    assert family_for("qwen3_moe").family.name == "qwen3_moe" and not family_for("qwen3_moe").fallback
    assert family_for(None).fallback
    with pytest.raises(UnknownNameError, match="unknown family 'nope'; known: deepseek_v3, generic"):
        get_family("nope")

    class Clash(Family):
        name = "clash"
        model_types = ("mixtral",)

        def plan(self, ctx):
            return RankPlan(ctx.parallel, [])

    with pytest.raises(Exception, match="model_type 'mixtral' is already claimed by family 'mixtral'"):
        register_family(Clash)


def test_check_plan_catches_a_broken_family(models):
    ckpt = open_checkpoint(models["llama"][0])
    src = ckpt.tensors["model.norm.weight"]
    gap = PlannedTensor("x", src.dtype, (128,), "non_experts", [Piece(src.name, ((0, 64),), 0)])
    with pytest.raises(LayoutError, match="pieces fill 64 of 128 elements"):
        check_plan(RankPlan(ParallelLayout(0), [gap]), ckpt.tensors, "broken")
    overlap = PlannedTensor("x", src.dtype, (64,), "non_experts",
                            [Piece(src.name, ((0, 40),), 0), Piece(src.name, ((0, 40),), 24)])
    with pytest.raises(LayoutError, match="unfilled or overlap"):
        check_plan(RankPlan(ParallelLayout(0), [overlap]), ckpt.tensors, "broken")
    wrong_dtype = PlannedTensor("x", "int8", (64,), "non_experts", [Piece(src.name, ((0, 64),), 0)])
    with pytest.raises(LayoutError, match="is float32, the tensor is int8"):
        check_plan(RankPlan(ParallelLayout(0), [wrong_dtype]), ckpt.tensors, "broken")


def test_checkpoint_with_fused_experts_on_disk(models, tmp_path):
    """A checkpoint saved in the module's own fused form (experts.gate_up_proj [E, 2I, H])."""
    ckpt, state, config = models["qwen3_moe"]
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, fused / "model.safetensors")
    (fused / "config.json").write_text((ckpt / "config.json").read_text())
    out = tmp_path / "out"
    prepack(fused, out, tp=4, ep=2, progress=False)  # 2 expert blocks x 2-way intermediate split
    images, full = _all_ranks(out, 4)
    gu = "model.layers.1.mlp.experts.gate_up_proj"
    assert images[3].tensors[gu].region == "experts" and images[3].tensors[gu].shape == (4, 32, 64)
    assert all(_same_bytes(t, state[n]) for n, t in full.items()) and set(full) == set(state)


@pytest.mark.parametrize("absent", ["missing", "null"])
def test_a_config_without_kv_heads_splits_as_transformers_reads_it(tmp_path, absent):
    """transformers reads no num_key_value_heads (LLaMA-1 conversions) or null as one KV head per
    attention head; tp=2 had been refused ('config.json has no num_key_value_heads')."""
    import json

    ckpt = tmp_path / "ck"
    model = save_tiny_model("llama", ckpt, seed=9, num_key_value_heads=4)  # = num_attention_heads
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_key_value_heads"]
    if absent == "null":
        cfg["num_key_value_heads"] = None
    (ckpt / "config.json").write_text(json.dumps(cfg))
    prepack(ckpt, tmp_path / "out", 2, progress=False)
    images, full = _all_ranks(tmp_path / "out", 2)
    assert set(full) == set(state) and all(_same_bytes(full[n], state[n]) for n in state)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert images[0].tensors[k].shape[0] * 2 == state[k].shape[0]  # split over the 4 KV heads, not replicated
