"""FlashLoad and bind: staged image -> arena -> views -> a transformers model, on the host backend
(and on CUDA where present: tests marked gpu)."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from flashboot.layouts import read_image
from flashboot.layouts.image import reassemble
from flashboot.layouts.tiny import save_tiny_model, tiny_config

import flashboot
from flashboot.errors import (
    ChecksumMismatchError,
    FlashBootError,
    LayoutError,
    OutOfMemoryError,
    WaitTimeoutError,
)
from flashboot.flashload import client, service, staging
from flashboot.flashload import shm as shm_files
from flashboot.flashload.landing import admit
from flashboot.memory import CPU

CHUNK = 16384
PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def _meta_model(model_type, **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen3-MoE (random weights, save_pretrained), pre-packed at tp=1 and tp=2, staged."""
    root = tmp_path_factory.mktemp("load")
    save_tiny_model("qwen3_moe", root / "hf", dtype=torch.bfloat16)
    flashboot.prepack(str(root / "hf"), str(root / "tp1"), chunk_bytes=CHUNK, progress=False)
    flashboot.prepack(str(root / "hf"), str(root / "tp2"), tp=2, chunk_bytes=CHUNK, progress=False)
    shm = root / "shm"
    staging.preload(staging.PreloadConfig(str(root / "tp1"), shm_dir=str(shm)))
    staging.preload(staging.PreloadConfig(str(root / "tp2"), shm_dir=str(shm)))
    return root


@pytest.fixture(scope="module")
def reference(qwen):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen / "hf", dtype=torch.bfloat16).eval()


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------------- load
def test_load_gives_views_of_the_image_in_one_arena(qwen):
    shm = qwen / "shm"
    img = read_image(qwen / "tp1", 0)
    with flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=shm) as loaded:
        assert loaded.arena.device == CPU and loaded.nbytes == img.nbytes
        assert set(loaded.tensors) == set(img.tensors)
        lo, hi = loaded.arena.ptr, loaded.arena.ptr + loaded.arena.nbytes
        for name, t in loaded.tensors.items():
            e = img.tensors[name]
            assert t.data_ptr() == lo + e.offset and t.data_ptr() + e.nbytes <= hi  # zero-copy views
            assert tuple(t.shape) == e.shape and t.stride() == e.stride
            assert torch.equal(_bytes(t), _bytes(img.view(name)))
        r = loaded.report
        assert r.mode == "host" and r.rank == 0 and r.nbytes == img.nbytes and r.tensors == len(img.tensors)
        assert r.h2d_ms > 0 and r.bind_ms > 0 and r.total_ms >= r.h2d_ms + r.wait_ms
        assert r.pin_ms == 0  # nothing to pin on the host backend
        assert r.details["io_mode"] in ("o_direct", "buffered")
        assert "h2d" in r.phases() and f"{img.nbytes:,} bytes" in r.summary()
    assert loaded.arena.closed and loaded.tensors == {}


def test_pin_early_returns_at_once_and_load_waits_for_it(qwen, tmp_path):
    image = Path(shutil.copytree(qwen / "tp1", tmp_path / "image"))
    shm = tmp_path / "shm"
    staged = flashboot.stage(image, 0, "cpu", timeout_s=30, shm_dir=shm)
    assert not staged.done, "stage() must not wait for the preloader"
    threading.Timer(0.2, lambda: staging.preload(staging.PreloadConfig(str(image), shm_dir=str(shm)))).start()
    with staged:
        loaded = flashboot.load(image, 0, "cpu", staged=staged, shm_dir=shm, timeout_s=30)
        assert staged.done and loaded.report.mode == "host (staged early)"
        assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == read_image(image, 0).path.read_bytes()
        loaded.close()
        with pytest.raises(FlashBootError, match="rank 0 of"):
            flashboot.load(image, 1, "cpu", staged=staged, shm_dir=shm)
        with pytest.raises(FlashBootError, match="exclude each other"):
            flashboot.load(image, 0, "cpu", staged=staged, served=True, shm_dir=shm)


def test_missing_ready_times_out_naming_the_path(qwen, tmp_path):
    """With streaming turned off (with it, a rank nobody stages streams: tests/test_stream.py)."""
    shm = tmp_path / "empty-shm"
    ready = shm_files.staged_paths(qwen / "tp1", 0, shm).ready
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError) as e:
        flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=shm, timeout_s=0.3, stream=False)
    assert time.monotonic() - t0 < 10
    assert str(ready) in str(e.value)
    staged = flashboot.stage(qwen / "tp1", 0, "cpu", timeout_s=0.2, shm_dir=shm)
    with pytest.raises(WaitTimeoutError, match=str(ready)):
        staged.wait()


