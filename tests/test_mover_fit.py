"""Fitting a mover's per-chunk cost and bandwidth, and the chain time it predicts."""

import pytest

from flashboot import FlashBootError
from flashboot.sim.mover_fit import MoverFit, fit_chunked, predict_chain_s

MiB, GiB = 1 << 20, 1 << 30


def rows_of(per_call_s, gbps, total=GiB, chunks=(256 << 10, MiB, 4 * MiB, 64 * MiB), mover="m", mode="per_call"):
    out = []
    for c in chunks:
        n = -(-total // c)
        out.append({"mover": mover, "mode": mode, "chunk_bytes": c, "n_chunks": n, "total_bytes": total,
                    "gpu_ms": (n * per_call_s + total / (gbps * 1e9)) * 1e3})
    return out


def test_fit_recovers_the_cost_per_call_and_the_bandwidth():
    fits = fit_chunked(rows_of(12e-6, 2000) + rows_of(3e-6, 1800, mode="batched"))
    f, b = fits[("m", "per_call")], fits[("m", "batched")]
    assert f.per_call_s == pytest.approx(12e-6, rel=1e-6) and f.gbps == pytest.approx(2000, rel=1e-6)
    assert b.per_call_s == pytest.approx(3e-6, rel=1e-6) and b.gbps == pytest.approx(1800, rel=1e-6)
    assert f.points == 4
    # 1 GiB in 1 MiB chunks: 1024 calls of 12 us beside 0.537 ms of copying
    assert f.effective_gbps(GiB, MiB) == pytest.approx(GiB / (1024 * 12e-6 + GiB / 2e12) / 1e9)


def test_fit_needs_two_chunk_counts():
    with pytest.raises(FlashBootError, match=r"fitting m \(per_call\) needs rows at two chunk counts"):
        fit_chunked(rows_of(1e-6, 100, chunks=(MiB,)))


def test_chain_prediction_counts_the_pipeline_fill_and_the_shared_memory():
    f = MoverFit("m", "flag", per_call_s=0.0, gbps=1000.0, points=2)
    chunk_s = 64 * MiB / 1e12
    # 8 GiB in 64 MiB chunks = 128 chunks; two hops: 129 chunk times
    assert predict_chain_s(f, 8 * GiB, 64 * MiB, 2, shared_memory=False) == pytest.approx(129 * chunk_s)
    assert predict_chain_s(f, 8 * GiB, 64 * MiB, 2, shared_memory=True) == pytest.approx(129 * 2 * chunk_s)
    with pytest.raises(FlashBootError, match="hops >= 1"):
        predict_chain_s(f, GiB, MiB, 0, shared_memory=True)
