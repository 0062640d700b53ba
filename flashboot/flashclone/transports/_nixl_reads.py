"""The READ loop the NIXL transport runs for every schedule (chain, star, ring).

Each participant publishes its *progress*: how many bytes of its own steps, taken in plan order,
it holds as a prefix (a counter in the store, raised per piece). For a chain that is the count of
leading bytes of the image; for a ring member its own shard first, then round by round what it
gathered. A piece is READ as soon as its source's progress covers it (``need``), so every link of
a chain or ring runs at once, at most :data:`DEPTH` READs outstanding (fewer on a slow link, so
that one lands within the timeout: :class:`_Flow`).

A source that fails (its ``failed`` status, NIXL's disconnect error, a probe READ of a stalled
source that fails, a READ still in progress or progress that has not moved for ``timeout_s``) is
handed to the schedule's ``on_failed``: a chain re-attaches upstream, a ring member loads the rest
from its own copy of the image, otherwise the clone fails naming the step.
Every wait is bounded by ``timeout_s``. A store lost mid-transfer ends only what needs it: our
progress is no longer announced (said in the warnings), and a source whose progress cannot be
read is failed like one that stalled; sources that hold everything (the seed) are read on.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from ... import _cuda
from ...errors import FlashBootError, StoreLostError
from ...schedulers import HOST

READ_BYTES = int(os.environ.get("FLASHBOOT_NIXL_READ_BYTES", str(64 << 20)))
"""Largest single READ: a step of the plan is split into pieces of at most this (and never across a
segment), so several are outstanding and a successor can follow piece by piece
(``$FLASHBOOT_NIXL_READ_BYTES`` overrides it)."""
DEPTH = int(os.environ.get("FLASHBOOT_NIXL_DEPTH", "8"))
"""READs outstanding at once, at most (``$FLASHBOOT_NIXL_DEPTH``)."""
POLL_S = float(os.environ["FLASHBOOT_NIXL_POLL_S"]) if os.environ.get("FLASHBOOT_NIXL_POLL_S") else None
"""Sleep between polls of outstanding READs when none completed (default 1 ms on the host, 0.2 ms on
GPUs; ``$FLASHBOOT_NIXL_POLL_S``)."""
STATUS_EVERY_S = 0.05
"""A source's status is read when its progress has not moved for this long."""
PROBE_S = 2.0
"""How long a liveness probe of a stalled source may stay in progress before we stop waiting for it
(the source is then taken as alive but slow; the wait's own deadline still applies)."""
HELD_EVERY_S = 0.001
"""Our progress is published at most this often (and at the end): each is a store call."""


class ReadFailed(FlashBootError):
    """A READ failed on the NIXL side (the message is NIXL's)."""


