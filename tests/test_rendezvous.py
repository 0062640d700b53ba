"""Rendezvous: token, authenticated and sealed records, manifests, the TCPStore connection, barriers."""

from __future__ import annotations

import threading
import time

import pytest

from flashboot.errors import RendezvousError, WaitTimeoutError
from flashboot.flashclone.manifest import Manifest
from flashboot.flashclone.records import ENV_TOKEN, ENV_TOKEN_FILE, Token, decode_record, encode_record, resolve_token
from flashboot.flashclone.rendezvous import JOIN_ATTEMPTS, Rendezvous, free_port, parse_address

pytestmark = pytest.mark.timeout(30)

TOKEN = "rendezvous-test-token-0123456789"
OTHER = "another-token-entirely-987654321"


@pytest.fixture
def address():
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def server(address):
    rdv = Rendezvous.connect(address, TOKEN, host=True, timeout_s=5)
    yield rdv
    rdv.close()


# ---------------------------------------------------------------------------------- addresses


@pytest.mark.parametrize("text, expected", [("127.0.0.1:29500", ("127.0.0.1", 29500)),
                                            ("node-7:1234", ("node-7", 1234)),
                                            ("[::1]:80", ("::1", 80))])
def test_parse_address(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text, message", [("localhost", "HOST:PORT"), ("h:port", "not a number"),
                                           ("h:0", "outside 1..65535"), ("h:70000", "outside")])
def test_parse_address_refuses(text, message):
    with pytest.raises(RendezvousError, match=message):
        parse_address(text)


# ---------------------------------------------------------------------------------- tokens


def test_token_sources_in_order(monkeypatch, tmp_path):
    f = tmp_path / "token"
    f.write_text(OTHER + "\n")
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    assert resolve_token(TOKEN).source == "the token argument"
    assert "token file" in resolve_token(token_file=f).source  # an explicit file beats the environment
    assert resolve_token().source == f"${ENV_TOKEN}"
    monkeypatch.delenv(ENV_TOKEN)
    monkeypatch.setenv(ENV_TOKEN_FILE, str(f))
    tok = resolve_token()
    assert "token file" in tok.source
    # the file's trailing newline is not part of the secret: it signs like the bare string
    assert tok.mac(b"x") == Token(OTHER).mac(b"x")
    assert OTHER not in repr(tok)


def test_missing_short_and_unreadable_tokens_are_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)
    with pytest.raises(RendezvousError, match="FLASHBOOT_TOKEN"):
        resolve_token()
    with pytest.raises(RendezvousError, match="is 5 bytes; use at least 16"):
        resolve_token("short")
    with pytest.raises(RendezvousError, match="cannot read token file"):
        resolve_token(token_file=tmp_path / "missing")


# ---------------------------------------------------------------------------------- records


def test_record_round_trip_and_sealed_part_is_encrypted():
    tok = Token(TOKEN)
    raw = encode_record(tok, "k/seed", {"pid": 42}, sealed={"fd": 7, "secret": "descriptor-bytes"})
    assert b"descriptor-bytes" not in raw and b'"fd"' not in raw
    rec = decode_record(tok, "k/seed", raw)
    assert rec.body == {"pid": 42} and rec.sealed == {"fd": 7, "secret": "descriptor-bytes"}
    # same content, fresh nonce: the ciphertexts differ
    assert encode_record(tok, "k/seed", {"pid": 42}, sealed={"fd": 7}) != encode_record(tok, "k/seed", {"pid": 42},
                                                                                       sealed={"fd": 7})


