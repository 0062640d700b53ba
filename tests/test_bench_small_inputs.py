"""The benchmarks on small or bad inputs: a small image, a size not a multiple of 8, a negative
warm-up or W, reads in flight of 0. Each is measured on its terms or refused by name before the
setup runs. No time is measured or asserted."""

from __future__ import annotations

import pytest


def test_bench_stream_plans_its_ceiling_for_the_slot_an_image_under_4mib_is_read_into(tmp_path):
    """The loader cuts its ring's slot to an image smaller than a slot (4 MiB); the ceiling had been
    planned for the uncut slot, and every run on such an image failed ('the stream read 1 x
    3,387,392 bytes at once, the ceiling was planned for 1 x 4,194,304')."""
    from flashboot.benchmarks import stream

    out = stream.run(scale=0.0002, device="cpu", image_root=str(tmp_path / "img"), ckpt_root=str(tmp_path / "ckpt"),
                     log=lambda line: None)
    s = out["stream"]
    assert s["nbytes"] < 4 << 20 and s["verified"]
    assert s["disk_read_bytes"] == -(-s["nbytes"] // 4096) * 4096 == s["report"]["details"]["slot_bytes"]
    assert s["disk_in_flight"] == s["threads"]


@pytest.mark.parametrize("threads", [0, -2, 1.5, True])
def test_bench_stream_refuses_bad_reads_in_flight_before_it_makes_the_checkpoint(tmp_path, threads):
    """--threads 0 had run the loader's default silently, -2 was refused only after the checkpoint
    was generated and pre-packed."""
    from flashboot.benchmarks import stream
    from flashboot.errors import FlashBootError

    with pytest.raises(FlashBootError, match=r"threads must be an int >= 1, got"):
        stream.run(scale=0.0002, device="cpu", image_root=str(tmp_path / "img"), ckpt_root=str(tmp_path / "ckpt"),
                   threads=threads, log=lambda line: None)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("size", [1, 1001])
def test_bench_arena_measures_a_size_not_a_multiple_of_8(size):
    """--size 1001 had ended in torch's 'must be divisible by 8' traceback after the creates and
    opens were timed, --size 1 in a ceiling of 0 bytes; the checksum and its ceiling are over the
    arena's own bytes."""
    from flashboot.benchmarks import arena as bench_arena

    f = bench_arena.run(size, "cpu", repeats=1)
    assert f.nbytes >= size and f.nbytes % 8 == 0
    assert f.checksum_gbps == pytest.approx(f.nbytes / (f.checksum_ms * 1e-3) / 1e9)
    assert f.copy_ceiling_gbps > 0 and len(f.create_map_ms) == len(f.export_ms) == len(f.open_in_child_ms) == 1


@pytest.mark.parametrize("warmup", [-1, 0.5, None])
def test_bench_load_refuses_a_bad_warmup_before_it_makes_the_checkpoints(tmp_path, warmup):
    """--warmup -1 had run the whole setup (checkpoint, pre-pack, disk rates, preload) and then
    ended in statistics' 'no median for empty data': a warm-up of -1 had eaten one of the repeats."""
    from flashboot.benchmarks import load as bench_load
    from flashboot.errors import FlashBootError

    with pytest.raises(FlashBootError, match=r"warmup must be an int >= 0, got"):
        bench_load.run(scale=0.0002, checkpoints=["A"], device="cpu", ckpt_root=str(tmp_path / "ckpt"),
                       image_root=str(tmp_path / "img"), warmup=warmup, repeats=1, log=lambda line: None)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kw, match", [
    ({"end_to_end": (float("nan"),)}, r"workloads W must be finite seconds >= 0, got nan"),
    ({"end_to_end": (0.0, -1.0)}, r"workloads W must be finite seconds >= 0, got -1.0"),
    ({"end_to_end": (0.0,), "e2e_repeats": 0}, r"e2e_repeats must be an int >= 1, got 0"),
    ({"scale": float("inf")}, r"scale must be a finite number > 0, got inf"),
])
def test_bench_boot_refuses_bad_workloads_and_scales_before_it_makes_the_shapes(tmp_path, kw, match):
    """--end-to-end nan had failed every end-to-end child after the checkpoints, images and boots
    were made and run; -1 ran and reported a row of a workload of -1 s; --scale inf ended in an
    OverflowError traceback."""
    from flashboot.benchmarks import boot
    from flashboot.errors import FlashBootError

    kw = {"scale": 0.0002} | kw
    with pytest.raises(FlashBootError, match=match):
        boot.run(shapes=["A"], device="cpu", root=str(tmp_path / "boot"), loaders=["safetensors"],
                 log=lambda line: None, **kw)
    assert not (tmp_path / "boot").exists()


