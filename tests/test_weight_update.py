"""Refit on the host backend (issue 18): publish packs a trainer's tensors into the image's layout
(same family rules and TP/EP slices as pre-pack), engines refit through a real TCPStore, and every
refusal leaves the old weights whole. The reference for the new weights is a from-scratch
pre-pack + load of the same tensors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import flashboot
from flashboot.errors import ChecksumMismatchError, OutOfMemoryError, WaitTimeoutError
from flashboot.weight_update import PublishError, Publisher, RefitError
from flashboot.weight_update.pack import PackTable, pack_per_tensor
from flashboot.weight_update.plan import box_runs

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import spawn_python, finish

pytestmark = pytest.mark.timeout(120)


def _new_weights(ckpt, scale: float, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, t in load_file(f).items():
            out[name] = (t.float() + scale * torch.randn(t.shape, generator=g)).to(t.dtype)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen3-MoE (experts, attention, norms) in bf16, pre-packed for tp=2 x ep=2."""
    from flashboot.layouts.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("refit")
    save_tiny_model("qwen3_moe", root / "ckpt", dtype=torch.bfloat16)
    flashboot.prepack(root / "ckpt", root / "img", tp=2, ep=2, progress=False, chunk_bytes=64 << 10)
    return root


def _reference(root, name: str, tensors: dict, rank: int):
    """The rank's tensors as a fresh pre-pack + load of ``tensors`` gives them."""
    import shutil

    from safetensors.torch import save_file

    ckpt = root / f"ckpt-{name}"
    if not ckpt.exists():
        ckpt.mkdir()
        shutil.copy(root / "ckpt" / "config.json", ckpt / "config.json")
        save_file({k: v.contiguous() for k, v in tensors.items()}, ckpt / "model.safetensors")
        flashboot.prepack(ckpt, root / f"img-{name}", tp=2, ep=2, progress=False, chunk_bytes=64 << 10)
    return flashboot.load(root / f"img-{name}", rank=rank, device="cpu")


def _shuffled(tensors: dict) -> list:
    items = list(tensors.items())
    random.Random(7).shuffle(items)
    return items


def _snapshot(loaded) -> dict[str, torch.Tensor]:
    return {n: v.clone() for n, v in loaded.tensors.items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.bool else a[n], b[n]), n


# ------------------------------------------------------------------------------------ the plan


