"""FlashClone against disagreeing, departed and hostile participants on the host backend: clones
that asked for different chunk sizes, a clone killed right after taking its position, garbage
planted in the store, superseded seeds, lost stores. Every test is bounded."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import flashboot
from flashboot.flashclone.rendezvous import free_port

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import MiB, finish, serve_in_thread, serving_holder, spawn_cli, stop, wait_until, write_raw_image

pytestmark = pytest.mark.timeout(60)
NBYTES = 4 * MiB


@pytest.fixture
def raw(tmp_path):
    path = tmp_path / "image.bin"
    return path, write_raw_image(path, NBYTES, 33)


def _bytes(result, nbytes=NBYTES):
    return result.arena.bytes().numpy()[:nbytes]


# ------------------------------------------------------------------------- 1: one chunk size a chain


def _seed_and_a_slow_first_clone(address, rdv, path):
    """A seed of ``path`` and a `flashboot clone` process of 256 KiB chunks slowed to 0.2 s a step,
    returned once it has published its member record as chain clone #1."""
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    proc = spawn_cli("clone", "--store", address, "--device", "cpu", "--chunk-bytes", "256KiB", "--timeout", 20,
                     FLASHBOOT_TEST_STEP_DELAY_S=0.2)
    try:
        wait_until(lambda: rdv.has(f"g/{s.generation}/chain/member/1"), 20, "clone #1's record", proc)
    except BaseException:
        stop(proc)
        s.close()
        raise
    return s, proc


def test_chain_clones_that_asked_for_different_chunks_follow_the_first_and_hold_the_right_bytes(store, raw):
    """#1 asked for 256 KiB chunks, #2 for 1 MiB: #2 used to plan 1 MiB steps on #1's 256 KiB
    flags and return with most bytes wrong. Now the first member's chunk holds for the chain."""
    address, rdv = store
    path, data = raw
    s, first = _seed_and_a_slow_first_clone(address, rdv, path)
    try:
        r = flashboot.clone(address, "cpu", "chain", chunk_bytes=MiB, timeout_s=20)
        try:
            assert r.report.position == 2 and r.report.source == "clone #1"
            assert r.report.chunk_bytes == 256 * 1024
            assert any("256 KiB" in w or "262,144" in w for w in r.report.warnings), r.report.warnings
            assert np.array_equal(_bytes(r), data)
        finally:
            r.close()
        rc, out, err = finish(first, 30)
        assert rc == 0, err
    finally:
        stop(first)
        s.close()


def test_ring_members_that_asked_for_different_chunks_follow_the_first(store, raw):
    """Two ring members with different chunk sizes stalled until their timeout (each waited on
    flags the other numbered differently); now the second follows the first's chunk."""
    address, _ = store
    path, data = raw
    results, errors = {}, []

    def member(chunk):
        try:
            results[chunk] = flashboot.clone(address, "cpu", "ring", image=path, clones=2, chunk_bytes=chunk,
                                             timeout_s=10)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(c,)) for c in (256 << 10, MiB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert not errors, errors
        assert len({r.report.chunk_bytes for r in results.values()}) == 1
        assert sum(bool(r.report.warnings) for r in results.values()) == 1
        for r in results.values():
            assert np.array_equal(_bytes(r), data)
    finally:
        for r in results.values():
            r.close()


# --------------------------------------------------------- 2: a clone gone right after its position


def test_a_clone_gone_before_publishing_its_record_is_skipped_by_every_later_clone(store, raw):
    """A clone killed right after taking position #1 never publishes its record: #2 used to fail
    ("waited 4 s for the descriptors of clone #1") and #3 to wait for #1 again. Now #2 reads the
    seed once #1's record is overdue, and marks #1 as gone, so #3 does not wait for it."""
    address, rdv = store
    path, data = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        assert rdv.add(f"g/{s.generation}/chain/join", 1) == 1  # the clone that died with position #1
        second = flashboot.clone(address, "cpu", "chain", chunk_bytes=256 << 10, timeout_s=2)
        try:
            assert second.report.position == 2 and second.report.source == "seed"
            assert any("clone #1" in r for r in second.report.recovered), second.report.recovered
            assert np.array_equal(_bytes(second), data)
        finally:
            second.close()
        third = flashboot.clone(address, "cpu", "chain", chunk_bytes=256 << 10, timeout_s=30)
        try:
            assert third.report.position == 3 and third.report.source == "seed"
            # #1 was skipped as departed up front, not waited for and re-attached past
            assert "#1" in third.report.source_note and not third.report.recovered, third.report
            assert np.array_equal(_bytes(third), data)
        finally:
            third.close()
    finally:
        s.close()


@pytest.mark.parametrize("sig,rc,error", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "KeyboardInterrupt")])
def test_flashboot_clone_stopped_by_a_signal_reports_failed_and_leaves(store, raw, sig, rc, error):
    """SIGTERM used to kill `flashboot clone` without a word (its successors waited for it), and
    SIGINT printed a traceback and recorded an empty error. Both now publish the failure, naming
    it, leave the chain, and print one line."""
    address, rdv = store
    path, _ = raw
    s, proc = _seed_and_a_slow_first_clone(address, rdv, path)
    try:
        proc.send_signal(sig)
        code, out, err = finish(proc, 20)
        assert code == rc and f"stopped by {sig.name}" in err and "Traceback" not in err, err
        status = rdv.read(f"g/{s.generation}/chain/status/1", what="status", timeout_s=1)
        assert status.body["state"] == "failed" and error in status.body["error"], status.body
        assert rdv.has(f"g/{s.generation}/chain/status/1/left")
    finally:
        stop(proc)
        s.close()


