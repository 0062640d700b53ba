"""Out-of-band rendezvous for FlashClone: manifests, arena descriptors and a start barrier, over
torch.distributed's ``TCPStore`` (no home-made server).

Who talks to whom:

* the **store** is a plain ``TCPStore``. Host it in a process of its own (``flashboot store
  HOST:PORT``, :class:`~flashboot.flashclone.store.StoreServer`), or use one the caller already
  runs (torchrun's ``MASTER_ADDR:MASTER_PORT`` store, any ``TCPStore(is_master=True)``): then a
  seed that dies takes only its own records with it. Without one, the seed hosts the store
  itself, and its death ends the store for everyone (a clone that already holds every byte keeps
  them and says so in ``report.warnings``);
* the **seed** hosts the store at ``HOST:PORT`` unless one already listens there (then it joins it
  as a client), and publishes its :class:`Manifest` (image key, sizes, per-chunk checksums) and its
  arena descriptor;
* each **clone** connects as a client, reads and checks the seed's manifest, takes a position by
  arrival order (an atomic ``store.add`` counter), publishes its own descriptors, and waits only
  for what it needs (its source's record, a start barrier) -- every wait with a deadline and a
  message naming what was awaited.

Trust. Every record is authenticated with an HMAC-SHA256 keyed by a shared token
(``FLASHBOOT_TOKEN``, or a token file) and bound to its key, so a process without the token
can neither forge a record nor move one to another key: a clone refuses a record that does not
verify before any byte moves. The fields that grant access to memory (arena descriptors, fabric
handles) are also sealed: encrypted with a keystream derived from the token (HMAC-SHA256 in
counter mode over a random per-record nonce), then authenticated (encrypt-then-MAC), so reading
the store without the token does not reveal them.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import RendezvousError, StoreLostError, WaitTimeoutError
from ..fileio import read_regular

ENV_TOKEN = "FLASHBOOT_TOKEN"
ENV_TOKEN_FILE = "FLASHBOOT_TOKEN_FILE"
MIN_TOKEN_BYTES = 16
"""Shorter secrets are refused: the HMAC is only as strong as the token."""
MAX_TOKEN_FILE_BYTES = 1 << 20
"""The most a token file may hold (read whole)."""
DEFAULT_TIMEOUT_S = 60.0
RECORD_VERSION = 1
KEY_PREFIX = "flashboot/v1"

_MAC_LABEL = b"flashboot-record-mac-v1"
_SEAL_LABEL = b"flashboot-record-seal-v1"


# ============================================================================================
# Addresses
# ============================================================================================


def parse_address(address: str, *, any_port: bool = False) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[v6]:PORT"``) -> ``(host, port)``; RendezvousError otherwise.
    ``any_port``: also accept port 0 (a server that lets the kernel pick one)."""
    if not isinstance(address, str) or ":" not in address:
        raise RendezvousError(f"store address must be HOST:PORT, got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise RendezvousError(f"store address {address!r}: port {port_text!r} is not a number") from None
    if not (0 if any_port else 1) <= port < 65536:
        raise RendezvousError(f"store address {address!r}: port {port} is outside "
                              f"{0 if any_port else 1}..65535")
    return host, port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and local runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ============================================================================================
# Token
# ============================================================================================


class Token:
    """The shared secret. Derives separate keys for authentication and sealing; never printed."""

    __slots__ = ("_mac_key", "_seal_key", "source")

    def __init__(self, secret: bytes | str, source: str = "argument"):
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        raw = raw.strip()
        if len(raw) < MIN_TOKEN_BYTES:
            raise RendezvousError(
                f"the token from {source} is {len(raw)} bytes; use at least {MIN_TOKEN_BYTES} "
                "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)"
            )
        self._mac_key = hmac.new(raw, _MAC_LABEL, hashlib.sha256).digest()
        self._seal_key = hmac.new(raw, _SEAL_LABEL, hashlib.sha256).digest()
        self.source = source

    def mac(self, payload: bytes) -> bytes:
        return hmac.new(self._mac_key, payload, hashlib.sha256).digest()

    def keystream(self, nonce: bytes, nbytes: int) -> bytes:
        """HMAC-SHA256(seal_key, nonce || counter) blocks: a PRF in counter mode."""
        out = bytearray()
        counter = 0
        while len(out) < nbytes:
            out += hmac.new(self._seal_key, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
            counter += 1
        return bytes(out[:nbytes])

    def __repr__(self) -> str:
        return f"Token(from {self.source}, secret hidden)"


def resolve_token(token: Token | str | bytes | None = None, token_file: str | os.PathLike | None = None) -> Token:
    """The token to use: ``token``, else the contents of ``token_file``, else ``$FLASHBOOT_TOKEN``,
    else the file named by ``$FLASHBOOT_TOKEN_FILE``. RendezvousError when there is none, the file
    cannot be read, or the secret is shorter than :data:`MIN_TOKEN_BYTES`."""
    if isinstance(token, Token):
        return token
    if token is not None:
        return Token(token, "the token argument")
    path = token_file if token_file is not None else None
    if path is None and os.environ.get(ENV_TOKEN):
        return Token(os.environ[ENV_TOKEN], f"${ENV_TOKEN}")
    if path is None:
        path = os.environ.get(ENV_TOKEN_FILE) or None
    if path is None:
        raise RendezvousError(
            f"no rendezvous token: set ${ENV_TOKEN} (or ${ENV_TOKEN_FILE}) or pass --token-file; the seed and "
            "every clone must share it"
        )
    try:
        secret = read_regular(path, MAX_TOKEN_FILE_BYTES, RendezvousError)
    except OSError as exc:
        raise RendezvousError(f"cannot read token file {os.fspath(path)!r}: {exc.strerror}") from None
    return Token(secret, f"token file {os.fspath(path)!r}")


# ============================================================================================
# Records: authenticated (and partly sealed) JSON
# ============================================================================================


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Record:
    """A verified record: ``body`` (readable by anyone with store access) and ``sealed`` (only with
    the token), both plain JSON values."""

    key: str
    body: dict
    sealed: dict | None = None


def encode_record(token: Token, key: str, body: Mapping[str, Any], sealed: Mapping[str, Any] | None = None) -> bytes:
    """Serialise ``body`` (+ encrypted ``sealed``) with an HMAC over everything, bound to ``key``."""
    nonce = secrets.token_bytes(16)
    sealed_hex = None
    if sealed is not None:
        plain = _canonical(dict(sealed))
        sealed_hex = bytes(a ^ b for a, b in zip(plain, token.keystream(nonce, len(plain)))).hex()
    envelope = {"v": RECORD_VERSION, "key": key, "body": dict(body), "sealed": sealed_hex, "nonce": nonce.hex()}
    envelope["mac"] = token.mac(_canonical(envelope)).hex()
    return _canonical(envelope)


def decode_record(token: Token, key: str, raw: bytes, where: str = "the store") -> Record:
    """Verify and decode a record read from ``key``. RendezvousError for anything that is not a
    record written under this key with this token (a planted or replayed record, a wrong token)."""
    try:
        envelope = json.loads(raw)
        mac = bytes.fromhex(envelope.pop("mac"))
        if not isinstance(envelope, dict) or envelope.get("v") != RECORD_VERSION:
            raise ValueError("unknown record version")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise RendezvousError(f"{key!r} in {where} is not a FlashBoot record ({type(exc).__name__}: {exc})") from None
    if not hmac.compare_digest(mac, token.mac(_canonical(envelope))):
        raise RendezvousError(
            f"{key!r} in {where} fails authentication: it was written with a different token, or planted by "
            f"someone without one; check that every participant shares the same token (ours from {token.source})"
        )
    if envelope.get("key") != key:
        raise RendezvousError(f"{key!r} in {where} holds a record written for {envelope.get('key')!r} (moved or replayed)")
    # Authentic from here on, but still checked: a participant with the token may have a bug.
    sealed = None
    try:
        if envelope.get("sealed") is not None:
            cipher = bytes.fromhex(envelope["sealed"])
            plain = bytes(a ^ b for a, b in zip(cipher, token.keystream(bytes.fromhex(envelope["nonce"]), len(cipher))))
            sealed = json.loads(plain)
            if not isinstance(sealed, dict):
                raise TypeError(f"the sealed part is {type(sealed).__name__}, not an object")
        body = envelope["body"]
        if not isinstance(body, dict):
            raise TypeError(f"the body is {type(body).__name__}, not an object")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise RendezvousError(f"{key!r} in {where} is an authentic but malformed record "
                              f"({type(exc).__name__}: {exc})") from None
    return Record(key, body, sealed)


# ============================================================================================
# Manifest
# ============================================================================================

_HEX16 = re.compile(r"[0-9a-f]{16}")
DEFAULT_CHECKSUM_CHUNK_BYTES = 64 << 20
"""Checksum granularity when a seed computes the table itself (a bare arena without an image)."""


@dataclass(frozen=True)
class Manifest:
    """What is being replicated: a clone must agree with it before any byte moves.

    ``nbytes``: the bytes replicated (the image); ``arena_nbytes``: the arena capacity (the image
    rounded up to the allocation granularity, so seed and clone agree exactly); ``checksums``:
    one 64-bit digest (:func:`flashboot.kernels.checksum.chunk_checksums`) per
    ``checksum_chunk_bytes`` of the image; ``key``: the image key (model, revision, layout,
    dtypes, with its digest) or None for a bare arena.
    """

    nbytes: int
    arena_nbytes: int
    checksum_chunk_bytes: int
    checksums: tuple[int, ...]
    key: dict | None = None

    def __post_init__(self) -> None:
        for name in ("nbytes", "arena_nbytes", "checksum_chunk_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise RendezvousError(f"manifest {name} must be a positive int, got {v!r}")
        if self.arena_nbytes < self.nbytes:
            raise RendezvousError(f"manifest arena_nbytes {self.arena_nbytes:,} is smaller than nbytes {self.nbytes:,}")
        want = -(-self.nbytes // self.checksum_chunk_bytes)
        if len(self.checksums) != want:
            raise RendezvousError(f"manifest has {len(self.checksums)} checksums; {self.nbytes:,} bytes in chunks of "
                                  f"{self.checksum_chunk_bytes:,} need {want}")
        object.__setattr__(self, "checksums", tuple(int(c) for c in self.checksums))

    @property
    def key_digest(self) -> str | None:
        return None if self.key is None else self.key.get("digest")

    def to_dict(self) -> dict:
        return {"nbytes": self.nbytes, "arena_nbytes": self.arena_nbytes,
                "checksum_chunk_bytes": self.checksum_chunk_bytes,
                "checksums": [f"{c:016x}" for c in self.checksums], "key": self.key}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Manifest":
        """Inverse of :meth:`to_dict`; RendezvousError naming the field that is missing or mistyped
        (ints exactly ints, checksums 16 hex digits each, key null or an object with a digest)."""
        if not isinstance(d, Mapping):
            raise RendezvousError(f"malformed manifest: must be an object, found {type(d).__name__}")
        missing = [k for k in ("nbytes", "arena_nbytes", "checksum_chunk_bytes", "checksums") if k not in d]
        if missing:
            raise RendezvousError(f"malformed manifest: missing {missing}")
        for name in ("nbytes", "arena_nbytes", "checksum_chunk_bytes"):
            if type(d[name]) is not int:
                raise RendezvousError(f"malformed manifest: {name} must be an int, found {d[name]!r}")
        sums = d["checksums"]
        if type(sums) is not list or not all(type(c) is str and _HEX16.fullmatch(c) for c in sums):
            raise RendezvousError(f"malformed manifest: checksums must be a list of 16-hex-digit strings, "
                                  f"found {str(sums)[:200]}")
        key = d.get("key")
        if key is not None and not (isinstance(key, dict) and type(key.get("digest")) is str):
            raise RendezvousError(f"malformed manifest: key must be null or an object with a digest, found "
                                  f"{str(key)[:200]}")
        return cls(d["nbytes"], d["arena_nbytes"], d["checksum_chunk_bytes"], tuple(int(c, 16) for c in sums), key)

    @property
    def digest(self) -> str:
        """SHA-256 of the whole manifest: equal digests mean the same bytes are expected."""
        return "sha256:" + hashlib.sha256(_canonical(self.to_dict())).hexdigest()

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of checksum chunk ``index``."""
        start = index * self.checksum_chunk_bytes
        return start, min(self.checksum_chunk_bytes, self.nbytes - start)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata, arena_nbytes: int | None = None) -> "Manifest":
        """From an image's :class:`~flashboot.layouts.format.ImageMetadata` (key + checksum table)."""
        nbytes = int(metadata.image_nbytes)
        cap = arena_nbytes if arena_nbytes is not None else -(-nbytes // (2 << 20)) * (2 << 20)
        return cls(nbytes, int(cap), int(metadata.checksums.chunk_bytes), tuple(metadata.checksums.digests),
                   metadata.key.to_dict())

    @classmethod
    def of_arena(cls, arena, nbytes: int | None = None, chunk_bytes: int = DEFAULT_CHECKSUM_CHUNK_BYTES,
                 key: dict | None = None) -> "Manifest":
        """Checksum the first ``nbytes`` (default: all) of ``arena`` (on its device) into a manifest."""
        from flashboot.kernels.checksum import chunk_checksums

        n = arena.nbytes if nbytes is None else int(nbytes)
        return cls(n, arena.nbytes, int(chunk_bytes), tuple(chunk_checksums(arena.span(0, n), int(chunk_bytes))), key)

    # -- comparison -------------------------------------------------------------------------
    def mismatches(self, expected: "Manifest | Mapping[str, Any] | Any") -> list[tuple[str, Any, Any]]:
        """``(field, expected, published)`` for every field ``expected`` states that differs.

        ``expected`` may be a Manifest (everything compared), an ImageMetadata (key, nbytes and
        checksums), an ImageKey, or a dict naming any of ``nbytes``, ``arena_nbytes``,
        ``key_digest`` and ImageKey fields (a partial key: the model and layout the caller wants).
        """
        if isinstance(expected, Manifest):
            want: dict[str, Any] = {"nbytes": expected.nbytes, "arena_nbytes": expected.arena_nbytes,
                                    "key_digest": expected.key_digest,
                                    "checksums": (expected.checksum_chunk_bytes, expected.checksums)}
        elif hasattr(expected, "image_nbytes") and hasattr(expected, "checksums"):  # ImageMetadata
            want = {"nbytes": int(expected.image_nbytes), "key_digest": expected.key.digest,
                    "checksums": (int(expected.checksums.chunk_bytes), tuple(expected.checksums.digests))}
        elif hasattr(expected, "fields") and hasattr(expected, "digest"):  # ImageKey
            want = {"key_digest": expected.digest}
        elif isinstance(expected, Mapping):
            want = dict(expected)
        else:
            raise RendezvousError(f"cannot compare a manifest with {type(expected).__name__}")
        have = {"nbytes": self.nbytes, "arena_nbytes": self.arena_nbytes, "key_digest": self.key_digest,
                "checksums": (self.checksum_chunk_bytes, self.checksums)}
        out = []
        for name, value in want.items():
            if name in have:
                found = have[name]
            elif self.key is not None and name in self.key:
                found = self.key[name]
            elif self.key is None:
                found = None
            else:
                raise RendezvousError(f"expected manifest names an unknown field {name!r}")
            if isinstance(value, tuple) and name != "checksums":
                value = list(value)
            if value != found:
                if name == "checksums":
                    value, found = _describe_checksums(*value), _describe_checksums(*found)
                out.append((name, value, found))
        return out

    def require(self, expected: Any, where: str) -> None:
        """Raise RendezvousError listing the mismatches with ``expected`` (see :meth:`mismatches`)."""
        if expected is None:
            return
        bad = self.mismatches(expected)
        if bad:
            lines = "; ".join(f"{k}: expected {e!r}, {where} has {f!r}" for k, e, f in bad)
            raise RendezvousError(f"manifest mismatch with {where} (another model, layout or size), refused before "
                                  f"any byte moved: {lines}")

    def describe(self) -> str:
        what = "bare arena" if self.key is None else f"{self.key.get('model_id')} ({(self.key_digest or '')[:19]})"
        return f"{what}, {self.nbytes:,} bytes in a {self.arena_nbytes:,}-byte arena, {len(self.checksums)} checksums"


def _describe_checksums(chunk_bytes: int, digests: tuple[int, ...]) -> str:
    blob = b"".join(int(d).to_bytes(8, "little") for d in digests)
    return f"{len(digests)} chunks of {chunk_bytes:,} B, sha256 {hashlib.sha256(blob).hexdigest()[:12]}"


# ============================================================================================
# The store connection
# ============================================================================================


_TCPSTORE_VALIDATE, _TCPSTORE_PING = 0, 13
"""c10d's ``QueryType`` codes (TCPStoreBackend.hpp, the same in torch 2.13 and 2.14.1, checked by
test_rendezvous against the installed torch): a client's first query is VALIDATE with
:data:`_TCPSTORE_MAGIC`, then PING with a nonce that the store sends back."""
_TCPSTORE_MAGIC = 0x3C85F7CE


def host_tcpstore(host: str, port: int, timeout: datetime.timedelta):
    """A ``TCPStore(is_master=True)`` for ``host:port``. An IP literal of this machine is listened
    on alone (TCPStore binds every interface itself, so a store asked for at 127.0.0.1 was
    reachable from the whole network): the socket is bound here and handed over
    (``master_listen_fd``, torch >= 2.4; the store closes it when it goes). A name listens on
    every interface, as TCPStore does: a machine's own name resolves to 127.0.1.1 on Debian and
    Ubuntu, and a NAT or cluster name to an address no interface has, so binding what it resolves
    to made the store unreachable. OSError EADDRINUSE when something listens there, EADDRNOTAVAIL
    when ``host`` is not an address of this machine (the caller may then join a store there)."""
    from torch.distributed import TCPStore

    literal = _ip_literal(host)
    if literal is None:
        if not _names_this_machine(host):
            raise OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address of this machine")
        return TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    if literal.is_unspecified:  # 0.0.0.0 / ::: every interface is what was asked for
        return TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_NUMERICHOST)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own listener does
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(host, sock.getsockname()[1], is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.fileno())
    except BaseException:
        if sock.fileno() != -1:
            sock.close()
        raise
    sock.detach()  # the store owns the fd now and closes it with its server
    return store


def _ip_literal(host: str):
    import ipaddress

    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve(host: str, address: str | None = None) -> list:
    """``getaddrinfo`` of ``host``; RendezvousError naming it when it does not resolve. Left to
    TCPStore, a name that resolves nowhere was hosted (it then waited its whole timeout and
    printed its C++ frames) or waited for until the deadline, as if no store were up yet."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousError(f"store host {host!r}{f' (in {address})' if address else ''} does not resolve: "
                              f"{exc.strerror or exc}") from None


def _names_this_machine(host: str) -> bool:
    """Whether ``host`` resolves to at least one address this machine can bind; RendezvousError
    when it resolves nowhere."""
    infos = _resolve(host)
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


WAIT_POLL_S = 0.02
"""The longest sleep between two checks of a key being waited for (a check is one round trip)."""

WAIT_POLL_SHARE = 0.05
"""A wait sleeps at most this share of the time it has waited so far (and 1 ms at least), so a key
that appears is seen within 5 % of the wait's length: a clone waiting 30 ms for its seed's handle
loses at most 1.5 ms, where doubling sleeps (1, 2, 4, 8, 16 ms) could add 16."""


def wait_poll_delay(waited_s: float) -> float:
    """The sleep before the next check of a wait that has lasted ``waited_s``."""
    return min(WAIT_POLL_S, max(0.001, WAIT_POLL_SHARE * waited_s))

CALLS_JOIN_S = 1.0
"""How long :meth:`Rendezvous.close` waits for its store thread to finish its last call and end."""

JOIN_ATTEMPTS = 5
"""How many times a join asks TCPStore's client to connect to a store that answered the pre-flight
(a store that keeps refusing after that is not busy: it is refusing)."""


def _await_store(host: str, port: int, deadline: float, address: str) -> None:
    """Speak TCPStore's own opening (validate, then ping) on a plain socket until a store answers it
    or ``deadline`` passes. torch's client constructor waits for the ping's answer without a bound
    and logs every retry with its C++ frames; a store that answers here is then joined at once.

    Raises WaitTimeoutError when nothing listens, or something listens and does not answer, by the
    deadline; RendezvousError at once when it answers something that is not a store's answer."""
    nonce = os.getpid() & 0xFFFFFFFF
    hello = struct.pack("=BIBI", _TCPSTORE_VALIDATE, _TCPSTORE_MAGIC, _TCPSTORE_PING, nonce)
    delay, last = 0.01, ""
    while True:
        try:
            answer = _store_hello(host, port, hello, deadline)
        except OSError as exc:
            last = exc.strerror or str(exc)
        else:
            if answer == struct.pack("=I", nonce):
                return
            if answer:
                raise RendezvousError(
                    f"what listens at {address} is not a rendezvous store: it answered TCPStore's ping with "
                    f"{answer.hex()} instead of the nonce {nonce:#x}; is {address} the store's address?")
            last = ("something listens there but did not answer TCPStore's ping" if answer is None else
                    "something listens there and closed the connection without answering TCPStore's ping")
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(
                f"no rendezvous store answered at {address} ({last}); is the store (`flashboot store HOST:PORT`) "
                "or the seed that hosts it (`flashboot seed DIR --store HOST:PORT`) running there?"
            )
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.2)


def _store_hello(host: str, port: int, hello: bytes, deadline: float) -> bytes | None:
    """Connect, send ``hello`` and read the 4-byte answer by ``deadline``: the answer, b"" when the
    peer closed (or reset) the connection first, None when it stayed silent. OSError when the
    connection cannot be made."""
    with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))) as s:
        answer = b""
        try:
            s.sendall(hello)
            while len(answer) < 4:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                part = s.recv(4 - len(answer))
                if not part:
                    break
                answer += part
        except socket.timeout:
            return None
        except ConnectionError:
            pass
        return answer


