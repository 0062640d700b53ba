"""The holder on the host backend: an arena kept across an engine's restart (a registry file or
the rendezvous store), its refusals, and the records' authentication. Moved out of
tests/test_clone.py; the restart inside the engines: tests/test_restart.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

import flashboot
from flashboot.arena import Arena
from flashboot.errors import ArenaError, FlashBootError, RendezvousError

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import MiB, TOKEN, finish, serving_holder, spawn_cli, stop, wait_until

pytestmark = pytest.mark.timeout(30)


_ENGINE = """
import ctypes, sys, numpy as np
from flashboot.arena import Arena
from flashboot.flashclone.holder import hand_over
a = Arena.create(3 << 20, "cpu")
data = np.random.default_rng(11).integers(0, 256, a.nbytes, dtype=np.uint8)
ctypes.memmove(a.ptr, data.ctypes.data, a.nbytes)
d = hand_over(a, "weights", registry=sys.argv[1], timeout_s=10)
print(d.arena_id, d.pid)
a.close()
"""

_RESTARTED = """
import ctypes, sys, time, numpy as np
from flashboot.flashclone.holder import open_held
t0 = time.perf_counter()
a = open_held("weights", registry=sys.argv[1])
ms = (time.perf_counter() - t0) * 1e3
got = np.ctypeslib.as_array((ctypes.c_uint8 * a.nbytes).from_address(a.ptr)).copy()
want = np.random.default_rng(11).integers(0, 256, a.nbytes, dtype=np.uint8)
print(a.arena_id, bool(np.array_equal(got, want)), f"{ms:.3f}")
a.close()
"""


def test_holder_keeps_weights_across_an_engine_restart(tmp_path):
    registry = tmp_path / "registry"
    holder = spawn_cli("hold", "--registry", registry)
    try:
        wait_until(lambda: (registry / "held").is_dir(), 15, "the holder registry", holder)

        def run(code):
            p = subprocess.run([sys.executable, "-c", code, str(registry)], capture_output=True, text=True, timeout=25)
            assert p.returncode == 0, p.stderr
            return p.stdout.split()

        arena_id, holder_pid = run(_ENGINE)  # the engine hands over, then exits
        assert int(holder_pid) == holder.pid
        again_id, same, _ms = run(_RESTARTED)
        assert again_id == arena_id and same == "True"
        listing = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--list", "--registry", str(registry)],
                                 capture_output=True, text=True, timeout=20)
        assert f"weights: {4 << 20:,} bytes, host arena {arena_id}" in listing.stdout
        released = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--release", "weights",
                                   "--registry", str(registry)], capture_output=True, text=True, timeout=20)
        assert released.returncode == 0 and "released weights" in released.stdout
        gone = subprocess.run([sys.executable, "-c", _RESTARTED, str(registry)], capture_output=True, text=True,
                              timeout=25)
        assert gone.returncode != 0 and "no arena is held as 'weights'" in gone.stderr
        holder.send_signal(signal.SIGTERM)
        rc, out, err = finish(holder, 15)
        assert rc == 0 and "holder stopped" in out, err
    finally:
        stop(holder)


def test_holder_in_process_refuses_a_writable_registry_and_a_dead_engine(tmp_path):
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over

    open_dir = tmp_path / "shared"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    with pytest.raises(FlashBootError, match="writable by others"):
        Holder(registry=open_dir)
    registry = tmp_path / "reg"
    holder = Holder(registry=registry)
    stop_ev = threading.Event()
    t = threading.Thread(target=holder.serve_forever, args=(stop_ev,), kwargs={"handle_signals": False})
    t.start()
    try:
        a = Arena.create(MiB, "cpu")
        a.bytes().numpy()[:] = 9
        d = hand_over(a, "w", registry=registry, timeout_s=10)
        assert d.pid == os.getpid() and set(d.fds).isdisjoint(a.export().fds)
        a.close()  # the engine's handle is gone; the holder's mapping keeps the memory
        b = flashboot.flashclone.holder.open_held("w", registry=registry)
        assert int(b.bytes().numpy().min()) == 9
        b.close()
        from flashboot.arena import ArenaDescriptor

        ghost = ArenaDescriptor("host", 2**22 - 3, (5,), MiB, -1, "memfd", 2 * MiB, 2 * MiB, "dead", None, "")
        holder.kv.put(REQUESTS, "ghost", {"descriptor": ghost.to_dict(), "request": "r1"})
        wait_until(lambda: holder.kv.get("held", "ghost"), 10, "the holder's answer")
        with pytest.raises(FlashBootError, match="last adoption failed"):
            flashboot.flashclone.holder.open_held("ghost", registry=registry)
        # an engine that hands over a look-alike memfd it could shrink under the holder: refused by name
        with Arena.create(MiB, "cpu") as c:
            fake = os.memfd_create(f"flashboot-arena-{c.arena_id}.0", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fake, c.nbytes)
                lookalike = types.SimpleNamespace(export=lambda: dataclasses.replace(c.export(), fds=(fake,)))
                with pytest.raises(ArenaError, match=rf"could not adopt 'shrinkable': .*segment 0 of arena "
                                                     rf"{c.arena_id}, 2,097,152 bytes\) is not sealed against shrinking"):
                    hand_over(lookalike, "shrinkable", registry=registry, timeout_s=10)
            finally:
                os.close(fake)
        b = flashboot.flashclone.holder.open_held("w", registry=registry)  # still held and served
        assert int(b.bytes().numpy().min()) == 9
        b.close()
    finally:
        stop_ev.set()
        t.join(10)
    assert holder.held == {}


def test_holder_over_the_store_authenticates_its_records(store):
    from flashboot.flashclone.holder import Holder, hand_over, open_held, release

    address, rdv = store
    holder = Holder(store=address, token=TOKEN, timeout_s=5)
    stop_ev = threading.Event()
    t = threading.Thread(target=holder.serve_forever, args=(stop_ev,), kwargs={"handle_signals": False})
    t.start()
    try:
        a = Arena.create(MiB, "cpu")
        a.bytes().numpy()[:] = 7
        d = hand_over(a, "w", store=address, token=TOKEN, timeout_s=10)
        assert d.arena_id == a.arena_id
        a.close()
        with open_held("w", store=address, token=TOKEN) as b:
            assert int(b.bytes().numpy().max()) == 7 and b.arena_id == d.arena_id
        with pytest.raises(RendezvousError, match="fails authentication"):
            open_held("w", store=address, token="not-the-holders-token-000")
        release("w", store=address, token=TOKEN, timeout_s=10)
        with pytest.raises(FlashBootError, match="no arena is held as 'w'"):
            open_held("w", store=address, token=TOKEN)
    finally:
        stop_ev.set()
        t.join(10)


def test_a_store_namespace_has_one_holder_at_a_time(store):
    """Two holders on one store namespace had both run: a release request taken by the one that
    did not hold the arena removed its record while the other kept it mapped, listed nowhere."""
    from flashboot.flashclone.holder import Holder

    address, _ = store
    first = Holder(store=address, token=TOKEN, timeout_s=5)
    with serving_holder(first) as t:
        with pytest.raises(FlashBootError, match=rf"another holder \(pid {os.getpid()} on .*\) already serves "
                                                 rf"store {address}, namespace 'default'"):
            Holder(store=address, token=TOKEN, timeout_s=5)
        Holder(store=address, token=TOKEN, namespace="other", timeout_s=5).close()  # a namespace of its own
    assert not t.is_alive() and first.errors == []
    Holder(store=address, token=TOKEN, timeout_s=5).close()  # the first closed: the next one starts


def test_a_killed_store_holder_is_taken_over_and_one_paused_past_its_lease_stops(store, monkeypatch):
    """A holder killed without closing leaves its lease: the next one waits out HOLDER_LEASE_S of
    silence and takes over. One stopped (SIGSTOP) for longer than that finds, when it runs again,
    that it has been replaced: it stops, naming the new holder, and leaves the new one's records."""
    from flashboot.flashclone import holder_registry
    from flashboot.flashclone.holder import Holder, hand_over, open_held

    monkeypatch.setattr(holder_registry, "HOLDER_LEASE_S", 1.0)
    address, _ = store
    code = ("import sys\nfrom flashboot.flashclone import holder, holder_registry\n"
            "holder_registry.HOLDER_LEASE_S = 1.0\n"
            "h = holder.Holder(store=sys.argv[1], timeout_s=5)\nprint('ready', flush=True)\nh.serve_forever()\n"
            "print('errors:', *h.errors, sep='\\n', flush=True)\n")
    killed = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert killed.stdout.readline().strip() == "ready"
        killed.kill()
        killed.communicate()
        second = Holder(store=address, token=TOKEN, timeout_s=5)  # the lease's silence waited out, not refused
        second.close()
        assert len(second.errors) == 1 and f"pid {killed.pid} on" in second.errors[0], second.errors
        assert "silent for 1 s and is taken as gone" in second.errors[0]
        paused = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert paused.stdout.readline().strip() == "ready"
            os.kill(paused.pid, signal.SIGSTOP)
            with serving_holder(Holder(store=address, token=TOKEN, timeout_s=5)):
                a = Arena.create(MiB, "cpu")
                a.bytes().numpy()[:] = 5
                hand_over(a, "w", store=address, token=TOKEN, timeout_s=10)
                a.close()
                os.kill(paused.pid, signal.SIGCONT)
                code_, out, err = finish(paused)
                assert code_ != 0 and "another holder" in err and f"pid {os.getpid()}" in err, (out, err)
                with open_held("w", store=address, token=TOKEN) as b:  # the new holder's record is left alone
                    assert int(b.bytes().numpy().max()) == 5
        finally:
            stop(paused)
    finally:
        stop(killed)


