"""Weights that stay, as a hostile user drives them (host backend): an engine-wide sleep whose
failure left an arena asleep, and the other edges of sleep, wake, swap and restart found in review."""

from __future__ import annotations

import pytest
import torch

from _engine_helpers import _key, _options, packed  # noqa: F401  (packed: a fixture)
from flashboot.errors import ArenaError
from flashboot.flashload import lifecycle
from flashboot.integrations.engine_prepack import load_engine_weights


def test_an_engine_wide_sleep_whose_failed_arena_went_to_sleep_wakes_it_again(packed, tmp_path, monkeypatch):
    """A level-1 copy out that fails in its wait (a CUDA D2H failing on its stream) leaves that
    arena asleep, its backup short: the engine told the pause failed ran on unmapped weights (the
    roll-back woke only the arenas before it). It is woken again too, from the image."""
    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay

    _, out, _ = packed
    first = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    second = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        before = {n: t.clone() for n, t in second.tensors.items()}
        ptrs = {n: t.data_ptr() for n, t in second.tensors.items()}
        stay(first, shm_dir=str(tmp_path / "shm"))
        stay(second, shm_dir=str(tmp_path / "shm"))
        real, calls = lifecycle._drain_into, []

        def failing_wait(backup, nbytes, device):  # the second arena's copy out fails once issued
            drain, settle = real(backup, nbytes, device)
            calls.append(device)
            if len(calls) == 1:
                return drain, settle

            def drain_then_fail(offset, segment):
                drain(offset, segment)

                def wait():
                    raise RuntimeError("injected: the D2H failed on its stream")
                return wait
            return drain_then_fail, settle

        monkeypatch.setattr(lifecycle, "_drain_into", failing_wait)
        with pytest.raises(ArenaError, match="the copy out of segment 0 .* failed: RuntimeError: injected") as failed:
            sleep_engine_weights(1)
        monkeypatch.undo()
        notes = "\n".join(getattr(failed.value, "__notes__", []))
        assert "the 2 arena(s) this sleep had put to sleep before it failed were woken again" in notes, notes
        assert not first.arena.asleep and not second.arena.asleep
        assert {n: t.data_ptr() for n, t in second.tensors.items()} == ptrs
        assert all(torch.equal(second.tensors[n], t) for n, t in before.items())
    finally:
        first.close()
        second.close()
