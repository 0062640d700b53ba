"""Version skew, as a rolling upgrade makes it: a holder, a preloader, images and records of an
older FlashBoot meeting this one. Each older peer is played here by the bytes or messages its
version writes (no other checkout is needed): what this version must do with them is either
work byte-exact or refuse naming the versions and what differs, never wait out a timeout for
nothing, nor share memory with a peer it cannot see."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from _clone_helpers import store  # noqa: F401  (a fixture)

from flashboot.errors import FlashBootError

pytestmark = pytest.mark.timeout(60)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_holder_refuses_a_registry_an_older_lockless_holder_still_serves(tmp_path):
    """A holder of a FlashBoot from before the registry's lock (2026-12-04 and earlier) takes no
    lock and writes records without its start time. This holder, started beside it on the same
    registry, had taken the lock and served too: both adopted every later request, so an arena
    released through one stayed mapped by the other. It is refused naming the other's pid, and
    starts once that holder is gone (dropping its records)."""
    from flashboot.flashclone.holder import Holder, list_held

    registry = tmp_path / "registry"
    for sub in ("requests", "held"):
        (registry / sub).mkdir(parents=True, mode=0o700)
    registry.chmod(0o700)
    old = _sleeper()
    try:
        record = {"descriptor": {"backend": "host", "pid": old.pid, "fds": [6], "nbytes": 2 << 20,
                                 "device_index": -1, "handle_type": "memfd", "granularity": 2 << 20,
                                 "segment_bytes": 256 << 20, "arena_id": "52e727636a7f78ee",
                                 "fabric_handles": None, "hostname": "vm"},
                  "request": "c9c01daf9d62a8fb", "since": 1.0, "holder_pid": old.pid, "image": None}
        (registry / "held" / "engine0.json").write_text(json.dumps(record))
        with pytest.raises(FlashBootError, match=rf"pid {old.pid} still holds 1 arena\(s\) here \(engine0\) without "
                                                 r"the registry's lock holder.lock: a holder of an older FlashBoot"):
            Holder(registry=registry)
        assert "engine0" in list_held(registry)  # its arena is that holder's: the record stays
    finally:
        old.kill()
        old.wait()
    with Holder(registry=registry) as holder:  # the lock was let go: the next start goes on
        assert list_held(registry) == {}
        assert any("engine0: removed the stale record" in e for e in holder.errors), list(holder.errors)


def _older_holder_answering(registry, pid: int, seen: list):
    """A holder of holder protocol 1 (before 2026-12-05), played by its loop: every request in
    ``requests/`` adopted under its pid, answered by a record that names no protocol."""
    import threading

    stop = threading.Event()

    def serve():
        while not stop.wait(0.005):
            for path in (registry / "requests").glob("*.json"):
                req = json.loads(path.read_text())
                seen.append(path.stem)
                (registry / "held" / path.name).write_text(json.dumps(
                    {"descriptor": {**req["descriptor"], "pid": pid}, "request": req.get("request"), "since": 1.0,
                     "holder_pid": pid, "image": req.get("image")}))
                path.unlink()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return stop, t


def test_an_older_holder_started_beside_this_one_takes_none_of_its_requests(tmp_path):
    """A holder of an older FlashBoot takes no lock: started after this FlashBoot's holder on its
    registry, it had adopted hand-overs too (a real one of 2026-12-04 took 5 of 20, three of them
    adopted by both), and alone there, a hand-over's descriptor was its own, used unsaid. This
    FlashBoot's engines ask where it does not look; a wait it leaves unanswered names it and both
    protocols, and its arena is refused, not mapped."""
    from flashboot.arena import Arena
    from flashboot.errors import ArenaError, WaitTimeoutError
    from flashboot.flashclone.holder import Holder, hand_over, open_held, release

    from _clone_helpers import serving_holder

    registry = tmp_path / "registry"
    old, seen = _sleeper(), []
    Holder(registry=registry).close()
    (registry / "requests").mkdir(mode=0o700, exist_ok=True)  # an older engine or holder made it
    stop, t = _older_holder_answering(registry, old.pid, seen)
    try:
        with Arena.create(2 << 20, "cpu") as arena:
            with pytest.raises(WaitTimeoutError, match=rf"no holder adopted 'w' within 0.5 s .*; pid {old.pid}, a "
                                                       r"holder of holder protocol 1, keeps 'x' here and does not "
                                                       r"see this FlashBoot's requests \(holder protocol 2\)"):
                (registry / "held" / "x.json").write_text(json.dumps(
                    {"descriptor": arena.export().to_dict(), "holder_pid": old.pid}))
                hand_over(arena, "w", registry=registry, timeout_s=0.5)
            with pytest.raises(ArenaError, match=rf"the arena held as 'x' in registry .* is refused: its holder "
                                                 rf"\(pid {old.pid}\) speaks holder protocol 1 \(an older FlashBoot's\); "
                                                 r"this FlashBoot speaks holder protocol 2"):
                open_held("x", registry=registry)
            with pytest.raises(ArenaError, match=r"'x' in registry .* is not released: its holder .* protocol 1"):
                release("x", registry=registry, timeout_s=0.5)
            (registry / "held" / "x.json").unlink()
            with serving_holder(Holder(registry=registry)) as holder_thread:  # this FlashBoot's holder beside it
                for i in range(5):
                    assert hand_over(arena, f"w{i}", registry=registry, timeout_s=10).pid == os.getpid()
                assert holder_thread.is_alive()
        assert seen == []
    finally:
        stop.set()
        t.join(5)
        old.kill()
        old.wait()


def test_an_older_engines_hand_over_is_refused_naming_both_protocols(tmp_path):
    """An engine of an older FlashBoot asks in ``requests/`` with no protocol: this holder had
    adopted it, beside any older holder that took it too. It answers, naming both protocols, and
    holds nothing; its own arena under that name keeps its record."""
    from flashboot.arena import Arena
    from flashboot.flashclone.holder import Holder, list_held

    registry = tmp_path / "registry"
    with Holder(registry=registry) as holder, Arena.create(2 << 20, "cpu") as arena:
        (registry / "requests").mkdir(mode=0o700, exist_ok=True)
        request = {"descriptor": arena.export().to_dict(), "request": "c9c01daf9d62a8fb", "pid": os.getpid(),
                   "image": None}
        (registry / "requests" / "old.json").write_text(json.dumps(request))
        assert holder.poll_once() == 1
        answer = list_held(registry)["old"]
        assert answer["request"] == "c9c01daf9d62a8fb" and "descriptor" not in answer, answer
        assert re.fullmatch(r"this holder \(registry .*\) speaks holder protocol 2 and the engine that asked holder "
                            r"protocol 1 \(an older FlashBoot's\): engines and their holder must run one FlashBoot "
                            r"version", answer["error"]), answer["error"]
        assert holder.held == {} and not (registry / "requests" / "old.json").exists()
        holder.adopt("mine", arena.export())
        (registry / "requests" / "mine.json").write_text(json.dumps({**request, "request": "r2"}))
        holder._next_older_poll = 0.0
        assert holder.poll_once() == 1
        assert list_held(registry)["mine"]["descriptor"]["pid"] == os.getpid()  # not overwritten by the answer
        assert any(e.startswith("mine: hand-over refused: this holder") for e in holder.errors), list(holder.errors)


def test_an_older_engines_hand_over_over_a_store_is_refused_naming_both_protocols(store):
    """The same over a store: an older engine's request, counted under ``hold/requests``, is
    answered with both protocols, and this FlashBoot's own hand-over still goes through."""
    from flashboot.arena import Arena
    from flashboot.flashclone.holder import Holder, _kv, hand_over, held_record

    from _clone_helpers import TOKEN, serving_holder, wait_until

    address, _ = store
    with serving_holder(Holder(store=address, token=TOKEN, timeout_s=5)), Arena.create(2 << 20, "cpu") as arena:
        older = _kv(store=address, token=TOKEN, timeout_s=5)  # writes as an older engine did
        older.put("requests", "old", {"descriptor": arena.export().to_dict(), "request": "r1", "pid": os.getpid()})
        older.close()
        answer = wait_until(lambda: held_record("old", store=address, token=TOKEN), 10, "the answer")
        assert answer["request"] == "r1" and "speaks holder protocol 2 and the engine that asked holder protocol 1 " \
            "(an older FlashBoot's)" in answer["error"], answer
        assert hand_over(arena, "new", store=address, token=TOKEN, timeout_s=10).pid == os.getpid()