def test_wrong_rank_tp_and_model_are_refused(qwen):
    shm = qwen / "shm"
    with pytest.raises(LayoutError, match="rank 2 requested"):
        flashboot.load(qwen / "tp2", 2, "cpu", shm_dir=shm)
    with pytest.raises(LayoutError, match="requested tp=4"):
        flashboot.load(qwen / "tp2", 1, "cpu", shm_dir=shm, tp=4)
    with pytest.raises(LayoutError, match="not the expected model"):
        flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=shm, expected_key={"model_id": "someone/else"})


def test_admission_refuses_before_any_allocation(qwen, monkeypatch):
    with pytest.raises(OutOfMemoryError) as e:
        admit(10 << 20, CPU, free_bytes=3 << 20)
    assert e.value.nbytes_needed == 10 << 20 and e.value.nbytes_free == 3 << 20
    assert "10,485,760" in str(e.value) and "3,145,728" in str(e.value)
    assert admit(1, CPU, free_bytes=2 << 20) == 2 << 20  # rounded to the 2 MiB arena granularity
    with pytest.raises(OutOfMemoryError):
        admit(1, CPU, free_bytes=(2 << 20) - 1)

    from flashboot.arena import Arena
    from flashboot.flashload import landing as _load

    def no_alloc(*a, **k):
        raise AssertionError("an arena was allocated before admission")

    monkeypatch.setattr(_load, "device_free_bytes", lambda dev: 4096)
    monkeypatch.setattr(Arena, "create", no_alloc)
    nbytes = read_image(qwen / "tp1", 0).nbytes
    with pytest.raises(OutOfMemoryError, match=f"{nbytes:,}-byte image into cpu"):
        flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=qwen / "shm")


def _corrupt(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_verify_names_the_corrupted_chunk(qwen, tmp_path):
    image = Path(shutil.copytree(qwen / "tp1", tmp_path / "image"))
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    with flashboot.load(image, 0, "cpu", shm_dir=shm, verify=True) as ok:
        assert ok.report.verify_ms > 0
    _corrupt(shm_files.staged_paths(image, 0, shm).image, 3 * CHUNK + 7)  # damage in shared memory
    from flashboot.arena import Arena

    created = []
    real_create = Arena.create.__func__

    def spy(cls, *a, **k):
        created.append(real_create(cls, *a, **k))
        return created[-1]

    import unittest.mock

    with unittest.mock.patch.object(Arena, "create", classmethod(spy)):
        with pytest.raises(ChecksumMismatchError) as e:
            flashboot.load(image, 0, "cpu", shm_dir=shm, verify=True)
    assert e.value.chunk == 3 and e.value.offset == 3 * CHUNK and e.value.nbytes == CHUNK
    assert "chunk 3" in str(e.value) and "rank 0" in str(e.value)
    assert created and created[0].closed, "the arena of a failed load is released"


def test_report_says_whether_it_verified_and_its_phases_add_up(qwen, tmp_path):
    image = Path(shutil.copytree(qwen / "tp1", tmp_path / "image"))
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm)
    with flashboot.load(image, 0, "cpu", shm_dir=shm) as plain:  # host backend: off by default (~2x the copy)
        r = plain.report
        assert r.verify_ms == 0 and "not verified: off by default on the host backend" in r.summary()
        counted = sum(ms for name, ms in r.phases().items() if name not in r.overlapped)
        unnamed = r.other_ms if "other" not in r.phases() else 0.0  # a rest under 0.05 ms is not listed
        # "other" names the rest; the phases' own clocks (the copy's) may overrun the wall clock by a
        # hair under load, and then there is no rest to name
        assert counted + unnamed == pytest.approx(r.total_ms, rel=1e-9) or (r.other_ms == 0 and counted > r.total_ms)
        assert "other" in r.phases() or r.other_ms < 0.05
    with flashboot.load(image, 0, "cpu", shm_dir=shm, verify=True) as checked:
        chunks = len(checked.metadata.checksums.digests)
        assert f"verified: {chunks} chunks match the pre-pack's checksums" in checked.report.summary()
    _corrupt(shm_files.staged_paths(image, 0, shm).image, 5)
    with pytest.raises(ChecksumMismatchError):
        flashboot.load(image, 0, "cpu", shm_dir=shm, verify=True)