def test_holder_over_the_store_skips_planted_and_missing_requests_and_keeps_its_arenas(store):
    """A request number bumped without a record, or garbage planted at one, used to stop
    `flashboot hold` (rc 2, "is not a FlashBoot record") and drop every arena it held."""
    from flashboot.arena import Arena
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over, open_held

    address, rdv = store
    raw_store = rdv.store
    holder = Holder(store=address, timeout_s=5)
    try:
        a = Arena.create(MiB, "cpu")
        a.bytes().numpy()[:] = 7
        with serving_holder(holder) as t:
            hand_over(a, "w", store=address, timeout_s=10)
            a.close()
            prefix = f"flashboot/v1/default/hold/{REQUESTS}"
            k = raw_store.add(f"{prefix}/count", 1)
            raw_store.set(f"{prefix}/#{k}", b"garbage")  # written without the token
            wait_until(lambda: any("not a FlashBoot record" in e for e in holder.errors), 10, "the planted request")
            raw_store.add(f"{prefix}/count", 1)  # counted, never written: later requests are not held up
            for name, fill in (("v", 9), ("x", 4)):
                b = Arena.create(MiB, "cpu")
                b.bytes().numpy()[:] = fill
                hand_over(b, name, store=address, timeout_s=10)
                b.close()
                raw_store.add(f"{prefix}/count", 10**7)  # a counter bumped far ahead
            assert t.is_alive()
            with open_held("w", store=address) as w, open_held("x", store=address) as x:
                assert int(w.bytes().numpy().max()) == 7 and int(x.bytes().numpy().min()) == 4
            assert any("jumped" in e for e in holder.errors), holder.errors
    finally:
        holder.close()


@pytest.mark.parametrize("content", ["[1, 2]", '{"request": "x"}', "{not json", '"text"'])
def test_holder_over_a_registry_skips_a_malformed_request_and_serves_the_next(tmp_path, content):
    from flashboot.arena import Arena
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over, open_held

    registry = tmp_path / "reg"
    holder = Holder(registry=registry)
    try:
        (registry / REQUESTS / "bad.json").write_text(content)
        holder.poll_once()  # raised AttributeError / KeyError 'descriptor' / FlashBootError
        assert any(e.startswith("bad:") for e in holder.errors), holder.errors
        assert not (registry / REQUESTS / "bad.json").exists()
        a = Arena.create(MiB, "cpu")
        a.bytes().numpy()[:] = 5
        with serving_holder(holder):
            hand_over(a, "good", registry=registry, timeout_s=10)
            a.close()
            with open_held("good", registry=registry) as g:
                assert int(g.bytes().numpy().max()) == 5
    finally:
        holder.close()


# ---------------------------------------------------------- 4: a bumped counter of finished clones


