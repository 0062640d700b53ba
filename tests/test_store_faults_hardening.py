"""The rendezvous store misbehaving as a cluster meets it: a store that goes silent mid-run, a store
name whose lookup hangs, ... . Each test checks what the caller gets (the error, its words) and
what its process still holds afterwards; none asserts a time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from flashboot.flashclone.rendezvous import Rendezvous, StoreSilentError

from _clone_helpers import TOKEN, stop_process, store_in_its_own_process

pytestmark = pytest.mark.timeout(120)


def _names_asked(dns) -> list[str]:
    """The names the fake name server (``_DNS``) was asked for, once it is stopped."""
    dns.kill()
    return [x.split()[1] for x in dns.communicate()[0].splitlines() if x.startswith("A ")]


def _sockets_to(port: int) -> list[int]:
    """This process's fds of TCP sockets connected to ``port``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            try:
                peer = s.getpeername()  # a Unix socket's is a path (a str), not (host, port)
            except OSError:
                continue
            if isinstance(peer, tuple) and peer[1] == port:
                out.append(int(fd))
    return out


def _store_threads(before=()) -> list[str]:
    """Store threads of this process that were not there ``before`` (other tests' may linger)."""
    return [t.name for t in threading.enumerate() if t.name == "flashboot-store-calls" and t not in before]


@pytest.fixture
def store_process():
    """A store hosted by a process of its own (which a test may stop); yields (address, process)."""
    with store_in_its_own_process() as hosted:
        yield hosted


def test_a_store_gone_silent_leaves_no_thread_or_socket_behind_after_close(store_process, monkeypatch):
    """The store stops answering mid-call (its process stopped; a cut link alike): the call ends
    with StoreSilentError by the timeout. Its store thread stayed blocked in the TCPStore call and
    kept the connection open for good (close() could only queue its end), so an engine that
    retries gathered a thread and a socket per try. Now the connection is shut down: after
    close() nothing of it is left, try after try."""
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    address, proc = store_process
    port = int(address.rsplit(":", 1)[1])
    before = set(threading.enumerate())
    assert _sockets_to(port) == []
    for attempt in range(3):
        r = Rendezvous.connect(address, TOKEN, timeout_s=1.0)
        assert r.add("k", 1) == attempt + 1
        assert _store_threads(before) == ["flashboot-store-calls"] and len(_sockets_to(port)) >= 1
        stop_process(proc.pid)
        with pytest.raises(StoreSilentError, match=f"the store at {address} did not answer within 1 s while "
                                                   "checking 'x'"):
            r.has("x")
        r.close()
        del r
        # checked while the store is still stopped: a store that answers again unblocks the call
        assert _store_threads(before) == [], f"attempt {attempt}"
        assert _sockets_to(port) == [], f"attempt {attempt}"
        os.kill(proc.pid, signal.SIGCONT)


# -- a store given by name, and a name server that misbehaves ---------------------------------

_DNS = r"""
import socket, struct, sys, threading, time
delay, ip = float(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 53))
print("ready", flush=True)
def answer(data, addr):
    i, labels = 12, []
    while data[i]:
        labels.append(data[i + 1:i + 1 + data[i]].decode(errors="replace"))
        i += data[i] + 1
    qtype = struct.unpack(">H", data[i + 1:i + 3])[0]
    if qtype == 1:
        print("A", ".".join(labels), flush=True)
    time.sleep(delay)
    rr = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(ip) if qtype == 1 else b""
    s.sendto(struct.pack(">HHHHHH", data[0] << 8 | data[1], 0x8180, 1, int(bool(rr)), 0, 0) + data[12:i + 5] + rr,
             addr)
while True:
    data, addr = s.recvfrom(512)
    threading.Thread(target=answer, args=(data, addr), daemon=True).start()
"""
"""``DELAY IP``: a name server on 127.0.0.1:53 that answers every A query with IP after DELAY s
(nothing for other types) and prints ``A NAME`` for each A query."""

_JOIN = """
import json, sys
from flashboot.errors import FlashBootError
from flashboot.flashclone.rendezvous import Rendezvous
out = {}
try:
    r = Rendezvous.connect(sys.argv[1], host=sys.argv[3] == "host", timeout_s=float(sys.argv[2]))
    r.publish("x", {"a": 1})
    out["read"] = r.read("x", what="our record").body
except FlashBootError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out), flush=True)
"""
"""``ADDRESS TIMEOUT_S join|host``: connect (or host) at ADDRESS, write and read a record back."""


