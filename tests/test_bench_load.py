"""The load benchmark's pieces: synthetic checkpoints A and B, the peer adapters, the digest that
verifies every loader, and one whole small run on the host backend. No time is asserted."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from flashboot.benchmarks import checkpoints as ck
from flashboot.benchmarks.load import FLASH_CRITICAL, FLASH_EARLY, FLASH_SERVED, LIMIT, run
from flashboot.benchmarks.peers import (
    BulkPinnedLoader, FastSafetensorsLoader, InstantTensorLoader, PerTensorPinnedLoader, SafetensorsLoader,
)
from flashboot.errors import FlashBootError

SMALL = ck.CheckpointSpec("S", layers=2, experts=4, expert_rows=32, expert_cols=16, hidden=16, vocab=32, shards=3)


def test_full_size_specs_match_the_reference_checkpoints():
    # ../shared/hardware.md: A 3,170 tensors, 13.76 GB, 4 files; B 18,722 tensors, 11.76 GB, 8 files.
    a, b = ck.CHECKPOINT_A, ck.CHECKPOINT_B
    assert (a.tensor_count, len(a.tensors()), a.nbytes, a.shards) == (3170, 3170, 13_755_351_040, 4)
    assert (b.tensor_count, len(b.tensors()), b.nbytes, b.shards) == (18722, 18722, 11_763_318_784, 8)
    assert sum(1 for n, s in a.tensors() if ".experts." in n and s == (2048, 1024)) == 16 * 64 * 2
    small = b.scaled(1e-4)
    assert small.tensor_count == b.tensor_count and small.nbytes < b.nbytes * 1e-3
    assert b.scaled(1) is b
    with pytest.raises(FlashBootError, match="scale must be positive"):
        a.scaled(0)
    with pytest.raises(FlashBootError, match="layers must be a positive int"):
        ck.CheckpointSpec("bad", 0, 1, 1, 1, 1, 1, 1)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return ck.make_checkpoint(str(tmp_path_factory.mktemp("bench") / "S"), SMALL, device="cpu")


def test_make_checkpoint_writes_what_it_records(small_ckpt):
    assert len(small_ckpt.files) == 3 and small_ckpt.tensor_count == SMALL.tensor_count
    tensors = {}
    for f in small_ckpt.files:
        tensors.update(load_file(f))
    assert set(tensors) == set(dict(SMALL.tensors())) == set(small_ckpt.checksums)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert sum(t.numel() * 2 for t in tensors.values()) == small_ckpt.nbytes == SMALL.nbytes
    for name, t in tensors.items():
        assert ck.tensor_checksum(t) == small_ckpt.checksums[name]
    assert ck.tensors_digest(tensors) == small_ckpt.expected_digest()
    assert json.load(open(os.path.join(small_ckpt.root, "config.json")))["model_type"] == "flashboot_synthetic_moe"
    mtimes = [os.stat(f).st_mtime_ns for f in small_ckpt.files]
    again = ck.make_checkpoint(small_ckpt.root, SMALL, device="cpu")  # complete: reused, not rewritten
    assert [os.stat(f).st_mtime_ns for f in again.files] == mtimes and again.checksums == small_ckpt.checksums


def test_digest_catches_swapped_renamed_and_corrupted_tensors(small_ckpt):
    tensors = {}
    for f in small_ckpt.files:
        tensors.update(load_file(f))
    expected = small_ckpt.expected_digest()
    w1, w3 = "model.layers.0.mlp.experts.0.w1.weight", "model.layers.0.mlp.experts.0.w3.weight"
    swapped = dict(tensors, **{w1: tensors[w3], w3: tensors[w1]})
    assert ck.tensors_digest(swapped) != expected
    renamed = dict(tensors)
    renamed["model.layers.0.mlp.experts.0.w4.weight"] = renamed.pop(w1)
    assert ck.tensors_digest(renamed) != expected
    corrupted = dict(tensors)
    corrupted[w1] = tensors[w1].clone()
    corrupted[w1].view(torch.uint8).view(-1)[5] ^= 1
    assert ck.tensors_digest(corrupted) != expected
    assert ck.tensors_digest(tensors) == expected


def test_peer_adapters_on_the_host(small_ckpt):
    expected = small_ckpt.expected_digest()
    for cls in (SafetensorsLoader, PerTensorPinnedLoader, BulkPinnedLoader):
        assert cls.availability("cpu") == (True, "")
        loader = cls(small_ckpt.files, "cpu")
        loader.prepare()
        out = loader.load()
        assert len(out) == small_ckpt.tensor_count and ck.tensors_digest(out) == expected, cls.name
        loader.release()
    for cls in (InstantTensorLoader, FastSafetensorsLoader):
        ok, why = cls.availability("cpu")
        assert not ok and why


def test_whole_benchmark_on_the_host_backend(tmp_path):
    out = run(checkpoints=[SMALL], device="cpu", ckpt_root=str(tmp_path / "ckpt"), image_root=str(tmp_path / "img"),
              shm_root=str(tmp_path / "shm"), warmup=0, repeats=1, log=lambda line: None)
    rows = {r["loader"]: r for r in out["loaders"]}
    measured = [r for r in out["loaders"] if not r["skipped"]]
    assert {"safetensors", "per-tensor pinned", LIMIT, FLASH_CRITICAL, FLASH_EARLY, FLASH_SERVED} <= set(rows)
    assert all(r["verified"] for r in measured), [r["loader"] for r in measured if not r["verified"]]
    assert rows[LIMIT]["x_limit"] == 1.0
    assert all(r["gbps"] > 0 and r["x_limit"] > 0 for r in measured)
    # every loader's GB/s over the same bytes, the checkpoint's (FlashLoad's image is larger: alignment)
    assert {r["nbytes"] for r in measured} == {SMALL.nbytes}
    assert all(r["gbps"] == SMALL.nbytes / (r["median_ms"] * 1e-3) / 1e9 for r in measured)
    assert rows[FLASH_SERVED]["details"]["image_nbytes"] > SMALL.nbytes
    assert all(r["first_ms"] == r["samples_ms"][0] for r in measured)  # warmup=0: the first call is the first repeat
    assert "safetensors" in rows[FLASH_SERVED]["speedup_vs"]
    assert rows["instanttensor"]["skipped"] and rows["fastsafetensors"]["skipped"]
    assert [p["step"].split(" (")[0] for p in out["pipeline"]] == ["disk read", "disk write", "pre-pack", "preload"]
    assert all(p["gbps"] > 0 for p in out["pipeline"]) and out["pipeline"][0]["vs_disk"] == 1.0
    extra = out["extra"]["S"]
    assert set(extra["flashload_reports"]) == {FLASH_CRITICAL, FLASH_EARLY, FLASH_SERVED}
    assert extra["flashload_reports"][FLASH_SERVED]["mode"] == "served"
    assert not os.path.exists(extra["image_dir"]), "cleaned up without --keep"
    json.dumps(out)  # the --json output is plain JSON


def test_cli_registers_bench_load():
    from flashboot.cli import build_parser

    args = build_parser().parse_args(["bench", "load", "--scale", "0.01", "--checkpoints", "B", "--json", "-"])
    assert args.scale == 0.01 and args.checkpoints == ["B"] and args.json == "-" and callable(args.func)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "load", "--checkpoints", "C"])


def test_measure_keeps_the_first_call_and_medians_the_repeats_after_the_warm_up():
    from flashboot.benchmarks.load import _measure

    samples, cleaned = iter([50.0, 3.0, 1.0, 2.0]), []
    timing, first_ms, ok = _measure("x", lambda: (next(samples), "result"), cleaned.append,
                                    lambda result: result == "result", warmup=1, repeats=3)
    assert first_ms == 50.0 and timing.samples_ms == [3.0, 1.0, 2.0] and timing.median_ms == 2.0 and ok
    assert cleaned == ["result"] * 4
    with pytest.raises(FlashBootError, match="repeats must be an int >= 1"):
        _measure("x", lambda: (1.0, None), cleaned.append, bool, warmup=1, repeats=0)


def test_flashload_is_timed_on_the_bench_clock_not_by_its_own_report(tmp_path, monkeypatch):
    """FlashLoad's rows are timed as the peers' are (the call plus a device sync, on the bench's
    clock): the report's own total_ms, taken inside the call, had been used instead."""
    import flashboot

    real = flashboot.load

    def load(*args, **kwargs):
        loaded = real(*args, **kwargs)
        loaded.report.total_ms = -1.0  # what the bench must not take for the time
        return loaded

    monkeypatch.setattr(flashboot, "load", load)
    out = run(checkpoints=[SMALL], device="cpu", ckpt_root=str(tmp_path / "ckpt"), image_root=str(tmp_path / "img"),
              shm_root=str(tmp_path / "shm"), warmup=0, repeats=1, log=lambda line: None)
    flash = [r for r in out["loaders"] if r["loader"].startswith("FlashLoad")]
    assert len(flash) == 3 and all(r["verified"] and r["first_ms"] > 0 and r["median_ms"] > 0 for r in flash)


def test_measure_verifies_every_call_the_first_one_too():
    """A loader whose first call in the process loads wrong bytes: its first call is a row of the
    table, and the run had said 'verified' because the last call alone was checked."""
    from flashboot.benchmarks.load import _measure

    results = iter(["wrong", "result", "result"])
    _, first_ms, ok = _measure("x", lambda: (1.0, next(results)), lambda result: None,
                               lambda result: result == "result", warmup=1, repeats=2)
    assert not ok
    results = iter(["result", "result", "result"])
    assert _measure("x", lambda: (1.0, next(results)), lambda result: None, lambda result: result == "result",
                    warmup=1, repeats=2)[2]