def test_box_runs_match_numpy_slicing():
    """Every box of a strided tensor becomes runs whose bytes are numpy's slice, in C order."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 4 * 6 * 10 * 2, dtype=np.uint8)
    full = base.view(np.int16).reshape(4, 6, 10)
    for box in [((0, 4), (0, 6), (0, 10)), ((1, 3), (0, 6), (0, 10)), ((0, 4), (2, 5), (0, 10)),
                ((0, 4), (0, 6), (3, 7)), ((1, 2), (1, 4), (2, 9)), ((0, 4), (0, 6), (0, 0))]:
        want = np.ascontiguousarray(full[tuple(slice(a, b) for a, b in box)]).view(np.uint8).ravel()
        got = np.zeros(want.size, np.uint8)
        for dst, src, nbytes, run, stride in box_runs((4, 6, 10), (60, 10, 1), 2, box, 0, 0, "t"):
            n_runs = nbytes // run
            for k in range(n_runs):
                got[dst + k * run:dst + (k + 1) * run] = base[src + k * stride:src + k * stride + run]
        assert np.array_equal(got, want), box


def test_box_runs_refuse_a_non_contiguous_last_dim():
    with pytest.raises(PublishError, match="'w'.*stride 4, not 1.*contiguous"):
        box_runs((4, 4), (1, 4), 2, ((0, 4), (0, 4)), 0, 0, "tensor 'w'")


# ---------------------------------------------------------------------- publish -> refit, byte-exact


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("atomic", [True, False])
def test_refit_gives_the_bytes_of_a_fresh_prepack(model, store, atomic, device):
    """Rank 1 of tp=2 x ep=2: column and row slices (strided table rows), an expert block."""
    address, _ = store
    new = _new_weights(model / "ckpt", 0.5, seed=1)
    loaded = flashboot.load(model / "img", rank=1, device=device)
    views_before = {n: v.data_ptr() for n, v in loaded.tensors.items()}
    try:
        with Publisher(model / "img", 1, store=address, device=device) as pub:
            rep = pub.publish(_shuffled({n: t.to(device) for n, t in new.items()}), version=1)
            assert rep.nbytes > 0 and rep.rows >= rep.tensors // 4
            report = loaded.refit(address, 1, atomic=atomic, timeout_s=30)
        assert loaded.version == 1 and report.version == 1 and report.atomic is atomic
        assert report.nbytes == loaded.metadata.image_nbytes and report.transport == "posix_fd"
        assert {n: v.data_ptr() for n, v in loaded.tensors.items()} == views_before  # same views, new bytes
        with _reference(model, "v1", new, rank=1) as ref:
            _equal({n: t.cpu() for n, t in _snapshot(loaded).items()}, _snapshot(ref))
    finally:
        loaded.close()


def test_pack_kernel_host_numpy_and_per_tensor_copy_agree(model):
    """The Triton table kernel (interpreter, several programs, tile -> row map), numpy over the
    same rows and a copy_ per piece write the same image bytes."""
    from flashboot.arena import Arena
    from flashboot.kernels.copy_table import CopyTable
    from flashboot.weight_update.pack import pack_rows_host

    new = _new_weights(model / "ckpt", 0.25, seed=2)
    with Publisher(model / "img", 0, store="127.0.0.1:1", device="cpu", token="x" * 16) as pub:
        plan = pub.plan(new)
        meta = pub.metadata
        arenas = [Arena.create(meta.image_nbytes, "cpu") for _ in range(3)]
        try:
            tables = [PackTable(plan, new, a) for a in arenas[:2]]
            with pytest.raises(PublishError, match=r"unknown knob\(s\) \['warps'\]"):
                PackTable(plan, new, arenas[0], tuning={"warps": 8})
            rows = tables[0].rows
            assert (rows[:, 3] < rows[:, 2]).any() and (rows[:, 3] == rows[:, 2]).any()  # strided and whole rows
            k = dict(block_bytes=4096, num_warps=4, num_stages=1, programs_per_sm=1)
            CopyTable(tables[0].rows[:, :3], runs=tables[0].rows[:, 3:], device=arenas[0].device, kind="sm",
                      **k).launch(0)
            pack_rows_host(tables[1].rows)
            pack_per_tensor(plan, new, arenas[2])
            images = [a.bytes().numpy()[:meta.image_nbytes] for a in arenas]
            assert images[0].any()
            assert np.array_equal(images[0], images[1]) and np.array_equal(images[1], images[2])
        finally:
            for a in arenas:
                a.close()


# ------------------------------------------------------------------------------- bad input


def test_publish_refuses_before_writing(model, store):
    address, _ = store
    new = _new_weights(model / "ckpt", 0.5, seed=3)
    with Publisher(model / "img", 0, store=address, device="cpu") as pub:
        pub.arena.bytes().numpy()[:] = 0x5A
        name = "model.layers.0.self_attn.q_proj.weight"
        with pytest.raises(PublishError, match=r"q_proj\.weight dim 0: dimension of size 63 does not split"):
            pub.publish(dict(new, **{name: new[name][:-1]}), version=1)
        norm = "model.layers.0.input_layernorm.weight"
        with pytest.raises(PublishError, match=r"input_layernorm\.weight.*bfloat16 \[62\] from the tensors given, "
                                               r"bfloat16 \[64\] in the image; nothing was written"):
            pub.publish(dict(new, **{norm: new[norm][:-2]}), version=1)
        bad_dtype = dict(new, **{name: new[name].float()})
        with pytest.raises(PublishError, match=r"q_proj"):
            pub.publish(bad_dtype, version=1)
        with pytest.raises(PublishError, match=r"'model\.layers\.0\.post_norm\.weight'.* not in the manifest of "
                                               r"ckpt rank 0"):
            pub.publish(dict(new, **{"model.layers.0.post_norm.weight": torch.zeros(64, dtype=torch.bfloat16)}), 1)
        with pytest.raises(PublishError, match=r"no tensor-parallel rule for 'extra\.weight'"):
            pub.publish(dict(new, **{"extra.weight": torch.zeros(4, dtype=torch.bfloat16)}), version=1)
        missing = {k: v for k, v in new.items() if k != "model.norm.weight"}
        with pytest.raises(PublishError, match=r"'model\.norm\.weight'.*get no bytes"):
            pub.publish(missing, version=1)
        with pytest.raises(PublishError, match="given twice"):
            pub.publish([(name, new[name]), (name, new[name])], version=1)
        assert (pub.arena.bytes().numpy() == 0x5A).all() and pub.seed is None and pub.version == 0
        pub.publish(new, version=2)
        with pytest.raises(PublishError, match="version 2 is not newer than version 2"):
            pub.publish(new, version=2)


def test_refit_refusals_leave_the_old_weights(model, store, monkeypatch):
    address, _ = store
    new = _new_weights(model / "ckpt", 0.5, seed=4)
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    before = _snapshot(loaded)
    try:
        with Publisher(model / "img", 1, store=address, device="cpu") as other_rank:
            other_rank.publish(new, version=1)  # rank 1's bytes, where the rank-0 engine looks
            with pytest.raises(RefitError, match="published for rank 1; this engine serves rank 0; nothing was copied"):
                loaded.refit(address, 1, timeout_s=10)
        with pytest.raises(WaitTimeoutError, match="trainer's publish of version 3"):
            loaded.refit(address, 3, timeout_s=0.5)
        with Publisher(model / "img", 0, store=address, device="cpu") as pub:
            pub.publish(new, version=2)
            pub.arena.bytes().numpy()[4096] ^= 0xFF  # the published arena changes before the engine copies it
            with pytest.raises(ChecksumMismatchError, match="chunk 0"):
                loaded.refit(address, 2, timeout_s=10)
            _equal(_snapshot(loaded), before)
            assert loaded.version == 0
            pub.arena.bytes().numpy()[4096] ^= 0xFF
            from flashboot.arena import backing_host

            with monkeypatch.context() as m:
                m.setattr(backing_host, "_host_mem_available", lambda: 1 << 20)
                with pytest.raises(OutOfMemoryError, match=r"atomic refit stages one image.*atomic=False\) copies "
                                                           r"in place.*needs 2,097,152 bytes but only 1,048,576"):
                    loaded.refit(address, 2, timeout_s=10)
            _equal(_snapshot(loaded), before)
            loaded.refit(address, 2, timeout_s=10)
            with pytest.raises(RefitError, match="version 2 is not newer than the live version 2"):
                loaded.refit(address, 2, timeout_s=10)
            loaded.arena.share("holder pid 42")
            with pytest.raises(RefitError, match=r"cannot remap this arena .*\(holder pid 42\).*nothing was copied"):
                loaded.refit(address, 3, timeout_s=10)
            loaded.arena.unshare("holder pid 42")
            loaded.sleep(level=2)
            with pytest.raises(RefitError, match="asleep.*wake\\(\\) it, then refit"):
                loaded.refit(address, 3, timeout_s=10)
    finally:
        loaded.close()
    for atomic in (True, False):  # had said "the old weights are serving", or "a mix of versions"
        with pytest.raises(RefitError, match="to version 3: its arena is closed .*; nothing was copied$"):
            loaded.refit(address, 3, timeout_s=10, atomic=atomic)


def test_publish_for_another_image_is_refused(model, store, tmp_path):
    """A record whose image key is not the engine's: refused before any byte moves."""
    from flashboot.layouts.tiny import save_tiny_model

    address, _ = store
    save_tiny_model("qwen3_moe", tmp_path / "ckpt", dtype=torch.bfloat16, seed=5)
    flashboot.prepack(tmp_path / "ckpt", tmp_path / "img", tp=2, ep=2, progress=False, chunk_bytes=64 << 10,
                      model_id="org/other")
    new = _new_weights(tmp_path / "ckpt", 0.1, seed=6)
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    before = _snapshot(loaded)
    try:
        with Publisher(tmp_path / "img", 0, store=address, device="cpu") as pub:
            pub.publish(new, version=1)
            with pytest.raises(RefitError, match=r"image key .*\(org/other\); this engine serves"):
                loaded.refit(address, 1, timeout_s=10)
        _equal(_snapshot(loaded), before)
    finally:
        loaded.close()


