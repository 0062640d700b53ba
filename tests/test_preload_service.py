"""The served-load daemon as a service: who may connect (socket mode, SO_PEERCRED, a configured
group), and what garbage, half-sent, oversized, silent and killed clients do to it: each is
answered or dropped, the others keep being served, and no fd or thread is left behind.

The daemon runs in this process (a thread), so the test can count its fds and threads; clients
are raw sockets, forked children of another uid, or engine processes."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import flashboot
from flashboot.arena import Arena
from flashboot.errors import FlashBootError, LayoutError, RendezvousError
from flashboot.fdshare import send_fds
from flashboot.flashload import client, serve_socket, server, staging
from flashboot.flashload import shm as shm_files

from flashboot.flashload.server import PreloadServer
from flashboot.flashload.shm import staged_paths
from flashboot.flashload.status import rank_states

from _preload_helpers import Daemon, daemon_process_of, fds_after_settling, make_tiny_image, open_fds  # noqa: E402  (tests/ is on the path, as for _clone_helpers)

NOBODY = 65534


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("service"))


@pytest.fixture
def open_root():
    """A staging root other users can traverse (pytest's own temp dirs are 0700)."""
    d = tempfile.mkdtemp(prefix="flashboot-svc-")
    os.chmod(d, 0o711)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(image, tmp_path):
    d = Daemon(image, tmp_path / "shm")
    yield d
    d.close()


def _ask(path: Path, payload: bytes, fds: list[int] | None = None, timeout_s: float = 10) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(path))
        if fds:
            send_fds(s, fds, payload)
        else:
            s.send(payload)
        s.settimeout(timeout_s)
        return json.loads(s.recv(1 << 20))


# ------------------------------------------------------------------------------- admission
def test_socket_is_owner_only_from_the_moment_it_has_its_name(daemon):
    st = os.stat(daemon.path)
    assert oct(st.st_mode & 0o777) == "0o600" and st.st_uid == os.geteuid()


def test_the_socket_is_created_0600_whatever_the_umask(tmp_path, monkeypatch):
    seen = []
    real_bind = socket.socket.bind

    def bind(self, address):  # the mode the file has the moment it exists
        real_bind(self, address)
        seen.append(oct(os.stat(address).st_mode & 0o777))

    monkeypatch.setattr(socket.socket, "bind", bind)
    old = os.umask(0)
    try:
        s = serve_socket._bind_private(tmp_path / "s.sock", None)
        s.close()
        assert os.umask(0) == 0, "the process umask is restored"
    finally:
        os.umask(old)
    assert seen == ["0o600"]
    with pytest.raises(FlashBootError, match="Unix sockets allow 107"):
        serve_socket._bind_private(tmp_path / ("x" * 120), None)