@pytest.fixture
def named_host():
    """A network namespace whose /etc/resolv.conf names 127.0.0.1 (where a test runs a name
    server) and waits up to 20 s for an answer: yields (Hosts, index)."""
    import shutil

    from flashboot.benchmarks.netns import Hosts, cannot_create

    why = cannot_create()
    if why:
        pytest.skip(f"cannot create network namespaces here: {why}")
    hosts = Hosts(1, tag="sf", subnet="10.217.0")
    etc = f"/etc/netns/{hosts.names[0]}"
    try:
        os.makedirs(etc, exist_ok=True)
        with open(f"{etc}/resolv.conf", "w") as f:
            f.write("nameserver 127.0.0.1\noptions timeout:20 attempts:1\n")
        yield hosts, 0
    finally:
        shutil.rmtree(etc, ignore_errors=True)
        hosts.close()


def _run(hosts, i: int, code: str, *args, timeout_s: float = 60):
    import json

    p = hosts.popen(i, [sys.executable, "-c", code, *map(str, args)],
                    env=dict(os.environ, FLASHBOOT_TOKEN=TOKEN, TORCH_CPP_LOG_LEVEL="ERROR"))
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"no answer within {timeout_s} s:\n{out}\n{err[-3000:]}") from None
    lines = [x for x in out.splitlines() if x.startswith("{")]
    assert lines, f"rc {p.returncode}:\n{out}\n{err[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("mode", ["join", "host"])
def test_a_store_name_whose_name_server_does_not_answer_ends_by_the_timeout_naming_the_host(named_host, mode):
    """Nothing answers at the name server (down, or its packets dropped): the lookup of the store's
    name waited for the resolver's own timeout (20 s here, 5 s a try and server by default), past
    the 2 s the caller gave, then said "does not resolve". It now ends by the timeout with a
    WaitTimeoutError naming the host, the time waited and where to look, joining or hosting."""
    hosts, i = named_host
    dns = hosts.popen(i, [sys.executable, "-c", _DNS, "600", "127.0.0.1"])  # takes the queries, answers none
    try:
        assert dns.stdout.readline().startswith("ready")
        r = _run(hosts, i, _JOIN, "store.fbtest.example:29000", 2, mode)
    finally:
        dns.kill()
        dns.communicate()
    assert r.get("error") == "WaitTimeoutError", r
    assert "store host 'store.fbtest.example' (in store.fbtest.example:29000)" in r["message"], r
    assert "did not resolve within 2.0 s" in r["message"] and "/etc/resolv.conf" in r["message"], r


def test_a_store_name_is_looked_up_once_per_join(named_host):
    """A slow name server (0.5 s an answer): the store's name was looked up by the check that it
    resolves, again by every pre-flight try and again by TCPStore, each costing the delay (a
    clone given 5 s joined after 6.8 s with a 1 s server). Now the join looks it up once and
    connects to the addresses it found."""
    hosts, i = named_host
    procs = []
    try:
        dns = hosts.popen(i, [sys.executable, "-c", _DNS, "0.5", "127.0.0.1"])
        procs.append(dns)
        assert dns.stdout.readline().startswith("ready")
        store = hosts.popen(i, [sys.executable, "-c", "import time\nfrom flashboot.flashclone.rendezvous import "
                                f"Rendezvous\nr = Rendezvous.connect('127.0.0.1:29000', {TOKEN!r}, host=True)\n"
                                "print('ready', flush=True)\ntime.sleep(300)"])
        procs.append(store)
        assert store.stdout.readline().startswith("ready")
        r = _run(hosts, i, _JOIN, "store.fbtest.example:29000", 20, "join")
        assert r == {"read": {"a": 1}}, r
        assert _names_asked(dns) == ["store.fbtest.example"]
    finally:
        for p in procs:
            p.kill()
            p.communicate()


# -- records larger than one store message -----------------------------------------------------


def _moe_metadata(experts: int) -> dict:
    """Image metadata as a tensor-parallel rank of a large MoE model lists it: every tensor,
    each expert's three matrices and their scales in each of 61 layers."""
    tensors = {}
    offset = 0
    for layer in range(61):
        for e in range(experts):
            for m in ("gate_proj", "up_proj", "down_proj"):
                for suffix, shape, dtype in ((".weight", [256, 896], "float8_e4m3fn"),
                                             (".weight_scale_inv", [2, 7], "float32")):
                    nbytes = shape[0] * shape[1] * (1 if dtype.startswith("float8") else 4)
                    tensors[f"model.layers.{layer}.mlp.experts.{e}.{m}{suffix}"] = {
                        "offset": offset, "nbytes": nbytes, "shape": shape, "stride": [shape[1], 1],
                        "dtype": dtype, "region": "experts"}
                    offset += nbytes
    return {"generation": "g1", "metadata": {"tensors": tensors}}