def test_hold_says_at_its_start_that_it_took_over_a_killed_holders_lease(store, monkeypatch, capsys):
    """`flashboot hold --store` after a holder was killed: the takeover is said when it starts
    (it had been kept in the error list, printed only when the holder stopped)."""
    from flashboot.cli import main
    from flashboot.flashclone import holder as holder_mod
    from flashboot.flashclone import holder_registry

    monkeypatch.setattr(holder_registry, "HOLDER_LEASE_S", 1.0)
    monkeypatch.setattr(holder_mod.Holder, "serve_forever",
                        lambda self, *args, **kwargs: print("(serving)", file=sys.stderr, flush=True) or self.close())
    address, _ = store
    killed = spawn_cli("hold", "--store", address)
    try:
        assert killed.stdout.readline().startswith("holder ready")
        killed.kill()
        killed.wait(10)
    finally:
        stop(killed)
    assert main(["hold", "--store", address]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"holder ready (store {address}, namespace 'default'); serving until SIGTERM"
    said, serving = err.find(f"flashboot hold: the holder before this one (pid {killed.pid} on "), err.find("(serving)")
    assert 0 <= said < serving and err.count("taken as gone") == 1, err


@pytest.mark.parametrize("where", ["registry", "store"])
def test_a_request_made_the_moment_the_last_one_is_answered_is_not_removed_with_it(where, tmp_path, store):
    """The holder removed a request after answering it: an engine that saw its answer and asked
    again under the name at once (a release, then the next hand-over) had its new request removed
    unanswered, and waited out its whole timeout ('is `flashboot hold` running there?')."""
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over

    kw = {"registry": tmp_path / "reg"} if where == "registry" else {"store": store[0], "token": TOKEN}
    holder = Holder(**kw, **({"timeout_s": 5} if where == "store" else {}))
    first, second = Arena.create(MiB, "cpu"), Arena.create(MiB, "cpu")
    put, outcome = holder.kv.put, {}

    def ask_again():
        try:
            outcome["second"] = hand_over(second, "w", timeout_s=5, **kw)
        except FlashBootError as exc:
            outcome["second"] = exc

    again = threading.Thread(target=ask_again)

    def answer_then_ask_again(kind, name, body):
        put(kind, name, body)
        if kind == "held" and body.get("request") == "r1":  # the engine sees it, and asks again at once
            again.start()
            time.sleep(0.2)  # it asks while the request answered is still there

    holder.kv.put = answer_then_ask_again
    try:
        put(REQUESTS, "w", {"descriptor": first.export().to_dict(), "request": "r1"})
        with serving_holder(holder):
            wait_until(lambda: "second" in outcome, 20, "the second engine's outcome")
        assert outcome["second"].pid == os.getpid(), outcome
    finally:
        again.join(20)
        holder.close()
        first.close()
        second.close()


def test_a_holder_killed_while_it_takes_an_arena_leaves_the_request_to_the_next(tmp_path):
    """A holder killed while it maps an arena (the OOM killer), restarted within the engine's
    wait: the request is still there, and the next holder takes it."""
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over

    registry = tmp_path / "reg"
    dying, outcome = Holder(registry=registry), {}
    dying.adopt = lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt())  # killed mid-adoption
    with Arena.create(MiB, "cpu") as arena:
        engine = threading.Thread(target=lambda: outcome.setdefault("d", hand_over(arena, "w", registry=registry,
                                                                                    timeout_s=20)))
        engine.start()
        try:
            wait_until(lambda: dying.kv.get(REQUESTS, "w"), 10, "the request")
            with pytest.raises(KeyboardInterrupt):
                dying.poll_once()
            dying.kv.close()  # its process gone, its lock with it
            with serving_holder(Holder(registry=registry)):
                engine.join(20)
        finally:
            engine.join(20)
        assert outcome["d"].pid == os.getpid()


