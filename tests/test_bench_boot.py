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
    # the ceiling copies what every loader delivers, the checkpoint's bytes, not the image's alignment too
    assert shape["ceiling_nbytes"] == shape["nbytes"] == ck.CHECKPOINT_A.scaled(1e-4).nbytes < shape["image_nbytes"]
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
    assert prepared["report"]["bind_ms"] > 0 and prepared["pass_ms"] > 0  # the load made the views; a pass after
    assert by["flashload prepared, pinned here"]["calls"][0]["report"]["mode"] == "host, prepared"
    streamed = by["flashload streamed"]["calls"][0]
    assert streamed["report"]["mode"] == "streamed from disk" and streamed["x_disk"] > 0 and shape["disk_gbps"] > 0
    assert streamed["report"]["details"]["peak_buffer_bytes"] <= streamed["report"]["details"]["buffer_cap_bytes"]
    boot.print_results(out)
    assert "first load in a fresh process" in capsys.readouterr().out
    assert not root.exists() and not any((root.parent / "disk").iterdir())  # cleaned up
    shutil.rmtree(root.parent)


def test_bench_boot_end_to_end_times_the_boot_in_fresh_processes(capsys):
    from flashboot.benchmarks import boot_e2e

    root = Path(tempfile.mkdtemp(prefix="fbe-")) / "boot"
    try:
        out = boot.run(shapes=["C"], scale=1e-4, device="cpu", root=str(root), loaders=["flashload served"],
                       end_to_end=(0.0, 0.1))
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    (shape,) = out["shapes"]
    e2e = shape["end_to_end"]
    assert e2e["steps_per_s"][0.1] > 0  # W's rate, calibrated in the W-alone process itself
    cells = {(r["w_s"], r["early"]): r for r in e2e["rows"]}
    assert set(cells) == {(0.0, False), (0.0, True), (0.1, False), (0.1, True)}
    for r in cells.values():
        assert "error" not in r, r
        assert r["verified"] and r["total_ms"] >= r["w_ms"] + r["load_ms"] - 1e-6
        assert r["x_bound"] == r["total_ms"] / max(r["w_alone_ms"], shape["ceiling_ms"])
        assert (r["steps_per_s"] > 0) == (r["w_s"] > 0)  # each boot cell calibrated its own W
        assert r["pass_ms"] > 0  # every tensor touched after the load, as an engine's binding does
        assert r["copy_request_ms"] > 0  # the daemon's request went out that long after the call
        # W > 0: W ran once more beside a second, bare daemon copy into the loaded arena
        assert (r.get("w_beside_copy_ms", 0) > 0) == (r["w_s"] > 0)
    early = cells[(0.1, True)]
    assert early["w_taken_by_prepare_ms"] == early["w_ms"] - early["w_beside_copy_ms"]
    # each W in wall and CPU time: what W's thread spent off the CPU during the boot
    assert 0 < early["w_cpu_ms"] and early["w_off_cpu_ms"] == early["w_ms"] - early["w_cpu_ms"]
    assert early["w_alone_cpu_ms"] > 0 and early["w_after_cpu_ms"] > 0 and early["w_beside_copy_cpu_ms"] > 0
    # the GIL the early call held, bounded by its call and its background thread's CPU time
    assert early["prepare_gil_bound_ms"] == early["prepare_call_ms"] + early["prepare_thread_cpu_ms"]
    assert early["prepare_thread_cpu_ms"] > 0 and early["prepare_gil_budget_ms"] == 20.0 + 40_250 / 1e3
    assert 0 <= early["prepare_handover_cpu_ms"] <= early["prepare_thread_cpu_ms"]  # its part of that CPU
    # the tight bound: less the thread's CPU inside calls that release the GIL
    assert 0 <= early["prepare_thread_gil_free_cpu_ms"] <= early["prepare_thread_cpu_ms"]
    assert early["prepare_gil_held_bound_ms"] == early["prepare_gil_bound_ms"] - early["prepare_thread_gil_free_cpu_ms"]
    assert early["x_bound_beside_copy"] == early["total_ms"] / max(early["w_beside_copy_ms"], shape["ceiling_ms"])
    assert cells[(0.1, True)]["w_alone_ms"] > 0 and cells[(0.0, True)]["w_alone_ms"] == 0
    boot.print_results(out)
    printed = capsys.readouterr().out
    assert "boot end to end on cpu" in printed and "x: total / max(W, bulk)" in printed and "x, W beside copy" in printed
    assert "x, W's CPU" in printed and "GIL held <=" in printed
    assert boot_e2e.headline(out).startswith("boot end to end (C@0.0001): early call + 0.1 s of engine work")


def test_an_end_to_end_cell_of_several_processes_is_the_one_of_the_median_total():
    from flashboot.benchmarks import boot_e2e
    from flashboot.benchmarks.boot_e2e import _row

    def res(total):
        return {"total_ms": total, "w_ms": total - 5, "load_ms": 5.0, "prepare_call_ms": 0.0, "pass_ms": 1.0,
                "verified": True, "steps_per_s": 1e6, "w_after_ms": 40.0 + total, "w_beside_copy_ms": 2 * total,
                "w_cpu_ms": total - 7,
                "copy_request_ms": 3.0, "report": {"details": {"ready_before_load_ms": total}, "wait_ms": 1.0}}

    alone = {"w_ms": 50.0}
    row = _row([res(30.0), res(10.0), res(20.0)], alone, 0.25, True, ceiling_ms=25.0)
    assert row["total_ms"] == 20.0 and row["totals_ms"] == [30.0, 10.0, 20.0] and row["repeats"] == 3
    assert row["x_bound"] == 20.0 / 50.0 and row["x_bound_same"] == 20.0 / 60.0
    assert row["x_bound_cpu"] == 20.0 / 25.0 and row["w_off_cpu_ms"] == 2.0  # W's CPU 13 ms < bulk 25 ms
    assert row["ready_before_load_ms"] == 20.0 and row["load_phases_ms"]["wait"] == 1.0
    assert row["w_beside_copy_ms"] == 40.0 and row["x_bound_beside_copy"] == 20.0 / 40.0
    assert row["w_taken_by_prepare_ms"] == 15.0 - 40.0 and row["copy_request_ms"] == 3.0
    # an even count: the upper middle, the slower of the two (the lower had been a best-of-two)
    assert _row([res(30.0), res(10.0)], alone, 0.25, False, 25.0)["total_ms"] == 30.0
    assert boot_e2e._median_alone([{"w_ms": 30.0}, {"w_ms": 10.0}])["w_ms"] == 10.0  # the bound: the strict one
    failed = _row([res(10.0), {"error": "the daemon died"}], alone, 0.25, True, 25.0)
    assert failed["error"] == "the daemon died" and "total_ms" not in failed