def test_records_refused_for_wrong_token_tampering_moving_and_garbage():
    tok = Token(TOKEN)
    raw = encode_record(tok, "k/seed", {"pid": 42}, sealed={"fd": 7})
    with pytest.raises(RendezvousError, match="fails authentication"):
        decode_record(Token(OTHER), "k/seed", raw)
    with pytest.raises(RendezvousError, match="fails authentication"):
        decode_record(tok, "k/seed", raw.replace(b'"pid":42', b'"pid":43'))
    with pytest.raises(RendezvousError, match="moved or replayed"):
        decode_record(tok, "k/other", raw)  # the key it was written for is covered by the MAC
    with pytest.raises(RendezvousError, match="not a FlashBoot record"):
        decode_record(tok, "k/seed", b"{not json")
    with pytest.raises(RendezvousError, match="not a FlashBoot record"):
        decode_record(tok, "k/seed", b'{"v": 1}')


# ---------------------------------------------------------------------------------- manifests


def _manifest(**kw) -> Manifest:
    base = dict(nbytes=10_000, arena_nbytes=2 << 20, checksum_chunk_bytes=4096, checksums=(1, 2, 3),
                key={"model_id": "org/a", "tp_size": 2, "dtypes": ["bfloat16"], "digest": "sha256:aa"})
    base.update(kw)
    return Manifest(**base)


def test_manifest_round_trip_and_digest():
    m = _manifest()
    again = Manifest.from_dict(m.to_dict())
    assert again == m and again.digest == m.digest
    assert _manifest(checksums=(1, 2, 4)).digest != m.digest
    assert m.chunk_range(2) == (8192, 10_000 - 8192)


def test_manifest_validates_itself():
    with pytest.raises(RendezvousError, match="has 2 checksums; 10,000 bytes in chunks of 4,096 need 3"):
        _manifest(checksums=(1, 2))
    with pytest.raises(RendezvousError, match="smaller than nbytes"):
        _manifest(arena_nbytes=4096)
    with pytest.raises(RendezvousError, match="malformed manifest"):
        Manifest.from_dict({"nbytes": 1})


def test_manifest_mismatches_name_every_differing_field():
    m = _manifest()
    assert m.mismatches({"model_id": "org/a", "tp_size": 2, "dtypes": ("bfloat16",)}) == []
    bad = dict((k, (e, f)) for k, e, f in m.mismatches({"model_id": "org/b", "tp_size": 4, "nbytes": 10_000}))
    assert bad == {"model_id": ("org/b", "org/a"), "tp_size": (4, 2)}
    other = _manifest(checksums=(1, 2, 4), nbytes=10_001)
    fields = [k for k, _, _ in m.mismatches(other)]
    assert fields == ["nbytes", "checksums"]
    with pytest.raises(RendezvousError, match=r"refused before any byte moved: model_id: expected 'org/b'"):
        m.require({"model_id": "org/b"}, "the seed")
    bare = _manifest(key=None)
    assert bare.mismatches({"model_id": "org/a"}) == [("model_id", "org/a", None)]


# ---------------------------------------------------------------------------------- the store


def test_host_then_join_and_exchange_records(address, server):
    assert server.is_server
    client = Rendezvous.connect(address, TOKEN, host=True, timeout_s=5)  # already served: joins as a client
    try:
        assert not client.is_server
        server.publish("seed", {"pid": 1}, sealed={"fd": 3})
        rec = client.read("seed", what="the seed")
        assert rec.body == {"pid": 1} and rec.sealed == {"fd": 3}
        assert client.try_read("nothing") is None
        assert [client.add("join"), server.add("join"), client.add("join", 0)] == [1, 2, 2]
    finally:
        client.close()


def test_wrong_token_and_planted_records_are_refused(address, server):
    server.publish("seed", {"pid": 1}, sealed={"fd": 3})
    server.store.set(server.full_key("planted"), b'{"v":1,"key":"x","body":{},"sealed":null,"nonce":"00","mac":"00"}')
    intruder = Rendezvous.connect(address, OTHER, timeout_s=5)
    try:
        with pytest.raises(RendezvousError, match="fails authentication"):
            intruder.read("seed", what="the seed")
    finally:
        intruder.close()
    with pytest.raises(RendezvousError, match="fails authentication"):
        server.read("planted", what="a planted record")


