"""Fitting a mover's per-chunk cost and bandwidth, and the chain time it predicts."""

import numpy as np
import pytest

from flashboot import FlashBootError
from flashboot.sim.mover_fit import MoverFit, fit_chunked, predict_chain_s, predict_measured_chains

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
    # two rows at one count are still one count: the message had said "got 2", as if that sufficed
    with pytest.raises(FlashBootError, match=r"got 2 row\(s\), all at 1024 chunk\(s\)"):
        fit_chunked(rows_of(1e-6, 100, chunks=(MiB, MiB)))


@pytest.mark.parametrize("rows,rate", [
    # more bytes in less time: the fitted rate was -3,221 GB/s, and predicted times negative
    ([{"n_chunks": 2, "total_bytes": GiB, "gpu_ms": 2.0}, {"n_chunks": 1, "total_bytes": 2 * GiB, "gpu_ms": 0.5}],
     "-3,221 GB/s"),
    # no time at all: the rate was inf
    ([{"n_chunks": 2, "total_bytes": GiB, "gpu_ms": 0.0}, {"n_chunks": 4, "total_bytes": GiB, "gpu_ms": 0.0}],
     "inf GB/s"),
])
def test_fit_refuses_a_rate_that_is_not_positive_and_finite(rows, rate):
    rows = [{"mover": "m", "mode": "per_call", **r} for r in rows]
    with pytest.raises(FlashBootError, match=rf"fitting m \(per_call\) gives a rate of {rate}.*rows \(n_chunks, bytes, "
                                             rf"gpu_ms\) \[\(2, {GiB}, "):
        fit_chunked(rows)


def test_a_fit_refuses_chunks_of_zero_bytes_and_a_rate_that_is_not_positive():
    fit = MoverFit("m", "per_call", 1e-6, 100.0, 2)
    with pytest.raises(FlashBootError, match="positive sizes, got total 1073741824 bytes in chunks of 0"):
        fit.effective_gbps(GiB, 0)  # was ZeroDivisionError
    with pytest.raises(FlashBootError, match="finite rate > 0"):
        MoverFit("m", "per_call", 1e-6, -5.0, 2)


def test_chain_prediction_counts_the_pipeline_fill_and_the_shared_memory():
    f = MoverFit("m", "flag", per_call_s=0.0, gbps=1000.0, points=2)
    chunk_s = 64 * MiB / 1e12
    # 8 GiB in 64 MiB chunks = 128 chunks; two hops: 129 steps, one hop alone in the first and the last
    assert predict_chain_s(f, 8 * GiB, 64 * MiB, 2) == pytest.approx(129 * chunk_s)
    # one GPU whose two copies at once reach 1,500 GB/s: the 127 steps with both hops take 2 chunks / 1,500 GB/s
    shared = predict_chain_s(f, 8 * GiB, 64 * MiB, 2, aggregate_gbps=1500.0)
    assert shared == pytest.approx(2 * chunk_s + 127 * 2 * 64 * MiB / 1.5e12)
    # an aggregate at or below one copy's rate: every shared step moves its two chunks at that rate
    assert predict_chain_s(f, 8 * GiB, 64 * MiB, 2, aggregate_gbps=1000.0) == pytest.approx(2 * chunk_s + 127 * 2 * chunk_s)
    # the per-call cost is paid once per step (the hops' calls overlap); three hops: 130 steps
    g = MoverFit("m", "per_call", per_call_s=5e-6, gbps=1000.0, points=2)
    assert predict_chain_s(g, 8 * GiB, 64 * MiB, 3) == pytest.approx(130 * 5e-6 + 130 * chunk_s)
    with pytest.raises(FlashBootError, match="hops >= 1"):
        predict_chain_s(f, GiB, MiB, 0)
    with pytest.raises(FlashBootError, match=r"aggregate bandwidth must be positive, got 0.0 GB/s"):
        predict_chain_s(f, GiB, MiB, 2, aggregate_gbps=0.0)
    # NaN passed the `<= 0` checks: a NaN time came back, or numpy's "arange: cannot compute length"
    with pytest.raises(FlashBootError, match="aggregate bandwidth must be positive, got nan"):
        predict_chain_s(f, GiB, MiB, 2, aggregate_gbps=float("nan"))
    with pytest.raises(FlashBootError, match="chunk=nan"):
        predict_chain_s(f, GiB, float("nan"), 2)
    with pytest.raises(FlashBootError, match="hops=2.5"):  # a fractional hop count was priced without a word
        predict_chain_s(f, GiB, MiB, 2.5)
    assert predict_chain_s(f, 8 * GiB, 64 * MiB, np.int64(2)) == pytest.approx(129 * chunk_s)  # a numpy count is a count


def test_measured_chains_are_predicted_from_their_hops_curve_and_the_concurrent_aggregate():
    rows = rows_of(0.5e-6, 1950, mover="flag_kernel", mode="flag") + rows_of(5e-6, 2100, mover="copy_engine")
    chain = {"method": "flag kernels", "nbytes": 8 * GiB, "chunk_bytes": 64 * MiB, "chain_ms": 9.2,
             "model": ["flag_kernel", "flag"], "hops": 2}
    report = {"rows": rows, "chain": [chain, {"method": "copy engine + stream memops", "nbytes": 8 * GiB,
                                              "chunk_bytes": 64 * MiB, "chain_ms": 8.1}],
              "concurrent": [{"mover": "flag_kernel", "copies": 2, "aggregate_gbps": 1880.0}]}
    flag, memops = predict_measured_chains(report)
    expect = predict_chain_s(MoverFit("", "", 0.5e-6, 1950.0, 4), 8 * GiB, 64 * MiB, 2, aggregate_gbps=1880.0)
    assert flag["predicted_s"] == pytest.approx(expect, rel=1e-6) and "1,880 GB/s measured" in flag["aggregate"]
    assert flag["error"] == pytest.approx((expect - 9.2e-3) / 9.2e-3, rel=1e-6)
    # a row without a model (older reports) takes the known one; without an aggregate, the fit's bandwidth
    assert memops["fit"].mover == "copy_engine" and memops["fit"].mode == "per_call"
    assert memops["aggregate"].startswith("not measured")
    assert memops["predicted_s"] == pytest.approx(
        predict_chain_s(memops["fit"], 8 * GiB, 64 * MiB, 2, aggregate_gbps=memops["fit"].gbps))
    missing = predict_measured_chains({"rows": rows, "chain": [dict(chain, model=["triton_tma", "flag"])]})
    assert missing == [{"method": "flag kernels", "fit": None, "why": "no rows of triton_tma (flag)"}]
    across = predict_measured_chains({"rows": rows, "chain": [dict(chain, devices=[0, 1, 0])]})
    assert across == [{"method": "flag kernels", "fit": None, "why": "hops across GPUs: the report has no P2P curve"}]