def test_a_served_load_hears_at_once_that_an_older_daemon_holds_a_pack_since_replaced(tmp_path, monkeypatch):
    """A preloader of an older FlashBoot (before 2026-12-01's status fields) answers its status
    without the metadata sha256 it holds. After the image is re-packed, a served load had waited
    its whole timeout for a re-staging that daemon never does, then advised re-running a preload
    that its lock refuses. It is refused at once, by the pre-pack its .ready names, telling to
    restart it."""
    import flashboot
    from flashboot.errors import LayoutError
    from flashboot.flashload.server import PreloadServer

    from _preload_helpers import TINY, Daemon, make_image

    image = make_image(tmp_path, TINY, chunk_bytes=4096)
    real_status = PreloadServer.status

    def older_status(self):  # the fields such a daemon's status had
        reply = real_status(self)
        return {"ok": True, "pid": reply["pid"], "image_dir": reply["image_dir"],
                "ranks": {r: {k: v for k, v in st.items() if k in ("state", "nbytes", "pin_ms", "error")}
                          for r, st in reply["ranks"].items()}}

    monkeypatch.setattr(PreloadServer, "status", older_status)
    d = Daemon(image, tmp_path / "shm")
    try:
        held = d.load_exact()  # the pre-pack it staged loads byte-exact
        assert held["ok"]
        from flashboot.flashload import client
        from flashboot.flashload.status import rank_states

        (state,) = rank_states(image, [0], d.shm, daemon=client.serve_status(image, d.shm))
        assert state.state == "served", state  # had been "stale ... metadata sha256 ''": its status does not say
        flashboot.prepack(str(tmp_path / "ckpt"), str(image), progress=False, chunk_bytes=4096)  # a new job id
        with pytest.raises(LayoutError, match=r"holds rank 0 of another pre-pack .* by its \.ready: a preloader of an "
                                              r"older FlashBoot.*restart it: `flashboot preload .* --stop`"):
            flashboot.load(image, 0, "cpu", served=True, timeout_s=30, shm_dir=d.shm)
        (state,) = rank_states(image, [0], d.shm, daemon=client.serve_status(image, d.shm))
        assert state.state == "stale" and "another pre-pack (by its " in state.detail, state
    finally:
        d.close()