@pytest.mark.parametrize("where", ["registry", "store"])
def test_two_engines_handing_over_under_one_name_at_once_are_each_answered(where, tmp_path, store):
    """Two engines handing over as one name at once: the second's request replaced the first's,
    which was never answered and waited out its whole timeout, asked whether a holder ran at all.
    A request waits while another under its name is pending; each engine hears its outcome."""
    from flashboot.errors import WaitTimeoutError
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over, held_record

    kw = {"registry": tmp_path / "reg"} if where == "registry" else {"store": store[0], "token": TOKEN}
    holder = Holder(**kw, **({"timeout_s": 5} if where == "store" else {}))
    arenas, outcomes = [Arena.create(MiB, "cpu") for _ in range(2)], {}

    def engine(i):
        try:
            outcomes[i] = hand_over(arenas[i], "w", timeout_s=5, **kw)
        except FlashBootError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
    try:
        threads[0].start()
        wait_until(lambda: holder.kv.get(REQUESTS, "w"), 10, "the first request")
        threads[1].start()
        time.sleep(0.3)  # the second engine asks while the first one's request is pending
        wait_until(lambda: holder.poll_once() == 0 and len(outcomes) == 2, 20, "both engines' outcomes")
        assert not any(isinstance(o, WaitTimeoutError) for o in outcomes.values()), outcomes
        assert outcomes[1].pid == os.getpid() and holder.held["w"].arena.arena_id == arenas[1].arena_id
        assert held_record("w", **kw)["request"] != ""
    finally:
        for t in threads:
            t.join(20)
        holder.close()
        for a in arenas:
            a.close()


