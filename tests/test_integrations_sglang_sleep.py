"""Putting the engine's weights to sleep and waking them: the memory-saver policy (what FlashBoot
hands to the engine's memory saver, or refuses), sleep and wake of the arenas handed to the engine
(flashboot.integrations.engine_sleep, engine-agnostic), and real SGLang's own release and resume of
the weights' memory occupation in a child process (the ``sglang_run`` fixture, conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from _engine_helpers import (  # noqa: F401  (packed: a fixture)
    PlainEngineLikeModel, _assert_same_tensors, _key, _options, assert_slept_and_woke, packed,
)
from flashboot.errors import CapabilityError, FlashBootError
from flashboot.integrations.engine_prepack import (
    LoaderOptions, bind_engine_model, load_engine_weights, memory_saver_policy,
)


def test_memory_saver_policy_hands_the_weights_to_flashboot_or_says_why_not():
    image = LoaderOptions(image_dir="/img")
    assert image.memory_saver == "sleep"
    assert memory_saver_policy(True, "--enable-memory-saver", image) is True
    assert memory_saver_policy(False, "--enable-memory-saver", image) is True
    for options, why in ((LoaderOptions(seed_store="h:1"), "the weights are cloned from a seed .seed_store.: there is no image"),
                         (LoaderOptions(image_dir="/img", publish_store="h:1"), "the arena is published as a FlashClone seed")):
        with pytest.raises(CapabilityError, match=f"--enable-memory-saver is on, but FlashBoot cannot put these "
                                                  f"weights to sleep: {why}.*\"resident\""):
            memory_saver_policy(True, "--enable-memory-saver", options)
        assert memory_saver_policy(False, "--enable-memory-saver", options) is False
    assert memory_saver_policy(True, "--enable-sleep-mode", LoaderOptions(image_dir="/img", memory_saver="resident")) \
        is False
    with pytest.raises(CapabilityError, match="--enable-sleep-mode is on and the flashboot option memory_saver is "
                                              "'refuse'"):
        memory_saver_policy(True, "--enable-sleep-mode", LoaderOptions(image_dir="/img", memory_saver="refuse"))
    assert memory_saver_policy(False, "--enable-sleep-mode", LoaderOptions(image_dir="/img", memory_saver="refuse")) \
        is False
    with pytest.raises(FlashBootError, match="memory_saver='offload'; known: sleep, resident, refuse"):
        LoaderOptions(image_dir="/img", memory_saver="offload")


def test_weights_handed_to_the_engine_sleep_wake_bitwise_at_the_same_addresses(packed, tmp_path):
    """What the engines' hooks call (SGLang's adapters, vLLM's sleep-mode backend): every arena
    handed over in the process sleeps at the level asked and wakes from the backup (level 1) or
    the disk (level 2), the bound model unchanged; asleep weights refuse an in-place reload."""
    from flashboot.integrations.engine_sleep import (
        check_awake, sleep_engine_weights, stay, staying_weights, wake_engine_weights,
    )

    model, out, _ = packed
    weights = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        with torch.device("meta"):
            target = PlainEngineLikeModel()
        bind_engine_model(target, weights)
        target._flashboot_weights = weights  # as both loaders keep it
        stay(weights, shm_dir=str(tmp_path / "shm"))
        assert staying_weights() == [weights]
        ptrs = {n: t.data_ptr() for n, t in list(target.named_parameters()) + list(target.named_buffers())}
        x = torch.tensor([1, 5, 7])
        before = target.proj(target.embed(x))
        for level, source in ((1, "backup"), (2, "disk")):
            [slept] = sleep_engine_weights(level)
            assert slept.level == level and weights.arena.asleep
            assert [r.level for r in sleep_engine_weights(level)] == [0]  # asleep already: a no-op
            with pytest.raises(FlashBootError, match=r"load_weights: the model's [\d,]+-byte weight arena is asleep"):
                check_awake(target, "load_weights")
            [woke] = wake_engine_weights()
            assert woke.source == source and not weights.arena.asleep
            assert [r.source for r in wake_engine_weights()] == ["awake"]
            _assert_same_tensors(model, target)
            assert torch.equal(target.proj(target.embed(x)), before)
            assert {n: t.data_ptr() for n, t in list(target.named_parameters()) + list(target.named_buffers())} == ptrs
        check_awake(target, "load_weights")
        with pytest.raises(FlashBootError, match="sleep level must be 1 .* or 2 .*, got 3"):
            sleep_engine_weights(3)
    finally:
        weights.close()
    assert staying_weights() == []  # closed weights are not put to sleep any more
    assert sleep_engine_weights(2) == [] and wake_engine_weights() == []


def test_an_engine_wide_sleep_that_fails_on_one_arena_wakes_the_others_again(packed, tmp_path):
    """Two arenas handed over, the second shared with a holder (its sleep is refused): the engine
    is told the pause failed, and the first arena, which had gone to sleep, is awake again with
    its bytes, not left asleep under a model that runs on."""
    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay, wake_engine_weights

    _, out, _ = packed
    first = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    second = load_engine_weights(_options(out, tmp_path), _key(), 0, "cpu", tp_size=1, ep_size=1)
    try:
        before = {n: t.clone() for n, t in first.tensors.items()}
        stay(first, shm_dir=str(tmp_path / "shm"))
        stay(second, shm_dir=str(tmp_path / "shm"))
        second.arena.share("holder pid 42")
        with pytest.raises(FlashBootError, match="other process.* map it .holder pid 42") as refused:
            sleep_engine_weights(2)
        assert "the 1 arena(s) this sleep had put to sleep before it failed were woken again" in \
            "\n".join(getattr(refused.value, "__notes__", []))
        assert not first.arena.asleep and not second.arena.asleep
        assert all(torch.equal(first.tensors[n], t) for n, t in before.items())
        second.arena.unshare("holder pid 42")
        assert [r.level for r in sleep_engine_weights(2)] == [2, 2]
        assert [r.source for r in wake_engine_weights()] == ["disk", "disk"]
    finally:
        first.close()
        second.close()


def test_a_rolled_back_sleep_names_a_refit_it_could_not_keep():
    """The roll-back wakes a level-2 arena from the image: a refit's version is gone; the error
    had said only that the arenas were woken again."""
    from types import SimpleNamespace

    from flashboot.integrations.engine_sleep import sleep_engine_weights, stay

    class Handle:
        def __init__(self, arena_id, fail):
            self.fail, self.arena = fail, SimpleNamespace(arena_id=arena_id, nbytes=4096, closed=False, asleep=False)

        def sleep(self, level):
            if self.fail:
                raise FlashBootError("refused")
            return SimpleNamespace(level=level, summary=lambda: "slept")

        def wake(self, **kw):
            return SimpleNamespace(details={"refit_version_lost": 3}, summary=lambda: "woke")

    class Weights:  # weakly referenced by stay(), as EngineWeights are
        def __init__(self, handle):
            self.handle, self.arena = handle, handle.arena

    weights = [Weights(Handle(f"a{i}", fail=i == 1)) for i in range(2)]
    for w in weights:
        stay(w)
    with pytest.raises(FlashBootError, match="refused") as refused:
        sleep_engine_weights(2)
    notes = "\n".join(refused.value.__notes__)
    assert "were woken again" in notes and "refit again: arena a0 is back at the image's version, not refit " \
        "version 3" in notes
    del weights  # the staying list holds weak references only


def test_real_sglang_memory_saver_refuses_what_flashboot_cannot_put_to_sleep(sglang_run):
    kind, msg = sglang_run["memory_saver_refuse"]
    assert kind == "CapabilityError" and "--enable-memory-saver is on and the flashboot option memory_saver" in msg
    kind, msg = sglang_run["memory_saver_published"]
    assert kind == "CapabilityError" and "published as a FlashClone seed (publish_store)" in msg


def test_real_sglang_release_and_resume_of_the_weights_put_the_arena_to_sleep_and_wake_it(sglang_run):
    # --enable-weights-cpu-backup: level 1, back from the pinned backup
    assert_slept_and_woke(sglang_run["sleep_level1"], 1, "backup")
    # without it: level 2, back from the disk (no preloader runs here), no weight update needed
    cycle = sglang_run["sleep_level2"]
    assert_slept_and_woke(cycle, 2, "disk")
    assert any("not backup: sleep(level=2) kept no backup" in line for line in cycle["logged"]), cycle["logged"]