def test_a_bumped_done_counter_does_not_keep_a_reattaching_clone_past_its_timeout(store, raw, monkeypatch):
    """Re-attaching after its seed died, a clone looked through every finished-clone number up to
    the store's counter, which anyone can bump to 10**7: it ran far past its timeout. Now only the
    newest numbers are looked at (a planted one passed over) and the host image takes over."""
    address, rdv = store
    path, data = raw
    seed = spawn_cli("seed", path, "--device", "cpu", "--store", address, "--timeout", "15", "--no-nccl")
    try:
        gen = wait_until(lambda: rdv.try_read("seed"), 20, "the seed to publish", seed).body["generation"]
        full = f"flashboot/v1/default/g/{gen}/done"
        n = rdv.store.add(f"{full}/count", 10**7)
        rdv.store.set(f"{full}/{n}", b"planted")
        result, errors = [], []
        killed = threading.Event()
        # the copy's first step waits for the seed's death: no race between the copy and the kill
        monkeypatch.setattr(importlib.import_module("flashboot.flashclone.cloning"), "_step_hook",
                            lambda _delay: lambda _step: killed.wait(20))

        def run():
            try:
                result.append(flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=5,
                                              image=path))
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: rdv.has(f"g/{gen}/star/member/1"), 15, "the clone to join")
        seed.kill()
        seed.wait(10)
        killed.set()
        t.join(30)
        assert not t.is_alive(), "the clone kept scanning"
        assert not errors, errors
        try:
            assert any("host image" in e for e in result[0].report.recovered), result[0].report.recovered
            assert np.array_equal(_bytes(result[0]), data)
        finally:
            result[0].close()
    finally:
        stop(seed)


# ------------------------------------------------------------------------- 5, 6: the seed's record


def test_closing_a_superseded_seed_leaves_its_replacements_record(store, raw):
    """Seed A, then seed B on the same store, then A.close(): A deleted B's record, and clones
    timed out waiting for a seed while B was alive."""
    address, rdv = store
    path, data = raw
    a = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    b = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        a.close()
        assert rdv.read("seed", what="the seed", timeout_s=1).body["generation"] == b.generation
        assert rdv.read("metadata", what="the metadata", timeout_s=1).body["generation"] == b.generation
        with flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=5) as r:
            assert np.array_equal(_bytes(r), data)
        b.close()
        assert not rdv.has("seed") and not rdv.has("metadata")  # its own records it withdraws
    finally:
        a.close()
        b.close()


def test_a_seed_of_another_job_in_the_namespace_is_yielded_to_not_overwritten_every_second(store, raw):
    """Two jobs, each with its own token, seeding one namespace: each seed took the other's record
    (which failed its MAC) for garbage and published over it every second, and about half the
    clones of each job read the other job's record. Now the seed published over stops, naming the
    namespace and the other token; the other job's record stays, and its clones clone."""
    from flashboot.errors import RendezvousError
    from flashboot.flashclone.records import ForeignRecordError

    address, rdv = store
    path, data = raw
    other = "another-jobs-token-fedcba9876543210"
    a = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    b = flashboot.seed(address, str(path), "cpu", token=other, serve_nccl=False, timeout_s=10)
    errors = {"a": [], "b": []}
    stop_b = threading.Event()

    def serve(seed, errs, ev=None):
        try:
            seed.serve_forever(ev, handle_signals=False)
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    ta = threading.Thread(target=serve, args=(a, errors["a"]))
    tb = threading.Thread(target=serve, args=(b, errors["b"], stop_b))
    ta.start()
    tb.start()
    try:
        ta.join(15)
        assert not ta.is_alive(), "the seed published over by another job's served on (and published back)"
        assert len(errors["a"]) == 1 and isinstance(errors["a"][0], RendezvousError), errors
        msg = str(errors["a"][0])
        assert "namespace 'default'" in msg and "different token" in msg and "--name" in msg, msg
        assert f"pid {os.getpid()}" in msg and a.generation in msg
        # the other job's record stands: ours does not verify it, theirs does, and their clone clones
        with pytest.raises(ForeignRecordError, match=r"\(namespace 'default'\) fails authentication: it is "
                                                     r"signed with a different token"):
            rdv.try_read("seed")
        with flashboot.clone(address, "cpu", "star", token=other, chunk_bytes=256 << 10, timeout_s=5) as r:
            assert np.array_equal(_bytes(r), data)
        with pytest.raises(RendezvousError, match="namespace 'default'.*different token"):
            flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=5)
        assert b.republished == 0 and not b.superseded and tb.is_alive()
    finally:
        a.stop()
        stop_b.set()
        ta.join(10)
        tb.join(10)
        a.close()
        b.close()
    assert errors["b"] == []


def test_a_serving_seed_republishes_on_a_restarted_store_and_fails_when_none_comes_back(raw):
    """A seed whose store was restarted kept running, invisible to every clone, and exited 0."""
    from flashboot.errors import RendezvousError
    from flashboot.flashclone.store import StoreServer

    path, data = raw
    address = f"127.0.0.1:{free_port()}"
    server = StoreServer(address)
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, host_store=False, timeout_s=3)
    t, errors = serve_in_thread(s)
    try:
        server.close()
        time.sleep(0.2)
        server = StoreServer(address)
        wait_until(lambda: s.republished >= 1, 15, "the seed to publish again")
        with flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=5) as r:
            assert np.array_equal(_bytes(r), data)
        server.close()  # and this time none comes back
        t.join(20)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], RendezvousError), errors
        assert "lost its store at " + address in str(errors[0])
    finally:
        s.stop()
        t.join(10)
        server.close()