def test_bench_clone_nccl_per_tensor_row_names_the_broadcasts_it_made():
    """A payload under 64 MiB goes whole in the first collective, so the per-tensor mode makes one
    broadcast whatever its tensors; the row had read '(5 tensors)' (3,170 by default) for it."""
    from flashboot.benchmarks.clone import print_results
    from flashboot.benchmarks.clone_from_start import nccl_from_start

    small = nccl_from_start(["cpu", "cpu"], 1 << 20, mode="per_tensor", tensors=5, timeout_s=120)
    assert small["broadcasts"] == 1 and small["payload_bytes"] == 1 << 20 and small["byte_exact"]
    big = nccl_from_start(["cpu", "cpu"], (64 << 20) + 4096 * 3, mode="per_tensor", tensors=3, timeout_s=120)
    assert big["broadcasts"] == 1 + 3 and big["byte_exact"]
    print_results({"devices": ["cpu", "cpu"], "nbytes": 1 << 20, "nccl": [small]})


@pytest.mark.parametrize("tensors", ["0", "-5"])
def test_bench_clone_refuses_a_tensor_count_under_1(tensors, capsys):
    from flashboot.cli import main

    assert main(["bench", "clone", "--device", "cpu", "--tensors", tensors]) == 2
    assert f"--tensors must be an int >= 1, got {tensors}" in capsys.readouterr().err


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0])
def test_bench_swap_refuses_a_bad_scale_by_name(tmp_path, scale):
    """--scale inf had ended in an OverflowError traceback from the checkpoint's dimensions."""
    from flashboot.benchmarks import swap
    from flashboot.errors import FlashBootError

    with pytest.raises(FlashBootError, match=r"scale must be a finite number > 0"):
        swap.run(scale=scale, device="cpu", repeats=1, root=str(tmp_path / "swap"))


@pytest.mark.parametrize("argv, err", [
    (["refit", "--device", "cpu", "--scale", "inf"], "--scale must be a finite number > 0, got inf"),
    (["refit", "--device", "cpu", "--scale", "0.0002", "--checkpoint", "A", "Z"], "unknown checkpoints Z; known: A"),
    (["refit", "--device", "cpu", "--repeats", "0"], "--repeats must be an int >= 1, got 0"),
    (["serve", "--scale", "inf"], "scale must be a finite number > 0, got inf"),
    (["serve", "--scale", "0.0002", "--repeats", "0"], "repeats must be an int >= 1, got 0"),
])
def test_bench_refit_and_serve_refuse_bad_arguments_by_name_up_front(argv, err, capsys):
    """refit and serve: --scale inf had ended in an OverflowError traceback; refit's unknown shape
    in a KeyError after the shapes before it had run; serve's --repeats 0 in 'no median for empty
    data' after the checkpoint, the daemon and the first rounds."""
    from flashboot.cli import main

    assert main(["bench", *argv]) == 2
    assert err in capsys.readouterr().err


@pytest.mark.parametrize("top", [0, -1])
def test_bench_tune_refuses_a_top_under_1_before_the_sweep(monkeypatch, top):
    """--top 0 had swept every configuration and shown an empty table; -1 left out each kernel's
    slowest row shown, silently."""
    import argparse

    from flashboot.benchmarks import tune_kernels as tune
    from flashboot.errors import FlashBootError

    def sweep(*a, **k):
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(tune, "run", sweep)
    args = argparse.Namespace(size="1MB", checksum_size="1MB", quick=True, top=top, json=None)
    with pytest.raises(FlashBootError, match=rf"--top must be an int >= 1, got {top}"):
        tune.main(args)
