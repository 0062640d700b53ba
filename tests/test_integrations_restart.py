"""An engine restarted without a reload, through the loader's own path (engine_bind on the host
backend, onto a meta-built ``PlainEngineLikeModel``): the loader option ``holder`` hands the first
engine's arena to a holder, and the restarted engine's early call and load map the held arena and
bind the model to it (no copy); another image or version loads normally with a warning naming why.
Before, the engines' loaders had no way to name a holder: every restart reloaded."""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch

from _clone_helpers import serving_holder
from _image_helpers import rewrite_metadata
from _engine_helpers import (  # noqa: F401  (packed: a fixture)
    PlainEngineLikeModel, _assert_same_tensors, _key, _options, packed,
)
from flashboot.errors import CapabilityError, FlashBootError
from flashboot.flashclone.holder import Holder
from flashboot.flashload import staging
from flashboot.integrations.engine_prepack import (
    LoaderOptions, bind_engine_model, load_engine_weights, memory_saver_policy, prepare_engine_load,
)


@pytest.fixture
def registry(tmp_path):
    path = tmp_path / "registry"
    with serving_holder(Holder(registry=path)):
        yield str(path)


def _held_name(out) -> str:
    from flashboot.flashload.restart import HolderOption

    return HolderOption(registry="-").name_for(out, 0, "cpu")


def _engine(options):
    """One engine start: the early call, its model built on meta, the load and the bind."""
    prepared = prepare_engine_load(options, _key(), 0, "cpu", tp_size=1, ep_size=1)
    with torch.device("meta"):
        model = PlainEngineLikeModel()
    weights = load_engine_weights(options, _key(), 0, "cpu", tp_size=1, ep_size=1, prepared=prepared)
    bind_engine_model(model, weights)
    return prepared, model, weights