def test_waits_time_out_naming_what_they_awaited(address, server):
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=r"waited 0.3 s for the seed's manifest \(store keys \['seed'\]"):
        server.read("seed", what="the seed's manifest", timeout_s=0.3)
    assert time.monotonic() - t0 < 5


def test_no_store_listening_times_out_with_the_address(address):
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=f"no rendezvous store answered at {address}"):
        Rendezvous.connect(address, TOKEN, timeout_s=0.5)
    assert time.monotonic() - t0 < 5


def test_the_store_handshake_is_the_one_torchs_tcpstore_answers():
    """The pre-flight speaks c10d's validate and ping itself: a real TCPStore of the installed torch
    answers it (a changed protocol fails here, not as a hang), a silent port does not."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from flashboot.flashclone.rendezvous import _await_store

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    _await_store("127.0.0.1", store.port, time.monotonic() + 10, f"127.0.0.1:{store.port}")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(WaitTimeoutError, match=rf"no rendezvous store answered at {address} \(something listens "
                                                   r"there but did not answer TCPStore's ping\)"):
            Rendezvous.connect(address, TOKEN, timeout_s=0.5)


def test_a_port_that_hangs_up_at_once_is_retried_until_the_timeout_and_named():
    import socket

    with socket.socket() as closing:
        closing.bind(("127.0.0.1", 0))
        closing.listen(64)
        address = f"127.0.0.1:{closing.getsockname()[1]}"
        stop = threading.Event()

        def hang_up():
            closing.settimeout(0.05)
            while not stop.is_set():
                try:
                    closing.accept()[0].close()
                except OSError:
                    pass

        t = threading.Thread(target=hang_up, daemon=True)
        t.start()
        try:
            with pytest.raises(WaitTimeoutError, match=rf"no rendezvous store answered at {address} \(something "
                                                       r"listens there and closed the connection without answering"):
                Rendezvous.connect(address, TOKEN, timeout_s=0.5)
        finally:
            stop.set()
            t.join(5)


def test_a_join_refused_after_the_store_answered_is_asked_again_within_the_bound(address, server, monkeypatch):
    """torch's client gives up on a refused connect as soon as its backoff outlasts the time left
    (CI once saw a join fail so, right after the store answered the pre-flight): the join asks
    again, a few times within its bound, then names the address, the attempts and torch's error."""
    import torch.distributed as dist

    real, calls = dist.TCPStore, []

    def refusing(times):
        def make(*args, **kwargs):
            calls.append(kwargs.get("is_master"))
            if len(calls) <= times:
                raise dist.DistNetworkError("The client socket has timed out after 999ms while trying to connect")
            return real(*args, **kwargs)
        return make

    monkeypatch.setattr(dist, "TCPStore", refusing(2))
    client = Rendezvous.connect(address, TOKEN, timeout_s=5)
    try:
        server.publish("seed", {"pid": 7})
        assert client.read("seed", what="the seed").body == {"pid": 7}
        assert calls == [False, False, False]
    finally:
        client.close()
    monkeypatch.setattr(dist, "TCPStore", refusing(10**6))
    calls.clear()
    with pytest.raises(RendezvousError, match=rf"cannot join the store at {address} \({JOIN_ATTEMPTS} attempt\(s\) in "
                                              r"[\d.]+ s of 30\): The client socket has timed out after 999ms"):
        Rendezvous.connect(address, TOKEN, timeout_s=30)
    assert len(calls) == JOIN_ATTEMPTS
    calls.clear()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"cannot join the store at {address} \(\d attempt\(s\) in "):
        Rendezvous.connect(address, TOKEN, timeout_s=0.1)
    assert time.monotonic() - t0 < 5


def test_connect_needs_a_token_before_touching_the_network(address, monkeypatch):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)
    with pytest.raises(RendezvousError, match="no rendezvous token"):
        Rendezvous.connect(address, host=True)


