"""``flashboot bench arena`` on the host backend: its ceiling is the host's own memcpy of the same
run, and the GPU targets are marked as not applying."""

from __future__ import annotations

import json

from flashboot.cli import main


def test_bench_arena_on_the_host_shows_the_host_ceiling_not_gpu_targets(tmp_path, capsys):
    out = tmp_path / "arena.json"
    assert main(["bench", "arena", "--device", "cpu", "--size", "8MiB", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["copy_ceiling_what"] == "host memcpy" and figures["copy_ceiling_gbps"] > 0
    ceiling = next(line for line in text.splitlines() if "ceiling" in line)
    assert "host memcpy ceiling" in ceiling and f"{figures['copy_ceiling_gbps']:,.1f} GB/s" in ceiling
    assert "d2d" not in text and " 0 GB/s" not in text
    for what in ("create+map, first call", "open in another process", "checksum"):
        line = next(line for line in text.splitlines() if what in line)
        assert "GPU target, n/a" in line or "x the memcpy" in line, line
    assert ">= 1000 GB/s" not in text and "< 10 ms" not in text


def test_bench_arena_shows_each_first_call_beside_the_median_of_the_later_ones(monkeypatch, capsys):
    """A process creates its arena once and opens an imported one once: the first call in the
    process is what it pays, so the table shows it (and holds the target to it), not only a median
    of every call that hides its one-time costs."""
    from flashboot.benchmarks import arena

    figures = arena.ArenaFigures(
        device="cpu", nbytes=1 << 20, create_map_ms=[9.25, 1.0, 2.0, 3.0], create_map_back_to_back_ms=[1.0],
        close_ms=[0.5], export_ms=[0.75, 0.25], open_in_child_ms=[7.5, 1.5, 2.5], map_rest_in_child_ms=[0.0],
        segments=1, roundtrip_ms=[40.0, 4.0, 6.0], checksum_ms=1.0, checksum_gbps=1.0, copy_ceiling_gbps=2.0,
        copy_ceiling_what="host memcpy", checksum_matches_host=None)
    monkeypatch.setattr(arena, "run", lambda *a, **k: figures)
    assert main(["bench", "arena", "--device", "cpu", "--size", "1MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()

    def line(what: str) -> str:
        return next(x for x in lines if what in x)

    assert "9.25 ms" in line("create+map, first call in this process") and "GPU target" in line("create+map, first")
    assert "2.00 ms" in line("create+map, later calls")  # the median of 1, 2, 3: the first left out
    assert "7.50 ms" in line("open in another process, its first call")
    assert "2.00 ms" in line("open there, later calls")
    assert "40.00 / 5.00 ms" in line("export + send + open + reply")