# ------------------------------------------------------------------- 7: ring loads one after another


def _ring(address, path, members, **kw):
    results, errors = [], []

    def member():
        try:
            results.append(flashboot.clone(address, "cpu", "ring", image=path, clones=members, chunk_bytes=256 << 10,
                                           timeout_s=10, **kw))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member) for _ in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors


def test_a_second_ring_load_on_the_same_store_runs_once_the_first_has_left(store, raw):
    """The second ring load on a store always failed ("already has its 2 members"): the last
    member to leave now frees the run's name; a load under way is refused naming --run."""
    address, rdv = store
    path, data = raw
    for _ in range(2):
        results, errors = _ring(address, path, 2)
        try:
            assert not errors, errors
            assert sorted(r.report.position for r in results) == [1, 2]
            for r in results:
                assert np.array_equal(_bytes(r), data)
            if _ == 0:  # while it is held, a third arrival is told how to name another load
                with pytest.raises(flashboot.errors.RendezvousError, match="--run NAME"):
                    flashboot.clone(address, "cpu", "ring", image=path, clones=2, timeout_s=5)
        finally:
            for r in results:
                r.close()
    assert not rdv.has("ring/join") and not rdv.has("ring/member/0")
    results, errors = _ring(address, path, 1, run="other")  # a name of its own
    assert not errors and results[0].report.position == 1, errors
    results[0].close()


@pytest.mark.timeout(120)
def test_a_ring_load_after_one_killed_at_its_barrier_names_the_member_gone(store, raw):
    """2 of 3 members were SIGKILLed at the start barrier: their arrivals and records stay under the
    run name. The next load's first member arrives third, passes that barrier alone and read the
    record of a member whose process was gone: it failed with the bare ArenaError of an arena
    that is gone. It is now refused before any byte moves, naming the member, the run and what
    to do."""
    address, rdv = store
    path, _ = raw
    procs = [spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "ring", "--clones", 3,
                       "--image", path, "--chunk-bytes", "256KiB", "--run", "stale", "--timeout", 60)
             for _ in range(2)]
    try:
        wait_until(lambda: rdv.add("barrier/stale/start/count", 0) == 2, 60, "2 members at the barrier")
        for p in procs:
            p.kill()
            p.wait(10)
    finally:
        for p in procs:
            stop(p)
    with pytest.raises(flashboot.errors.RendezvousError) as info:
        flashboot.clone(address, "cpu", "ring", image=path, clones=3, chunk_bytes=256 << 10, timeout_s=5,
                        run="stale")
    assert "ring 'stale': member 0 (pid" in str(info.value) and "has exited" in str(info.value), info.value
    assert "--run NAME" in str(info.value)


@pytest.mark.timeout(120)
def test_a_star_clone_late_in_a_long_lived_seeds_life_plans_only_its_own_steps(store, raw):
    """A star clone reads the seed alone, but planned by its position: clone #2,001 of a seed built
    2,001 clones' steps (2 million of 4 KiB, over what a plan may hold) and failed with a PlanError
    asking for larger chunks; #400 spent a second of its exchange on steps it never ran."""
    address, rdv = store
    path, data = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        rdv.add(f"g/{s.generation}/star/join", 2000)  # the clones that came and went before
        with flashboot.clone(address, "cpu", "star", chunk_bytes=4096, verify=True, timeout_s=10) as r:
            assert r.report.position == 2001 and r.report.source == "seed" and r.report.chunk_bytes == 4096
            assert np.array_equal(_bytes(r), data) and r.report.verified
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_clones_retried_with_fewer_after_their_start_barrier_ran_out_start(store, raw):
    """2 of 3 clones came and their start barrier ran out; the 2 retried with --clones 2 (the third
    had died) waited for a count their barrier had passed ("4 of 2 had arrived") and failed, as every
    later retry of that seed's generation did. The barrier now opens at or past its count."""
    address, _ = store
    path, data = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)

    def cohort(clones, timeout_s):
        results, errors = [], []

        def one():
            try:
                results.append(flashboot.clone(address, "cpu", "star", clones=clones, chunk_bytes=256 << 10,
                                               timeout_s=timeout_s, verify=True))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        return results, errors

    try:
        results, errors = cohort(3, 2)
        assert not results and len(errors) == 2, errors
        assert all(isinstance(e, flashboot.errors.WaitTimeoutError) and "of 3 had arrived" in str(e) for e in errors)
        results, errors = cohort(2, 10)
        try:
            assert not errors, errors
            for r in results:
                assert np.array_equal(_bytes(r), data) and r.report.verified
        finally:
            for r in results:
                r.close()
    finally:
        s.close()