def _as_user(fn, uid: int, gid: int) -> dict:
    """Run ``fn()`` (returning a JSON-able dict) in a forked child switched to ``uid``/``gid``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only syscalls and json from here on
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = fn()
            except OSError as exc:
                out = {"oserror": exc.errno}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _status_error(d) -> dict:
    try:
        client.serve_status(d.image, d.shm, timeout_s=5)
    except FlashBootError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching a child to another uid needs root")


@needs_root
def test_a_stranger_is_refused_logged_and_the_daemon_keeps_serving(image, open_root):
    d = Daemon(image, open_root)
    try:
        os.chmod(d.path.parent, 0o711)
        status = json.dumps({"op": "status"}).encode()
        # the socket's mode keeps another user out before it can say anything ...
        assert _as_user(lambda: _ask(d.path, status), NOBODY, NOBODY) == {"oserror": 13}  # EACCES
        # ... and an engine of that user is told why and what to do
        told = _as_user(lambda: _status_error(d), NOBODY, NOBODY)
        assert told["error"] == "RendezvousError" and "not permitted to connect" in told["message"]
        assert "mode 0o600" in told["message"] and "--allow-group" in told["message"]
        # with the mode opened up (a careless chmod), the daemon's own check refuses it by its uid
        os.chmod(d.path, 0o666)
        before = open_fds()
        reply = _as_user(lambda: _ask(d.path, status), NOBODY, NOBODY)
        assert reply.get("ok") is False and reply["error"] == "RendezvousError", reply
        assert f"runs as uid {NOBODY}" in reply["message"] and f"serves uid {os.geteuid()} only" in reply["message"]
        assert d.server.refused == 1 and any(f"uid {NOBODY}" in line and "refused" in line for line in d.log)
        d.load_exact()  # and goes on serving its own user
        d.idle()
        assert fds_after_settling(before) == before
    finally:
        d.close()


@needs_root
def test_a_configured_group_is_admitted_and_other_groups_are_not(image, open_root):
    group = next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (0, NOBODY))
    d = Daemon(image, open_root, allow_group=group)
    try:
        os.chmod(d.path.parent, 0o711)
        st = os.stat(d.path)
        assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == group
        status = json.dumps({"op": "status"}).encode()
        member = _as_user(lambda: _ask(d.path, status), NOBODY, group)
        assert member["ok"] is True and member["pid"] == os.getpid()
        os.chmod(d.path, 0o666)
        outsider = _as_user(lambda: _ask(d.path, status), NOBODY, NOBODY)
        assert outsider["ok"] is False and f"or group {group}" in outsider["message"]
        assert d.server.refused == 1
    finally:
        d.close()


def _plant_socket(path: Path, ready_w: int) -> None:
    """In a child switched to another user: listen at ``path`` and take one connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(path))
        s.listen(1)
        os.write(ready_w, b"1")
        s.settimeout(20)
        try:
            conn, _ = s.accept()
            conn.settimeout(5)
            conn.recv(1 << 16)  # a request and its fds would arrive here
            conn.close()
        except OSError:
            pass


