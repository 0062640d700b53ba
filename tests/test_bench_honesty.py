"""What the benchmarks report, checked on controlled inputs: every cell that failed is shown, and
a wrong result fails the run. No time is measured or asserted."""

from __future__ import annotations

import argparse


def test_bench_tune_names_failed_and_wrong_configurations_below_its_top_rows(monkeypatch, capsys):
    """The table shows the --top fastest configurations per kernel and path: a configuration that
    failed (0 GB/s) or copied wrong bytes below them had been left out of it, and the run exited 0."""
    from flashboot.benchmarks import tune_kernels as tune

    row = tune.TuneRow
    rows = [row("copy_engine", "d2d", {}, 100.0, 100.0, 1.0, True),
            row("sm_copy", "d2d", {"block_bytes": 16384}, 90.0, 100.0, 0.9, True),
            row("sm_copy", "d2d", {"block_bytes": 65536}, 80.0, 100.0, 0.8, False),
            row("sm_copy", "d2d", {"block_bytes": 32768, "error": "out of resources"}, 0.0, 100.0, 0.0, False)]
    monkeypatch.setattr(tune, "run", lambda *a, **k: rows)
    args = argparse.Namespace(size="1MB", checksum_size="1MB", quick=True, top=1, json=None)
    assert tune.main(args) == 1
    out = capsys.readouterr().out
    assert "failed: sm_copy d2d block_bytes=32768: out of resources" in out
    assert "WRONG BYTES: sm_copy d2d block_bytes=65536" in out
    monkeypatch.setattr(tune, "run", lambda *a, **k: rows[:2])
    assert tune.main(args) == 0
