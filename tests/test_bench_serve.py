"""``flashboot bench serve`` on the host backend: 1, 2, 4, 8 and 16 engine processes ask the
preloader daemon for the same image at once; every one gets every byte. No time is asserted."""

from flashboot.benchmarks.checkpoints import CheckpointSpec
from flashboot.benchmarks.serve import print_results, run

SMALL = CheckpointSpec("S", layers=2, experts=8, expert_rows=256, expert_cols=128, hidden=64, vocab=128, shards=2)


def test_every_engine_gets_every_byte_at_1_2_4_8_16(tmp_path, capsys):
    out = run(engines=[16, 1, 2, 4, 8], spec=SMALL, root=str(tmp_path / "work"), repeats=1, timeout_s=120)
    assert [r.engines for r in out["rounds"]] == [1, 2, 4, 8, 16]
    for r in out["rounds"]:
        assert r.failed == [] and r.exact == r.engines, r
        assert r.devices == ["cpu"] and r.nbytes == out["nbytes"] >= SMALL.nbytes  # plus alignment
        assert r.gbps > 0 and r.ceiling_gbps > 0 and r.x_ceiling == r.gbps / r.ceiling_gbps
        assert r.latency_ms["min"] <= r.latency_ms["median"] <= r.latency_ms["max"]
    assert [c.devices for c in out["ceilings"]] == [["cpu"]]
    assert not (tmp_path / "work").exists(), "the work directory is removed"
    print_results(out)
    text = capsys.readouterr().out
    assert "16/16" in text and "ceiling, cpu at once" in text
