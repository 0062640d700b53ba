"""``flashboot bench swap`` on the host backend at a small scale: every figure is produced and
every wake is byte-exact. No time is asserted."""

from flashboot.benchmarks import swap


def test_a_small_swap_run_reports_every_figure(tmp_path, capsys):
    out = swap.run(scale=0.0005, images=2, device="cpu", repeats=1, root=str(tmp_path / "w"))
    assert out["exact"] is True and out["images"] == 2 and out["tensors"] == 3170
    for key in ("wake_served_ms", "sleep_release_ms", "swap_ms", "level1_sleep_ms", "level1_wake_ms"):
        assert out[key] > 0, key
    # where the time went: each sleep's release calls, each wake's parts; the swap's handover falls
    # back to a release before B's wake on the host backend, and says why
    assert set(out["sleep_release_parts"]["steps_ms"]) == {"close memfd", "unmap segment, keep the reservation"}
    served, level1 = out["wake_served_parts"], out["level1_wake_parts"]
    assert served["total_ms"] >= served["probe_ms"] + served["copy_ms"] and served["daemon_h2d_ms"] > 0
    assert level1["arena_fill_ms"] > 0 and level1["first_copy_issued_ms"] > 0 and "arena_create_ms" in level1
    assert out["wake_served_rested_parts"]["daemon_h2d_ms"] > 0
    released = {mode: m["released"] for mode, m in out["swap_modes"].items()}
    assert released.pop("handover")[0].startswith("before (the host backend's segments are memfds")
    assert released == {"during": ["during"], "after": ["after"], "before": ["before"]}
    assert out["swap_ms"] == out["swap_modes"]["handover"]["ms"] and out["swap_modes"]["after"]["parts"]["wake"]["total_ms"] > 0
    assert out["torch"]["offload_ms"] > 0 and out["torch"]["reload_ms"] > 0
    # torch moves the tensors' bytes, fewer than the image's (alignment): its ratios are per byte
    # against the ceilings' (a ratio of the times had been kind to it by the alignment's share)
    t, n = out["torch"], out["nbytes"]
    assert 0 < t["nbytes"] < n
    d2h = min(out["ceiling_before"]["d2h_ms"], out["ceiling_after"]["d2h_ms"])
    assert out["ratios"]["torch_offload_over_d2h"] == (t["offload_ms"] / t["nbytes"]) / (d2h / n)
    assert out["restart"]["tensors"] == 3170 and out["restart"]["restart_ms"] > 0
    # a restarted engine is a new process: its first load from the holder, timed there, is what the
    # budget judges (the median of restarts in this warm process had been)
    r = out["restart"]
    assert r["restart_first_ms"] > 0 and r["restart_first_exact"] is True
    assert r["within_budget"] == (r["restart_first_ms"] <= r["budget_ms"])
    assert set(out["ratios"]) == {"wake_served_x_h2d", "level1_sleep_x_d2h", "level1_wake_x_h2d", "swap_over_h2d",
                                  "swap_release_handover_over_h2d", "swap_release_during_over_h2d",
                                  "swap_release_after_over_h2d",
                                  "swap_release_before_over_h2d", "torch_offload_over_d2h", "torch_reload_over_h2d"}
    swap.print_results(out)
    text = capsys.readouterr().out
    assert "wake from the daemon" in text and "restart via the holder, in a fresh process" in text
    assert "level-1 wake parts, ms: total" in text and "swap parts (release after), ms: total" in text
    assert not (tmp_path / "w").exists()  # the images and the staging are removed