def test_a_record_over_the_stores_message_limit_is_written_and_read_whole():
    """torch's TCPStore server (libuv) drops a client that sends more than 8 MiB at once: a seed
    whose image metadata is that large (a large MoE model's tensors, ~16 MB here) failed with
    StoreLostError "lost the rendezvous store ... Connection reset by peer", and every later
    call failed with it. Such a record now goes in parts: read back whole by another client;
    written again or deleted, it leaves no part behind in the store."""
    from flashboot.flashclone.store import serve_store

    server = serve_store("127.0.0.1:0")
    writer = Rendezvous.connect(server.address, TOKEN, timeout_s=20)
    reader = Rendezvous.connect(server.address, TOKEN, timeout_s=20)
    try:
        body = _moe_metadata(256)
        empty = writer.store.num_keys()
        writer.publish("metadata", body)
        assert writer.lost is None
        assert reader.read("metadata", what="the seed's metadata").body == body
        keys = writer.store.num_keys()
        body["generation"] = "g2"  # a seed restarted: its record again, another generation
        writer.publish("metadata", body)
        assert reader.try_read("metadata").body == body
        assert writer.store.num_keys() == keys  # the first one's parts went
        writer.delete("metadata")
        assert writer.store.num_keys() == empty and reader.try_read("metadata") is None
        assert writer.lost is None and reader.lost is None
    finally:
        writer.close()
        reader.close()
        server.close()


_BROADCAST_CLONE = """
import hashlib, json, sys, flashboot
r = flashboot.clone(sys.argv[1], "cpu", "star", transport="nccl", verify=True, timeout_s=20)
print(json.dumps({"source": r.report.source, "verified": r.report.verified,
                  "sha256": hashlib.sha256(r.arena.bytes().numpy()[:r.report.nbytes].tobytes()).hexdigest()}))
r.close()
"""


def test_a_broadcast_clone_does_not_look_the_stores_name_up_again(named_host):
    """A broadcast (gloo) clone listens on the address it reaches the store from: it looked the
    store's name up again for that, with no bound (a name server that stopped answering since the
    clone joined held it for the resolver's timeouts). It now takes the address it joined."""
    from _clone_helpers import SEED_SCRIPT, pattern

    hosts, i = named_host
    here = hosts.address(i)
    procs = []
    try:
        dns = hosts.popen(i, [sys.executable, "-c", _DNS, "0", here])
        procs.append(dns)
        assert dns.stdout.readline().startswith("ready")
        seed = hosts.popen(i, [sys.executable, "-c", SEED_SCRIPT, f"{here}:29000", str(2 << 20), "5", "20"],
                           env=dict(os.environ, FLASHBOOT_TOKEN=TOKEN))
        procs.append(seed)
        assert seed.stdout.readline().startswith("ready")
        r = _run(hosts, i, _BROADCAST_CLONE, "store.fbtest.example:29000")
        import hashlib

        assert r["verified"] and r["source"] == "seed (broadcast)", r
        assert r["sha256"] == hashlib.sha256(pattern(2 << 20, 5).tobytes()).hexdigest(), r
        assert _names_asked(dns) == ["store.fbtest.example"]
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_key_over_the_stores_limit_is_refused_by_name_and_the_connection_kept():
    """A name longer than the store takes (the libuv TCPStore drops a client that sends a key over
    8 KiB) was a StoreLostError, "lost the rendezvous store ... Connection reset by peer", and
    every later call of the connection failed. It is now refused by its length, before it is
    sent, and the connection works on."""
    from flashboot.errors import RendezvousError
    from flashboot.flashclone.store import serve_store

    server = serve_store("127.0.0.1:0")
    r = Rendezvous.connect(server.address, TOKEN, namespace="n" * 9000, timeout_s=20)
    ok = Rendezvous.connect(server.address, TOKEN, timeout_s=20)
    try:
        with pytest.raises(RendezvousError, match=r"is 9,018 bytes long \(namespace 9,000\); the store takes keys "
                                                  r"of at most 8,128: use a shorter name"):
            r.publish("seed", {"a": 1})
        with pytest.raises(RendezvousError, match="use a shorter name"):
            ok.publish("held/" + "m" * 9000, {"a": 1})
        ok.publish("seed", {"a": 2})
        assert ok.read("seed", what="the seed").body == {"a": 2} and ok.lost is None
    finally:
        r.close()
        ok.close()
        server.close()


def test_hosting_where_the_port_is_held_by_a_silent_program_names_the_taken_port():
    """A seed asked to host the store where another program holds the port (one that accepts and
    never answers) waited its timeout, then asked whether the store, or the seed that hosts it,
    was running there: what it had itself been told to do. It now says the port is taken by
    something that is no store, and how to find it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        from flashboot.errors import WaitTimeoutError

        with pytest.raises(WaitTimeoutError) as info:
            Rendezvous.connect(address, TOKEN, host=True, timeout_s=1)
    message = str(info.value)
    assert message.startswith(f"cannot host a store at {address}: the port is taken (EADDRINUSE)"), message
    assert "something listens there but did not answer TCPStore's ping, 1 s" in message, message
    assert f"ss -ltnp 'sport = :{address.rsplit(':', 1)[1]}'" in message and "is the store" not in message, message