def test_a_restarted_engine_binds_the_held_arena_without_a_copy(packed, tmp_path, registry, monkeypatch):
    reference, out, _ = packed
    options = _options(out, tmp_path, holder=registry)
    name = _held_name(out)
    with pytest.warns(RuntimeWarning, match=rf"not restarting from the holder \(nothing is held as '{name}'"):
        prepared, model, weights = _engine(options)
    assert prepared is not None  # nothing held yet: the first engine's early call copies as usual
    assert weights.report.mode != "held" and weights.report.details["handed_over_as"] == name
    _assert_same_tensors(reference, model)
    arena_id = weights.arena.arena_id
    weights.close()  # the engine exits; the holder keeps its memory

    staged = []
    real = staging.stage_for_load
    monkeypatch.setattr(staging, "stage_for_load", lambda *a, **k: staged.append(a) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a restart says nothing
        prepared, model, weights = _engine(options)
    try:
        assert prepared is None  # held: no early arena, no copy to throw away
        assert staged == [], "the restart staged the image from disk first, to throw it away"
        assert weights.report.mode == "held" and weights.report.h2d_ms == 0
        assert weights.arena.arena_id == arena_id and weights.arena.imported
        _assert_same_tensors(reference, model)
        lo, hi = weights.arena.ptr, weights.arena.ptr + weights.arena.nbytes
        assert all(lo <= t.data_ptr() < hi for t in list(model.parameters()) + list(model.buffers()))
    finally:
        weights.close()


def test_a_restart_onto_another_pre_pack_loads_it_normally_naming_why(packed, tmp_path, registry):
    reference, out, _ = packed
    options = _options(out, tmp_path, holder=registry)
    with pytest.warns(RuntimeWarning, match="nothing is held"):
        _, _, weights = _engine(options)
    weights.close()
    rank_dir = next(out.glob("rank-0/metadata.json")).parent
    meta = json.loads((rank_dir / "metadata.json").read_text())
    meta["note"] = "re-packed"  # another pre-pack of the same weights
    rewrite_metadata(rank_dir, meta)
    with pytest.warns(RuntimeWarning, match=rf"the arena held as '{_held_name(out)}' is another image or version "
                                            r"\(metadata_sha256: held"):
        _, model, weights = _engine(options)
    try:
        assert weights.report.mode != "held" and weights.report.details["handed_over_as"] == _held_name(out)
        _assert_same_tensors(reference, model)
    finally:
        weights.close()


def test_the_holder_option_is_checked_when_the_options_are_made(tmp_path):
    with pytest.raises(FlashBootError, match="holder= needs exactly one of registry and store"):
        LoaderOptions(image_dir=str(tmp_path), holder={"name": "x"})
    with pytest.raises(FlashBootError, match=r"unknown holder option\(s\) \['registy'\]"):
        LoaderOptions(image_dir=str(tmp_path), holder={"registy": str(tmp_path)})
    with pytest.raises(FlashBootError, match=r"it does not apply to a clone \(seed_store\)"):
        LoaderOptions(seed_store="127.0.0.1:1", holder=str(tmp_path))
    with pytest.raises(FlashBootError, match="it does not apply to mode=prepack"):
        LoaderOptions(image_dir=str(tmp_path), mode="prepack", holder=str(tmp_path))
    options = LoaderOptions.from_extra_config({"image_dir": str(tmp_path), "holder": {"store": "127.0.0.1:5"}})
    assert options.holder == {"store": "127.0.0.1:5"}
    # a held arena is mapped by the holder: the engine's sleep could free none of it
    with pytest.raises(CapabilityError, match=r"kept by a holder across restarts \(holder\): the holder maps it"):
        memory_saver_policy(True, "--enable-memory-saver", options)
    assert memory_saver_policy(False, "--enable-memory-saver", options) is False


def _tp2_image(out):
    """A tp=2 engine image of PlainEngineLikeModel (both ranks pre-packed by threads)."""
    from flashboot.integrations.engine_prepack import RankGroup, prepack_engine_model

    box, barrier, errors = {}, threading.Barrier(2, timeout=30), []

    def broadcast(value, r):
        if r == 0:
            box["v"] = value
        barrier.wait()
        got = box["v"]
        barrier.wait()
        return got

    def rank(r):
        try:
            group = RankGroup(r, 2, broadcast=lambda v: broadcast(v, r), barrier=barrier.wait)
            prepack_engine_model(PlainEngineLikeModel(seed=r), out, _key(tp_size=2), group, device="cpu", tp_size=2,
                                 ep_size=1, source_path="/m", model_type="p", chunk_bytes=4096)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_the_ranks_of_one_engine_given_a_holder_name_each_keep_their_own_arena(tmp_path, registry):
    """The loader options (and so the holder's name) are the same on every rank of a tp=2 engine:
    each rank's hand-over replaced the other's, so the holder kept one rank and every restart of
    the other reloaded it, warning each time."""
    out = tmp_path / "img"
    _tp2_image(out)
    options = _options(out, tmp_path, holder={"registry": registry, "name": "llama"})

    def load(r):
        return load_engine_weights(options, _key(tp_size=2), r, "cpu", tp_size=2, ep_size=1)

    with pytest.warns(RuntimeWarning, match="nothing is held"):
        first = [load(r) for r in range(2)]
    assert [w.report.details["handed_over_as"] for w in first] == ["llama.rank0.cpu", "llama.rank1.cpu"]
    for w in first:
        w.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a restart of each rank says nothing
        again = [load(r) for r in range(2)]
    try:
        assert [w.report.mode for w in again] == ["held", "held"]
        assert [w.section.rank for w in again] == [0, 1]
    finally:
        for w in again:
            w.close()


def test_a_killed_holders_record_does_not_skip_the_early_call(packed, tmp_path, registry):
    """The record of a holder that was killed stays behind it: the early call had been skipped (and
    the staging) for a restart that could only fail, and the load then streamed from disk."""
    import subprocess
    import sys

    from flashboot.flashload.restart import held_here

    reference, out, _ = packed
    options = _options(out, tmp_path, holder=registry)
    with pytest.warns(RuntimeWarning, match="nothing is held"):
        _, _, weights = _engine(options)
    weights.close()
    assert held_here(registry, out, 0, "cpu")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = next((tmp_path / "registry" / "held").glob("*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "holder_pid": dead.pid}))
    assert not held_here(registry, out, 0, "cpu")


def test_every_ask_of_a_holder_store_is_bounded_by_the_options_timeout(packed, tmp_path, monkeypatch):
    """A store that does not answer blocked each of the early call's look, the load's and the
    hand-over 31 s (the store's default), ~90 s for one engine start."""
    from flashboot.errors import RendezvousError
    from flashboot.flashclone import rendezvous

    asked = []

    def connect(address, token=None, **kw):
        asked.append(kw.get("timeout_s"))
        raise RendezvousError(f"nothing answers at {address}")

    monkeypatch.setattr(rendezvous.Rendezvous, "connect", staticmethod(connect))
    _, out, _ = packed
    options = _options(out, tmp_path, holder={"store": "127.0.0.1:9", "handover_timeout_s": 3})
    with pytest.warns(RuntimeWarning):
        _, _, weights = _engine(options)
    weights.close()
    assert asked == [2.0, 3, 3]  # the early call's look (at most 2 s), the load's look, the hand-over