def test_w_alone_is_measured_beside_each_repeat_and_its_median_bounds_the_cell():
    """W alone runs in its own process once per repeat, interleaved with the boots it bounds (the
    machine's speed drifts over a run), and the cell's bound is the median of those."""
    from flashboot.benchmarks import boot_e2e

    order, alone_w = [], iter([300.0, 100.0, 200.0])

    def run_child(spec):
        order.append(spec["what"] if spec["what"] == "alone" else ("early" if spec["early"] else "plain"))
        if spec["what"] == "alone":
            return {"w_ms": next(alone_w), "w_cpu_ms": 1.0, "steps_per_s": 5.0, "steps": 1}
        return {"total_ms": 250.0, "w_ms": 240.0, "load_ms": 10.0, "prepare_call_ms": 0.0, "pass_ms": 1.0,
                "verified": True, "steps_per_s": 5.0, "w_after_ms": 230.0, "w_cpu_ms": 240.0,
                "report": {"details": {}, "wait_ms": 0.0}}

    out = boot_e2e.run_shape(run_child, device="cpu", image="i", shm="s", ceiling_ms=50.0, w_levels=(0.0, 0.25),
                             log=lambda line: None, repeats=3)
    assert order == ["plain", "early"] * 3 + ["alone", "plain", "early"] * 3  # no W alone at W = 0
    rows = [r for r in out["rows"] if r["w_s"] == 0.25]
    assert all(r["w_alone_ms"] == 200.0 and r["w_alone_all_ms"] == [300.0, 100.0, 200.0] for r in rows)
    assert rows[0]["x_bound"] == 250.0 / 200.0 and out["steps_per_s"] == {0.25: 5.0}
    assert boot_e2e._median_alone([{"error": "boom"}, {"w_ms": 1.0}]) == {"error": "boom"}


def test_first_calls_times_a_restart_in_a_fresh_process(tmp_path):
    import flashboot
    from flashboot.benchmarks import first_calls

    tiny = ck.CheckpointSpec("tiny", layers=2, experts=4, expert_rows=64, expert_cols=32, hidden=32, vocab=64,
                             shards=1)
    ck.make_checkpoint(str(tmp_path / "ckpt"), tiny, device="cpu")
    flashboot.prepack(str(tmp_path / "ckpt"), str(tmp_path / "image"), progress=False)
    (row,) = first_calls.views([str(tmp_path / "image")], "cpu")
    assert "error" not in row, row
    assert row["tensors"] == tiny.tensor_count and row["views_ms"] > 0 and row["metadata_ms"] > 0
    assert row["restart_ms"] >= row["open_ms"] + row["metadata_ms"] + row["views_ms"] - 1e-6
    assert row["restart_target_ms"] == 20 + 2e-3 * tiny.tensor_count
    assert row["view_threads"] is None  # measured as restart makes them: make_views' own default
    (line,) = first_calls.summary_lines([row, {"note": "neither kind"}])
    assert line.startswith("image (view threads default): ") and f"{tiny.tensor_count} tensors" in line
    assert f"restart {row['restart_ms']:.1f} ms vs target {row['restart_target_ms']:.1f} ms" in line


def test_a_peer_child_imports_the_peer_library_before_its_first_timed_call(tmp_path):
    """The FlashLoad children import FlashBoot's loader before the clock, as an engine does at
    start; a peer's child imports the peer's library the same way (it had imported the adapters'
    module instead, leaving safetensors' import inside the peer's first timed call)."""
    import json

    from flashboot.benchmarks.peers import FastSafetensorsLoader, InstantTensorLoader, SafetensorsLoader
    from _python import run_python

    assert (SafetensorsLoader.module, InstantTensorLoader.module, FastSafetensorsLoader.module) == \
        ("safetensors.torch", "instanttensor", "fastsafetensors")
    tiny = ck.CheckpointSpec("tiny", layers=1, experts=2, expert_rows=8, expert_cols=8, hidden=8, vocab=8, shards=1)
    ck.make_checkpoint(str(tmp_path / "ckpt"), tiny, device="cpu")
    code = f"""
import json, sys
from flashboot.benchmarks import boot, peers
seen = []
load = peers.SafetensorsLoader.load
def spy(self):
    seen.append("safetensors.torch" in sys.modules)
    return load(self)
peers.SafetensorsLoader.load = spy
out = boot._child({{"loader": "safetensors", "device": "cpu", "checkpoint": {str(tmp_path / "ckpt")!r}}})
print(json.dumps([seen, [c["verified"] for c in out["calls"]]]))
"""
    seen, verified = json.loads(run_python("-c", code).strip().splitlines()[-1])
    assert seen == [True, True] and verified == [True, True]