def test_flashboot_clone_takes_a_ring_run_name(store, raw):
    address, rdv = store
    path, data = raw
    rdv.add("ring/join", 5)  # a load whose member failed holds the default name
    procs = [spawn_cli("clone", "--store", address, "--device", "cpu", "--schedule", "ring", "--clones", 2,
                       "--image", path, "--chunk-bytes", "256KiB", "--run", "second", "--timeout", 15)
             for _ in range(2)]
    try:
        for p in procs:
            rc, out, err = finish(p, 40)
            assert rc == 0, err
    finally:
        for p in procs:
            stop(p)


# ------------------------------------------------------------------ 8: a store listens where asked


def _listeners(port):
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_stores_asked_for_at_127_0_0_1_listen_there_only():
    """TCPStore bound every interface whatever HOST said: a store (or a seed hosting one) at
    127.0.0.1 was reachable from the whole network."""
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.flashclone.store import StoreServer

    server = StoreServer("127.0.0.1:0")
    try:
        assert _listeners(server.port) == ["0100007F"]
        rdv = Rendezvous.connect(server.address, timeout_s=5)
        rdv.publish("k", {"v": 1})
        assert rdv.read("k", what="k", timeout_s=1).body == {"v": 1}
        rdv.close()
    finally:
        server.close()
    port = free_port()
    hosted = Rendezvous.connect(f"127.0.0.1:{port}", host=True, timeout_s=5)
    try:
        assert hosted.is_server and _listeners(port) == ["0100007F"]
        joined = Rendezvous.connect(f"127.0.0.1:{port}", host=True, timeout_s=5)  # one listens: joined
        assert not joined.is_server
        joined.close()
    finally:
        hosted.close()


# ------------------------------------------------------------------------------ 9: the clone CLI


@pytest.mark.parametrize("value", ["nan", "inf", "1e12", "0", "-3"])
def test_flashboot_clone_refuses_a_timeout_that_is_not_a_finite_positive_number(value):
    proc = spawn_cli("clone", "--store", "127.0.0.1:1", "--device", "cpu", "--timeout", value)
    rc, out, err = finish(proc, 30)
    assert rc == 2 and "--timeout" in err and "Traceback" not in err, err


def test_flashboot_clone_refuses_a_json_path_it_cannot_write_before_cloning(store, raw):
    address, rdv = store
    path, _ = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        rc, out, err = finish(spawn_cli("clone", "--store", address, "--device", "cpu", "--timeout", 10,
                                        "--json", "/nonexistent/dir/x.json"), 30)
        assert rc == 2 and "--json /nonexistent/dir/x.json" in err and "Traceback" not in err, err
        assert not rdv.has(f"g/{s.generation}/chain/join")  # refused before it took a position
    finally:
        s.close()


def test_a_participant_asked_to_host_at_another_hosts_address_joins_as_a_client(monkeypatch):
    """Binding to HOST fails where HOST is not one of ours (EADDRNOTAVAIL: a ring member on
    another machine than the store): it joins the store there, as before the bind was narrowed."""
    import errno as errno_mod

    from flashboot.flashclone import connection, rendezvous
    from flashboot.flashclone.store import StoreServer

    server = StoreServer("127.0.0.1:0")

    def not_ours(host, port, timeout):
        raise OSError(errno_mod.EADDRNOTAVAIL, "Cannot assign requested address")

    monkeypatch.setattr(connection, "host_tcpstore", not_ours)  # where the join looks it up
    try:
        rdv = rendezvous.Rendezvous.connect(server.address, host=True, timeout_s=5)
        assert not rdv.is_server
        rdv.close()
    finally:
        server.close()


def test_a_store_named_by_a_name_listens_on_every_interface():
    """Binding what a name resolves to made `flashboot store $(hostname):P` unreachable from other
    machines (a Debian machine's own name resolves to 127.0.1.1): a name listens everywhere."""
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.flashclone.store import StoreServer

    everywhere = {"00000000", "00000000000000000000000000000000"}
    server = StoreServer("localhost:0")
    try:
        assert set(_listeners(server.port)) & everywhere, _listeners(server.port)
    finally:
        server.close()
    port = free_port()
    hosted = Rendezvous.connect(f"localhost:{port}", host=True, timeout_s=5)
    try:
        assert hosted.is_server and set(_listeners(port)) & everywhere, _listeners(port)
    finally:
        hosted.close()


