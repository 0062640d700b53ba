"""``flashboot bench swap`` on the host backend at a small scale: every figure is produced and
every wake is byte-exact. No time is asserted."""

from flashboot.benchmarks import swap


def test_a_small_swap_run_reports_every_figure(tmp_path, capsys):
    out = swap.run(scale=0.0005, images=2, device="cpu", repeats=1, root=str(tmp_path / "w"))
    assert out["exact"] is True and out["images"] == 2 and out["tensors"] == 3170
    for key in ("wake_served_ms", "sleep_release_ms", "swap_ms", "level1_sleep_ms", "level1_wake_ms"):
        assert out[key] > 0, key
    assert out["torch"]["offload_ms"] > 0 and out["torch"]["reload_ms"] > 0
    assert out["restart"]["tensors"] == 3170 and out["restart"]["restart_ms"] > 0
    assert set(out["ratios"]) == {"wake_served_x_h2d", "level1_sleep_x_d2h", "level1_wake_x_h2d", "swap_over_h2d",
                                  "torch_offload_over_d2h", "torch_reload_over_h2d"}
    swap.print_results(out)
    text = capsys.readouterr().out
    assert "wake from the daemon" in text and "restart via the holder" in text
    assert not (tmp_path / "w").exists()  # the images and the staging are removed
