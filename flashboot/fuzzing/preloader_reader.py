"""The preloader's socket as a reader: requests (and the fds that come with them) sent to a real
daemon, every reply checked to name a FlashBoot error."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
from pathlib import Path

from ..errors import FlashBootError
from .campaign import LeakProbe, Reader
from .image_readers import _fresh_copy
from .mutate import mutate_document


class _Preloader:
    """A real served-load daemon (host backend) over the seed image, and a real host arena to
    copy into; requests are handed to its connection handler over a socketpair."""

    def __init__(self, image_dir: Path, work: Path):
        import threading

        from flashboot.arena import Arena
        from flashboot.flashload.server import PreloadServer
        from flashboot.flashload.shm import rank_source
        from flashboot.flashload.staging import PreloadConfig

        self.image_dir = _fresh_copy(image_dir, work / "served")
        self.logs: list[str] = []
        shutil.rmtree(work / "shm", ignore_errors=True)
        cfg = PreloadConfig(str(self.image_dir), ranks=[0], shm_dir=str(work / "shm"), serve=True, threads=1)
        self.server = PreloadServer(cfg, log=self.logs.append)
        self.thread = threading.Thread(target=self.server.run, name="fuzz-preloader", daemon=True)
        self.thread.start()
        res = self.server.residents[0]
        if not res.event.wait(120) or res.error is not None:
            raise FlashBootError(f"the fuzzed preloader did not stage rank 0: {res.error}")
        self.source = rank_source(self.image_dir, 0)
        self.arena = Arena.create(self.source.nbytes, "cpu")
        self.desc = self.arena.export()
        self.other = Arena.create(self.source.nbytes // 2 or 4096, "cpu")  # an arena of another size
        self.other_desc = self.other.export()

    def close(self) -> None:
        self.server.stop.set()
        self.thread.join(timeout=30)
        self.arena.close()
        self.other.close()


_FD_KINDS = ("arena", "arena", "arena", "none", "other-size", "pipe", "devnull", "socket", "two", "many", "image",
             "short")
"""What a fuzzed request carries: the arena's own fd, none, another (smaller) arena's memfd, a pipe,
/dev/null, a socket, two arenas' fds, SCM_MAX_FD fds, the image file, a memfd named like the
arena's segment but shorter (the size check is all that stands between it and a SIGBUS)."""


def preloader_reader(image_dir: Path, work: Path) -> tuple[Reader, _Preloader]:
    """``PreloadServer._handle`` on mutated requests with the right, no, or the wrong fds
    attached (another arena's memfd, a pipe, /dev/null, a socket, the image file, too many).
    The reply must be a FlashBootError by name (or ok), and every received fd closed."""
    from flashboot.fdshare import SCM_MAX_FD

    p = _Preloader(image_dir, work)
    load = {"op": "load", "rank": 0, "descriptor": p.desc.to_dict(), "nbytes": p.source.nbytes,
            "metadata_sha256": p.source.metadata_sha256, "timeout_s": 5, "pci_bus_id": None}
    # fds_follow: the hand-over's stream of later batches (FdStream), fed the same fds as the first message
    seeds = [bytes([k]) + json.dumps(req).encode() for req in (load, {**load, "fds_follow": True})
             for k in range(len(_FD_KINDS))]
    seeds.append(bytes([0]) + json.dumps({"op": "status"}).encode())
    from flashboot import errors as _errors

    def mutate(seed: bytes, rng: random.Random) -> bytes:
        kind = rng.randrange(len(_FD_KINDS)) if rng.random() < 0.5 else seed[0]
        body = seed[1:] if rng.random() < 0.05 else mutate_document(seed[1:], rng)
        return bytes([kind]) + body

    def fds_for(kind: str) -> tuple[list[int], list[int]]:
        """(fds to send, fds this harness opened for it and closes after)"""
        if kind == "arena":
            return list(p.desc.fds), []
        if kind == "other-size":
            return list(p.other_desc.fds), []
        if kind == "none":
            return [], []
        if kind == "pipe":
            r, w = os.pipe()
            return [r], [r, w]
        if kind == "devnull":
            fd = os.open(os.devnull, os.O_RDWR)
            return [fd], [fd]
        if kind == "socket":
            a, b = socket.socketpair()
            fa, fb = a.detach(), b.detach()
            return [fa], [fa, fb]
        if kind == "image":
            fd = os.open(p.source.path, os.O_RDONLY)
            return [fd], [fd]
        if kind == "short":
            from flashboot.arena import _memfd_name

            fd = os.memfd_create(_memfd_name(p.desc.arena_id, 0), os.MFD_CLOEXEC)
            os.ftruncate(fd, max(4096, p.desc.nbytes // 2))
            return [fd], [fd]
        if kind == "two":
            return list(p.desc.fds) + list(p.other_desc.fds), []
        fd = os.open(os.devnull, os.O_RDONLY)
        return [fd] * SCM_MAX_FD, [fd]

    def feed(data: bytes):
        from flashboot.fdshare import send_fds

        data = data or b"\0"
        # No client can send more in one SOCK_SEQPACKET message (EMSGSIZE at its end, wmem_default ~208 KiB).
        kind, msg = _FD_KINDS[data[0] % len(_FD_KINDS)], data[1:_MAX_SEND_BYTES + 1]
        fds, mine = fds_for(kind)
        engine, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if fds:
                send_fds(engine, fds, msg)
            else:
                engine.send(msg)
            engine.shutdown(socket.SHUT_WR)  # a client that said all it will say
            p.server._handle(daemon)  # closes daemon, and every fd it received
            engine.settimeout(5)
            try:
                reply = engine.recv(1 << 20)
            except OSError as exc:
                return ("no reply", str(exc))
        finally:
            engine.close()
            for fd in mine:
                os.close(fd)
        if not reply:
            return ("empty", "")
        reply = json.loads(reply)
        if reply.get("ok") is True:
            return ("ok", reply)
        cls = getattr(_errors, str(reply.get("error")), None)
        if isinstance(cls, type) and issubclass(cls, FlashBootError):
            raise cls.__new__(cls)  # refused, by name
        raise _UnnamedReply(f"reply names {reply.get('error')}: {str(reply.get('message'))[:300]}")

    def check(result, data: bytes) -> str | None:
        what, reply = result
        if what == "ok" or (what == "empty" and data[1:] == b""):
            return None  # an empty message is a closed connection: nothing to answer
        return f"{what} to a {len(data) - 1}-byte request: {reply}"

    return Reader("preloader request + fds (_handle)", seeds, feed, check, mutate, LeakProbe("/memfd:", 64)), p


_MAX_SEND_BYTES = 200_000


class _UnnamedReply(Exception):
    """The daemon answered with an error that is no FlashBootError (a crash of the contract)."""