class Rendezvous:
    """A connection to the rendezvous store, scoped to one ``namespace``, that reads and writes
    authenticated records. Build one with :meth:`connect`."""

    def __init__(self, store, address: str, token: Token, namespace: str, is_server: bool, timeout_s: float):
        self.store = store
        self.address = address
        self.token = token
        self.namespace = namespace
        self.is_server = is_server
        self.timeout_s = float(timeout_s)
        self._closed = False
        self.bounded = False
        """Bound every store call by ``timeout_s`` (a TCPStore call blocks forever when the link to
        the store goes down mid-call): set by transports that run across hosts."""
        self._broken: str | None = None
        self._calls = None
        self._calls_thread: threading.Thread | None = None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str, token: Token | str | bytes | None = None, *, token_file=None,
                namespace: str = "default", host: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Rendezvous":
        """Connect to the store at ``address`` (``HOST:PORT``).

        ``host=True``: host the store in this process unless one already listens there (then join
        it as a client); the store then lives only as long as this process. Otherwise wait up to
        ``timeout_s`` for a store to appear: one hosted by ``flashboot store``
        (:class:`~flashboot.flashclone.store.StoreServer`) or any ``TCPStore(is_master=True)``, such
        as torchrun's at ``MASTER_ADDR:MASTER_PORT``. The token is resolved first (RendezvousError
        without one), so nothing is exchanged without it. Joining is bounded by ``timeout_s``:
        WaitTimeoutError names the address when nothing there answers TCPStore's handshake in time,
        RendezvousError when what answers is not a store.
        """
        tok = resolve_token(token, token_file)
        if not namespace or "/" in namespace:
            raise RendezvousError(f"namespace must be a non-empty name without '/', got {namespace!r}")
        h, port = parse_address(address)
        _resolve(h, address)  # at once: an unresolvable name is no store that is not up yet
        from torch.distributed import DistError, TCPStore

        started = time.monotonic()
        deadline = started + float(timeout_s)
        td = datetime.timedelta(seconds=float(timeout_s))
        not_ours = False
        if host:
            try:
                store = host_tcpstore(h, port, td)
                return cls(store, address, tok, namespace, True, timeout_s)
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    raise RendezvousError(f"cannot host a store at {address}: {exc.strerror or exc}") from None
                # someone already serves there, or the address is another host's: join it as a client
                not_ours = exc.errno == errno.EADDRNOTAVAIL
            except DistError as exc:
                if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc):
                    raise RendezvousError(f"cannot host a store at {address}: {str(exc).splitlines()[0]}") from None
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            try:
                _await_store(h, port, deadline, address)
            except WaitTimeoutError as exc:
                if not not_ours:
                    raise
                # a NAT, ClusterIP or docker-published address: nobody hosts unless told where
                raise WaitTimeoutError(f"{exc}; {h} is not an address of this machine (EADDRNOTAVAIL), so this "
                                       f"process did not host the store there: to host it here, use "
                                       f"0.0.0.0:{port} (every interface) or an address of this machine, and "
                                       f"give the others {address}") from None
            remaining = max(0.5, deadline - time.monotonic())
            try:
                store = TCPStore(h, port, is_master=False, timeout=datetime.timedelta(seconds=remaining))
                break
            except DistError as exc:
                # the store answered the pre-flight a moment ago, so a refused or unanswered connect
                # now is a store too busy to accept (torch's own retries give up early, its backoff
                # longer than what is left): ask again while the bound allows, a few times
                if attempt == JOIN_ATTEMPTS or time.monotonic() >= deadline:
                    raise RendezvousError(f"cannot join the store at {address} ({attempt} attempt(s) in "
                                          f"{time.monotonic() - started:.1f} s of {float(timeout_s):g}): "
                                          f"{str(exc).splitlines()[0]}") from None
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return cls(store, address, tok, namespace, False, timeout_s)

    # -- keys ------------------------------------------------------------------------------------
    def full_key(self, key: str) -> str:
        return f"{KEY_PREFIX}/{self.namespace}/{key}"

    def _store_call(self, what: str, fn, *args):
        from torch.distributed import DistError

        if self._closed:
            raise RendezvousError(f"rendezvous at {self.address} is closed")
        self._check_broken(what)
        try:
            return self._bounded_call(what, fn, args) if self.bounded else fn(*args)
        except DistError as exc:
            raise self._lost(what, exc) from None

    @property
    def lost(self) -> str | None:
        """Why the store connection broke (the call and the error), or None while it works."""
        return self._broken

    def _check_broken(self, what: str) -> None:
        if self._broken is not None:
            raise StoreLostError(f"the store at {self.address} stopped answering earlier ({self._broken}); "
                                 f"not {what}")

    def _lost(self, what: str, exc: BaseException) -> StoreLostError:
        """Remember that the store is gone (later calls fail at once, a dead store does not
        answer a retry either) and name it."""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._broken = f"{what}: {reason}"
        return StoreLostError(f"lost the rendezvous store at {self.address} while {what}: {reason}")

    def _bounded_call(self, what: str, fn, args):
        """``fn(*args)`` on this connection's store thread, waited for at most ``timeout_s``."""
        import queue

        if self._calls is None:
            self._calls = queue.SimpleQueue()
            self._calls_thread = threading.Thread(target=self._serve_calls, args=(self._calls,),
                                                  name="flashboot-store-calls", daemon=True)
            self._calls_thread.start()
        box: dict = {}
        done = threading.Event()
        self._calls.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            self._broken = f"{what}: no answer within {self.timeout_s:g} s"
            raise WaitTimeoutError(f"the store at {self.address} did not answer within {self.timeout_s:g} s while "
                                   f"{what} (is the link to it down?)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    @staticmethod
    def _serve_calls(calls) -> None:
        while True:
            fn, args, box, done = calls.get()
            if fn is None:
                return
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()
                fn = args = box = done = None  # the last call's bound method kept the store's connection open

    # -- records -----------------------------------------------------------------------------
    def publish(self, key: str, body: Mapping[str, Any], sealed: Mapping[str, Any] | None = None) -> None:
        """Write an authenticated record (``sealed`` encrypted) under ``key``."""
        full = self.full_key(key)
        self._store_call(f"publishing {key!r}", self.store.set, full, encode_record(self.token, full, body, sealed))

    def agree(self, key: str, body: Mapping[str, Any]) -> Record:
        """Publish ``body`` under ``key`` unless a record is there already (an atomic
        compare-and-set), and return the record that holds: ours, or the first writer's, verified.
        RendezvousError when what is there is not an authentic record (planted garbage)."""
        full = self.full_key(key)
        raw = self._store_call(f"agreeing on {key!r}", self.store.compare_set, full, "",
                               encode_record(self.token, full, body))
        return decode_record(self.token, full, raw, f"the store at {self.address}")

    def read(self, key: str, *, what: str, timeout_s: float | None = None) -> Record:
        """Wait up to ``timeout_s`` (default: the connection's) for ``key`` and verify it.

        WaitTimeoutError names ``what`` and the key; RendezvousError for a record that fails
        authentication."""
        full = self.full_key(key)
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        self.wait_keys([key], what=what, timeout_s=t)
        raw = self._store_call(f"reading {key!r}", self.store.get, full)
        return decode_record(self.token, full, raw, f"the store at {self.address}")

    def try_read(self, key: str) -> Record | None:
        """The verified record under ``key``, or None when there is none yet."""
        full = self.full_key(key)
        if not self._store_call(f"checking {key!r}", self.store.check, [full]):
            return None
        raw = self._store_call(f"reading {key!r}", self.store.get, full)
        return decode_record(self.token, full, raw, f"the store at {self.address}")

    def wait_keys(self, keys: Iterable[str], *, what: str, timeout_s: float | None = None) -> None:
        """Wait up to ``timeout_s`` until every one of ``keys`` is in the store (checked every
        :func:`wait_poll_delay`); WaitTimeoutError names ``what``."""
        keys = list(keys)
        full = [self.full_key(k) for k in keys]
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        deadline = start + max(t, 0.001)
        # polled, not store.wait: a signal handler (SIGTERM in `flashboot clone`) runs during the
        # sleep, where store.wait held it off until the wait ended, and short store.wait slices
        # log two c10d warnings each
        while not self._store_call(f"waiting for {what}", self.store.check, full):
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(f"waited {t:g} s for {what} (store keys {keys} at {self.address})")
            time.sleep(min(wait_poll_delay(time.monotonic() - start), left))

    def has(self, key: str) -> bool:
        return bool(self._store_call(f"checking {key!r}", self.store.check, [self.full_key(key)]))

    def delete(self, key: str) -> None:
        self._store_call(f"deleting {key!r}", self.store.delete_key, self.full_key(key))

    # -- counters and barriers ---------------------------------------------------------------------
    def add(self, key: str, amount: int = 1) -> int:
        """Atomic ``store.add``: the counter's value after adding ``amount`` (0 reads it)."""
        return int(self._store_call(f"counting {key!r}", self.store.add, self.full_key(key), amount))

    def barrier(self, name: str, count: int, *, timeout_s: float | None = None) -> float:
        """Block until ``count`` participants have entered barrier ``name``; returns ms waited.

        The last to arrive publishes a release key; everyone waits for it with a deadline, and a
        WaitTimeoutError says how many had arrived."""
        t0 = time.perf_counter()
        arrived = self.add(f"barrier/{name}/count", 1)
        if arrived == count:
            self.publish(f"barrier/{name}/go", {"count": count})
        try:
            self.wait_keys([f"barrier/{name}/go"], what=f"the start barrier {name!r} ({count} participants)",
                           timeout_s=timeout_s)
        except WaitTimeoutError as exc:
            now = self.add(f"barrier/{name}/count", 0)
            raise WaitTimeoutError(f"{exc}; {now} of {count} had arrived") from None
        self.read(f"barrier/{name}/go", what=f"barrier {name!r}", timeout_s=1.0)  # authenticate the release
        return (time.perf_counter() - t0) * 1e3

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the connection (a hosting process stops serving when its last reference goes)."""
        self._closed = True
        thread = self._calls_thread
        if self._calls is not None and self._broken is None:
            self._calls.put((None, (), {}, None))  # the store thread ends (a stuck one stays, a daemon)
            if thread is not threading.current_thread():
                # briefly, so the connection it holds is gone when close() returns (a soak counted its fds)
                thread.join(CALLS_JOIN_S)
        self._calls, self._calls_thread = None, None
        self.store = None

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "hosting" if self.is_server else "client of"
        return f"Rendezvous({role} {self.address}, namespace {self.namespace!r})"


__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_TOKEN", "ENV_TOKEN_FILE", "MIN_TOKEN_BYTES", "Manifest", "Record", "Rendezvous",
    "StoreLostError", "Token", "decode_record", "encode_record", "free_port", "parse_address", "resolve_token",
]
