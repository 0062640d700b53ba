"""``flashboot bench refit`` on the host backend with a small checkpoint shape: every section
runs on the same bytes and the engine ends with the trainer's tensors. No time is asserted."""

from __future__ import annotations

import pytest

from flashboot.benchmarks.checkpoints import CheckpointSpec
from flashboot.benchmarks.refit import rows, run, write_sparse_checkpoint

pytestmark = pytest.mark.timeout(240)

SPEC = CheckpointSpec("T", layers=2, experts=4, expert_rows=64, expert_cols=32, hidden=64, vocab=128, shards=1)


def test_sparse_checkpoint_reads_as_zeros_of_the_spec(tmp_path):
    from flashboot.layouts import open_checkpoint

    write_sparse_checkpoint(str(tmp_path), SPEC)
    ckpt = open_checkpoint(tmp_path)
    assert [(n, t.shape) for n, t in ckpt.tensors.items()] == [(n, tuple(s)) for n, s in SPEC.tensors()]
    assert ckpt.nbytes == SPEC.nbytes


def test_bench_refit_runs_every_section_on_the_host_backend(tmp_path):
    res = run(SPEC, "cpu", repeats=2, workdir=str(tmp_path))
    assert res["tensors"] == SPEC.tensor_count and res["nbytes"] == SPEC.nbytes
    assert res["refit_bytes_equal_trainer"] is True and res["refit_tensors_compared"] == SPEC.tensor_count
    for mode in ("atomic", "in_place"):
        assert res[f"refit_{mode}"]["transport"] == "posix_fd"
    assert res["pack_copy_engine_ms"] is None and res["copy_engine_note"] == "GPU only"
    # where each refit's total went: every step present and non-negative; only atomic remaps
    for mode in ("atomic", "in_place"):
        b = res[f"refit_{mode}"]["breakdown"]
        assert {"record_ms", "staging_create_ms", "clone_ms", "clone_exchange_ms", "copy_ms", "verify_ms",
                "clone_other_ms", "clone_close_ms"} <= set(b)
        assert all(v >= 0 for v in b.values()), b
    assert {"remap_ms", "remap_unmap_ms", "remap_map_ms", "remap_release_old_ms", "staging_close_ms"} <= \
        set(res["refit_atomic"]["breakdown"])
    assert "remap_ms" not in res["refit_in_place"]["breakdown"]
    table = rows(res)
    assert table[0][0] == "host copy ceiling (before, after)" and len(table) == 16
    # the refit rows are medians: each mode's first refit of the run (the atomic one maps the
    # trainer's arena) is a row of its own, not only a JSON field
    for mode in ("atomic", "in_place"):
        first = res[f"refit_{mode}"]["first"]
        assert [f"refit {mode.replace('_', ' ')}: its first of the run, copy / total",
                f"{first['copy_ms']:.2f} / {first['total_ms']:.2f} ms", "", ""] in table
    assert ["engine's tensors equal the trainer's after the refits", f"{SPEC.tensor_count:,} tensors", "yes", ""] in table


def test_refit_ratios_use_the_faster_ceiling_over_the_bytes_it_copied():
    """The ceiling is measured before and after the rest: the faster sample is the ceiling (the slower
    one had credited every path with the drift), and its GB/s is over the image's bytes, which it
    copied (the tensors' bytes had under-reported it by the alignment)."""
    from flashboot.benchmarks.refit import _ratios

    refit = {"copy_ms": 4.0, "verify_ms": 1.0, "remap_ms": 1.0, "total_ms": 8.0}
    res = {"nbytes": 1_000_000, "image_nbytes": 2_000_000, "d2d_ceiling_ms": [2.0, 1.0],
           "pack_kernel_ms": 1.0, "pack_copy_per_tensor_ms": 5.0, "pack_copy_engine_ms": None,
           "baseline_per_parameter_ms": 10.0, "publish": {"pack_ms": 1.0},
           "refit_atomic": dict(refit), "refit_in_place": dict(refit)}
    _ratios(res)
    assert res["d2d_ceiling_gbps"] == 2.0  # 2 MB in 1 ms
    assert res["pack_kernel_vs_d2d"] == 0.5  # 1 MB in 1 ms against 2 GB/s
    assert res["pack_copy_per_tensor_vs_d2d"] == 0.1 and "pack_copy_engine_vs_d2d" not in res
    assert res["refit_atomic"]["copy_gbps"] == 0.5 and res["refit_atomic"]["copy_vs_d2d"] == 0.25
    assert res["speedup_vs_baseline"] == {"copy_atomic": 2.5, "pack_plus_refit_atomic": 10.0 / 9.0}


def test_bench_refit_fails_when_the_engine_does_not_hold_the_trainer_s_bytes(monkeypatch, capsys):
    """A refit that left wrong bytes had exited 0: the check was not in the table nor the exit code."""
    from flashboot.benchmarks import refit
    from flashboot.cli import main

    def fake_run(spec, device, **kw):
        refit_row = {"copy_ms": 1.0, "verify_ms": 1.0, "remap_ms": 0.0, "total_ms": 2.0, "transport": "posix_fd"}
        res = {"spec": spec.name, "device": "cpu", "tensors": 1, "nbytes": 10, "image_nbytes": 10, "rows": 1,
               "d2d_ceiling_ms": [1.0, 1.0], "pack_kernel_ms": 1.0, "pack_copy_per_tensor_ms": 1.0,
               "pack_copy_engine_ms": None, "copy_engine_note": "GPU only", "baseline_per_parameter_ms": 1.0,
               "publish": {"pack_ms": 1.0, "checksum_ms": 1.0, "publish_ms": 1.0}, "refit_atomic": dict(refit_row),
               "refit_in_place": dict(refit_row), "refit_bytes_equal_trainer": False, "refit_tensors_compared": 1}
        refit._ratios(res)
        return res

    monkeypatch.setattr(refit, "run", fake_run)
    assert main(["bench", "refit", "--checkpoint", "C", "--device", "cpu"]) == 1
    assert "NO" in next(line for line in capsys.readouterr().out.splitlines() if "equal the trainer" in line)