def test_barrier_releases_everyone_and_times_out_with_a_count(address, server):
    clients = [Rendezvous.connect(address, TOKEN, timeout_s=5) for _ in range(3)]
    waited = []
    threads = [threading.Thread(target=lambda c=c: waited.append(c.barrier("start", 3, timeout_s=10))) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(waited) == 3
    with pytest.raises(WaitTimeoutError, match="1 of 2 had arrived"):
        clients[0].barrier("lonely", 2, timeout_s=0.3)
    for c in clients:
        c.close()


def test_positions_by_arrival_are_unique(address, server):
    clients = [Rendezvous.connect(address, TOKEN, timeout_s=5) for _ in range(4)]
    got = []
    threads = [threading.Thread(target=lambda c=c: got.extend(c.add("g/x/chain/join") for _ in range(5)))
               for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(got) == list(range(1, 21))
    for c in clients:
        c.close()


def test_namespaces_keep_records_apart(address, server):
    other = Rendezvous.connect(address, TOKEN, namespace="other", timeout_s=5)
    try:
        server.publish("seed", {"who": "default"})
        assert other.try_read("seed") is None
        with pytest.raises(RendezvousError, match="namespace"):
            Rendezvous.connect(address, TOKEN, namespace="a/b")
    finally:
        other.close()


def test_bounded_store_calls_end_by_the_deadline_when_the_store_stops_answering():
    """A TCPStore call blocks forever when the store's host stops answering (a cut link): with
    ``bounded`` every call ends within timeout_s, and later calls fail at once."""
    from _clone_helpers import stop_process, store_in_its_own_process

    with store_in_its_own_process(sleep_s=120) as (address, host):
        client = Rendezvous.connect(address, TOKEN, timeout_s=1.0)
        client.bounded = True
        assert client.add("k", 2) == 2  # answered normally while the host runs
        stop_process(host.pid)  # a call sent before it stopped was once answered
        t0 = time.monotonic()
        with pytest.raises(WaitTimeoutError, match="did not answer within 1 s while counting 'k'"):
            client.add("k", 1)
        assert time.monotonic() - t0 < 5
        t1 = time.monotonic()
        with pytest.raises(RendezvousError, match="stopped answering earlier"):
            client.publish("other", {"x": 1})
        assert time.monotonic() - t1 < 0.5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1, 1e12, True])
def test_a_timeout_that_is_no_finite_positive_number_is_refused_by_name(address, server, bad, tmp_path):
    """NaN reached timedelta as a bare ValueError, inf an OverflowError, and 0 or -1 a
    StoreSilentError saying the store (which answered) did not answer within 0 s, "is the link
    down?". Now each entry point names its timeout and the value, before loading or connecting."""
    import flashboot
    from flashboot.errors import FlashBootError
    from flashboot.flashclone.store import StoreServer

    with pytest.raises(RendezvousError, match=rf"rendezvous timeout_s must be a finite number of seconds .*got {bad!r}"):
        Rendezvous.connect(address, TOKEN, timeout_s=bad)
    with pytest.raises(FlashBootError, match=rf"clone timeout_s must be a finite number .*got {bad!r}"):
        flashboot.clone(address, "cpu", "star", token=TOKEN, timeout_s=bad)
    with pytest.raises(FlashBootError, match=rf"seed timeout_s must be a finite number .*got {bad!r}"):
        flashboot.seed(address, str(tmp_path / "no-such-image"), "cpu", token=TOKEN, timeout_s=bad)
    with pytest.raises(RendezvousError, match=rf"store timeout_s must be a finite number .*got {bad!r}"):
        StoreServer(f"127.0.0.1:{free_port()}", timeout_s=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1])