@needs_root
@pytest.mark.parametrize("trusted", [False, True])
def test_an_engine_refuses_a_socket_planted_by_another_user(image, open_root, monkeypatch, trusted):
    d = shm_files.staging_dir(image, open_root)
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)  # created first by someone else, writable by them
    path = shm_files.socket_path(image, open_root)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            _plant_socket(path, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
        if trusted:  # the deployment says that user runs the preloader: the engine talks to it
            monkeypatch.setenv(client.PRELOADER_UID_ENV, str(NOBODY))
            with pytest.raises(RendezvousError, match="closed the connection without answering"):
                client.serve_status(image, open_root, timeout_s=5)
        else:
            with pytest.raises(RendezvousError, match=f"running as uid {NOBODY}, not by this user") as e:
                client.serve_status(image, open_root, timeout_s=5)
            assert client.PRELOADER_UID_ENV in str(e.value)
    finally:
        os.close(r)
        os.waitpid(pid, 0)  # its accept() had the engine's connection, refused or not


@needs_root
def test_a_staged_copy_planted_by_another_user_is_refused_by_name(image, tmp_path, monkeypatch):
    """Defect: a staging folder another user made first (its name is the image path's hash), with
    a .ready copied from the real one and an image of their bytes, was loaded without a word (the
    engine checked only the socket's owner, not the staged files'), and a preloader skipped it as
    already staged and served it. Now a staged copy is taken only from a folder of this user, root
    or $FLASHBOOT_PRELOADER_UID that no other user may write."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    paths = staged_paths(image, 0, shm)
    planted = bytearray(paths.image.read_bytes())
    planted[100] ^= 0xFF
    paths.image.write_bytes(bytes(planted))
    for p in (paths.dir, paths.image, paths.ready):
        os.chown(p, NOBODY, -1)
    real = shm_files.rank_source(image, 0).path.read_bytes()

    def loaded_bytes(**options) -> bytes:
        with flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=10, **options) as loaded:
            return bytes(loaded.arena.bytes()[:len(real)].numpy()), loaded.report.details.get("stream_reason", "")

    got, why = loaded_bytes()  # streamed from the image on disk instead, saying why
    assert got == real and f"{paths.dir} belongs to uid {NOBODY}" in why, why
    with pytest.raises(LayoutError, match=f"belongs to uid {NOBODY}") as e:
        loaded_bytes(stream=False)
    assert client.PRELOADER_UID_ENV in str(e.value)
    with pytest.raises(LayoutError, match=f"belongs to uid {NOBODY}"):  # nor staged into, nor skipped as staged
        staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    (state,) = rank_states(image, [0], shm)
    assert state.state == "unreadable" and f"belongs to uid {NOBODY}" in state.detail, state

    monkeypatch.setenv(client.PRELOADER_UID_ENV, str(NOBODY))  # the deployment says that user stages for us
    assert loaded_bytes(stream=False)[0] == bytes(planted)
    monkeypatch.delenv(client.PRELOADER_UID_ENV)

    for p in (paths.dir, paths.image, paths.ready):
        os.chown(p, os.geteuid(), -1)
    os.chmod(paths.dir, 0o777)  # ours, but any user may swap its files
    with pytest.raises(LayoutError, match="other users may write"):
        loaded_bytes(stream=False)

    old_umask = os.umask(0)  # a folder staging makes is never one others may write, whatever the umask
    try:
        staging.stage_rank(image, 0, shm_dir=tmp_path / "shm0", threads=2, chunk_bytes=8192)
    finally:
        os.umask(old_umask)
    assert not staged_paths(image, 0, tmp_path / "shm0").dir.stat().st_mode & 0o002


def test_allow_group_is_validated_and_passed_to_the_service(image):
    with pytest.raises(FlashBootError, match="no such group"):
        staging.PreloadConfig(str(image), allow_group="no-such-group-here")
    with pytest.raises(FlashBootError, match="group name or gid"):
        staging.PreloadConfig(str(image), allow_group=[0])
    cfg = staging.PreloadConfig(str(image), serve=True, allow_group="0")
    assert cfg.allow_gid() == 0
    from flashboot.flashload import service

    assert service.config_argv(cfg)[-2:] == ["--allow-group", "0"]


def test_admits_by_uid_primary_and_supplementary_group():
    peer = serve_socket.PeerCredentials(pid=1, uid=1000, gid=100, groups=(100, 27))
    assert serve_socket.admits(peer, uid=1000, group=None)
    assert not serve_socket.admits(peer, uid=0, group=None)
    assert serve_socket.admits(peer, uid=0, group=100) and serve_socket.admits(peer, uid=0, group=27)
    assert not serve_socket.admits(peer, uid=0, group=5)


def test_peer_credentials_of_a_real_connection():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        peer = serve_socket.peer_credentials(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())


# --------------------------------------------------------------------------- hostile clients
def test_garbage_half_sent_and_oversized_requests_are_answered_and_nothing_leaks(daemon):
    daemon.load_exact()  # the first load maps what later loads reuse
    daemon.idle()
    fds_before, threads_before = open_fds(), threading.active_count()
    cases = {
        b"not json at all": "not JSON",
        b"\xff\xfe\xfd": "not JSON",
        b"[" * 50_000: "not JSON",  # nested past the decoder's recursion limit
        b"[1, 2]": "must be a JSON object",
        json.dumps({"op": "nope"}).encode(): "unknown request op 'nope'",
        json.dumps({"op": "load", "rank": 0}).encode(): "load request without a descriptor",
        b"x" * 100_000: "more than 65,536 bytes",
    }
    for payload, expected in cases.items():
        reply = _ask(daemon.path, payload)
        assert reply["ok"] is False and expected in reply["message"], (payload[:20], reply)
    # a load request that names what it does not bring, with a real fd attached
    src = shm_files.rank_source(daemon.image, 0)
    with Arena.create(src.nbytes, "cpu") as arena:
        desc = arena.export().to_dict()
        good = {"op": "load", "rank": 0, "descriptor": desc, "nbytes": src.nbytes,
                "metadata_sha256": src.metadata_sha256, "timeout_s": 5, "pci_bus_id": None}
        bad = {
            "rank": ("0", "rank must be an int"),
            "timeout_s": (float("nan"), "timeout_s must be a finite number"),
            "nbytes": (src.nbytes - 1, "of another pre-pack"),
            "descriptor": ({**desc, "fds": "many"}, "descriptor must be an object with a list of fds"),
        }
        for key, (value, expected) in bad.items():
            reply = _ask(daemon.path, json.dumps({**good, key: value}).encode(), list(desc["fds"]))
            assert reply["ok"] is False and expected in reply["message"], (key, reply)
        # an fd of another kind than the descriptor says (a pipe for a memfd)
        r, w = os.pipe()
        try:
            reply = _ask(daemon.path, json.dumps(good).encode(), [r])
        finally:
            os.close(r)
            os.close(w)
        assert reply["ok"] is False, reply
        # half-sent: the descriptor lists 300 fds, one batch of 253 arrives and nothing more
        many = [os.dup(desc["fds"][0]) for _ in range(253)]
        try:
            lying = {**good, "descriptor": {**desc, "fds": list(range(300))}}
            reply = _ask(daemon.path, json.dumps(lying).encode(), many)
        finally:
            for fd in many:
                os.close(fd)
        assert reply["ok"] is False and reply["error"] == "WaitTimeoutError", reply
        # ... and the same, with the client gone before the rest: dropped
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(daemon.path))
            send_fds(s, list(desc["fds"]), json.dumps(lying).encode())
        # the arena was never written by any of them
        assert not arena.bytes().numpy().any()
    daemon.load_exact()
    daemon.idle()
    assert fds_after_settling(fds_before) == fds_before
    assert threading.active_count() == threads_before
    assert daemon.thread.is_alive()


def test_a_silent_client_times_out_while_others_are_served(daemon):
    fds_before = open_fds()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect(str(daemon.path))
    try:
        t0 = time.monotonic()
        daemon.load_exact()  # served while the silent one holds its connection
        assert _ask(daemon.path, json.dumps({"op": "status"}).encode())["ok"]
        silent.settimeout(10)
        reply = json.loads(silent.recv(1 << 20))
        assert reply["error"] == "WaitTimeoutError" and "no request arrived within 1 s" in reply["message"]
        assert time.monotonic() - t0 < 10  # the 1 s request timeout, not the 10 s wait above
        # connect and leave without a word: dropped without an answer
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(daemon.path))
    finally:
        silent.close()
    daemon.idle()
    assert fds_after_settling(fds_before) == fds_before


def test_connections_beyond_the_limit_are_told_busy(daemon):
    daemon.server.max_connections = 2
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    try:
        for s in held:
            s.connect(str(daemon.path))
        deadline = time.monotonic() + 10
        while sum(t.is_alive() for t in daemon.server._threads) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reply = _ask(daemon.path, json.dumps({"op": "status"}).encode())
        assert reply["ok"] is False and "busy" in reply["message"] and "at most 2" in reply["message"]
    finally:
        for s in held:
            s.close()
    daemon.idle()
    assert _ask(daemon.path, json.dumps({"op": "status"}).encode())["ok"]


_ENGINE = """
import sys, time
from flashboot.arena import Arena
from flashboot.flashload import client, shm
src = shm.rank_source(sys.argv[1], 0)
arena = Arena.create(src.nbytes, "cpu")
copy = client.start_served_load(arena, image_dir=sys.argv[1], rank=0, nbytes=src.nbytes,
                                metadata_sha256=src.metadata_sha256, timeout_s=30, shm_dir=sys.argv[2])
print("sent", flush=True)
time.sleep(60)
"""


def test_an_engine_killed_mid_copy_leaves_nothing_behind(daemon, monkeypatch):
    started, go = threading.Event(), threading.Event()
    real = server._read_staged

    def held(*a, **k):
        """The daemon's host copy, stopped at its start until the test says go."""
        started.set()
        assert go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(server, "_read_staged", held)
    daemon.idle()
    fds_before = open_fds()
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, str(daemon.image), str(daemon.shm)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "sent"
        assert started.wait(30)
        engine.kill()  # mid-copy: the daemon holds the engine's arena fd and mapping
        engine.wait(10)
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.stdout.close()
    go.set()
    daemon.idle()
    assert any("engine connection lost" in line for line in daemon.log), daemon.log
    assert fds_after_settling(fds_before) == fds_before
    monkeypatch.setattr(server, "_read_staged", real)
    daemon.load_exact()


def _engine_sent(image, shm) -> subprocess.Popen:
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, str(image), str(shm)], stdout=subprocess.PIPE, text=True)
    assert engine.stdout.readline().strip() == "sent"
    return engine


