"""What both ends of the served-load socket share: who is at the other end (the kernel's
credentials), and errors, which travel as JSON and are raised again with their class. The
engine's client imports this, not the daemon's module."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from .. import errors as _errors
from ..errors import (
    FlashBootError,
)


PROTOCOL_VERSION = 2
"""The served-load protocol this FlashBoot speaks, named in every request and reply
(``"protocol"``), so that an error between an engine and a preloader of different FlashBoot
versions (a daemon that runs for weeks while engines are upgraded) names both. 1: the protocol
before versions were named (a peer naming none), whose engines also asked ``attach`` then
``copy`` until 2026-12-01 and whose host arenas were not sealed until then."""

REMOVED_OPS = {"attach": "an arena attached first, then copied on 'copy' (prepare() before 2026-12-01)",
               "copy": "the copy into an arena attached before (prepare() before 2026-12-01)"}
"""Requests of older engines that this protocol no longer has: named as such, not as unknown."""


def protocol_of(message: dict) -> int:
    """The protocol a request or reply names; 1 for one naming none (an older FlashBoot's)."""
    value = message.get("protocol", 1)
    return value if type(value) is int else 1


def protocol_note(message: dict, peer: str, us: str) -> str:
    """'' when ``message`` (from ``peer``) names this protocol; else what differs, for an error."""
    theirs = protocol_of(message)
    if theirs == PROTOCOL_VERSION:
        return ""
    how = ("names none: an older FlashBoot" if "protocol" not in message else
           "older" if theirs < PROTOCOL_VERSION else "newer")
    return (f" [{peer} speaks served-load protocol {theirs} ({how}), {us} {PROTOCOL_VERSION}: run engines and "
            "preloader of one FlashBoot version]")


def _error_payload(exc: BaseException) -> dict:
    attrs = {k: v for k, v in vars(exc).items() if isinstance(v, (int, float, str, bool, type(None)))}
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "attrs": attrs,
            "protocol": PROTOCOL_VERSION}


def _raise_remote(reply: dict, who: str) -> None:
    cls = getattr(_errors, reply.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, FlashBootError)):
        cls = FlashBootError
    exc = cls.__new__(cls)
    note = protocol_note(reply, "the preloader", "this engine")
    Exception.__init__(exc, f"{who}: {reply.get('message', 'failed')}{note}")
    exc.__dict__.update(reply.get("attrs") or {})
    raise exc


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""The peer's supplementary groups (Linux >= 4.13); Python names it only from 3.13 on some builds."""


@dataclass(frozen=True)
class PeerCredentials:
    """Who is at the other end of a Unix socket, as the kernel recorded it at connect()."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connected peer's pid, uid, gid (``SO_PEERCRED``) and supplementary groups
    (``SO_PEERGROUPS``, empty where the kernel lacks it)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
        groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    except OSError:  # ENOPROTOOPT (old kernel) or ERANGE (more than 256 groups): the primary gid still counts
        groups = ()
    return PeerCredentials(pid, uid, gid, tuple(groups))