@pytest.mark.gpu
def test_gpu_load_verifies_by_default_once_the_kernel_is_loaded_and_catches_a_flipped_byte(qwen, tmp_path,
                                                                                           monkeypatch):
    from flashboot.kernels import checksum_gpu

    image = Path(shutil.copytree(qwen / "tp1", tmp_path / "image"))
    no_shm = tmp_path / "no-shm"  # nothing staged: streamed from disk
    with monkeypatch.context() as m:  # as in a fresh process: the kernel's first call would cost ~1 s
        m.setattr(checksum_gpu, "LAUNCHED_ON", set())
        with flashboot.load(image, 0, "cuda:0", shm_dir=no_shm) as cold:
            assert "not verified: off by default for a load in this process" in cold.report.summary()
            assert cold.report.verify_ms == 0
        with flashboot.load(image, 0, "cuda:0", shm_dir=no_shm, verify=True) as asked:
            assert asked.report.verify_ms > 0 and "verified: " in asked.report.summary()
        assert 0 in checksum_gpu.LAUNCHED_ON
        with flashboot.load(image, 0, "cuda:0", shm_dir=no_shm) as ok:  # the kernel is loaded now: on by default
            assert ok.report.verify_ms > 0 and "verified: " in ok.report.summary()
    _corrupt(read_image(image, 0).path, 2 * CHUNK + 3)
    with pytest.raises(ChecksumMismatchError) as e:
        flashboot.load(image, 0, "cuda:0", shm_dir=no_shm)
    assert e.value.chunk == 2
    with flashboot.load(image, 0, "cuda:0", shm_dir=no_shm, verify=False) as unchecked:
        assert "not verified: verify=False" in unchecked.report.summary()


def test_truncated_image_is_refused(qwen, tmp_path):
    image = Path(shutil.copytree(qwen / "tp1", tmp_path / "image"))
    img = read_image(image, 0)
    with open(img.path, "r+b") as f:
        f.truncate(img.nbytes - CHUNK)
    with pytest.raises(LayoutError, match="truncated"):
        flashboot.load(image, 0, "cpu", shm_dir=tmp_path / "shm", timeout_s=0.2)


def _spy_arenas(monkeypatch) -> list:
    """Record every arena Arena.create makes (to check a failed load released it)."""
    from flashboot.arena import Arena

    created = []
    real_create = Arena.create.__func__

    def spy(cls, *a, **k):
        created.append(real_create(cls, *a, **k))
        return created[-1]

    monkeypatch.setattr(Arena, "create", classmethod(spy))
    return created


def test_views_are_built_while_the_copy_runs_and_metadata_is_reported(qwen):
    with flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=qwen / "shm") as loaded:
        r = loaded.report
        assert r.overlapped == ["bind"] and r.metadata_ms > 0 and r.bind_ms > 0
        assert list(r.phases())[:2] == ["wait", "metadata"] and "(*: while the copy ran)" in r.summary()
        assert "bind" in r.summary() and r.to_dict()["overlapped"] == ["bind"]


def test_a_failing_copy_releases_the_arena_and_raises(qwen, monkeypatch):
    from flashboot.movers.host import HostMover

    from flashboot.errors import MoverError
    from flashboot.flashload import landing as _load

    views_done = []
    real_make_views = _load.make_views

    def recording_views(arena, meta):
        views = real_make_views(arena, meta)
        views_done.append(len(views))
        return views

    def broken_copy(self, dst, src, nbytes, path, stream):
        time.sleep(0.05)
        raise MoverError(f"injected: copy of {nbytes:,} bytes failed")

    monkeypatch.setattr(_load, "make_views", recording_views)
    monkeypatch.setattr(HostMover, "_copy", broken_copy)
    created = _spy_arenas(monkeypatch)
    with pytest.raises(MoverError, match="injected: copy of"):
        flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=qwen / "shm")
    assert views_done, "the views were built beside the copy"
    assert len(created) == 1 and created[0].closed, "the arena of a failed load is released"


def test_pin_early_checks_what_load_asks_for(qwen):
    shm = qwen / "shm"
    with flashboot.stage(qwen / "tp2", 1, "cpu", shm_dir=shm) as staged:
        with pytest.raises(LayoutError, match="packed for tp=2 .* requested tp=4"):
            flashboot.load(qwen / "tp2", 1, "cpu", staged=staged, shm_dir=shm, tp=4)
        with flashboot.load(qwen / "tp2", 1, "cpu", staged=staged, shm_dir=shm, tp=2) as loaded:
            assert loaded.report.details["metadata_validated_by"] == "stage()"
            assert loaded.source is staged.source and loaded.metadata.parallel.rank == 1


