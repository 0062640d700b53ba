"""The pure parts of ``flashboot bench clone``: clone placement, NCCL log parsing, the table."""

from __future__ import annotations

from flashboot.benchmarks.clone import _breakdown, _rows, clone_device
from flashboot.benchmarks.clone_from_start import _nccl_transports


def test_first_clone_is_remote_and_a_chain_alternates_gpus():
    devices = ["cuda:0", "cuda:1"]
    assert [clone_device(devices, i) for i in range(4)] == ["cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert [clone_device(["cuda:0"], i) for i in range(2)] == ["cuda:0", "cuda:0"]


def test_nccl_transports_come_from_its_channel_log_lines():
    log = ("host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
           "host:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
           "host:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
           "host:2:2 [1] NCCL INFO Connected all rings, use ring PXN 0 GDR 1\n")
    assert _nccl_transports(log) == ["P2P/CUMEM/read", "SHM/direct/direct"]
    assert _nccl_transports("no nccl here") == []


def test_table_shows_each_clones_device_and_the_exchange_breakdown():
    rep = {"device": "cuda:1", "stream_gbps": 389.0, "gbps": 374.0, "exchange_ms": 1.2, "verified": True,
           "warm_ms": 12.0, "warm_note": "warmed import+map from cuda:1, cuda:0",
           "exchange_detail": {"seed_record_ms": 0.5, "join_ms": 0.1, "import_ms": 0.2, "set_access_ms": 0.3},
           "segments_mapped_during_copy": 31, "map_during_copy_ms": 4.5}
    rep2 = dict(rep, device="cuda:0", stream_gbps=360.0)
    res = {"ceiling": {"path": "p2p", "gbps": 396.0, "ms": 21.7, "byte_exact": True},
           "clone": [{"schedule": "chain", "clones": 2, "reports": [rep, rep2]}]}
    rows = _rows(res)
    chain = next(r for r in rows if r[0] == "chain x2")
    assert "389 (cuda:1), 360 (cuda:0)" in chain[3] and "91% of ceiling" in chain[3]
    exch = next(r for r in rows if r[0].startswith("exchange+map"))
    assert exch[1] == 1.2 and "import (first segment) 0.20" in exch[3] and "cuda:0" in exch[3]
    assert "set access (first segment) 0.30" in exch[3] and "other 31 segments mapped during the copy in 4.50 ms" in exch[3]
    assert _breakdown({"pidfd_getfd_ms": 0.25, "other": 9}) == "pidfd_getfd (all segments) 0.25"


def test_nccl_from_start_moves_each_byte_once_as_flashclone_does():
    """The first collective (NCCL connects lazily) sends the first 64 MiB of the weights; the
    transfer then sends the rest: it had sent every byte again, 64 MiB more than FlashClone moves
    (twice the bytes of a payload under 64 MiB). Run with gloo on the host backend."""
    from flashboot.benchmarks.clone_from_start import nccl_from_start

    for nbytes, mode, tensors in (((64 << 20) + 4096 * 3, "bulk", 1), ((64 << 20) + 4096 * 3, "per_tensor", 3),
                                  (1 << 20, "per_tensor", 5)):
        r = nccl_from_start(["cpu", "cpu"], nbytes, mode=mode, tensors=tensors, timeout_s=120)
        assert r["payload_bytes"] == nbytes and r["byte_exact"], (nbytes, mode, r)