def test_trainer_dying_mid_publish_times_out_naming_the_step(model, store):
    """The trainer process is killed while packing: the engine's wait ends naming the publish."""
    address, _ = store
    code = f"""
import os, signal, torch
from flashboot.weight_update import Publisher
import flashboot.weight_update.pack as pack
pub = Publisher({str(model / 'img')!r}, 0, store={address!r}, device="cpu")
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
pack.pack_rows_host = die
from flashboot.weight_update import publish as p
from safetensors.torch import load_file
import glob
t = {{}}
for f in glob.glob({str(model / 'ckpt' / '*.safetensors')!r}):
    t.update(load_file(f))
pub.publish(t, version=1)
"""
    proc = spawn_python(code)
    rc, out, err = finish(proc, 60)
    assert rc == -9, err
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    try:
        with pytest.raises(WaitTimeoutError, match="trainer's publish of version 1"):
            loaded.refit(address, 1, timeout_s=1)
        assert loaded.version == 0
    finally:
        loaded.close()


def test_two_engines_refit_as_a_chain(model, store):
    """Two engines of one rank take version 1 together: the second copies from the first."""
    import threading

    address, _ = store
    new = _new_weights(model / "ckpt", 0.5, seed=8)
    engines = [flashboot.load(model / "img", rank=0, device="cpu") for _ in range(2)]
    reports, errors = {}, []

    def refit(i):
        try:
            reports[i] = engines[i].refit(address, 1, schedule="chain", clones=2, timeout_s=60)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    try:
        with Publisher(model / "img", 0, store=address, device="cpu") as pub:
            pub.publish(_shuffled(new), version=1)
            threads = [threading.Thread(target=refit, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        assert not errors, errors
        assert sorted(r.position for r in reports.values()) == [1, 2]
        assert {r.details["source"] for r in reports.values()} == {"seed", "clone #1"}
        with _reference(model, "chain", new, rank=0) as ref:
            want = _snapshot(ref)
            for e in engines:
                _equal(_snapshot(e), want)
    finally:
        for e in engines:
            e.close()


def test_the_published_arena_changing_during_a_refit_fails_its_checksums(model, store, monkeypatch):
    """The trainer overwrites its arena's last chunk while the engine is still copying the first
    ones (each pipeline step slowed): the copy verifies against the published checksums, the refit
    is refused and the engine keeps the old weights."""
    import threading
    import time

    address, _ = store
    new = _new_weights(model / "ckpt", 0.5, seed=9)
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    before = _snapshot(loaded)
    monkeypatch.setenv("FLASHBOOT_TEST_STEP_DELAY_S", "0.05")
    try:
        with Publisher(model / "img", 0, store=address, device="cpu") as pub:
            pub.publish(new, version=1)
            last = loaded.metadata.image_nbytes - 64

            def overwrite():
                time.sleep(0.15)
                pub.arena.bytes().numpy()[last:last + 64] ^= 0xFF

            t = threading.Thread(target=overwrite)
            t.start()
            with pytest.raises(ChecksumMismatchError, match=r"chunk \d+"):
                loaded.refit(address, 1, chunk_bytes=64 << 10, timeout_s=30)
            t.join(30)
        _equal(_snapshot(loaded), before)
        assert loaded.version == 0 and loaded.refit_sources == {}  # a trainer that failed us is not kept mapped
    finally:
        loaded.close()


def test_the_trainers_arena_stays_mapped_from_one_version_to_the_next(model, store):
    """A trainer publishes every version from one arena: the engine maps it once, the next refit
    reads the same mapping (no segment mapped again) and gets the new bytes; a trainer's new arena
    replaces the mapping, and closing the engine releases it."""
    address, _ = store
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    try:
        with Publisher(model / "img", 0, store=address, device="cpu") as pub:
            pub.publish(_new_weights(model / "ckpt", 0.5, seed=11), version=1)
            loaded.refit(address, 1, timeout_s=30)
            [held] = loaded.refit_sources.values()
            assert held.mapped_nbytes == held.nbytes
            mapped = held.map_stats["segments"]
            v2 = _new_weights(model / "ckpt", 0.5, seed=12)
            pub.publish(v2, version=2)
            loaded.refit(address, 2, atomic=False, timeout_s=30)
            assert list(loaded.refit_sources.values()) == [held] and held.map_stats["segments"] == mapped
            with _reference(model, "held", v2, rank=0) as ref:
                _equal(_snapshot(loaded), _snapshot(ref))
        with Publisher(model / "img", 0, store=address, device="cpu") as other:
            other.publish(_new_weights(model / "ckpt", 0.5, seed=13), version=3)
            loaded.refit(address, 3, timeout_s=30)
            [now] = loaded.refit_sources.values()
            assert now is not held and held.closed and now.arena_id == other.arena.arena_id
    finally:
        loaded.close()
    assert loaded.refit_sources == {} and now.closed


def test_sleep_releases_the_trainers_arena_and_the_next_refit_maps_it_again(model, store):
    """A sleeping engine frees the GPU's memory for the trainer: the trainer's arena, mapped for
    the next refit, is released too (it kept the trainer's memory in use after its own release);
    after the wake, the next refit maps it again and gets its bytes."""
    address, _ = store
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    try:
        with Publisher(model / "img", 0, store=address, device="cpu") as pub:
            pub.publish(_new_weights(model / "ckpt", 0.5, seed=21), version=1)
            loaded.refit(address, 1, timeout_s=30)
            [held] = loaded.refit_sources.values()
            loaded.sleep(level=1)
            assert loaded.refit_sources == {} and held.closed
            loaded.wake()
            v2 = _new_weights(model / "ckpt", 0.5, seed=22)
            pub.publish(v2, version=2)
            loaded.refit(address, 2, atomic=False, timeout_s=30)
            [again] = loaded.refit_sources.values()
            assert again is not held and loaded.version == 2
            with _reference(model, "slept", v2, rank=0) as ref:
                _equal(_snapshot(loaded), _snapshot(ref))
    finally:
        loaded.close()


def test_a_swap_by_handover_releases_the_outgoing_trainers_arena(model, store):
    """A swap that hands the outgoing arena's segments over (CUDA only, so its outgoing side is
    called here directly) frees the trainer's arena as a sleep does: it had kept the trainer's
    memory in use after the outgoing image slept."""
    from flashboot.flashload.swapping import _handover_sleep

    address, _ = store
    loaded = flashboot.load(model / "img", rank=0, device="cpu")
    try:
        with Publisher(model / "img", 0, store=address, device="cpu") as pub:
            pub.publish(_new_weights(model / "ckpt", 0.5, seed=23), version=1)
            loaded.refit(address, 1, timeout_s=30)
            [held] = loaded.refit_sources.values()
            assert not held.closed
            report = _handover_sleep(loaded, 2)
            assert report.level == 2 and loaded.refit_sources == {} and held.closed
    finally:
        loaded.close()


def test_refit_over_a_transport_that_runs_the_copy_itself(model, store):
    """The transports registry decides: over the broadcast fallback (gloo here) the copy still lands
    in the staging arena, is verified and remapped under the same views."""
    address, _ = store
    new = _new_weights(model / "ckpt", 0.5, seed=10)
    loaded = flashboot.load(model / "img", rank=1, device="cpu")
    ptrs = {n: v.data_ptr() for n, v in loaded.tensors.items()}
    try:
        with Publisher(model / "img", 1, store=address, device="cpu", serve_nccl=True) as pub:
            pub.publish(new, version=1)
            report = loaded.refit(address, 1, transport="nccl", timeout_s=30)
            assert report.transport == "nccl" and report.remap_ms >= 0 and pub.seed.nccl_served == 1
        assert {n: v.data_ptr() for n, v in loaded.tensors.items()} == ptrs
        with _reference(model, "nccl", new, rank=1) as ref:
            _equal(_snapshot(loaded), _snapshot(ref))
    finally:
        loaded.close()
