"""``flashboot bench boot`` on the host backend: every loader in its own fresh process, first and
second call, each result verified. No time is asserted."""

import shutil
import tempfile
from pathlib import Path

from flashboot.benchmarks import boot
from flashboot.benchmarks import checkpoints as ck


def test_shape_c_has_forty_thousand_tensors():
    c = ck.CHECKPOINT_C
    assert c.tensor_count == len(c.tensors()) == 40_250 and 2.5e9 < c.nbytes < 2.7e9
    assert c.scaled(1e-4).tensor_count == c.tensor_count


def test_bench_boot_runs_each_loader_in_a_fresh_process(capsys):
    root = Path(tempfile.mkdtemp(prefix="fbb-")) / "boot"  # short: the daemon's socket path must fit AF_UNIX
    loaders = ["flashload served", "flashload prepared", "flashload prepared, pinned here", "flashload streamed",
               "safetensors"]
    out = boot.run(shapes=["A"], scale=1e-4, device="cpu", root=str(root), loaders=loaders, stream_shapes=["A"],
                   disk_root=str(root.parent / "disk"))
    (shape,) = out["shapes"]
    assert shape["tensors"] == ck.CHECKPOINT_A.tensor_count and shape["ceiling_ms"] > 0
    by = {r["loader"]: r for r in shape["loaders"]}
    assert set(by) == set(loaders)
    for r in by.values():
        assert "error" not in r, r
        assert len(r["calls"]) == 2 and all(c["verified"] for c in r["calls"]) and r["process_s"] > 0
    served = by["flashload served"]["calls"][0]["report"]
    prepared = by["flashload prepared"]["calls"][0]
    assert served["mode"] == "served" and served["metadata_ms"] > 0
    assert prepared["report"]["mode"] == "served, prepared" and prepared["prepare_ms"] > 0
    assert prepared["report"]["metadata_ms"] == 0  # paid in prepare, before the load
    assert by["flashload prepared, pinned here"]["calls"][0]["report"]["mode"] == "host, prepared"
    streamed = by["flashload streamed"]["calls"][0]
    assert streamed["report"]["mode"] == "streamed from disk" and streamed["x_disk"] > 0 and shape["disk_gbps"] > 0
    assert streamed["report"]["details"]["peak_buffer_bytes"] <= streamed["report"]["details"]["buffer_cap_bytes"]
    boot.print_results(out)
    assert "first load in a fresh process" in capsys.readouterr().out
    assert not root.exists() and not any((root.parent / "disk").iterdir())  # cleaned up
    shutil.rmtree(root.parent)