def _engine_request(sock_path, message: dict, fds: list[int]) -> dict:
    """``message`` with ``fds`` attached, as an engine sends it, and the daemon's answer."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(20)
        s.connect(str(sock_path))
        socket.send_fds(s, [json.dumps(message).encode()], fds)
        return json.loads(s.recv(1 << 20))


@pytest.mark.parametrize("older", ["attach", "unsealed"])
def test_a_daemon_names_both_protocols_to_an_older_engine(tmp_path, older):
    """An engine of an older FlashBoot, as the preloader is upgraded first: one from before
    2026-12-01's streamed hand-over asks ``attach`` (prepare()), whose answer had been 'unknown
    request op'; one older still hands over a host arena not sealed against shrinking. Both are
    refused naming what is gone and both protocols, and the daemon serves on."""
    from flashboot.arena import Arena
    from flashboot.flashload import shm as shm_files

    from _preload_helpers import Daemon, make_tiny_image

    image = make_tiny_image(tmp_path)
    src = shm_files.rank_source(image, 0)
    d = Daemon(image, tmp_path / "shm")
    try:
        with Arena.create(src.nbytes, "cpu") as arena:
            desc = arena.export().to_dict()
            fds = list(arena.export().fds)
            if older == "unsealed":  # a memfd as the older engine made it: no F_SEAL_SHRINK
                fd = os.memfd_create(f"flashboot-arena-{desc['arena_id']}.0", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, desc["nbytes"])
                fds = [fd]
            req = {"op": "attach" if older == "attach" else "load", "rank": 0, "descriptor": desc,
                   "nbytes": src.nbytes, "metadata_sha256": src.metadata_sha256, "timeout_s": 10.0,
                   "pci_bus_id": None, **({"verify": False, "hold_s": 60.0} if older == "attach" else {})}
            try:
                reply = _engine_request(d.path, req, fds)
            finally:
                if older == "unsealed":
                    os.close(fds[0])
        assert not reply["ok"] and reply["protocol"] == 2, reply
        what = "request op 'attach' (an arena attached first" if older == "attach" else "not sealed against shrinking"
        assert what in reply["message"], reply["message"]
        assert reply["message"].endswith("[the engine speaks served-load protocol 1 (names none: an older "
                                         "FlashBoot), this preloader 2: run engines and preloader of one FlashBoot "
                                         "version]"), reply["message"]
        d.load_exact()  # this version's engine is served as before
    finally:
        d.close()


def test_an_engine_names_both_protocols_for_an_older_daemon(tmp_path):
    """A preloader of an older FlashBoot (its replies name no protocol) refuses a load, or
    answers a verifying load without digests (it verified nothing): the engine's error names both
    protocols, not only the daemon's words."""
    import socket
    import threading

    from flashboot.arena import Arena
    from flashboot.errors import LayoutError, RendezvousError
    from flashboot.flashload import client
    from flashboot.flashload import shm as shm_files

    from _preload_helpers import make_tiny_image

    image = make_tiny_image(tmp_path)
    src = shm_files.rank_source(image, 0)
    shm = tmp_path / "shm"
    path = shm_files.socket_path(image, shm)
    path.parent.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(4)
    listener.settimeout(20)
    answers = [{"ok": False, "error": "LayoutError", "message": "rank 0: the daemon holds another pre-pack"},
               {"ok": True, "map_ms": 0.1, "h2d_ms": 0.2}]  # an older daemon's: verify unknown to it
    requests = []

    def older_daemon():
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 253)
                requests.append(json.loads(msg))
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps(answer).encode())

    t = threading.Thread(target=older_daemon, daemon=True)
    t.start()
    try:
        note = ("[the preloader speaks served-load protocol 1 (names none: an older FlashBoot), this engine 2: run "
                "engines and preloader of one FlashBoot version]")
        with Arena.create(src.nbytes, "cpu") as arena:
            with pytest.raises(LayoutError, match="holds another pre-pack") as err:
                client.start_served_load(arena, image_dir=image, rank=0, nbytes=src.nbytes,
                                         metadata_sha256=src.metadata_sha256, timeout_s=10, shm_dir=shm).wait()
            assert str(err.value).endswith(note), str(err.value)
            reply = client.start_served_load(arena, image_dir=image, rank=0, nbytes=src.nbytes,
                                             metadata_sha256=src.metadata_sha256, timeout_s=10, shm_dir=shm,
                                             verify=True).wait()
            with pytest.raises(RendezvousError, match="carries no chunk digests") as err:
                client.check_daemon_digests(reply, src.metadata, "rank 0")
            assert str(err.value).endswith(note), str(err.value)
        assert [r["protocol"] for r in requests] == [2, 2]  # and this engine names its own
    finally:
        t.join(20)
        listener.close()