def test_asked_to_host_at_an_address_not_of_this_machine_it_says_so_when_no_store_is_there():
    """A seed hosting at a NAT or ClusterIP address got EADDRNOTAVAIL, joined as a client and
    timed out naming only the address: nobody hosted, and nothing said why."""
    from flashboot.errors import RendezvousError, WaitTimeoutError
    from flashboot.flashclone.rendezvous import Rendezvous
    from flashboot.flashclone.store import StoreServer

    with pytest.raises(WaitTimeoutError, match=r"not an address of this machine.*0\.0\.0\.0:9"):
        Rendezvous.connect("192.0.2.1:9", host=True, timeout_s=1)  # TEST-NET-1: no machine's address
    with pytest.raises(RendezvousError, match=r"not an address of this machine.*0\.0\.0\.0:0"):
        StoreServer("192.0.2.1:0")


def test_sigterm_stops_a_clone_waiting_at_its_start_barrier_without_waiting_out_the_timeout(store, raw):
    """A signal handler cannot run inside store.wait: a clone held at the --clones barrier (or
    waiting for a seed) exited on SIGTERM only when its --timeout ran out (Kubernetes SIGKILLs
    after 30 s). Here the timeout is 300 s and the process must be gone well within the bound."""
    address, rdv = store
    path, _ = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    proc = spawn_cli("clone", "--store", address, "--device", "cpu", "--chunk-bytes", "256KiB", "--clones", 2,
                     "--timeout", 300)
    try:
        wait_until(lambda: rdv.has(f"g/{s.generation}/chain/member/1"), 30, "clone #1's record", proc)
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc, 60)
        assert code == 143 and "stopped by SIGTERM" in err, err
        status = rdv.read(f"g/{s.generation}/chain/status/1", what="status", timeout_s=1)
        assert status.body["state"] == "failed" and "SIGTERM" in status.body["error"], status.body
    finally:
        stop(proc)
        s.close()


def test_a_live_clone_waiting_on_a_dead_one_is_not_marked_gone_by_the_clone_after_it(store, raw):
    """#1 died after taking its position; #2 waits out its timeout for #1. #3 (shorter timeout)
    used to take #2 as gone when its own deadline passed and mark it left, though #2 was alive:
    it then dropped out of every later clone's sources. #2 announces itself before waiting now."""
    address, rdv = store
    path, data = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    results, errors = {}, []

    def clone(name, timeout_s):
        try:
            results[name] = flashboot.clone(address, "cpu", "chain", chunk_bytes=256 << 10, timeout_s=timeout_s)
        except BaseException as exc:
            errors.append(exc)

    try:
        assert rdv.add(f"g/{s.generation}/chain/join", 1) == 1  # the clone that died with position #1
        second = threading.Thread(target=clone, args=("second", 6))
        second.start()
        wait_until(lambda: rdv.add(f"g/{s.generation}/chain/join", 0) >= 2, 20, "#2 to take its position")
        clone("third", 2)  # its deadline passes while #2 still waits for #1
        second.join(30)
        assert not errors, errors
        assert results["third"].report.position == 3 and results["second"].report.position == 2
        left = rdv.try_read(f"g/{s.generation}/chain/status/2/left")
        assert left is None, left.body  # nobody wrote it on #2's behalf (#2 has not left yet)
        assert any("clone #1" in r for r in results["second"].report.recovered)
        for r in results.values():
            assert np.array_equal(_bytes(r), data)
    finally:
        for r in results.values():
            r.close()
        s.close()


def test_a_nixl_reader_takes_an_upstream_clone_that_exited_before_publishing_as_gone(store):
    """Peers.open waited for a NIXL member record with rdv.read, whose WaitTimeoutError the open
    loop did not catch: one dead clone failed every later NIXL clone. It shares the chain's check
    now (here: a joined record whose process is dead)."""
    import subprocess
    import sys

    from flashboot.errors import RendezvousError
    from flashboot.flashclone.transports._nixl_reads import PeerKeys, Peers

    address, rdv = store
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rdv.publish("g/x/chain/joined/1", {"position": 1, "pid": dead.pid, "host": __import__("socket").gethostname()})
    keys = PeerKeys(member=lambda p: f"g/x/chain/member/{p}", held=lambda p: f"g/x/chain/nixl/held/{p}",
                    status=lambda p: f"g/x/chain/status/{p}", who=lambda p: f"clone #{p}",
                    joined=lambda p: f"g/x/chain/joined/{p}")
    peers = Peers(rdv, None, None, keys, 1.0, {})
    with pytest.raises(RendezvousError, match=f"clone #1 exited \\(pid {dead.pid}\\)"):
        peers.open(1)
    assert rdv.has("g/x/chain/status/1/left")