def _kill(engine: subprocess.Popen) -> None:
    engine.kill()
    engine.wait(10)
    engine.stdout.close()


@pytest.mark.parametrize("waits_for", ["its rank", "the device"])
def test_an_engine_killed_while_its_load_waits_is_let_go_at_once(image, tmp_path, monkeypatch, waits_for):
    """Defect: an engine killed while its request waited (for its rank to become resident: a
    restarted daemon pins what its .ready says is staged, seconds for a large rank; or for the
    device, behind another engine's copy) had its arena's fds held by the daemon until the wait
    ended, its memory (GPU memory on CUDA) kept from the engine restarted in its place, and then
    the whole rank copied into the dead engine's arena, holding the device from those queued
    behind. The daemon now sees the engine hang up while it waits and lets its arena go."""
    go, started = threading.Event(), threading.Event()
    if waits_for == "its rank":
        real_resident = PreloadServer._make_resident

        def held_resident(self, rank):  # staged; made resident once the test says go
            started.set()
            assert go.wait(60)
            return real_resident(self, rank)

        monkeypatch.setattr(PreloadServer, "_make_resident", held_resident)
    else:
        real_read = server._read_staged

        def held_read(*a, **k):  # the first copy holds the device until the test says go
            started.set()
            assert go.wait(60)
            return real_read(*a, **k)

        monkeypatch.setattr(server, "_read_staged", held_read)
    d = Daemon(image, tmp_path / "shm", staged=waits_for != "its rank")
    first = None
    try:
        if waits_for == "the device":
            src = shm_files.rank_source(image, 0)
            first = Arena.create(src.nbytes, "cpu")
            copy = client.start_served_load(first, image_dir=str(image), rank=0, nbytes=src.nbytes,
                                            metadata_sha256=src.metadata_sha256, timeout_s=30, shm_dir=d.shm)
        assert started.wait(30)
        fds_before = open_fds()
        engine = _engine_sent(image, d.shm)
        try:
            deadline = time.monotonic() + 10
            while open_fds() == fds_before:  # the daemon took the engine's arena
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            _kill(engine)
        assert fds_after_settling(fds_before) == fds_before  # while the wait still lasts
        assert any("hung up" in line and f"pid {engine.pid}" in line for line in d.log), d.log
        go.set()
        if first is not None:
            copy.wait()
            first.close()
        d.idle()
        d.load_exact()
    finally:
        go.set()
        d.close()