def test_a_wait_given_no_finite_timeout_is_refused_instead_of_polling_for_good(address, server, bad):
    """``wait_keys``/``read``/``barrier`` (and ``linger`` through them) given NaN or inf polled
    forever: no deadline is ever reached. Now the wait is refused, naming what it was for."""
    for call in (lambda: server.wait_keys(["nothing"], what="nothing", timeout_s=bad),
                 lambda: server.read("nothing", what="nothing", timeout_s=bad),
                 lambda: server.barrier("alone", 2, timeout_s=bad)):
        box = {}

        def run():
            try:
                call()
            except BaseException as exc:  # noqa: BLE001
                box["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), f"a wait given timeout_s={bad} still waits"
        assert isinstance(box.get("error"), RendezvousError), box
        assert f"timeout_s must be a finite number of seconds in [0, " in str(box["error"]), box["error"]
        assert "the wait for " in str(box["error"])


# ---------------------------------------------------------------------------------- round trips


class _CountingStore:
    """A TCPStore client that records the name of every call (each one a round trip to the store)."""

    def __init__(self, store):
        self._store, self.calls = store, []

    def __getattr__(self, name):
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def counted(*args):
            self.calls.append(name)
            return fn(*args)

        return counted


def test_a_delete_costs_two_round_trips_and_a_withdrawing_seed_two_a_record(address, server):
    """A delete looked for a pointer to parts with check, then get, before deleting (three round
    trips), and a closing seed read each of its two records to see it was its own, then deleted it
    that way (five each: ~1-2 ms per publish on a remote store, a Publisher withdrawing a seed on
    every publish). Now a look is one compare_set, and the seed's own read serves the delete; a
    superseded seed still leaves its replacement's records alone."""
    import flashboot
    from flashboot.arena import Arena

    client = Rendezvous.connect(address, TOKEN, timeout_s=5)
    arena = Arena.create(1 << 20, "cpu")
    try:
        server.publish("claim", {"v": 1})
        counting = client.store = _CountingStore(client.store)
        client.delete("claim")
        client.delete("never-there")
        assert counting.calls == ["compare_set", "delete_key"] * 2
        assert not server.has("claim") and not server.has("never-there")  # a look wrote nothing

        a = flashboot.seed(address, arena, "cpu", token=TOKEN, serve_nccl=False, timeout_s=5)
        b = flashboot.seed(address, arena, "cpu", token=TOKEN, serve_nccl=False, timeout_s=5)
        try:
            counting = a.rendezvous.store = _CountingStore(a.rendezvous.store)
            a.close()  # superseded: one look at each record, and both stay b's
            assert counting.calls == ["compare_set"] * 2
            for key in ("seed", "metadata"):
                assert server.read(key, what=key, timeout_s=1).body["generation"] == b.generation
            counting = b.rendezvous.store = _CountingStore(b.rendezvous.store)
            b.close()
            assert counting.calls == ["compare_set", "delete_key"] * 2
            assert not server.has("seed") and not server.has("metadata")
        finally:
            a.close()
            b.close()
    finally:
        arena.close()
        client.close()


def test_delete_if_withdraws_a_record_in_parts_whole_and_only_when_owned(address, server):
    """The one read of :meth:`delete_if` finds the parts of a record over VALUE_PART_BYTES too:
    deleted with it, none left behind; one not owned stays, parts and all."""
    from flashboot.flashclone.rendezvous import VALUE_PART_BYTES

    empty = server.store.num_keys()
    body = {"generation": "g1", "blob": "x" * (VALUE_PART_BYTES + 1000)}
    server.publish("metadata", body)
    assert server.store.num_keys() > empty + 2  # the pointer and two parts at least
    assert server.delete_if("metadata", lambda rec: rec.body["generation"] == "g2") is False
    assert server.read("metadata", what="the metadata", timeout_s=1).body == body
    assert server.delete_if("metadata", lambda rec: rec.body["generation"] == "g1") is True
    assert server.store.num_keys() == empty and server.try_read("metadata") is None
    assert server.delete_if("metadata", lambda rec: True) is False