# --------------------------------------------------------------------------------- bind
def test_bind_gives_bitwise_equal_logits_and_generate_works(qwen, reference):
    model = _meta_model("qwen3_moe")
    with flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=qwen / "shm") as loaded:
        report = flashboot.bind(model, loaded)
        assert sorted(report.recomputed) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
        assert not report.missing and not report.unexpected and not report.mismatched and not report.cast
        lo, hi = loaded.arena.ptr, loaded.arena.ptr + loaded.arena.nbytes
        for name, p in model.named_parameters():
            assert lo <= p.data_ptr() < hi, f"{name} is not a view into the arena"
            assert not p.requires_grad
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        model.eval()
        with torch.no_grad():
            got, want = model(PROMPT).logits, reference(PROMPT).logits
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        out = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert out.shape == (1, PROMPT.shape[1] + 6)
        assert torch.equal(out, reference.generate(PROMPT, max_new_tokens=6, do_sample=False))


def test_bind_tied_embeddings_share_one_view(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny_model("mixtral", tmp_path / "hf", dtype=torch.bfloat16, tie_word_embeddings=True)
    flashboot.prepack(str(tmp_path / "hf"), str(tmp_path / "img"), progress=False)
    staging.stage_rank(tmp_path / "img", 0, shm_dir=tmp_path / "shm")
    model = _meta_model("mixtral", tie_word_embeddings=True)
    with flashboot.load(tmp_path / "img", 0, "cpu", shm_dir=tmp_path / "shm") as loaded:
        assert "lm_head.weight" not in loaded.tensors
        report = flashboot.bind(model, loaded)
        assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
        assert model.lm_head.weight is model.model.embed_tokens.weight
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
        with torch.no_grad():
            assert torch.equal(model.eval()(PROMPT).logits, ref(PROMPT).logits)


def test_bind_lists_what_does_not_match(qwen):
    with flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=qwen / "shm") as loaded:
        other = _meta_model("qwen3_moe", vocab_size=160, num_hidden_layers=3)
        with pytest.raises(LayoutError) as e:
            flashboot.bind(other, loaded)
        msg = str(e.value)
        assert "missing from the image" in msg and "model.layers.2." in msg
        assert "mismatched" in msg and "model.embed_tokens.weight (image [128, 64]" in msg
        assert all(p.is_meta for p in other.parameters()), "a strict failure rebinds nothing"
        report = flashboot.bind(other, loaded, strict=False)
        assert "model.layers.0.self_attn.q_proj.weight" in report.bound
        assert any(n.startswith("model.layers.2.") for n in report.missing)
        assert any(n.startswith("model.embed_tokens.weight") for n in report.mismatched)
        smaller = _meta_model("qwen3_moe", num_hidden_layers=1)
        with pytest.raises(LayoutError, match="in the image but not in the module"):
            flashboot.bind(smaller, loaded)


def test_bind_casts_only_when_asked(qwen):
    with flashboot.load(qwen / "tp1", 0, "cpu", shm_dir=qwen / "shm") as loaded:
        model = _meta_model("qwen3_moe")
        model.model.norm.weight = torch.nn.Parameter(torch.empty(64, dtype=torch.float32, device="meta"))
        with pytest.raises(LayoutError, match="model.norm.weight"):
            flashboot.bind(model, loaded)
        report = flashboot.bind(model, loaded, cast=True)
        assert report.cast == ["model.norm.weight"] and model.model.norm.weight.dtype == torch.float32
        assert torch.equal(model.model.norm.weight, loaded.tensors["model.norm.weight"].float())


def test_tp2_ranks_put_back_together_equal_the_original(qwen, reference):
    pairs = []
    loaded = [flashboot.load(qwen / "tp2", r, "cpu", shm_dir=qwen / "shm", verify=True) for r in (0, 1)]
    try:
        for li in loaded:
            assert li.metadata.parallel.tp_size == 2
            pairs += [(li.metadata.tensors[n], t) for n, t in li.tensors.items()]
        full = reassemble(pairs)
        state = reference.state_dict()
        assert set(full) == set(state)
        for name, t in full.items():
            assert torch.equal(_bytes(t), _bytes(state[name])), name
    finally:
        for li in loaded:
            li.close()


