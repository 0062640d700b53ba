"""``flashboot bench serve`` on the host backend: 1, 2, 4, 8 and 16 engine processes ask the
preloader daemon for the same image at once; every one gets every byte. No time is asserted."""

from flashboot.benchmarks.checkpoints import CheckpointSpec
from flashboot.benchmarks.serve import print_results, run

SMALL = CheckpointSpec("S", layers=2, experts=8, expert_rows=256, expert_cols=128, hidden=64, vocab=128, shards=2)


def test_every_engine_gets_every_byte_at_1_2_4_8_16(tmp_path, capsys):
    out = run(engines=[16, 1, 2, 4, 8], spec=SMALL, root=str(tmp_path / "work"), repeats=1, timeout_s=120)
    assert [r.engines for r in out["rounds"]] == [1, 2, 4, 8, 16]
    for r in out["rounds"] + [r.first for r in out["rounds"]]:
        assert r.failed == [] and r.exact == r.engines, r
        assert r.devices == ["cpu"] and r.nbytes == out["nbytes"] >= SMALL.nbytes  # plus alignment
        assert r.gbps > 0 and r.ceiling_gbps > 0 and r.x_ceiling == r.gbps / r.ceiling_gbps
        assert r.latency_ms["min"] <= r.latency_ms["median"] <= r.latency_ms["max"]
    assert [c.devices for c in out["ceilings"]] == [["cpu"]]
    assert not (tmp_path / "work").exists(), "the work directory is removed"
    print_results(out)
    text = capsys.readouterr().out
    assert "16/16" in text and "ceiling, cpu at once" in text


def test_each_engine_count_reports_its_fresh_engines_first_loads_and_their_failures():
    """Each N starts N fresh engines: their first round (each engine's first served load) is
    reported, failures included, beside the median of the later rounds; it had been a warm-up of
    engines kept across the counts, its time and its failures dropped."""
    from flashboot.benchmarks.serve import Ceiling, _rounds_of

    ceilings = {("cpu",): Ceiling(["cpu"], 1000, 1.0, 1.0)}
    started, closed = [], []

    class FakeEngines:
        def __init__(self, n):
            self.calls = 0
            started.append(n)

        def round(self, n):
            self.calls += 1
            spans = {1: 0.010, 2: 0.003, 3: 0.001, 4: 0.002}  # seconds; the first round is the slow one
            out = [{"device": "cpu", "t0": 0.0, "t1": spans[self.calls], "h2d_ms": 1.0, "queue_ms": 0.0,
                    "exact": True} for _ in range(n)]
            if self.calls == 1 and n == 2:
                out[1] = {"device": "cpu", "error": "ChecksumMismatchError: chunk 3"}
            return out

        def close(self):
            closed.append(self)

    one = _rounds_of(FakeEngines, 1, 1000, ceilings, repeats=3)
    assert one.first.span_ms == 10.0 and one.first.exact == 1 and one.span_ms == 2.0  # the median of 3, 1, 2
    two = _rounds_of(FakeEngines, 2, 1000, ceilings, repeats=3)
    assert two.first.failed == ["ChecksumMismatchError: chunk 3"] and two.first.exact == 1
    assert two.failed == [] and two.exact == 2
    assert started == [1, 2] and len(closed) == 2  # fresh engines per count, each set closed


def test_a_failed_first_load_fails_the_run(monkeypatch, capsys):
    import argparse

    from flashboot.benchmarks import serve

    def round_(engines, failed=()):
        return serve.ServeRound(engines, ["cpu"], 1000, engines - len(failed), list(failed), 1.0, 1.0, 1.0, 1.0,
                                {"min": 1.0, "median": 1.0, "max": 1.0}, 0.0, 1.0)

    r = round_(2)
    r.first = round_(2, failed=["WaitTimeoutError: no reply"])
    out = {"nbytes": 1000, "tensors": 1, "devices": ["cpu"], "pinned": False, "rounds": [r],
           "ceilings": [serve.Ceiling(["cpu"], 1000, 1.0, 1.0)]}
    monkeypatch.setattr(serve, "run", lambda **kw: out)
    args = argparse.Namespace(engines=[2], devices=None, scale=None, dir=None, repeats=1, timeout=1.0, keep=False,
                              shm_dir=None, json=None)
    assert serve.main(args) == 1
    text = capsys.readouterr().out
    assert "2, 1st loads" in text and "2, later" in text
