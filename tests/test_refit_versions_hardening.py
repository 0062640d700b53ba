"""Refit versions from a hostile RL run's side: what the engine claims to serve after a failed
in-place refit, two trainers publishing one version number, and the store's keys over thousands
of versions. Host backend."""

from __future__ import annotations

import pytest
import torch

import flashboot
from flashboot.weight_update import Publisher, RefitError

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from test_refit_trainer_hardening import _trainer_weights, generic_image  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)


def _holds(loaded, weights: dict) -> bool:
    return all(torch.equal(loaded.tensors[n], t) for n, t in weights.items())


@pytest.mark.parametrize("how", ["checksums", "interrupt"])
def test_a_failed_in_place_refit_claims_no_version_until_a_refit_succeeds(generic_image, store, monkeypatch, how):
    """An in-place refit to version 2 failed after its bytes landed (checksums, or a Ctrl-C in the
    copy): loaded.version had stayed 1 while the arena held version 2's bytes (or a mix), so the
    engine reported serving version 1 with bytes that were not version 1's."""
    import flashboot.flashclone.cloning as cloning

    address, _ = store
    one, two, three = _trainer_weights(21), _trainer_weights(22), _trainer_weights(23)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(one, version=1)
            loaded.refit(address, 1, timeout_s=30)
            pub.publish(two, version=2)
            if how == "checksums":
                pub.arena.bytes().numpy()[:64] ^= 0xFF  # the copy lands in place, then fails its checksums
                with pytest.raises(RefitError, match=r"may hold a mix of versions 1 and 2, so the weights claim no "
                                                     r"version \(loaded.version is None\)"):
                    loaded.refit(address, 2, atomic=False, timeout_s=30)
                pub.arena.bytes().numpy()[:64] ^= 0xFF
            else:
                real_clone = cloning.clone

                def interrupted(*args, **kwargs):
                    real_clone(*args, **kwargs).close()  # every byte landed in place
                    raise KeyboardInterrupt

                monkeypatch.setattr(cloning, "clone", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    loaded.refit(address, 2, atomic=False, timeout_s=30)
                monkeypatch.setattr(cloning, "clone", real_clone)
            assert not _holds(loaded, one)  # what it had claimed to serve
            assert loaded.version is None
            assert loaded.refit_torn["last_whole"] == 1 and loaded.refit_torn["versions"] == [1, 2]
            with pytest.raises(RefitError, match=r"version 1 is not newer than version 1, the last whole one \(an "
                                                 r"in-place refit to version 2 failed .*a mix of versions 1 and 2"):
                loaded.refit(address, 1, timeout_s=30)
            report = loaded.refit(address, 2, timeout_s=30)  # the torn version, again: whole this time
            assert loaded.version == 2 and loaded.refit_torn is None and _holds(loaded, two)
            assert report.previous_version is None and "refit torn weights -> v2" in report.summary()
            pub.publish(three, version=3)
            assert loaded.refit(address, 3, atomic=False, timeout_s=30).previous_version == 2
            assert loaded.version == 3 and _holds(loaded, three)
    finally:
        loaded.close()


@pytest.mark.parametrize("how", ["barrier", "transport", "mover"])
def test_an_in_place_refit_that_fails_before_writing_a_byte_keeps_its_version(generic_image, store, how):
    """An in-place refit that failed before the clone wrote a byte into the arena (the start
    barrier ran out, the transport asked for refused, a mover that is not there) marked the weights
    torn all the same: loaded.version None over bytes that were still version 1's, whole."""
    from flashboot.errors import FlashBootError

    address, _ = store
    one, two = _trainer_weights(24), _trainer_weights(25)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(one, version=1)
            loaded.refit(address, 1, timeout_s=30)
            pub.publish(two, version=2)
            options = {"barrier": {"clones": 2, "timeout_s": 2}, "transport": {"transport": "nccl"},
                       "mover": {"mover": "no-such-mover"}}[how]
            with pytest.raises(FlashBootError) as raised:
                loaded.refit(address, 2, atomic=False, **{"timeout_s": 30, **options})
            assert "mix of versions" not in str(raised.value)
            assert loaded.version == 1 and loaded.refit_torn is None and _holds(loaded, one)
            assert loaded.refit(address, 2, atomic=False, timeout_s=30).previous_version == 1
            assert loaded.version == 2 and _holds(loaded, two)
    finally:
        loaded.close()


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("published", [True, False])
def test_a_copy_its_publisher_repacked_is_refused_naming_the_next_version(generic_image, store, monkeypatch, atomic,
                                                                         published):
    """The trainer ran ahead: it published version 2 (into its one arena; or was still packing it)
    while an engine was still copying version 1. The engine's error was a bare checksum mismatch of
    chunk 0, read as corruption; its cause, and the version to refit to, went unsaid."""
    from flashboot.errors import ChecksumMismatchError
    from flashboot.flashclone.session import _Session

    address, _ = store
    one, two = _trainer_weights(27), _trainer_weights(28)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(one, version=1)
            copy = _Session.run

            def trainer_ran_ahead(session, executor):
                if pub.seed is not None and pub.version == 1:
                    if published:
                        pub.publish(two, version=2)
                    else:  # withdrawn, and the pack of the next version under way
                        pub.withdraw()
                        pub.arena.bytes().numpy()[:64] ^= 0xFF
                return copy(session, executor)

            monkeypatch.setattr(_Session, "run", trainer_ran_ahead)
            newer = "version 2" if published else "the next version"
            with pytest.raises(RefitError, match=rf"chunk 0 .* has checksum .*: its publisher withdrew version 1 "
                                                 rf"during the copy and packs {newer} into the arena it read .*; "
                                                 rf"refit to {newer}") as raised:
                loaded.refit(address, 1, atomic=atomic, timeout_s=30)
            causes, exc = [], raised.value
            while exc is not None:
                causes, exc = causes + [type(exc)], exc.__cause__
            assert causes[-1] is ChecksumMismatchError
            assert loaded.version == (0 if atomic else None)
            monkeypatch.setattr(_Session, "run", copy)
            if not published:
                pub.publish(two, version=2)
            loaded.refit(address, 2, atomic=atomic, timeout_s=30)
            assert loaded.version == 2 and _holds(loaded, two)
            pub.arena.bytes().numpy()[:64] ^= 0xFF  # not its publisher's next version: the checksums' error as ever
            pub.publish(one, version=3)
            pub.arena.bytes().numpy()[:64] ^= 0xFF
            with pytest.raises(ChecksumMismatchError, match="chunk 0"):
                loaded.refit(address, 3, atomic=True, timeout_s=30)
    finally:
        loaded.close()


def test_a_refit_on_the_ring_schedule_is_refused_up_front(generic_image, store):
    """schedule="ring" (a clone's schedule, which loads shards of a host image) reached the clone,
    which asked for image= and clones=, options refit does not take."""
    address, _ = store
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(_trainer_weights(26), version=1)
            with pytest.raises(RefitError, match=r"refit option schedule must be 'chain' or 'star', got 'ring'; "
                                                 r"nothing was copied"):
                loaded.refit(address, 1, schedule="ring", atomic=False, timeout_s=30)
            assert loaded.version == 0 and loaded.refit_torn is None
    finally:
        loaded.close()


def test_a_second_publisher_of_a_published_version_is_refused_by_name(generic_image, store):
    """Two trainers (two Publishers, say a restarted trainer beside the old one) published version 1
    to one store: the last one won silently, and engines that had been told version 1 was the
    first trainer's bytes refitted to the second's."""
    from flashboot.weight_update import PublishError

    address, _ = store
    first, second = _trainer_weights(31), _trainer_weights(32)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as a, \
                Publisher(generic_image, 0, store=address, device="cpu") as b:
            a.publish(first, version=1)
            b.arena.bytes().numpy()[:] = 0x5A
            with pytest.raises(PublishError, match=r"version 1 was already published at .* by another Publisher "
                                                   r"\(pid \d+ on .*\); this one is pid \d+ .*publish a newer "
                                                   r"version.*nothing was written"):
                b.publish(second, version=1)
            assert b.version == 0 and b.seed is None and (b.arena.bytes().numpy() == 0x5A).all()
            loaded.refit(address, 1, timeout_s=30)
            assert _holds(loaded, first)
            b.publish(second, version=2)  # a newer version is its own
            a.close()  # version 1 withdrawn: no engine can take it any more, the number is free again
            b.publish(first, version=3)
            with Publisher(generic_image, 0, store=address, device="cpu") as c:
                c.publish(second, version=1)
                with pytest.raises(PublishError, match="version 3 was already published"):
                    c.publish(second, version=3)
            loaded.refit(address, 3, timeout_s=30)
            assert _holds(loaded, first)
    finally:
        loaded.close()


def test_the_store_keeps_no_keys_of_versions_no_engine_can_ask_for(generic_image, store):
    """Every refit left about eight keys in the store (its clone's position, records, status and
    counters) under the version's namespace, for good: a long RL run's thousands of versions grew
    the store without bound. A withdrawn version's keys go once its readers have left."""
    from flashboot.flashclone.common import _gkey
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.weight_update.publish import SPENT_KEPT, version_namespace

    address, host = store
    server = host.store
    weights = [_trainer_weights(40 + v % 3) for v in range(3)]
    engines = [flashboot.load(generic_image, device="cpu") for _ in range(2)]
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            counts = []
            for v in range(1, 41):
                pub.publish(weights[v % 3], version=v)
                for e in engines[: 1 + v % 2]:  # one engine, or a chain of two
                    e.refit(address, v, timeout_s=30)
                counts.append(server.num_keys())
            assert max(counts) <= max(counts[:2]), counts  # one version's keys at a time, not forty
            assert engines[0].version == 40 and _holds(engines[0], weights[1])
            assert engines[1].version == 39 and _holds(engines[1], weights[0])
            # an engine that joined version 41's clone and never left (killed mid-copy): its keys stay
            # while it may still be copying, then go
            pub.publish(weights[0], version=41)
            with Rendezvous.connect(address, namespace=version_namespace("refit", 41), timeout_s=10) as rdv:
                join = _gkey(pub.seed.generation, "chain", "join")
                rdv.add(join, 1)
                for v in range(42, 42 + SPENT_KEPT):
                    pub.publish(weights[v % 3], version=v)
                    assert rdv.has(join) and server.num_keys() == 6, v  # its claim, the live version's four
                pub.publish(weights[0], version=42 + SPENT_KEPT)
                assert not rdv.has(join)
            assert server.num_keys() == 4  # the live version's seed, metadata and claim, the name's latest
            engines[0].refit(address, 42 + SPENT_KEPT, timeout_s=30)
        assert server.num_keys() == 0 and _holds(engines[0], weights[0])
    finally:
        for e in engines:
            e.close()


def test_the_store_keeps_no_process_group_keys_of_the_broadcast_fallback(generic_image, store):
    """Each refit over the broadcast fallback (transport="nccl"; gloo on the host backend) left
    the keys torch's process group wrote under its prefix (each rank's address) in the store for
    good: two more keys with every version, when the rest of the version's keys went."""
    from flashboot.flashclone.common import PG_STORE_KEYS, _gkey
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.weight_update.publish import version_namespace

    address, host = store
    server = host.store
    weights = [_trainer_weights(70 + v % 2) for v in range(2)]
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu", serve_nccl=True) as pub:
            counts = []
            for v in range(1, 6):
                pub.publish(weights[v % 2], version=v)
                report = loaded.refit(address, v, transport="nccl", timeout_s=30)
                assert report.transport == "nccl" and _holds(loaded, weights[v % 2])
                if v == 1:  # the group's keys, as this torch writes them
                    with Rendezvous.connect(address, namespace=version_namespace("refit", 1), timeout_s=10) as rdv:
                        prefix = rdv.full_key(_gkey(pub.seed.generation, "nccl", "pg", 1))
                    assert any(server.check([f"{prefix}/{key}"]) for key in PG_STORE_KEYS)
                counts.append(server.num_keys())
            assert counts == counts[:1] * len(counts), counts  # one version's keys at a time
            assert not any(server.check([f"{prefix}/{key}"]) for key in PG_STORE_KEYS)
        assert server.num_keys() == 0
    finally:
        loaded.close()


def test_a_publisher_closing_on_a_store_that_stopped_answering_waits_for_it_once(generic_image, monkeypatch):
    """The store's host stopped answering (a cut link) with withdrawn versions still kept (an
    engine joined each and never left). Closing the Publisher waited out its timeout on the dead
    store for a version's keys, then again for its claim: the versions' keys went over a
    Rendezvous of their own, whose finding the store silent the publisher's never heard of."""
    from _clone_helpers import stop_process, store_in_its_own_process

    from flashboot.flashclone.common import _gkey
    from flashboot.flashclone.rendezvous import Rendezvous, StoreSilentError
    from flashboot.weight_update.publish import version_namespace

    silent = []
    bounded = Rendezvous._bounded_call

    def counted(self, what, fn, args):
        try:
            return bounded(self, what, fn, args)
        except StoreSilentError:
            silent.append(what)
            raise

    monkeypatch.setattr(Rendezvous, "_bounded_call", counted)
    with store_in_its_own_process() as (address, proc):
        pub = Publisher(generic_image, 0, store=address, device="cpu", timeout_s=1)
        try:
            for v in (1, 2):
                pub.publish(_trainer_weights(v), version=v)
                with Rendezvous.connect(address, namespace=version_namespace("refit", v), timeout_s=10) as rdv:
                    rdv.add(_gkey(pub.seed.generation, "chain", "join"), 1)  # a reader that never leaves
            pub.publish(_trainer_weights(3), version=3)
            assert [version for _, version, _ in pub._spent] == [1, 2]
            stop_process(proc.pid)
        finally:
            pub.close()
    # the seed's own connection, then the publisher's: each finds the store silent once
    assert len(silent) == 2, silent
    assert pub.arena.closed


def test_a_version_whose_publisher_died_mid_publish_is_refused_naming_what_happened(generic_image, store):
    """A trainer killed while packing version 1 (after claiming it); restarted, it publishes version 1
    again. The claim stays (nobody can tell a dead trainer on another host from a slow one), so the
    restart is refused, but the error had said version 1 "was already published" when no engine
    could ever take it: it names the claimant as dead and the version as never published."""
    from _clone_helpers import finish, spawn_python

    from flashboot.weight_update import PublishError

    address, _ = store
    shapes = {n: tuple(t.shape) for n, t in _trainer_weights(0).items()}
    code = f"""
import os, signal, torch
from flashboot.weight_update import Publisher
import flashboot.weight_update.pack as pack
pack.pack_rows_host = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
weights = {{n: torch.zeros(shape) for n, shape in {shapes!r}.items()}}
Publisher({str(generic_image)!r}, 0, store={address!r}, device="cpu").publish(weights, version=1)
"""
    proc = spawn_python(code)
    rc, out, err = finish(proc, 60)
    assert rc == -9, err
    with Publisher(generic_image, 0, store=address, device="cpu") as pub:
        with pytest.raises(PublishError, match=rf"version 1 was claimed at .* by another Publisher \(pid {proc.pid} "
                                               r"on .*, not running any more\), which never published it: it died "
                                               r"mid-publish.*publish a newer version.*nothing was written"):
            pub.publish(_trainer_weights(51), version=1)
        pub.publish(_trainer_weights(51), version=2)


def test_a_version_stays_claimed_while_an_engine_may_still_be_taking_it(generic_image, store):
    """Trainer A closed while an engine was still copying its version 1 (the engine's mapping keeps
    A's bytes alive, so that copy succeeds); trainer B then published version 1 and the engines
    after it took B's bytes as version 1. The number stays A's while its readers may be taking it."""
    from flashboot.flashclone.common import _gkey
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.weight_update import PublishError
    from flashboot.weight_update.publish import version_namespace

    address, _ = store
    with Publisher(generic_image, 0, store=address, device="cpu") as b:
        with Publisher(generic_image, 0, store=address, device="cpu") as a:
            a.publish(_trainer_weights(60), version=1)
            with Rendezvous.connect(address, namespace=version_namespace("refit", 1), timeout_s=10) as rdv:
                rdv.add(_gkey(a.seed.generation, "chain", "join"), 1)  # an engine's clone joined, and is copying
        with pytest.raises(PublishError, match=r"version 1 was published at .* by another Publisher "
                                               r"\(pid \d+ on .*, still running\), which closed while an engine was "
                                               r"still copying it: .*; this one"):
            b.publish(_trainer_weights(61), version=1)
        b.publish(_trainer_weights(61), version=2)


def test_an_engine_asking_for_a_version_its_publisher_replaced_is_told_at_once(generic_image, store):
    """An engine lagging behind the trainer asked for version 1 after version 2 was published (a
    Publisher withdraws its last version as it publishes the next): it waited its whole timeout
    for a publish that would never come, then said it had waited for the trainer's publish."""
    address, _ = store
    one, two = _trainer_weights(70), _trainer_weights(71)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(one, version=1)
            pub.publish(two, version=2)
            with pytest.raises(RefitError, match=r"to version 1: version 1 is not out: its publisher has published "
                                                 r"version 2 since .*refit to version 2; nothing was copied"):
                loaded.refit(address, 1, timeout_s=60)
            assert loaded.version == 0
            loaded.refit(address, 2, timeout_s=30)
        assert loaded.version == 2 and _holds(loaded, two)
    finally:
        loaded.close()


def test_ranks_of_one_image_published_under_one_name_are_refused_naming_the_ranks(tmp_path, store):
    """The trainer of a TP=2 engine made a Publisher per image rank, both with the default name:
    rank 1's record overwrote rank 0's (one namespace per version), and the rank-0 engine was
    refused at its refit ("published for rank 1"). Now rank 1's publish is refused at once, naming
    both ranks and name=; with its own name, each rank's engine takes its own bytes."""
    from safetensors.torch import load_file

    from flashboot.layouts.tiny import save_tiny_model
    from flashboot.weight_update import PublishError

    address, _ = store
    save_tiny_model("qwen3_moe", tmp_path / "ckpt", dtype=torch.bfloat16)
    flashboot.prepack(tmp_path / "ckpt", tmp_path / "img", tp=2, ep=2, progress=False, chunk_bytes=64 << 10)
    new = {n: (t.float() * 0.5).to(t.dtype) for n, t in load_file(tmp_path / "ckpt" / "model.safetensors").items()}
    engines = [flashboot.load(tmp_path / "img", rank=r, device="cpu") for r in (0, 1)]
    try:
        with Publisher(tmp_path / "img", 0, store=address, device="cpu") as zero, \
                Publisher(tmp_path / "img", 1, store=address, device="cpu") as one, \
                Publisher(tmp_path / "img", 1, store=address, device="cpu", name="refit-1") as own:
            zero.publish(new, version=1)
            with pytest.raises(PublishError, match=r"version 1 under name 'refit' was claimed by another Publisher .* "
                                                   r"for image rank 0, and this one \(pid \d+ on .*\) publishes rank "
                                                   r"1: each rank of an image publishes under its own name="):
                one.publish(new, version=1)
            own.publish(new, version=1)
            engines[0].refit(address, 1, timeout_s=30)
            engines[1].refit(address, 1, name="refit-1", timeout_s=30)
            for e, pub in zip(engines, (zero, own)):  # each rank's engine holds its own rank's packed bytes
                n = e.metadata.image_nbytes
                assert e.version == 1 and torch.equal(e.arena.bytes()[:n], pub.arena.bytes()[:n])
    finally:
        for e in engines:
            e.close()


def test_a_torn_image_wakes_from_its_backup_unverified_and_from_the_disk_whole_again(generic_image, store):
    """After a failed in-place refit (loaded.version None): a verified wake from the level-1 backup
    checked the mix against the image's checksums and failed; a wake from the disk brought the
    image's own bytes back but left the image claiming no version, torn."""
    address, _ = store
    image_weights = None
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        image_weights = {n: t.clone() for n, t in loaded.tensors.items()}
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(_trainer_weights(31), version=1)
            pub.arena.bytes().numpy()[:64] ^= 0xFF
            with pytest.raises(RefitError, match="claim no version"):
                loaded.refit(address, 1, atomic=False, timeout_s=30)
        assert loaded.version is None and loaded.refit_torn is not None
        loaded.sleep(level=1)
        report = loaded.wake(verify=True)
        assert report.source == "backup" and "the backup holds a mix of refit versions" in report.summary()
        assert loaded.version is None and loaded.refit_torn is not None
        loaded.sleep(level=2)
        report = loaded.wake(verify=True)
        assert report.source != "backup" and "replace failed refit's mix of versions: refit again" in report.summary()
        assert loaded.version == 0 and loaded.refit_torn is None and _holds(loaded, image_weights)
    finally:
        loaded.close()


def test_a_version_whose_publisher_closed_mid_copy_is_free_again_once_its_engines_have_left(generic_image, store,
                                                                                           monkeypatch):
    """Trainer A closed while an engine was copying its version 1: the claim (and the version's
    keys) stayed, as they should while the engine copied, but for good: no publish of A's would
    ever ask again, so a trainer started again was refused version 1 ("already published") long
    after every engine had left, and the keys stayed in the store."""
    import threading

    from flashboot.flashclone.session import _Session
    from flashboot.weight_update import PublishError

    address, host = store
    one, again = _trainer_weights(80), _trainer_weights(81)
    copying, go = threading.Event(), threading.Event()
    copy = _Session.run

    def held_mid_copy(session, executor):
        copying.set()
        assert go.wait(60)
        return copy(session, executor)

    monkeypatch.setattr(_Session, "run", held_mid_copy)
    engine, fresh = flashboot.load(generic_image, device="cpu"), flashboot.load(generic_image, device="cpu")
    try:
        a = Publisher(generic_image, 0, store=address, device="cpu")
        a.publish(one, version=1)
        failed = []
        refit = threading.Thread(target=lambda: failed.extend(_raised(engine.refit, address, 1, timeout_s=60)))
        refit.start()
        assert copying.wait(60)
        a.close()
        with Publisher(generic_image, 0, store=address, device="cpu") as b:
            with pytest.raises(PublishError, match=r"version 1 was published at .* by another Publisher .*which closed "
                                                   r"while an engine was still copying it"):
                b.publish(again, version=1)  # the engine is still taking A's version 1
            go.set()
            refit.join(60)
            assert not failed and engine.version == 1 and _holds(engine, one)  # A's bytes, as published
            monkeypatch.setattr(_Session, "run", copy)
            b.publish(again, version=1)
            fresh.refit(address, 1, timeout_s=30)
            assert fresh.version == 1 and _holds(fresh, again)
        assert host.store.num_keys() == 0  # A's version 1 keys too
    finally:
        go.set()
        engine.close()
        fresh.close()


def _raised(fn, *args, **kwargs) -> list:
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001  (the test reports it)
        return [exc]
    return []


@pytest.mark.parametrize("atomic", [True, False])
def test_an_interrupt_as_the_refit_releases_its_clone_leaves_the_new_version_claimed(generic_image, store,
                                                                                     monkeypatch, atomic):
    """An interrupt (a signal, a watchdog's exception) while the refit closed its clone, after the
    new weights were in place and verified (swapped in, or copied in place): the engine claimed
    the old version over the new bytes (atomic), or a torn mix of both (in place)."""
    from flashboot.flashclone.report import CloneResult

    address, _ = store
    new = _trainer_weights(90)
    close = CloneResult.close

    def interrupted(result, **kwargs):
        close(result, **kwargs)
        raise KeyboardInterrupt("a signal as the clone closed")

    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=1)
            monkeypatch.setattr(CloneResult, "close", interrupted)
            with pytest.raises(KeyboardInterrupt):
                loaded.refit(address, 1, atomic=atomic, timeout_s=30)
            monkeypatch.setattr(CloneResult, "close", close)
            assert _holds(loaded, new)
            assert loaded.version == 1 and loaded.refit_torn is None
            with pytest.raises(RefitError, match="version 1 is not newer than the live version 1"):
                loaded.refit(address, 1, atomic=atomic, timeout_s=30)
    finally:
        loaded.close()