def test_an_engine_whose_answer_was_replaced_before_it_looked_is_told_so(tmp_path, monkeypatch):
    """The holder took an engine's arena, then another engine's under the same name, before the
    first looked for its answer: the first waited out its whole timeout ('no holder adopted')."""
    from flashboot.flashclone import holder_client
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over

    registry = tmp_path / "reg"
    holder = Holder(registry=registry)
    first, second = Arena.create(MiB, "cpu"), Arena.create(MiB, "cpu")
    ask = holder_client._ask

    def ask_then_look_late(kv, name, body, *args):
        ask(kv, name, body, *args)
        wait_until(lambda: holder.kv.get("held", name), 10, "the first engine's answer")
        holder.kv.put(REQUESTS, name, {"descriptor": second.export().to_dict(), "request": "r2", "pid": 4242})
        wait_until(lambda: "w" in holder.held and holder.held["w"].arena.arena_id == second.arena_id, 10,
                   "the second engine's arena taken")

    monkeypatch.setattr(holder_client, "_ask", ask_then_look_late)
    try:
        with serving_holder(holder):
            with pytest.raises(ArenaError, match=rf"took 'w' and then, before this engine looked, another engine's "
                                                 rf"\(pid {os.getpid()}\) hand-over under that name in its place: "
                                                 r"two engines hand over as 'w'"):
                hand_over(first, "w", registry=registry, timeout_s=5)
        assert holder.held == {}  # released when the holder stopped
    finally:
        first.close()
        second.close()