@pytest.mark.parametrize("version", [2, 0])
def test_a_clone_record_of_another_record_version_is_refused_naming_both(version):
    """A seed of another FlashBoot writes its records in another envelope version (its MAC
    valid under the shared token). The reader had called it 'not a FlashBoot record', as for
    planted garbage; it names the version found and the one it reads."""
    from flashboot.errors import RendezvousError
    from flashboot.flashclone.records import Token, canonical_json, decode_record, encode_record

    token = Token("0123456789abcdef0123456789abcdef")
    envelope = json.loads(encode_record(token, "default/seed", {"pid": 1}))
    envelope.pop("mac")
    envelope["v"] = version
    envelope["mac"] = token.mac(canonical_json(envelope)).hex()
    with pytest.raises(RendezvousError, match=rf"'default/seed' in the store is a record of version {version}; this "
                                              r"FlashBoot reads record version 1: seed, clones and holder must run "
                                              r"one FlashBoot version"):
        decode_record(token, "default/seed", canonical_json(envelope))
    assert decode_record(token, "default/seed", encode_record(token, "default/seed", {"pid": 1})).body == {"pid": 1}


def test_a_restart_names_the_arena_an_older_flashboot_held_under_its_old_name(tmp_path):
    """An engine upgraded across a rename of the default held-arena name (the folder's name alone
    before 2026-12-05; cudaN until the GPU's PCI address) finds nothing under its new name and
    loads again, while the holder keeps the older engine's arena beside it: twice the memory,
    under a warning that said nothing was held. It names that arena and how to release it."""
    import hashlib

    import torch

    import flashboot
    from flashboot.arena import Arena
    from flashboot.flashclone.holder import Holder, hand_over, list_held
    from flashboot.flashload.restart import HolderOption

    from _clone_helpers import serving_holder
    from _preload_helpers import make_tiny_image

    image = make_tiny_image(tmp_path)
    registry = tmp_path / "registry"
    real = os.path.realpath(image)
    old = f"{os.path.basename(real)}.rank0.cpu"  # the name such an engine gave it
    assert old not in (HolderOption(registry=str(registry)).name_for(image, 0, "cpu"),)
    with serving_holder(Holder(registry=registry)):
        data = flashboot.layouts.read_image(image, 0).path.read_bytes()
        with Arena.create(len(data), "cpu") as arena:  # the older engine's load, handed over under its name
            arena.bytes().numpy()[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()
            identity = {"image_dir": real, "rank": 0, "nbytes": len(data), "device": "cpu", "format_version": 1,
                        "metadata_sha256": hashlib.sha256(b"its metadata").hexdigest(), "key_digest": "sha256:0"}
            hand_over(arena, old, registry=registry, timeout_s=20, image=identity)
        with pytest.warns(RuntimeWarning, match=rf"nothing is held as '[^']+' in registry [^;]+; an arena of this "
                                                rf"image is held as '{re.escape(old)}', the name an older FlashBoot "
                                                rf"gave it, and stays held beside this load until released: "
                                                rf"`flashboot hold --registry {re.escape(str(registry))} --release "
                                                rf"{re.escape(old)}`"):
            loaded = flashboot.load(image, 0, "cpu", stream=True, holder=str(registry))
        try:
            assert bytes(loaded.arena.bytes()[:len(data)].numpy()) == data
        finally:
            loaded.close()
        assert sorted(list_held(registry)) == sorted([old, HolderOption(registry=str(registry)).name_for(image, 0,
                                                                                                             "cpu")])