def test_an_engine_waiting_for_a_version_its_publisher_skips_is_told_once_a_newer_one_is_out(generic_image, store,
                                                                                              monkeypatch):
    """An engine ahead of its trainer waited for version 2; the trainer (numbering by its step)
    published version 3 instead. The engine waited out its whole timeout for a publish that would
    never come, then blamed the trainer's publish of version 2; it had been told only when it
    asked after version 3 was out."""
    import threading

    from flashboot.flashclone.rendezvous import Rendezvous

    address, _ = store
    one, three = _trainer_weights(95), _trainer_weights(96)
    waiting = threading.Event()
    wait_keys = Rendezvous.wait_keys

    def engine_waits(rdv, keys, **kwargs):
        if rdv.namespace == "refit.v2":
            waiting.set()
        return wait_keys(rdv, keys, **kwargs)

    monkeypatch.setattr(Rendezvous, "wait_keys", engine_waits)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(one, version=1)
            loaded.refit(address, 1, timeout_s=30)
            trainer = threading.Thread(target=lambda: waiting.wait(60) and pub.publish(three, version=3))
            trainer.start()
            try:
                with pytest.raises(RefitError, match=r"to version 2: version 2 is not out: its publisher has "
                                                     r"published version 3 since .*refit to version 3"):
                    loaded.refit(address, 2, timeout_s=60)
            finally:
                waiting.set()
                trainer.join(60)
            assert pub.version == 3 and loaded.version == 1 and _holds(loaded, one)
            loaded.refit(address, 3, timeout_s=30)
        assert loaded.version == 3 and _holds(loaded, three)
    finally:
        loaded.close()


@pytest.mark.parametrize("version", [0, -1, "3", 2.0, True, None])
def test_a_bad_version_is_refused_by_the_sides_own_error(generic_image, version):
    """A version that is no positive int raised a bare FlashBootError from publish and refit alike,
    which a trainer's ``except PublishError`` and an engine's ``except RefitError`` let through."""
    from flashboot.weight_update import PublishError

    with Publisher(generic_image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, host_store=False) as pub:
        with pytest.raises(PublishError, match=rf"publish: version must be a positive int, got {version!r}"):
            pub.publish(_trainer_weights(97), version=version)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with pytest.raises(RefitError, match=rf"refit: version must be a positive int, got {version!r}"):
            loaded.refit("127.0.0.1:1", version, timeout_s=1)
        assert loaded.version == 0
    finally:
        loaded.close()