def test_a_hand_over_on_a_store_no_holder_of_its_protocol_serves_says_so(store):
    """A store namespace whose only holder is an older FlashBoot's (it takes no lease, and does not
    see this FlashBoot's requests), or that none serves: the wait ran out asking whether
    `flashboot hold` ran at all. It says that no holder of this protocol holds the lease."""
    from flashboot.errors import WaitTimeoutError
    from flashboot.flashclone.holder import Holder, hand_over

    address, _ = store
    with Arena.create(MiB, "cpu") as a:
        for _ in range(2):  # never served, then served once and given back
            with pytest.raises(WaitTimeoutError, match=r"no holder adopted 'w' within 0.5 s \(store .*\); no holder of "
                                                       r"holder protocol 2 serves it \(none holds its lease; a holder "
                                                       r"of an older FlashBoot takes none"):
                hand_over(a, "w", store=address, token=TOKEN, timeout_s=0.5)
            Holder(store=address, token=TOKEN, timeout_s=5).close()


def test_a_hand_over_over_a_store_with_an_image_of_tuples_is_its_own_request(store):
    """A store's request is made by a compare-and-set that returns the record there: compared
    whole with what was asked, an ``image`` holding a tuple (a list once stored) read as another
    engine's request, and the hand-over waited out its timeout behind itself."""
    from flashboot.flashclone.holder import Holder, hand_over, held_record

    address, _ = store
    with serving_holder(Holder(store=address, token=TOKEN, timeout_s=5)), Arena.create(MiB, "cpu") as a:
        assert hand_over(a, "w", store=address, token=TOKEN, timeout_s=5, image={"shape": (1, 2)}).pid == os.getpid()
        assert held_record("w", store=address, token=TOKEN)["image"] == {"shape": [1, 2]}


def test_a_path_as_image_is_refused_by_name_or_taken_as_its_string(tmp_path):
    """hand_over(image=Path) had raised a raw TypeError from the request's JSON (so had a dict of
    one): a Path in the dict is its string, anything else not JSON is refused by name."""
    from flashboot.flashclone.holder import Holder, hand_over, held_record, release

    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)), Arena.create(MiB, "cpu") as arena:
        with pytest.raises(FlashBootError, match="image= takes a dict .* got PosixPath"):
            hand_over(arena, "p", registry=registry, image=tmp_path, timeout_s=10)
        with pytest.raises(FlashBootError, match="image= must hold JSON values"):
            hand_over(arena, "p", registry=registry, image={"dirs": {tmp_path}}, timeout_s=10)
        hand_over(arena, "p", registry=registry, image={"image_dir": tmp_path}, timeout_s=10)
        assert held_record("p", registry=registry)["image"] == {"image_dir": str(tmp_path)}
        release("p", registry=registry)


