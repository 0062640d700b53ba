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
    for what in ("create+map (no arena", "open in another process", "checksum"):
        line = next(line for line in text.splitlines() if what in line)
        assert "GPU target, n/a" in line or "x the memcpy" in line, line
    assert ">= 1000 GB/s" not in text and "< 10 ms" not in text
