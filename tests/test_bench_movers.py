"""``bench movers --chunked`` refuses plainly without a GPU (it measures GPU copies only)."""

import pytest

from flashboot._cuda import cuda_available


@pytest.mark.skipif(cuda_available(), reason="checks the refusal on machines without CUDA")
def test_chunked_mode_without_cuda_says_why(capsys):
    from flashboot.cli import main

    try:
        rc = main(["bench", "movers", "--chunked", "--chunks", "1MiB", "--chain-bytes", "none"])
    except SystemExit as exc:
        rc = exc.code
    assert rc != 0
    assert "bench movers --chunked measures GPU copies and needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_chain_rows_report_each_hop_beside_the_hop_alone():
    """The chain benchmark on one GPU, small: every method verified byte-exact, the aggregate is
    the two hops' bytes over the chain's time, and every ratio is against the same ceiling."""
    from flashboot.benchmarks.movers_chunked import chain_rows

    rows = chain_rows(64 << 20, 4 << 20, repeats=1)
    assert [r["method"] for r in rows] == ["flag kernels", "copy engine + stream memops"]
    for r in rows:
        assert r["verified"] and r["devices"] == [0, 0, 0] and r["model"] in (["flag_kernel", "flag"], ["copy_engine", "per_call"])
        assert r["aggregate_gbps"] == pytest.approx(2 * r["nbytes"] / r["chain_ms"] / 1e6)
        for key in ("hop1", "chain", "alone", "aggregate"):
            assert r[f"{key}_ratio"] == pytest.approx(r[f"{key}_gbps"] / r["ceiling_gbps"])


@pytest.mark.gpu
def test_gpu_concurrent_rows_copy_both_halves():
    import torch

    from flashboot.benchmarks.movers_chunked import concurrent_rows
    from flashboot.kernels.checksum import checksum

    total = 64 << 20
    src = torch.randint(-2**31, 2**31 - 1, (total // 4,), dtype=torch.int32, device="cuda:0").view(torch.uint8)
    dst = torch.zeros_like(src)
    stream = torch.cuda.Stream(device=0)
    rows = concurrent_rows(dst, src, total, 4 << 20, stream, 1, checksum(src))
    assert [r["mover"] for r in rows] == ["copy_engine", "flag_kernel", "triton_sm"]
    assert all(r["verified"] and r["copies"] == 2 for r in rows)


@pytest.mark.two_gpus
def test_two_gpus_flag_chain_rows_cross_gpus_and_verify():
    from flashboot.benchmarks.movers_chunked import chain_rows

    rows = chain_rows(64 << 20, 4 << 20, repeats=1, devices=(0, 1, 0))
    assert [r["method"] for r in rows] == ["flag kernels"]  # the stream-memop chain is the one-GPU comparison
    assert rows[0]["verified"] and rows[0]["devices"] == [0, 1, 0] and rows[0]["ceiling_gbps"] > 0


def test_the_first_call_is_its_own_column_and_its_bytes_are_checked(monkeypatch):
    """A warm-up had hidden each mover's first call (a kernel's JIT), and only the last repeat's
    bytes were checked: a first call that wrote wrong bytes passed as verified."""
    from flashboot.benchmarks import movers as bench

    rows = bench.run(["host"], [1 << 20], repeats=1)
    assert rows and all(r.verified and r.first_ms > 0 for r in rows)

    calls = {"n": 0}
    real = bench._first_call_ms

    def first_call_writes_garbage(mover, dst, src, nbytes, device):
        ms = real(mover, dst, src, nbytes, device)
        dst[:8].fill_(0x55)  # the first call's bytes are wrong; the timed calls' are right
        calls["n"] += 1
        return ms

    monkeypatch.setattr(bench, "_first_call_ms", first_call_writes_garbage)
    rows = bench.run(["host"], [1 << 20], repeats=1)
    assert calls["n"] == len(rows) and not any(r.verified for r in rows)