_OLDER_ENGINE = """
import sys
from flashboot.arena import Arena
from flashboot.flashclone.holder import hand_over
assert 'requests.v2' not in open(sys.modules['flashboot.flashclone.holder_client'].__file__).read()
with Arena.create(2 << 20, 'cpu') as a:
    try:
        hand_over(a, 'older', registry=sys.argv[1], timeout_s=20)
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


def test_an_older_flashboots_own_hand_over_hears_the_refusal_naming_both_protocols(tmp_path):
    """The protocol-1 client itself, from git history (b2a1e87, the parent of a76e076 which made
    protocol 2), hands over to this holder: it reads the refusal in held/NAME.json (its request
    id and an ``error``) and stops waiting, naming both protocols. The hand-written request of
    test_version_skew_hardening is the test that needs no history; this one checks it is what
    that client writes and reads."""
    import shutil

    from flashboot.flashclone.holder import Holder

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    older = tmp_path / "older"
    older.mkdir()
    if shutil.which("git") is None:
        pytest.skip("no git")
    archive = subprocess.run(["git", "-C", repo, "archive", "b2a1e87", "flashboot"], capture_output=True, timeout=60)
    if archive.returncode != 0:  # no history here (a shallow clone, an sdist)
        pytest.skip(f"commit b2a1e87 is not in this checkout's history: {archive.stderr.decode()[-200:]}")
    subprocess.run(["tar", "-x", "-C", str(older)], input=archive.stdout, check=True, timeout=60)
    registry = tmp_path / "registry"
    with serving_holder(Holder(registry=registry)):
        env = {**os.environ, "PYTHONPATH": str(older), "PYTHONSAFEPATH": "1"}
        p = subprocess.run([sys.executable, "-c", _OLDER_ENGINE, str(registry)], capture_output=True, text=True,
                           timeout=25, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("ArenaError the holder (registry ") and "could not adopt 'older': this holder " \
        "(registry" in p.stdout and "speaks holder protocol 2 and the engine that asked holder protocol 1 (an older " \
        "FlashBoot's)" in p.stdout, p.stdout


def test_a_request_naming_a_pid_past_pid_max_is_answered_and_the_holder_keeps_serving(tmp_path):
    """A request whose descriptor names a pid past the kernel's (an int is all the descriptor
    checks) had raised a bare OverflowError out of the holder's poll (os.pidfd_open): its loop
    ended and dropped every arena it held, and the request, never removed, did so again at the
    next holder's first poll. It is answered by name and the held arena stays."""
    from flashboot.flashclone.holder import REQUESTS, Holder, list_held

    registry = tmp_path / "reg"
    with Holder(registry=registry) as holder, Arena.create(MiB, "cpu") as a:
        holder.adopt("kept", a.export())
        planted = {**a.export().to_dict(), "pid": 10**30}
        holder.kv.put(REQUESTS, "planted", {"descriptor": planted, "request": "r1", "pid": os.getpid()})
        assert holder.poll_once() == 1
        answer = list_held(registry)["planted"]
        assert answer["request"] == "r1" and answer["error"] == \
            f"the request names engine pid {10**30}, which no process can have (Linux's pids end at {2**22:,})"
        assert list(holder.held) == ["kept"] and holder.kv.names(REQUESTS) == []


def test_the_hold_command_says_a_problem_as_it_happens(tmp_path):
    """`flashboot hold` is a log: a refused request is said when it is refused, not at the stop
    (an operator watching it had seen nothing while engines waited)."""
    registry = tmp_path / "held"
    holder = spawn_cli("hold", "--registry", registry)
    try:
        assert holder.stdout.readline().startswith("holder ready")
        from flashboot.flashclone.holder_registry import REQUESTS

        (registry / REQUESTS).mkdir(parents=True, exist_ok=True)
        (registry / REQUESTS / "planted.json").write_text("[1, 2]")
        line = holder.stderr.readline()  # blocks until said: the stop below comes only after it
        assert line.startswith("flashboot hold: planted: request skipped: ") and "planted.json is a JSON list" in line, line
        assert holder.poll() is None
        holder.terminate()
        assert holder.wait(20) == 0
    finally:
        stop(holder)


def test_an_arena_whose_engine_gave_up_while_it_was_mapped_is_let_go(tmp_path, monkeypatch):
    """The engine's wait runs out while the holder maps its arena (a large arena takes a while): it
    says "no holder adopted" and withdraws. The holder had then published and kept it, its memory
    held by no one's wish; it now looks before publishing, and lets it go."""
    from flashboot.errors import WaitTimeoutError
    from flashboot.flashclone.holder import REQUESTS, Holder, hand_over, held_record

    registry = tmp_path / "held"
    engine_done = threading.Event()
    outcome: list[BaseException | None] = []
    real_map = Arena.map_range

    def slow_map(self, *args, **kwargs):  # the holder's mapping outlasts the engine's wait
        assert engine_done.wait(20)
        return real_map(self, *args, **kwargs)

    with Holder(registry=registry) as holder, Arena.create(2 * MiB, "cpu") as arena:
        def engine():
            try:
                hand_over(arena, "slow", registry=registry, timeout_s=1)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                outcome.append(exc)
            engine_done.set()

        t = threading.Thread(target=engine)
        t.start()
        wait_until(lambda: holder.kv.names(REQUESTS), 10, "the engine's request")
        monkeypatch.setattr(Arena, "map_range", slow_map)
        holder.poll_once()
        t.join(10)
        assert isinstance(outcome[0], WaitTimeoutError), outcome
        assert "slow" not in holder.held and held_record("slow", registry=registry) is None
        assert any("withdrew its hand-over" in e for e in holder.errors), list(holder.errors)