@dataclass
class Piece:
    """One READ: bytes ``[offset, offset + nbytes)`` (within one segment) from participant ``src``.

    ``pos``: where the piece sits in our progress (default: its offset, as in a chain); ``need``:
    the progress ``src`` must have published before it is READ (default: its end)."""

    step: int
    src: int
    offset: int
    nbytes: int
    pos: int = -1
    need: int = -1

    def __post_init__(self) -> None:
        if self.pos < 0:
            self.pos = self.offset
        if self.need < 0:
            self.need = self.offset + self.nbytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def pieces(steps, segment_bytes: int, read_bytes: int | None = None,
           place: Callable[[Any], tuple[int, int]] | None = None) -> deque:
    """The plan's steps cut into READs of at most ``read_bytes`` (default :data:`READ_BYTES`) that
    never cross a segment. ``place(step)`` gives (our progress, the source's progress) at the step's
    first byte; by default both are its offset (a chain)."""
    read_bytes = read_bytes or READ_BYTES
    out = deque()
    for s in steps:
        pos0, need0 = place(s) if place is not None else (s.offset, s.offset)
        o, end = s.offset, s.offset + s.nbytes
        while o < end:
            seg_end = (o // segment_bytes + 1) * segment_bytes
            n = min(end, seg_end, o + read_bytes) - o
            out.append(Piece(s.id, s.src, o, n, pos=pos0 + o - s.offset, need=need0 + o - s.offset + n))
            o += n
    return out


def progress_starts(steps) -> dict[int, int]:
    """Step id -> the participant's progress at the step's first byte (its steps in id order)."""
    out, at = {}, 0
    for s in sorted(steps, key=lambda s: s.id):
        out[s.id] = at
        at += s.nbytes
    return out


@dataclass
class PeerKeys:
    """Where a schedule keeps each participant's records in the store, and what it calls them."""

    member: Callable[[int], str]
    held: Callable[[int], str]
    status: Callable[[int], str]
    who: Callable[[int], str]
    joined: Callable[[int], str] | None = None
    """Where a chain clone announces itself before it waits for its own sources (see
    :func:`~flashboot.flashclone.sources.await_member`); None: wait for the member record alone."""


class Peers:
    """The participants a NIXL reader READs from. ``fixed``: participants whose record is known and
    who hold everything from the start (a chain's seed): participant -> (record, who)."""

    def __init__(self, rdv, agent, manifest, keys: PeerKeys, timeout_s: float, detail: dict,
                 fixed: dict[int, tuple[dict, str]] | None = None):
        self.rdv, self.agent, self.manifest, self.keys = rdv, agent, manifest, keys
        self.timeout_s, self.detail = timeout_s, detail
        self.fixed = fixed or {}
        self.opened: dict[int, tuple[str, dict, str]] = {}
        """participant -> (remote agent name, its NIXL record, who)."""
        self.held: dict[int, int] = {}
        self._moved: dict[int, float] = {}

    def who(self, p: int) -> str:
        return self.keys.who(p)

    def open(self, p: int) -> tuple[str, dict, str]:
        from ...errors import RendezvousError
        from .nixl import check_record

        if p in self.opened:
            return self.opened[p]
        t0 = time.perf_counter()
        if p in self.fixed:
            record, who = self.fixed[p]
        else:
            if self.keys.joined is not None:  # a dead upstream clone is told from a slow one, as with mapped arenas
                from ..sources import await_member

                rec = await_member(self.rdv, self.keys.member(p), self.keys.joined(p), self.keys.status(p),
                                   self.who(p), self.timeout_s)
            else:
                rec = self.rdv.read(self.keys.member(p), what=f"the NIXL record of {self.who(p)}",
                                    timeout_s=self.timeout_s)
            if rec.body.get("manifest_digest") != self.manifest.digest:
                raise RendezvousError(f"{self.who(p)} holds another image (manifest {rec.body.get('manifest_digest')}, "
                                      f"ours {self.manifest.digest}); refusing to read from it")
            record, who = rec.sealed.get("nixl"), f"{self.who(p)} (pid {rec.body.get('pid')} on {rec.body.get('host')})"
        self.detail["records_ms"] = self.detail.get("records_ms", 0.0) + (time.perf_counter() - t0) * 1e3
        check_record(record, self.manifest, who)
        t1 = time.perf_counter()
        name = self.agent.add_remote(record, who)
        self.detail["add_remote_ms"] = self.detail.get("add_remote_ms", 0.0) + (time.perf_counter() - t1) * 1e3
        self.opened[p] = (name, record, who)
        self.held[p] = record["nbytes"] if p in self.fixed else 0
        return self.opened[p]

    def drop(self, p: int) -> None:
        if p in self.opened:
            self.agent.remove_remote(self.opened.pop(p)[0])

    def refresh(self, p: int) -> None:
        """Re-read ``p``'s progress; ReadFailed when it failed or left (checked when it has not moved
        on for :data:`STATUS_EVERY_S`: two more store calls, then a probe READ)."""
        if p in self.fixed:
            return
        held = self.rdv.add(self.keys.held(p), 0)
        now = time.monotonic()
        if held != self.held.get(p):
            self.held[p], self._moved[p] = held, now
            return
        if now - self._moved.get(p, 0.0) < STATUS_EVERY_S:
            return
        self._moved[p] = now
        status = self.rdv.try_read(self.keys.status(p))
        if status is not None and status.body.get("state") == "failed":
            raise ReadFailed(f"it failed: {status.body.get('error', '?')}")
        if self.rdv.has(self.keys.status(p) + "/left"):
            raise ReadFailed("it left before we finished reading from it")
        self.probe(p)

    def probe(self, p: int) -> None:
        """Is ``p`` still there? A killed process publishes no status, so READ its first byte (into
        the agent's scratch buffer); a gone peer fails it at once."""
        name, record, _ = self.opened[p]
        base, devid, mem = self.agent.scratch()
        ticket = self.agent.read([(base, 1, devid)], [(record["base"], 1, record["devid"])], mem, record["mem"], name)
        deadline = time.monotonic() + PROBE_S
        try:
            while self.agent.state(ticket) != "DONE" and time.monotonic() < deadline:
                time.sleep(0.001)
        except ReadFailed as exc:
            raise ReadFailed(f"it is gone ({exc})") from None
        finally:
            self.agent.release(ticket)


class _Flow:
    """How many bytes each source may have in flight, so that a READ of it lands within half the
    timeout at the rate its READs have landed so far (at most :data:`DEPTH` READs; one to start).

    A READ is taken as stalled when nothing of its source landed for ``timeout_s``. UCX interleaves
    the READs in flight, so none of a window completes before the whole window has come: a star of
    16 clones of one seed on 1 GbE (8 x 64 MiB at ~8 MB/s each: 65 s) failed every healthy clone
    at the default 60 s, as would any link slower than the window over the timeout."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.last: dict[int, float] = {}
        """source -> when a READ of it last landed."""
        self._inflight: dict[int, list[int]] = {}  # source -> [READs, bytes] in flight
        self._got: dict[int, int] = {}  # source -> bytes landed
        self._busy: dict[int, float] = {}  # source -> seconds with READs in flight, before _since
        self._since: dict[int, float] = {}  # source -> when its READs in flight began

    def room(self, src: int, nbytes: int) -> bool:
        reads, inflight = self._inflight.get(src, (0, 0))
        if reads == 0:
            return True
        if reads >= DEPTH:
            return False
        busy = self._busy.get(src, 0.0) + time.monotonic() - self._since[src]
        if src not in self.last or busy <= 0:
            return False  # one READ until its rate is known
        return inflight + nbytes <= self._got[src] / busy * self.timeout_s / 2

    def posted(self, src: int, nbytes: int) -> None:
        n = self._inflight.setdefault(src, [0, 0])
        if n[0] == 0:
            self._since[src] = time.monotonic()
        n[0] += 1
        n[1] += nbytes

    def landed(self, src: int, nbytes: int) -> None:
        now = time.monotonic()
        self.last[src] = now
        self._got[src] = self._got.get(src, 0) + nbytes
        n = self._inflight[src]
        n[0] -= 1
        n[1] -= nbytes
        if n[0] == 0:
            self._busy[src] = self._busy.get(src, 0.0) + now - self._since.pop(src)

    def forget(self, src: int) -> None:
        """``src`` failed: its READs in flight were put back."""
        self._inflight.pop(src, None)
        self._since.pop(src, None)


@dataclass
class Reader:
    """What the READ loop needs besides the pieces: who we are and how the schedule reacts."""

    rdv: Any
    dev: Any
    position: int
    what: str
    """Us, for messages (``clone #2``, ``ring member 1``)."""
    held_key: str
    timeout_s: float
    hook: Callable | None
    on_failed: Callable[[Piece, str, deque], None]
    """Called with the failed source's first piece, NIXL's reason and the pending pieces (the
    failed source's in-flight ones already put back): re-route them, or raise naming the step."""
    local_copy: Callable[[Piece], None] | None = None
    """Copies a piece re-routed to :data:`~flashboot.schedulers.HOST` (our own copy of the image)."""
    held: int = 0
    """Our progress before the loop (a ring member's own shard)."""
    warnings: list[str] = field(default_factory=list)
    """Where a store lost mid-transfer is said (the report's warnings)."""


@_cuda.keeps_context
def read_pieces(r: Reader, agent, peers: Peers, arena, todo: deque) -> set[int]:
    """READ every piece of ``todo`` into ``arena``, each as soon as its source's progress covers it,
    at most :data:`DEPTH` outstanding; raise our published progress as pieces land. Returns the
    participants read from."""
    rdv, timeout_s = r.rdv, r.timeout_s
    if r.dev.is_cuda:
        _cuda.use_device(r.dev.index)
    poll_s = POLL_S if POLL_S is not None else (0.0002 if r.dev.is_cuda else 0.001)
    devid = r.dev.index if r.dev.is_cuda else 0
    mem = "VRAM" if r.dev.is_cuda else "DRAM"
    base = arena.ptr
    done: dict[int, int] = {}  # pos -> end of landed pieces not yet counted in `held`
    held = published = r.held
    published_at = 0.0
    inflight: dict[int, tuple[Piece, int, float]] = {}
    used: set[int] = set()
    waiting_since: float | None = None
    last_refresh = 0.0
    total = r.held + sum(p.nbytes for p in todo)
    announce = True  # our progress, while the store takes it
    flow = _Flow(timeout_s)

    def fail(piece: Piece, why: str) -> None:
        for key, (p, ticket, _) in list(inflight.items()):
            if p.src == piece.src:
                agent.release(ticket)
                del inflight[key]
                todo.appendleft(p)
        flow.forget(piece.src)
        r.on_failed(piece, why, todo)

    while todo or inflight:
        progressed = False
        # issue: in order, while the source's progress covers the piece
        while todo and len(inflight) < DEPTH:
            piece = todo[0]
            if piece.src == HOST:  # re-routed to our own copy of the image
                todo.popleft()
                r.local_copy(piece)
                done[piece.pos] = piece.pos + piece.nbytes
                progressed = True
                continue
            if not flow.room(piece.src, piece.nbytes):
                break
            if peers.held.get(piece.src, 0) < piece.need:
                now = time.monotonic()
                if now - last_refresh >= poll_s:
                    last_refresh = now
                    try:
                        peers.refresh(piece.src)
                    except ReadFailed as exc:
                        fail(piece, str(exc))
                        break
                    except StoreLostError as exc:  # its progress cannot be read: as good as gone
                        fail(piece, f"its progress cannot be read any more ({exc})")
                        break
                if peers.held.get(piece.src, 0) < piece.need:
                    waiting_since = waiting_since or now
                    if now - waiting_since > timeout_s:
                        # a source whose host vanished publishes nothing more and its probe READ stays
                        # in progress: failed, like a stalled READ (re-attached, or the step named)
                        waiting_since = None
                        fail(piece, f"its progress stayed at {peers.held.get(piece.src, 0):,} bytes for "
                                    f"{timeout_s:g} s, short of the {piece.need:,} this step needs ({held:,} of "
                                    f"{total:,} bytes in place)")
                    break
            waiting_since = None
            todo.popleft()
            if r.hook is not None:
                r.hook(piece)
            name, record, _ = peers.opened[piece.src]
            try:
                ticket = agent.read([(base + piece.offset, piece.nbytes, devid)],
                                    [(record["base"] + piece.offset, piece.nbytes, record["devid"])],
                                    mem, record["mem"], name)
            except ReadFailed as exc:  # not posted: the piece goes back to be re-routed with the rest
                todo.appendleft(piece)
                fail(piece, str(exc))
                continue
            inflight[piece.pos] = (piece, ticket, time.monotonic())
            flow.posted(piece.src, piece.nbytes)
            used.add(piece.src)
            progressed = True
        # complete
        for key, (piece, ticket, t_post) in list(inflight.items()):
            try:
                state = agent.state(ticket)
            except ReadFailed as exc:
                fail(piece, str(exc))
                break
            if state == "DONE":
                agent.release(ticket)
                del inflight[key]
                done[piece.pos] = piece.pos + piece.nbytes
                flow.landed(piece.src, piece.nbytes)
                progressed = True
            elif time.monotonic() - max(t_post, flow.last.get(piece.src, 0.0)) > timeout_s:
                # NIXL never fails a READ of a host that vanished (its link down, a partition): a
                # stalled source is a failed one, so a chain re-attaches upstream and a ring member
                # loads from its own copy, where raising here failed a clone whose seed was reachable
                fail(piece, f"its READ was still in progress after {timeout_s:g} s (the link to it or the source "
                            f"stalled; {held:,} of {total:,} bytes in place)")
                break
        while held in done:
            held = done.pop(held)
        now = time.monotonic()
        if held > published and announce and (now - published_at >= HELD_EVERY_S or not (todo or inflight)):
            try:
                rdv.add(r.held_key, held - published)
            except StoreLostError as exc:
                # only those who would follow us need it (they find us stalled and re-attach): the
                # bytes still come from sources that need no store, where this failed a clone of a
                # seed it could reach
                announce = False
                r.warnings.append(f"{exc}; {r.what} went on reading without announcing its progress (announced "
                                  f"{published:,} of {total:,} bytes)")
            published, published_at = held, now
        if not progressed:
            time.sleep(poll_s)
    return used