def test_cli_load_prints_the_phases(qwen, capsys):
    from flashboot.cli import main

    assert main(["load", str(qwen / "tp1"), "--rank", "0", "--device", "cpu", "--shm-dir", str(qwen / "shm"),
                 "--verify", "--json", "-"]) == 0
    captured = capsys.readouterr()  # with --json -, stdout carries the JSON alone and the summary goes to stderr
    out = captured.out
    assert '"mode": "host"' in out and json.loads(out)["verify_ms"] > 0
    assert "h2d" in captured.err and "verify" in captured.err
    assert "verified: " in captured.err and "chunks match the pre-pack's checksums" in captured.err
    assert "0.00 GB/s" not in captured.err and "B/s end to end" in captured.err
    assert main(["load", str(qwen / "tp1"), "--rank", "0", "--device", "cpu", "--shm-dir", str(qwen / "shm"),
                 "--no-verify"]) == 0
    assert "not verified: verify=False" in capsys.readouterr().out
    assert main(["load", str(qwen / "tp1"), "--rank", "5", "--device", "cpu", "--shm-dir", str(qwen / "shm")]) == 2


# ---------------------------------------------------------------------------------- GPU
@pytest.fixture
def gpu_shm(qwen):
    """Staged copies in tmpfs, as in production: pinning a file-backed mapping of a disk
    filesystem is refused by recent kernels (long-term pins of shared file pages)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="flashboot-test-", dir="/dev/shm"))
    staging.preload(staging.PreloadConfig(str(qwen / "tp1"), shm_dir=str(root)))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.gpu
def test_gpu_pin_on_critical_path_vs_pinned_early(qwen, gpu_shm):
    shm = gpu_shm
    with flashboot.load(qwen / "tp1", 0, "cuda:0", shm_dir=shm, verify=True) as li:
        assert li.report.mode == "pin on critical path" and li.report.pin_ms > 0
        assert li.arena.device.is_cuda and li.report.verify_ms > 0
        assert "pageable" not in li.report.details
        if li.release_thread is not None:
            li.release_thread.join()
    staged = flashboot.stage(qwen / "tp1", 0, "cuda:0", shm_dir=shm).wait()
    with staged:
        assert staged.pinned and staged.pin_ms > 0
        with flashboot.load(qwen / "tp1", 0, "cuda:0", staged=staged, shm_dir=shm, verify=True) as li:
            assert li.report.mode == "pinned early" and li.report.pin_ms == 0
            assert li.report.pinned_early_ms == staged.pin_ms
            host = read_image(qwen / "tp1", 0).path.read_bytes()
            assert bytes(li.arena.bytes()[:li.nbytes].cpu().numpy()) == host


@pytest.mark.gpu
def test_gpu_served_load_with_a_pinned_daemon(qwen, gpu_shm):
    shm = gpu_shm
    cfg = staging.PreloadConfig(str(qwen / "tp1"), shm_dir=str(shm), serve=True, devices={0: "cuda:0"})
    service.start_background(cfg, timeout_s=120)
    try:
        deadline = time.monotonic() + 120
        while client.serve_status(qwen / "tp1", shm)["ranks"]["0"]["state"] not in ("pinned", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.serve_status(qwen / "tp1", shm)["ranks"]["0"]["state"] == "pinned"
        with flashboot.load(qwen / "tp1", 0, "cuda:0", served=True, shm_dir=shm) as li:  # verified by default
            assert li.report.mode == "served" and li.report.details["daemon_pinned"] is True
            assert li.report.pinned_early_ms > 0 and li.report.h2d_ms > 0
            assert li.report.details["verified"].endswith("(verified by the daemon)") and li.report.verify_ms > 0
        _corrupt(shm_files.staged_paths(qwen / "tp1", 0, shm).image, CHUNK + 11)  # the daemon's pinned pages
        with pytest.raises(ChecksumMismatchError) as e:
            flashboot.load(qwen / "tp1", 0, "cuda:0", served=True, shm_dir=shm)
        assert e.value.chunk == 1 and e.value.offset == CHUNK
    finally:
        service.stop_service(qwen / "tp1", shm)


@pytest.mark.gpu
def test_gpu_bind_logits_bitwise_equal_and_generate(qwen, gpu_shm):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(qwen / "hf", dtype=torch.bfloat16).to("cuda:0").eval()
    model = _meta_model("qwen3_moe")
    with flashboot.load(qwen / "tp1", 0, "cuda:0", shm_dir=gpu_shm) as loaded:
        flashboot.bind(model, loaded)
        assert all(p.device.type == "cuda" for p in model.parameters())
        assert model.model.rotary_emb.inv_freq.device.type == "cuda"
        model.eval()
        ids = PROMPT.to("cuda:0")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                           ref.generate(ids, max_new_tokens=6, do_sample=False))
