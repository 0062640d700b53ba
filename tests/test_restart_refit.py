"""A held arena refit in place, then restarted from (host backend): the held bytes are a refit
version's, or a failed refit's mix, and a restart says so. It had bound them as the image's
(``loaded.version`` 0, mode ``held``, no word), and verify had failed them against the image's
checksums."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import flashboot
from flashboot.errors import FlashBootError
from flashboot.flashclone.holder import Holder
from flashboot.flashclone.holder_refit import read_refit
from flashboot.flashload.restart import HolderOption
from flashboot.weight_update import Publisher, RefitError

from _clone_helpers import _token, serving_holder, store  # noqa: F401  (fixtures)
from test_refit_trainer_hardening import _trainer_weights, generic_image  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def holder(tmp_path):
    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        yield registry


def _holds(loaded, weights: dict) -> bool:
    return all(torch.equal(loaded.tensors[n], t) for n, t in weights.items())


def _first(image, holder):
    """The first engine: loaded, and handed to the holder."""
    with pytest.warns(RuntimeWarning, match="nothing is held"):
        return flashboot.load(image, device="cpu", holder=holder)


def _restart(image, holder, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return flashboot.load(image, device="cpu", holder=holder, **options)


def test_a_restart_binds_the_refit_version_the_held_arena_holds(generic_image, holder, store):
    """Refit in place to version 2, the engine exits, a restart maps the held arena: it had said
    version 0 (the image's) over version 2's bytes."""
    address, _ = store
    two, three = _trainer_weights(2), _trainer_weights(3)
    first = _first(generic_image, holder)
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        first.refit(address, 2, atomic=False, timeout_s=30)
        first.close()
        again = _restart(generic_image, holder)
        try:
            assert again.report.mode == "held" and again.version == 2 and again.refit_torn is None
            assert _holds(again, two) and again.report.details["refit_version"] == 2
            assert "the held bytes are refit version 2, not the image's" in again.report.summary()
            with pytest.raises(RefitError, match="version 2 is not newer than the live version 2"):
                again.refit(address, 2, atomic=False, timeout_s=30)
            pub.publish(three, version=3)
            again.refit(address, 3, atomic=False, timeout_s=30)  # the restarted engine's refit is recorded too
        finally:
            again.close()
    with _restart(generic_image, holder) as third:
        assert third.version == 3 and _holds(third, three)
    listing = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--list", "--registry", str(holder)],
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "; refit version 3, not the image's bytes" in listing.stdout, listing
    # released, the record goes with the arena: the next engine's fresh load is the image's
    name = HolderOption(registry=holder).name_for(generic_image, 0, "cpu")
    flashboot.flashclone.holder.release(name, registry=holder)
    assert not (holder / "refit" / f"{name}.json").exists()
    _first(generic_image, holder).close()
    with _restart(generic_image, holder) as fresh:
        assert fresh.version == 0 and not _holds(fresh, three) and "refit_version" not in fresh.report.details


def test_a_failed_in_place_refit_of_a_held_arena_restarts_torn(generic_image, holder, store, monkeypatch):
    """An in-place refit that failed after its bytes landed (its checksums) left a mix in the
    holder's memory: a restart had bound it as version 0. It is marked torn before the copy's
    first write (an engine killed mid-copy leaves that), and a restart binds it as the engine had
    it: no version claimed, refit_torn naming the mix; a refit repairs it."""
    import flashboot.flashclone.cloning as cloning

    address, _ = store
    two = _trainer_weights(2)
    first = _first(generic_image, holder)
    name = HolderOption(registry=holder).name_for(generic_image, 0, "cpu")
    request = flashboot.flashclone.holder.held_record(name, registry=holder)["request"]
    seen, real_clone = [], cloning.clone

    def clone_seeing_the_record(*args, **kwargs):
        seen.append(read_refit(name, request, registry=holder))  # as the copy starts
        return real_clone(*args, **kwargs)

    monkeypatch.setattr(cloning, "clone", clone_seeing_the_record)
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        pub.arena.bytes().numpy()[:64] ^= 0xFF  # the copy lands in place, then fails its checksums
        with pytest.raises(RefitError, match="may hold a mix of versions 0 and 2"):
            first.refit(address, 2, atomic=False, timeout_s=30)
        pub.arena.bytes().numpy()[:64] ^= 0xFF
        assert seen[0]["torn"]["versions"] == [0, 2] and "did not finish" in seen[0]["torn"]["error"]
        first.close()
        listing = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--list", "--registry", str(holder)],
                                 capture_output=True, text=True, timeout=60)
        assert "; TORN by an in-place refit (versions 0, 2 mixed, 0 the last whole one)" in listing.stdout, listing
        with pytest.warns(RuntimeWarning, match=r"restarted from the holder, but the arena held as .* holds a torn "
                                                r"in-place refit \(0, 2 mixed, version 0 the last whole one: .*checksum"
                                                r".*refit to a version newer than 0, or release it"):
            again = flashboot.load(generic_image, device="cpu", holder=holder)
        try:
            assert again.report.mode == "held" and again.version is None
            assert again.refit_torn["last_whole"] == 0 and again.refit_torn["versions"] == [0, 2]
            assert "checksum" in again.refit_torn["error"] and "not whole" in again.report.summary()
            again.refit(address, 2, atomic=False, timeout_s=30)  # the torn version again, whole this time
            assert again.version == 2 and _holds(again, two)
        finally:
            again.close()
    with _restart(generic_image, holder) as third:
        assert third.version == 2 and third.refit_torn is None and _holds(third, two)


def test_an_in_place_refit_that_writes_nothing_leaves_the_held_record_as_it_was(generic_image, holder, store):
    """A refit refused before its first write (a mover that is not there) puts the record its torn
    mark replaced back: the held bytes are still version 2's, whole."""
    address, _ = store
    two = _trainer_weights(2)
    first = _first(generic_image, holder)
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        first.refit(address, 2, atomic=False, timeout_s=30)
        pub.publish(_trainer_weights(3), version=3)
        with pytest.raises(FlashBootError) as raised:
            first.refit(address, 3, atomic=False, mover="no-such-mover", timeout_s=30)
        assert "mix of versions" not in str(raised.value) and first.version == 2
    first.close()
    with _restart(generic_image, holder) as again:
        assert again.version == 2 and again.refit_torn is None and _holds(again, two)


def test_a_restart_with_verify_checks_a_refit_version_against_its_publish(generic_image, holder, store):
    """verify=True on a restart of a refit arena had failed it against the image's checksums
    ("chunk 0 ... expected ...") and loaded the image in its place: refit version 2 is checked
    against version 2's checksums; bytes no checksums describe are refused naming why."""
    import json

    address, _ = store
    two = _trainer_weights(2)
    first = _first(generic_image, holder)
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        first.refit(address, 2, atomic=False, timeout_s=30)
    first.close()
    with _restart(generic_image, holder, verify=True) as again:
        assert again.report.mode == "held" and again.version == 2 and _holds(again, two)
        assert again.report.verified_text().startswith("verified: ") and "refit version 2's checksums" in \
            again.report.verified_text()
        again.arena.bytes()[3] ^= 0xFF  # a stray write into the holder's memory
    with pytest.warns(RuntimeWarning, match=r"does not verify: the arena held as .* \(refit version 2\): chunk 0"):
        with flashboot.load(generic_image, device="cpu", holder=holder, verify=True) as reloaded:
            assert reloaded.version == 0 and reloaded.report.mode != "held"
    # a record without checksums: nothing to verify against, said so
    first = _restart(generic_image, holder)  # the reload's arena, handed over in the damaged one's place
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        first.refit(address, 2, atomic=False, timeout_s=30)
    first.close()
    name = HolderOption(registry=holder).name_for(generic_image, 0, "cpu")
    path = holder / "refit" / f"{name}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "manifest": None}))
    with pytest.warns(RuntimeWarning, match=r"holds refit version 2, whose checksums were not recorded, not the "
                                            r"image's bytes: nothing to verify it against"):
        flashboot.load(generic_image, device="cpu", holder=holder, verify=True).close()


def test_a_store_holder_keeps_the_refit_record_signed_beside_its_arena(generic_image, store):
    """The same through a store's holder: the record is a signed store record, gone with the arena."""
    from _clone_helpers import TOKEN

    address, rdv = store
    two = _trainer_weights(2)
    where = {"store": address}
    with serving_holder(Holder(store=address, token=TOKEN, timeout_s=5)):
        first = _first(generic_image, where)
        name = HolderOption(**where).name_for(generic_image, 0, "cpu")
        request = flashboot.flashclone.holder.held_record(name, **where)["request"]
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(two, version=2)
            first.refit(address, 2, atomic=False, timeout_s=30)
        first.close()
        assert read_refit(name, request, **where)["version"] == 2 and rdv.has(f"hold/refit/{name}")
        with _restart(generic_image, where) as again:
            assert again.report.mode == "held" and again.version == 2 and _holds(again, two)
        flashboot.flashclone.holder.release(name, **where)
        assert read_refit(name, request, **where) is None and not rdv.has(f"hold/refit/{name}")


def test_an_engine_whose_arena_is_held_no_more_does_not_replace_the_next_ones_record(generic_image, holder, store):
    """Engine A's arena was released from the holder and B's handed over under the same name; A
    still refits in place (its memory is its own now): its record had replaced B's, and B's
    restart bound B's version 2 as the image's."""
    address, _ = store
    two = _trainer_weights(2)
    name = HolderOption(registry=holder).name_for(generic_image, 0, "cpu")
    a = _first(generic_image, holder)
    flashboot.flashclone.holder.release(name, registry=holder)
    b = _first(generic_image, holder)
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        b.refit(address, 2, atomic=False, timeout_s=30)
        b.close()
        pub.publish(_trainer_weights(3), version=3)
        a.refit(address, 3, atomic=False, timeout_s=30)
        assert a.version == 3
        a.close()
    with _restart(generic_image, holder) as again:
        assert again.version == 2 and _holds(again, two)


def test_a_holder_removes_the_refit_records_of_arenas_no_one_holds(tmp_path):
    """A holder killed leaves its records: the next one removed the held ones, and the refit
    records beside them had stayed for good."""
    registry = tmp_path / "registry"
    Holder(registry=registry).close()
    (registry / "refit" / "gone.json").write_text('{"request": "ab", "version": 2, "manifest": null}')
    with Holder(registry=registry):
        assert not (registry / "refit" / "gone.json").exists()


def test_an_in_place_refit_whose_torn_mark_cannot_be_recorded_copies_nothing(generic_image, holder, store,
                                                                             monkeypatch):
    """Where the held arena's record cannot be written (a full disk, a store down), an in-place
    refit would write bytes a restart takes for the image's: it is refused, naming why."""
    import flashboot.flashclone.holder_refit as holder_refit

    address, _ = store
    first = _first(generic_image, holder)
    before = {n: t.clone() for n, t in first.tensors.items()}

    def full_disk(*args, **kwargs):
        raise FlashBootError("cannot write refit/x.json: No space left on device")

    monkeypatch.setattr(holder_refit, "write_refit", full_disk)
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(_trainer_weights(2), version=2)
        with pytest.raises(RefitError, match=r"the arena is the holder's memory, and the refit could not be recorded "
                                             r"there before its first write \(held as .*No space left on device\); .*"
                                             r"nothing was copied"):
            first.refit(address, 2, atomic=False, timeout_s=30)
    assert first.version == 0 and all(torch.equal(first.tensors[n], t) for n, t in before.items())
    first.close()


def test_an_arena_refit_before_its_hand_over_restarts_as_its_refit_version(generic_image, holder, store):
    """An engine loaded without the holder, refit to version 2, then handed its arena over itself
    (``hand_over``): the refit record was written only for arenas held when they were refit, so a
    restart bound version 2's bytes as the image's (version 0)."""
    from flashboot.flashclone.holder import hand_over, held_record, release

    address, _ = store
    two = _trainer_weights(2)
    name = HolderOption(registry=holder).name_for(generic_image, 0, "cpu")
    first = _first(generic_image, holder)  # the image's identity, as a restart checks it
    identity = held_record(name, registry=holder)["image"]
    first.close()
    release(name, registry=holder)
    loaded = flashboot.load(generic_image, device="cpu")
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(two, version=2)
        loaded.refit(address, 2, timeout_s=30)
    hand_over(loaded.arena, name, registry=holder, image=identity)
    loaded.close()
    with _restart(generic_image, holder) as again:
        assert again.report.mode == "held" and again.version == 2 and _holds(again, two)
    # refit, then woken from the disk (the image's bytes again, version 0), then handed over: the
    # refit's version is not recorded over the image's bytes
    release(name, registry=holder)
    loaded = flashboot.load(generic_image, device="cpu")
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        pub.publish(_trainer_weights(3), version=3)
        loaded.refit(address, 3, timeout_s=30)
    loaded.sleep(level=2)
    assert loaded.wake(source="disk").source == "disk" and loaded.version == 0
    hand_over(loaded.arena, name, registry=holder, image=identity)
    loaded.close()
    with _restart(generic_image, holder, verify=True) as fresh:
        assert fresh.version == 0 and not _holds(fresh, two) and "refit_version" not in fresh.report.details
