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


def test_bench_stream_judges_the_cap_on_the_first_load_in_a_fresh_process_too(tmp_path, capsys):
    """The ring's cap on extra host memory had been judged on the load after a warm-up only; the
    first load in a fresh process, the one an engine makes, is judged and printed too."""
    from flashboot.benchmarks import stream

    out = stream.run(scale=0.002, device="cpu", image_root=str(tmp_path / "img"), ckpt_root=str(tmp_path / "ckpt"),
                     log=lambda line: None)
    s = out["stream"]
    first = s["first"]
    assert first["within_cap"] == (first["peak_extra_host_bytes"] <= s["buffer_cap_bytes"])
    assert s["verified"] and first["x_disk"] == first["stream_gbps"] / s["disk_gbps"]
    stream.print_results(out)
    assert f"within the cap: 1st load in a fresh process {first['within_cap']}, after a warm-up {s['within_cap']}" \
        in capsys.readouterr().out


def test_a_bench_checks_its_json_path_before_it_runs_and_leaves_no_earlier_report(tmp_path, monkeypatch, capsys):
    """A --json path in a missing directory had failed after the whole run (its figures lost), and
    a report of an earlier run stayed in place when this run failed, reading as this run's."""
    from flashboot.benchmarks import arena
    from flashboot.cli import main
    from flashboot.errors import FlashBootError

    ran = []

    def fail(*args, **kwargs):
        ran.append(True)
        raise FlashBootError("the benchmark failed")

    monkeypatch.setattr(arena, "run", fail)
    assert main(["bench", "arena", "--device", "cpu", "--json", str(tmp_path / "missing" / "a.json")]) == 2
    assert "cannot write the JSON report to" in capsys.readouterr().err and ran == []  # refused before the work
    old = tmp_path / "a.json"
    old.write_text('{"checksum_gbps": 1000.0}\n')
    assert main(["bench", "arena", "--device", "cpu", "--json", str(old)]) == 2
    assert "the benchmark failed" in capsys.readouterr().err
    assert ran == [True] and old.read_text() == ""  # no earlier run's figures left as this run's
