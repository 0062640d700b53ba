"""The engine-image machinery both engine loaders share (flashboot.integrations.engine_prepack),
engine-agnostic: collecting an engine model's tensors, the engine image (a layouts image with an
engine section) and its key, the refusals of another, missing, edited or engine-less image, and the
job protocol of a pre-pack written by two ranks. Run everywhere on ``PlainEngineLikeModel``, a plain
``torch.nn.Module`` (_engine_helpers.py); loading and binding are in test_integrations_engine_load.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from _engine_helpers import PlainEngineLikeModel, _key, _options, packed  # noqa: F401  (packed: a fixture)
from _image_helpers import rewrite_metadata
from flashboot.errors import LayoutError
from flashboot.integrations.engine_prepack import (
    RankGroup, check_engine_key, collect_engine_tensors, load_engine_weights, prepack_engine_model,
    read_engine_section, read_job_engine_key,
)


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


def test_check_engine_key_accepts_the_same_key():
    check_engine_key(_key(), _key(), "x")
    with pytest.raises(LayoutError, match="ep_size: engine 2, image 1"):
        check_engine_key(_key(), _key(ep_size=2), "x")