def test_the_default_chain_chunk_does_not_depend_on_the_first_clones_position(store, raw):
    """Without --clones, clone #1 planned as a chain of one (1 GiB chunks) and the agreement then
    fixed that for the whole chain: pipeline fill 4x longer. The chain default is 256 MiB unless
    clones=1 is said; star clones, which never read each other's flags, each keep their own."""
    from flashboot.schedulers import DEFAULT_CHUNK_BYTES
    from flashboot.schedulers.plan import SINGLE_HOP_CHUNK_BYTES

    address, rdv = store
    path, data = raw
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        with flashboot.clone(address, "cpu", "chain", timeout_s=10) as r:
            assert r.report.position == 1 and r.report.chunk_bytes == DEFAULT_CHUNK_BYTES
            assert np.array_equal(_bytes(r), data)
        with flashboot.clone(address, "cpu", "star", chunk_bytes=MiB, timeout_s=10) as a, \
                flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=10) as b:
            assert (a.report.chunk_bytes, b.report.chunk_bytes) == (MiB, 256 << 10)
            assert not b.report.warnings, b.report.warnings
    finally:
        s.close()
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        with flashboot.clone(address, "cpu", "chain", clones=1, timeout_s=10) as r:
            assert r.report.chunk_bytes == SINGLE_HOP_CHUNK_BYTES
    finally:
        s.close()


def test_a_seed_whose_store_stops_answering_still_stops_on_sigterm(raw):
    """The seed's store check made unbounded store calls on its serve loop: with the store
    SIGSTOPped, a SIGTERMed seed (--timeout 3) was still running a minute later."""
    from flashboot.flashclone.rendezvous import Rendezvous

    path, _ = raw
    address = f"127.0.0.1:{free_port()}"
    server = spawn_cli("store", address)
    seed = None
    try:
        rdv = Rendezvous.connect(address, timeout_s=20)
        seed = spawn_cli("seed", path, "--device", "cpu", "--store", address, "--timeout", 3, "--no-host-store")
        wait_until(lambda: rdv.try_read("seed"), 30, "the seed to publish", seed)
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(CHECK_S)  # let a store check start against the silent store (it may or may not have)
        seed.send_signal(signal.SIGTERM)
        code, out, err = finish(seed, 45)  # unbounded, it never returned
        assert code is not None and "Traceback" not in err, err
    finally:
        if seed is not None:
            stop(seed)
        stop(server)


CHECK_S = 1.5
"""A little over the seed's store-check period (seed.CHECK_PUBLISHED_S = 1 s)."""


def test_a_clone_whose_seed_withdrew_its_metadata_fails_instead_of_returning_no_tensors(store, tmp_path):
    """Seed.close deletes the metadata record: a clone that had read the seed's record before
    read the metadata after copying, found none and finished with tensors == {} and no error."""
    from _clone_helpers import make_prepacked_image

    address, rdv = store
    img = make_prepacked_image(tmp_path)
    s = flashboot.seed(address, str(img), "cpu", serve_nccl=False, timeout_s=10)
    try:
        with flashboot.clone(address, "cpu", "star", timeout_s=10) as r:
            assert len(r.tensors) == 7
        rdv.delete("metadata")  # as a closing seed does, after the clone read the seed's record
        with pytest.raises(flashboot.errors.RendezvousError, match="no image metadata"):
            flashboot.clone(address, "cpu", "star", timeout_s=10)
    finally:
        s.close()


def test_a_holder_keeps_only_its_newest_errors_and_counts_the_rest(tmp_path):
    """Every planted request added a line to Holder.errors for as long as the holder ran."""
    from flashboot.flashclone.holder import MAX_ERRORS, REQUESTS, Holder

    registry = tmp_path / "reg"
    holder = Holder(registry=registry)
    try:
        for i in range(MAX_ERRORS + 50):
            (registry / REQUESTS / f"bad{i:04d}.json").write_text("[1]")
        holder.poll_once()
        assert len(holder.errors) == MAX_ERRORS and holder.errors.dropped == 50
        assert holder.errors[-1].startswith(f"bad{MAX_ERRORS + 49:04d}:"), holder.errors[-1]
    finally:
        holder.close()