def test_an_engine_killed_mid_copy_is_copied_into_no_further(daemon, monkeypatch):
    """Defect: the daemon copied the whole rank into the arena of an engine killed mid-copy (a 140
    GB rank: seconds on a GPU, a minute pageable or on the host backend), its memory kept from the
    engine restarted in its place and the device from those queued behind. Now the copy looks
    for the hang-up before each piece."""
    from flashboot import fileio
    from flashboot.flashload import serve_copy

    monkeypatch.setattr(serve_copy, "HOST_READ_CHUNK_BYTES", 4096)  # 31 pieces of the tiny image
    nbytes = shm_files.rank_source(daemon.image, 0).nbytes
    started, go, reads, real = threading.Event(), threading.Event(), [], fileio.read_exactly

    def read_exactly(*a, **k):
        reads.append(a[2])
        started.set()
        assert go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(fileio, "read_exactly", read_exactly)
    daemon.idle()
    fds_before = open_fds()
    engine = _engine_sent(daemon.image, daemon.shm)
    assert started.wait(30)
    _kill(engine)
    go.set()
    daemon.idle()
    assert len(reads) < -(-nbytes // 4096) / 2, (len(reads), nbytes)
    assert any(f"pid {engine.pid}) hung up while its load was copied" in line for line in daemon.log), daemon.log
    assert fds_after_settling(fds_before) == fds_before
    monkeypatch.setattr(fileio, "read_exactly", real)
    daemon.load_exact()


@pytest.fixture
def daemon_process(image, tmp_path):
    """The daemon in its own process: what a client does to memory the daemon maps must not kill
    it (a thread in this process would take pytest with it)."""
    with daemon_process_of(image, tmp_path) as running:
        yield running


def _load_exact(image, shm) -> None:
    src = shm_files.rank_source(image, 0)
    with Arena.create(src.nbytes, "cpu") as arena:
        client.served_load(arena, src, timeout_s=10, shm_dir=shm)
        assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()


def test_a_client_that_shrinks_memory_the_daemon_maps_cannot_kill_it(image, daemon_process):
    """Defect: an unsealed memfd attached, truncated to 0, then 'copy': the daemon died of SIGBUS.
    Now the attach is refused by name, a real arena cannot shrink, and a truncated staged image is
    refused; after each the daemon answers the next client byte-exact."""
    proc, shm, log = daemon_process
    src = shm_files.rank_source(image, 0)
    with Arena.create(src.nbytes, "cpu") as arena:
        desc = arena.export()
        fake = os.memfd_create(f"flashboot-arena-{desc.arena_id}.0", os.MFD_CLOEXEC)  # a look-alike, unsealed
        try:
            os.ftruncate(fake, desc.nbytes)
            req = {"op": "load", "rank": 0, "descriptor": desc.to_dict(), "nbytes": src.nbytes,
                   "metadata_sha256": src.metadata_sha256, "timeout_s": 5, "pci_bus_id": None}
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(str(shm_files.socket_path(image, shm)))
                send_fds(s, [fake], json.dumps(req).encode())
                s.settimeout(10)
                reply = json.loads(s.recv(1 << 20))
        finally:
            os.close(fake)
        assert reply["ok"] is False and reply["error"] == "ArenaError", reply
        assert (f"(segment 0 of arena {desc.arena_id}, {desc.nbytes:,} bytes) is not sealed against shrinking: "
                "seals found: F_SEAL_SEAL; required: F_SEAL_SHRINK") in reply["message"]  # created without MFD_ALLOW_SEALING
        # a real arena: it cannot shrink under the daemon, which copies into it
        with pytest.raises(PermissionError):
            os.ftruncate(desc.fds[0], 0)
        client.served_load(arena, src, timeout_s=10, shm_dir=shm)
        assert bytes(arena.bytes()[:src.nbytes].numpy()) == src.path.read_bytes()
    assert proc.poll() is None, log.read_text()
    # the staged image the daemon holds, truncated by a process of the same uid
    staged = staged_paths(image, 0, shm).image
    good = staged.read_bytes()
    os.truncate(staged, 4096)
    with Arena.create(src.nbytes, "cpu") as arena:
        with pytest.raises(LayoutError, match=rf"{staged}: the staged image of rank 0 holds 4,096 bytes; "
                                              rf"{src.nbytes:,} were staged \(it was truncated since\)"):
            client.served_load(arena, src, timeout_s=10, shm_dir=shm)
    assert proc.poll() is None, log.read_text()
    with open(staged, "r+b") as f:  # the same file again: the daemon holds it open
        f.write(good)
    _load_exact(image, shm)
    assert proc.poll() is None, log.read_text()


def test_a_staged_image_that_shrinks_during_the_copy_reads_short_and_the_daemon_keeps_serving(daemon, monkeypatch):
    """The host backend copies the staged file with pread: truncated between the daemon's size check
    and its read, the read ends short (an error naming where) where a mapping would have faulted."""
    from flashboot import fileio

    staged = staged_paths(daemon.image, 0, daemon.shm).image
    good, real = staged.read_bytes(), fileio.read_exactly

    def shrink_then_read(*a, **k):
        os.truncate(staged, 4096)
        return real(*a, **k)

    monkeypatch.setattr(fileio, "read_exactly", shrink_then_read)
    src = shm_files.rank_source(daemon.image, 0)
    with Arena.create(src.nbytes, "cpu") as arena:
        with pytest.raises(LayoutError, match=rf"{staged}: ends at byte 4,096; {src.nbytes:,} bytes were expected "
                                              r"\(the file shrank while it was read\)"):
            client.served_load(arena, src, timeout_s=10, shm_dir=daemon.shm)
    monkeypatch.setattr(fileio, "read_exactly", real)
    with open(staged, "r+b") as f:
        f.write(good)
    daemon.load_exact()


@pytest.mark.gpu
def test_gpu_a_truncated_staged_image_is_refused_and_the_pinned_daemon_keeps_serving(image):
    """CUDA: the daemon copies from the staged file's pinned pages; a file truncated since is refused
    before the copy (it would serve pages the file no longer has), and the daemon serves on."""
    shm = Path(tempfile.mkdtemp(prefix="flashboot-test-", dir="/dev/shm"))  # pinning needs tmpfs pages
    d = Daemon(image, shm, devices={0: "cuda:0"})
    try:
        assert d.server.residents[0].state == "pinned"
        src = shm_files.rank_source(image, 0)
        staged = staged_paths(image, 0, shm).image
        good = staged.read_bytes()
        os.truncate(staged, 4096)
        with Arena.create(src.nbytes, "cuda:0") as arena:
            with pytest.raises(LayoutError, match=rf"{staged}: the staged image of rank 0 holds 4,096 bytes"):
                client.served_load(arena, src, timeout_s=30, shm_dir=shm)
        with open(staged, "r+b") as f:
            f.write(good)
        with Arena.create(src.nbytes, "cuda:0") as arena:
            client.served_load(arena, src, timeout_s=30, shm_dir=shm)
            assert bytes(arena.bytes()[:src.nbytes].cpu().numpy()) == good
        assert d.thread.is_alive()
    finally:
        d.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_fifo_lock_grants_in_arrival_order_and_gives_up_a_timed_out_place():
    lock = server._FifoLock()
    assert lock.acquire(1)
    order, ready = [], []

    def waiter(i):
        ev = threading.Event()
        ready.append(ev)
        if lock.acquire(10):
            order.append(i)
            lock.release()

    threads = []
    for i in range(5):
        t = threading.Thread(target=waiter, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 10
        while lock.queued < i + 1:  # queue them one after the other
            assert time.monotonic() < deadline
            time.sleep(0.001)
    assert not lock.acquire(0.05) and lock.queued == 5  # a timed-out waiter leaves the queue
    lock.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, 4]
    assert lock.acquire(0) and lock.queued == 0


def test_each_device_has_its_own_copy_lock(image, tmp_path):
    """Two GPUs asking at once each copy over their own link: one device's queue never holds up
    another's."""
    srv = PreloadServer(staging.PreloadConfig(str(image), shm_dir=str(tmp_path / "shm"), serve=True))
    a, b = srv._lock_for("cuda:0"), srv._lock_for("cuda:1")
    assert a is srv._lock_for("cuda:0") and a is not b
    assert a.acquire(0) and b.acquire(0)  # both held at once
    assert not a.acquire(0.01)
    a.release()
    b.release()
