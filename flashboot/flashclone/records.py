"""Authenticated records for FlashClone's rendezvous store: the shared token, and JSON records MACed
by it and bound to their key, with the fields that grant access to memory sealed.

Every record is authenticated with an HMAC-SHA256 keyed by a shared token (``FLASHBOOT_TOKEN``, or
a token file) and bound to its key, so a process without the token can neither forge a record nor
move one to another key. The fields that grant access to memory (arena descriptors, fabric
handles) are also sealed: encrypted with a keystream derived from the token (HMAC-SHA256 in
counter mode over a random per-record nonce), then authenticated (encrypt-then-MAC), so reading
the store without the token does not reveal them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import RendezvousError
from ..fileio import read_regular

ENV_TOKEN = "FLASHBOOT_TOKEN"
ENV_TOKEN_FILE = "FLASHBOOT_TOKEN_FILE"
MIN_TOKEN_BYTES = 16
"""Shorter secrets are refused: the HMAC is only as strong as the token."""
MAX_TOKEN_FILE_BYTES = 1 << 20
"""The most a token file may hold (read whole)."""
RECORD_VERSION = 1

_MAC_LABEL = b"flashboot-record-mac-v1"
_SEAL_LABEL = b"flashboot-record-seal-v1"


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


def canonical_json(obj: Any) -> bytes:
    """The one JSON encoding that is MACed and digested: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class ForeignRecordError(RendezvousError):
    """A well-formed record that this participant cannot verify: written with another token (another
    job that uses the same namespace of the store, or a participant given another token), planted by
    someone without one, or of another record version. ``claimed``: its body as written, unverified
    (for an error message only: nothing in it is to be trusted)."""

    def __init__(self, message: str, claimed: dict | None = None):
        super().__init__(message)
        self.claimed = claimed


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
        plain = canonical_json(dict(sealed))
        sealed_hex = bytes(a ^ b for a, b in zip(plain, token.keystream(nonce, len(plain)))).hex()
    envelope = {"v": RECORD_VERSION, "key": key, "body": dict(body), "sealed": sealed_hex, "nonce": nonce.hex()}
    envelope["mac"] = token.mac(canonical_json(envelope)).hex()
    return canonical_json(envelope)


def decode_record(token: Token, key: str, raw: bytes, where: str = "the store") -> Record:
    """Verify and decode a record read from ``key``. RendezvousError for anything that is not a
    record written under this key with this token (a planted or replayed record, a wrong token)."""
    try:
        envelope = json.loads(raw)
        mac = bytes.fromhex(envelope.pop("mac"))
        if not isinstance(envelope, dict) or type(envelope.get("v")) is not int:
            raise ValueError("unknown record version")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise RendezvousError(f"{key!r} in {where} is not a FlashBoot record ({type(exc).__name__}: {exc})") from None
    claimed = envelope.get("body") if isinstance(envelope.get("body"), dict) else None
    if envelope["v"] != RECORD_VERSION:  # a seed or clone of another FlashBoot: said, not taken as garbage
        raise ForeignRecordError(f"{key!r} in {where} is a record of version {envelope['v']}; this FlashBoot "
                                 f"reads record version {RECORD_VERSION}: seed, clones and holder must run one "
                                 "FlashBoot version", claimed)
    if not hmac.compare_digest(mac, token.mac(canonical_json(envelope))):
        raise ForeignRecordError(
            f"{key!r} in {where} fails authentication: it is signed with a different token than ours (from "
            f"{token.source}): another job uses the same namespace of this store (give each job its own name, "
            "--name), or a participant of this job was given another token, or someone without one planted "
            "it; every seed and clone of one job must share one token", claimed)
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


__all__ = ["ENV_TOKEN", "ENV_TOKEN_FILE", "ForeignRecordError", "MIN_TOKEN_BYTES", "Record", "Token", "canonical_json",
           "decode_record", "encode_record", "resolve_token"]