def test_a_ring_member_that_cannot_free_the_run_name_says_so(store, raw):
    """_clear_run's store failures were swallowed: the next load under the name was refused
    with nothing in the report of the member that should have freed it."""
    from flashboot.errors import RendezvousError

    address, _ = store
    path, _ = raw
    results, errors = _ring(address, path, 1, run="unfreed")
    assert not errors, errors
    r = results[0]
    rdv = r._session.rdv

    def refuse(key):
        raise RendezvousError(f"deleting {key!r}: the store is gone")

    rdv.delete = refuse
    r.close()
    assert any("'unfreed'" in w and "--run NAME" in w for w in r.report.warnings), r.report.warnings


def test_flashboot_clone_refuses_run_for_chain_and_star_and_leaves_no_empty_json(tmp_path):
    """--run was silently ignored outside a ring; a failed clone left an empty --json file where
    there had been none."""
    rc, out, err = finish(spawn_cli("clone", "--store", "127.0.0.1:1", "--device", "cpu", "--run", "x"), 30)
    assert rc == 2 and "--run names a ring load" in err, err
    report = tmp_path / "report.json"
    rc, out, err = finish(spawn_cli("clone", "--store", f"127.0.0.1:{free_port()}", "--device", "cpu",
                                    "--timeout", 1, "--json", report), 30)
    assert rc != 0 and not report.exists(), err


def test_a_seeds_extra_fields_cannot_replace_its_own(store, raw):
    """``extra={"generation": ...}`` replaced the seed record's generation: the seed then took its
    own record for another seed's and stopped serving, blaming "another seed (pid ...)". Fields of
    the record's own are refused by name before anything is loaded; others are published."""
    from flashboot.errors import RendezvousError

    address, rdv = store
    path, _ = raw
    for field in ("generation", "pid", "manifest"):
        with pytest.raises(RendezvousError, match=rf"extra fields \['{field}'\] are the seed record's own"):
            flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10, extra={field: "v7"})
    assert not rdv.has("seed")
    with flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10, extra={"refit_version": 7}) as s:
        body = rdv.read("seed", what="the seed", timeout_s=1).body
        assert body["refit_version"] == 7 and body["generation"] == s.generation
        assert s.check_published() is False and not s.superseded


def test_a_seed_that_replaced_the_seed_hosting_its_store_hosts_the_store_when_that_one_exits(raw):
    """Seed A (`flashboot seed`, another job's token) hosts the store; seed B joins it and publishes
    over A's record. A yields and exits, and the store with it: B, though free to host one
    (host_store=True), only waited to join a store there again and stopped with "lost its store",
    so neither job had a seed. Now B hosts the store, publishes again, and its clones clone."""
    path, data = raw
    address = f"127.0.0.1:{free_port()}"
    other = "another-jobs-token-fedcba9876543210"
    a = spawn_cli("seed", path, "--device", "cpu", "--store", address, "--timeout", 5, token=other)
    b = None
    errors = []
    done = threading.Event()
    try:
        assert "hosting store" in a.stdout.readline()
        b = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=5)
        assert not b.rendezvous.is_server

        def serve():
            try:
                b.serve_forever(done, handle_signals=False)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=serve)
        t.start()
        code, _, err = finish(a, 20)
        assert code != 0 and "another job's seed" in err, err
        wait_until(lambda: b.republished >= 1 or errors, 20, "seed B to publish again")
        assert errors == [] and b.rendezvous.is_server
        with flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=5) as r:
            assert np.array_equal(_bytes(r), data)
        done.set()
        t.join(10)
        assert errors == []
    finally:
        done.set()
        stop(a)
        if b is not None:
            b.close()


def test_a_seed_that_lost_a_flashboot_store_waits_for_it_rather_than_host_one_in_its_place(raw):
    """A seed free to host (the default) that joined `flashboot store` waits for that store to come
    back when it restarts, as before, rather than take its port (the restarted store had then
    failed with "the port is taken", and the store lived only as long as that seed)."""
    from flashboot.flashclone.store import StoreServer

    path, data = raw
    address = f"127.0.0.1:{free_port()}"
    server = StoreServer(address)
    s = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    t, errors = serve_in_thread(s)
    try:
        assert not s.rendezvous.is_server
        server.close()
        wait_until(lambda: s.rendezvous.lost is not None or s.republished or errors, 20,
                   "the seed to find its store gone")
        server = StoreServer(address)  # the port is free: the seed did not host one there
        wait_until(lambda: s.republished >= 1 or errors, 20, "the seed to publish again")
        assert errors == [] and not s.rendezvous.is_server
        with flashboot.clone(address, "cpu", "star", chunk_bytes=256 << 10, timeout_s=5) as r:
            assert np.array_equal(_bytes(r), data)
    finally:
        s.stop()
        t.join(10)
        server.close()
