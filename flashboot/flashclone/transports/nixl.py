"""Any host: one-sided NIXL READs (UCX backend) of the source's registered arena.

The seed (``seed(..., nixl=True)``) registers every segment of its arena with a NIXL agent and
publishes the agent's metadata and the segments, sealed with the token, in its rendezvous record.
A clone creates its own agent while it connects (off the critical path, like the driver
warm-up), registers its own arena, adds its source's agent and READs the image in pieces of at
most :data:`READ_BYTES`, several outstanding at once. Chain, star and ring follow the plan's
sources; each participant publishes its progress (a counter in the store, raised per piece: the
bytes of its steps it holds as a prefix, in plan order), and a successor READs a piece as soon as
its source's progress covers it, so all links run at once (see ``_nixl_reads``). A ring member
loads its own shard from its own copy of the image first (:func:`ring_member`).

Every wait is bounded: NIXL leaves a READ in progress forever when the link goes down, so a READ
outstanding longer than ``timeout_s`` fails its source, naming the byte range and the bytes in
place. A source that dies surfaces as a NIXL error (``NIXL_ERR_REMOTE_DISCONNECT``) or as its
``failed`` status. Either way the clone then re-attaches upstream (chain), loads the rest from its
own copy of the image (ring) or fails naming the step.

Optional: ``pip install flashboot[nixl]`` (the ``nixl-cu13`` wheel; UCX is bundled). Across
network namespaces on one machine UCX would copy through ``cma`` and never touch the link: set
``UCX_TLS=tcp`` there. On GPU machines keep ``cuda_copy`` (and ``cuda_ipc``) in ``UCX_TLS``.
"""

from __future__ import annotations

import base64
import importlib
import itertools
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections import deque
from typing import Any

import numpy as np

from ... import _cuda
from ...errors import CapabilityError, FlashBootError, RendezvousError, StoreLostError, WaitTimeoutError
from ...memory import Device
from ._nixl_reads import DEPTH, READ_BYTES, PeerKeys, Peers, ReadFailed, Reader, pieces, read_pieces  # noqa: F401 - the knobs live there
from .registry import Seen, Transport, register_transport

EXTRA = "pip install flashboot[nixl]"
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "2M", "UCX_TCP_RX_SEG_SIZE": "2M"}
"""Measured on the 2-core CPU machine between namespaces: 2 MB TCP segments took NIXL from
0.64-0.75 to 1.5-1.8 GB/s. Set only where the environment does not say otherwise."""

OPEN_TRIES = 3
"""Attempts to load a chain source's agent before it is taken as gone and its upstream is read instead."""
OPEN_RETRY_S = 1.0
"""A failed attempt that took longer than this is not tried again (see :data:`OPEN_TRIES`)."""
SETTLE_S = 5.0
"""How long :meth:`Agent.close` waits for outstanding READs to finish or fail before destroying the
agent (which aborts them). A killed peer fails them at once; a silent one only when UCX gives up."""
stats = {"agents": 0, "registrations": 0, "reads_posted": 0, "remotes_loaded": 0}
"""Counters for this process (tests assert what did and did not happen: no registration before the
token checked out, no READ before the metadata matched the manifest, how often a peer was tried)."""


def nixl_module():
    """The installed NIXL Python module; CapabilityError naming the extra when there is none."""
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "nixl_agent"):
            if not os.environ.get("NIXL_LOG_LEVEL"):
                # NIXL logs INFO lines to stdout, which would mix with `flashboot clone --json -`
                logging.getLogger("nixl").setLevel(logging.WARNING)
            return mod
    raise CapabilityError(f"transport nixl needs NIXL, which is not installed in this Python "
                          f"(tried modules {', '.join(_MODULES)}): {EXTRA}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _mem_type(dev: Device) -> str:
    return "VRAM" if dev.is_cuda else "DRAM"


def segment_ranges(arena) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each segment of ``arena``."""
    seg, n = arena.segment_bytes, arena.nbytes
    return [(i * seg, min(seg, n - i * seg)) for i in range(arena.segments)]


class Agent:
    """One NIXL agent (UCX backend) and the arenas it registered; :meth:`close` releases both.

    NIXL's progress thread (which answers peers' READs over TCP and progresses ours) is created by
    its Python API with no pause between polls: 0.7 of a core while idle, measured, which starves a
    2-core machine. The agent is created with a :data:`PROGRESS_DELAY_US` pause instead (idle cost
    ~1.5 % of a core). One lock serialises our calls into the agent.

    :meth:`close` settles every READ still outstanding, then destroys the agent (its progress thread
    and UCX endpoints), so nothing native touches a registered arena once its owner unmaps it: found
    in CI, a clone whose source was killed mid-READ unmapped its arena under UCX's thread (SIGSEGV)."""

    def __init__(self, name: str, timeout_s: float | None = None):
        mod = nixl_module()
        for k, v in _UCX_DEFAULTS.items():
            os.environ.setdefault(k, v)
        self._lock = threading.Lock()
        t0 = time.perf_counter()
        try:
            self._agent = _create_agent(mod, name)
            _add_ucx(self._agent, timeout_s)
        except Exception as exc:  # noqa: BLE001 - NIXL raises bare exceptions; named here
            raise CapabilityError(f"NIXL agent {name!r} could not start (UCX backend): {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise CapabilityError(f"NIXL agent {name!r} has no UCX backend (plugins: {self._agent.get_plugin_list()})")
        self.create_ms = (time.perf_counter() - t0) * 1e3
        self.name = name
        self._registered: list = []
        self._live: dict[int, Any] = {}
        """ticket -> NIXL transfer handle not yet released (a READ posted, in progress, failed or aborting)."""
        self._peer_of: dict[int, str] = {}
        """ticket -> the remote agent its READ targets (while the ticket is live)."""
        self._leaving: set[str] = set()
        """Dropped peers whose metadata stays loaded until their last READ is released (see :meth:`remove_remote`)."""
        self._tickets = itertools.count()
        self._scratch: np.ndarray | None = None
        self.remotes: dict[str, str] = {}
        """Remote agent name -> who (for messages)."""
        stats["agents"] += 1

    @_cuda.keeps_context
    def register(self, arena) -> dict:
        """Register every segment of ``arena``; returns the record a peer needs to READ it."""
        t0 = time.perf_counter()
        dev = arena.device
        if dev.is_cuda:  # UCX works in the calling thread's current context: the arena's device's
            _cuda.use_device(dev.index)
        devid = dev.index if dev.is_cuda else 0
        base = arena.ptr
        segs = segment_ranges(arena)
        with self._lock:
            descs = self._agent.register_memory([(base + o, n, devid, "") for o, n in segs], _mem_type(dev))
            self._registered.append(descs)
            metadata = self._agent.get_agent_metadata()
        stats["registrations"] += 1
        self.register_ms = (time.perf_counter() - t0) * 1e3
        return {"agent": self.name, "mem": _mem_type(dev), "devid": devid, "base": base,
                "segments": [[o, n] for o, n in segs], "nbytes": arena.nbytes, "metadata": _b64(metadata)}

    def scratch(self) -> tuple[int, int, str]:
        """(address, devid, memory type) of a small registered host buffer that liveness probes READ
        into: never an arena, where a probed byte could land on one we already hold (a ring member
        holds bytes its predecessor does not yet have)."""
        if self._scratch is None:
            buf = np.zeros(64, np.uint8)
            with self._lock:
                self._registered.append(self._agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
            self._scratch = buf
        return self._scratch.ctypes.data, 0, "DRAM"

    def add_remote(self, record: dict, who: str) -> str:
        """Load a peer's agent metadata (from its sealed record); returns the peer agent's name."""
        if record.get("agent") in self._leaving:
            raise RendezvousError(f"{who} (NIXL agent {record['agent']!r}) was dropped and a READ of it is still being "
                                  "aborted: it is not loaded again")
        stats["remotes_loaded"] += 1  # attempts: loading one connects to the peer
        t0 = time.monotonic()
        try:
            name = self._call(self._agent.add_remote_agent, _unb64(record["metadata"]), error=RendezvousError,
                              what=f"NIXL refused the agent metadata of {who}: ")
        except RendezvousError as exc:  # NIXL says only NIXL_ERR_BACKEND for a host out of reach
            why = f"{exc} (after {time.monotonic() - t0:.1f} s)"
        else:
            why = None
        if why is not None:
            raise RendezvousError(f"{why}; loading it connects to its host: is that host reachable from here (a "
                                  "firewall, a route, its link) and the process alive?")
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != record["agent"]:
            raise RendezvousError(f"the NIXL metadata of {who} names agent {name!r}, its record {record['agent']!r}; "
                                  "refused before any READ")
        self.remotes[name] = who
        return name

    def _call(self, fn, *args, error: type[FlashBootError] | None = None, what: str = ""):
        """``fn(*args)`` under the lock; NIXL's bare exceptions (e.g. ``NIXL_ERR_REMOTE_DISCONNECT``)
        become ``error`` (ReadFailed) with NIXL's message, raised outside the handler: NIXL's
        exception, chained, would keep its frames, and through them the agent, alive past :meth:`close`."""
        try:
            with self._lock:
                return fn(*args)
        except Exception as exc:  # noqa: BLE001 - NIXL raises bare exceptions
            why = f"{what}{type(exc).__name__}: {exc}"
        del fn, args  # the error's traceback keeps this frame: it must not keep NIXL's objects
        raise (error or ReadFailed)(why)

    def _best_effort(self, fn, *args) -> None:
        try:
            self._call(fn, *args)
        except ReadFailed:
            pass  # teardown: the peer may be gone, a READ still in progress cannot be released

    def remove_remote(self, name: str) -> None:
        """Stop using peer ``name``; its metadata is unloaded now, or once its last READ is released.

        A READ of a peer that died may still be aborting inside UCX (:meth:`release` cannot release
        it yet). Unloading the peer's metadata meanwhile tears down the endpoint and remote keys
        that UCX's threads still use: NIXL's race of that kind (ai-dynamo/nixl#1868: the rkey freed
        under ``ucp_get_nbx``) is a SIGSEGV of the whole process. So the peer stays loaded until
        then, or until :meth:`close` destroys the agent, which aborts in the right order."""
        if self.remotes.pop(name, None) is None:
            return
        if name in self._peer_of.values():
            self._leaving.add(name)
        else:
            self._best_effort(self._agent.remove_remote_agent, name)

    def read(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]], mem: str, remote_mem: str,
             remote_agent: str) -> int:
        """Post one READ (lists of (address, nbytes, devid)); returns its ticket for :meth:`state` and
        :meth:`release`. NIXL's handle objects never leave this class: each one keeps the native agent
        (and its threads) alive, and one caught in a failed frame's traceback would outlive :meth:`close`."""
        ticket = next(self._tickets)
        state = self._call(self._post, ticket, local, remote, mem, remote_mem, remote_agent)
        stats["reads_posted"] += 1
        if state == "ERR":
            raise ReadFailed("NIXL refused to post the READ")
        return ticket

    def _post(self, ticket: int, local, remote, mem: str, remote_mem: str, remote_agent: str) -> str:
        a = self._agent
        self._live[ticket] = a.initialize_xfer("READ", a.get_xfer_descs(local, mem),
                                               a.get_xfer_descs(remote, remote_mem), remote_agent)
        self._peer_of[ticket] = remote_agent
        return a.transfer(self._live[ticket])  # released by release(), or settled by close()

    def state(self, ticket: int) -> str:
        state = self._call(self._agent.check_xfer_state, self._live[ticket])
        if state == "ERR":
            raise ReadFailed("NIXL reports the READ failed")
        return state

    def release(self, ticket: int) -> bool:
        """Release the READ; False while NIXL cannot (one still in progress is being aborted: it stays
        outstanding and :meth:`close` settles it)."""
        handle = self._live.get(ticket)
        if handle is None:
            return True
        try:
            self._call(self._agent.release_xfer_handle, handle)
        except ReadFailed:
            return False
        del self._live[ticket]
        peer = self._peer_of.pop(ticket, None)
        if peer in self._leaving and peer not in self._peer_of.values():
            self._leaving.discard(peer)
            self._best_effort(self._agent.remove_remote_agent, peer)
        return True

    def settle(self, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) for every outstanding READ to finish or fail, releasing each;
        returns how many are still in progress."""
        deadline = time.monotonic() + timeout_s
        while self._live:
            for ticket in list(self._live):
                try:
                    busy = self.state(ticket) == "PROC"
                except ReadFailed:
                    busy = False
                if not busy:
                    self.release(ticket)
            if not self._live or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        return len(self._live)

    def close(self) -> None:
        """Settle outstanding READs, drop the peers, deregister, then destroy the agent. Idempotent."""
        if self._agent is None:
            return
        self.settle(SETTLE_S)
        for name in list(self.remotes):
            self.remove_remote(name)
        for descs in self._registered:
            self._best_effort(self._agent.deregister_memory, descs)
        self._registered = []
        # The last reference to the agent: its destructor stops the progress thread and closes UCX,
        # aborting whatever settle() could not (NIXL queues an unreleasable handle for exactly this),
        # and unloads the peers still leaving.
        self._live.clear()
        self._peer_of.clear()
        self._leaving.clear()
        native, self._agent = getattr(self._agent, "agent", None), None
        if native is not None and sys.getrefcount(native) > 2:  # ours and the call's: anything more keeps it alive
            warnings.warn(f"NIXL agent {self.name!r} is still referenced after close ({sys.getrefcount(native) - 2} "
                          "more): its progress thread may touch memory that is unmapped next", RuntimeWarning, stacklevel=2)


PROGRESS_DELAY_US = int(os.environ.get("FLASHBOOT_NIXL_PROGRESS_DELAY_US", "10"))
"""Pause between the progress thread's polls (NIXL's ``pthrDelay``; its Python API fixes it at 0).
Measured on the 2-core machine: 0 costs 0.7 of a core while idle; 10-1000 us about 0.015; between
namespaces 10 us READ 0.29-0.36 GB/s where 100 us READ 0.23 (same load). ``$FLASHBOOT_NIXL_PROGRESS_DELAY_US``
overrides it."""
_CREATE_LOCK = threading.Lock()


def syn_retries(timeout_s: float) -> int:
    """TCP SYN retransmits after which a connect gives up within ``timeout_s`` (at least 1, at most
    Linux's default 6): the kernel waits 1, 2, 4, ... s for each, so ``n`` of them end at ``2**(n+1) - 1`` s."""
    n = 1
    while n < 6 and 2 ** (n + 2) - 1 <= timeout_s:
        n += 1
    return n


def _create_agent(mod, name: str):
    """``mod.nixl_agent`` with the progress thread pausing :data:`PROGRESS_DELAY_US` between polls,
    and no backend yet (:func:`_add_ucx` makes it).

    The Python API builds the C++ config itself and sets ``pthrDelay = 0``; the binding's
    constructor is wrapped for the duration of the call to raise it. Where the module is laid out
    differently, the agent is created as the API makes it."""
    config = mod.nixl_agent_config(enable_prog_thread=True, backends=[])
    api = sys.modules.get(mod.nixl_agent.__module__)
    bind = getattr(api, "nixlBind", None)
    real = getattr(bind, "nixlAgent", None)
    if real is None:
        return mod.nixl_agent(name, config)

    def with_delay(agent_name, agent_config):
        agent_config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, agent_config)

    with _CREATE_LOCK:
        bind.nixlAgent = with_delay
        try:
            return mod.nixl_agent(name, config)
        finally:
            bind.nixlAgent = real


def _add_ucx(agent, timeout_s: float | None) -> None:
    """Make the agent's UCX backend (where it has none yet), its TCP connects bounded by ``timeout_s``.

    Loading a peer's metadata (``add_remote_agent``) connects to it inside the call: to a host whose
    packets are dropped (a firewall, a dead route, its link down) the kernel retries the SYN for
    127 s, and a clone given 8 s had waited 136 s in that call. So the backend is made with
    ``TCP_SYN_CNT`` (:func:`syn_retries`) unless ``$UCX_TCP_SYN_CNT`` says otherwise."""
    if "UCX" in agent.backends or "UCX" not in agent.get_plugin_list():  # the caller names what is missing
        return
    init: dict[str, str] = {}
    if timeout_s is not None and not os.environ.get("UCX_TCP_SYN_CNT"):
        init["engine_config"] = f"TCP_SYN_CNT={syn_retries(timeout_s)}"
    agent.create_backend("UCX", init)


class AgentWarmup:
    """Create an :class:`Agent` in a background thread (0.5-1.2 s of UCX start-up), started while the
    clone connects to the store; :meth:`join` hands it over. Registers nothing. :meth:`close` (a
    session's release step) closes the agent whether or not it was taken over."""

    @classmethod
    def start_for(cls, transport: str, role: str, timeout_s: float) -> "AgentWarmup | None":
        """For ``transport == "nixl"``: NIXL must be installed (CapabilityError naming the extra,
        before anything else), and the agent starts now, overlapping connecting. None otherwise."""
        if transport != "nixl":
            return None
        nixl_module()
        return cls(f"flashboot-{role}-{os.getpid()}-{time.time_ns()}", timeout_s)

    def __init__(self, name: str, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.agent: Agent | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(name,), name="flashboot-nixl-agent", daemon=True)
        self._thread.start()

    def _run(self, name: str) -> None:
        try:
            self.agent = Agent(name, self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join
            self.error = exc

    def join(self, timeout_s: float) -> Agent:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WaitTimeoutError(f"creating the NIXL agent did not finish within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.agent

    def close(self) -> None:
        try:
            agent = self.join(self.timeout_s)
        except FlashBootError:
            return
        agent.close()  # idempotent: a clone that took it over closes it too


def check_record(record: Any, manifest, who: str) -> None:
    """Refuse a peer's NIXL record that does not describe the manifest's arena (before any READ)."""
    if not isinstance(record, dict) or not {"agent", "mem", "segments", "nbytes", "metadata", "base"} <= set(record):
        raise RendezvousError(f"{who} publishes no usable NIXL record (keys {sorted(record) if isinstance(record, dict) else record!r}); "
                              "refused before any READ")
    segs = record["segments"]
    covered = 0
    for o, n in segs:
        if o != covered or n <= 0:
            raise RendezvousError(f"the NIXL segments of {who} are not back to back: segment at {o:,} after "
                                  f"{covered:,} bytes; refused before any READ")
        covered += n
    if covered != record["nbytes"] or covered != manifest.arena_nbytes:
        raise RendezvousError(f"the NIXL record of {who} registers {covered:,} bytes of a {record['nbytes']:,}-byte "
                              f"arena; the manifest says {manifest.arena_nbytes:,} (image {manifest.nbytes:,}); "
                              "refused before any READ")
    if record["mem"] not in ("DRAM", "VRAM"):
        raise RendezvousError(f"{who} registered {record['mem']!r} memory; only DRAM or VRAM can be READ; "
                              "refused before any READ")


@register_transport
class Nixl(Transport):
    """One-sided READs through a NIXL agent (UCX: RDMA, TCP, cuda_ipc, ...) from the source's registered arena."""

    name = "nixl"
    order = 20
    reach = "any_host"
    memory = ("host", "device")
    setup = ("agent creation 0.4-1.2 s (while connecting, off the critical path), registration ~1 ms, "
             "add_remote_agent 10-25 ms")

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            mod = nixl_module()
        except CapabilityError as exc:
            return False, str(exc)
        return True, f"module {mod.__name__}"

    @classmethod
    def usable(cls, seen: Seen, dev: Device) -> tuple[bool, str]:
        ok, why = cls.availability()
        if not ok:
            return False, why
        if not seen.offers.get("nixl"):
            return False, "the seed publishes no NIXL agent (start it with --nixl)"
        return True, f"seed on {seen.desc.hostname!r}: NIXL READs from its registered arena"

    @classmethod
    def run(cls, ctx) -> Any:
        return _clone(ctx)


def _clone(ctx):
    """The whole clone over NIXL (called by :func:`flashboot.flashclone.clone` once the seed's record
    checked out and a position is taken)."""
    from ...schedulers import build_plan
    from ..common import _gkey, _verify, _views
    from ..report import CloneResult

    session, dev, report, manifest = ctx.session, ctx.dev, ctx.report, ctx.manifest
    rdv, position, timeout_s = session.rdv, report.position, ctx.timeout_s
    rdv.bounded = True  # the store may sit across the same link as the source: no call may hang on it
    detail: dict[str, float] = {}
    t0 = time.perf_counter()
    # before anything is registered: the seed's NIXL record must describe the manifest's arena
    check_record(ctx.seed_rec.sealed.get("nixl"), manifest, f"the seed at {rdv.address}")
    if ctx.nixl_warm is not None:  # created while connecting, joined before the seed's record was read
        agent = ctx.nixl_warm.join(timeout_s)
        detail["agent_create_ms"] = agent.create_ms  # off the critical path
        detail["agent_wait_ms"] = 0.0
    else:
        agent = Agent(f"flashboot-clone-{ctx.gen}-{ctx.schedule}-{position}-{os.getpid()}", timeout_s)
        detail["agent_create_ms"] = detail["agent_wait_ms"] = agent.create_ms  # on the critical path
    session.extra.append(agent)
    n = max(position, ctx.clones or 1)
    plan = build_plan(ctx.schedule, n, manifest.nbytes, ctx.chunk_bytes)
    report.chunk_bytes = plan.chunk_bytes
    keys = PeerKeys(member=lambda p: _gkey(ctx.gen, ctx.schedule, "member", p),
                    held=lambda p: _gkey(ctx.gen, ctx.schedule, "nixl", "held", p),
                    status=lambda p: _gkey(ctx.gen, ctx.schedule, "status", p),
                    who=lambda p: "the seed" if p == 0 else f"clone #{p}",
                    joined=lambda p: _gkey(ctx.gen, ctx.schedule, "joined", p))
    sources = Peers(rdv, agent, manifest, keys, timeout_s, detail,
                    fixed={0: (ctx.seed_rec.sealed.get("nixl"), f"the seed (pid {ctx.seed_rec.body.get('pid')} on "
                                                                  f"{ctx.seed_rec.body.get('host')})")})
    my_steps = [s for s in plan.steps_into(position) if s.kind == "copy"]
    redirect: dict[int, int] = {}  # a source clone that cannot be reached -> the nearest upstream that can
    for p in sorted({s.src for s in my_steps}):
        q, tries = p, 0
        while True:
            t_open = time.monotonic()
            try:
                sources.open(q)
                break
            except (RendezvousError, WaitTimeoutError) as exc:  # e.g. it finished and exited: NIXL cannot reach its agent
                if q == 0 or not ctx.retry or "holds another image" in str(exc):
                    raise
                tries += 1
                # seen under load: UCX refused a live peer once (NIXL_ERR_BACKEND, at once). Not a try
                # that took seconds: a host that dropped our SYNs until UCX gave up drops the next
                # ones too, and three such tries had kept a clone 3 x 31 s from an upstream it could reach
                if tries < OPEN_TRIES and time.monotonic() - t_open < OPEN_RETRY_S:
                    time.sleep(0.2)
                    continue
                tries = 0
                report.recovered.append(f"{sources.who(q)} cannot be reached ({exc}); re-attached to "
                                        f"{sources.who(q - 1)}")
                q -= 1
        redirect[p] = q
    ta = time.perf_counter()
    session.take_arena(ctx.into, manifest.arena_nbytes, dev)
    if session.arena.nbytes != manifest.arena_nbytes:
        raise RendezvousError(f"our arena on {dev} rounds to {session.arena.nbytes:,} bytes, the seed's to "
                              f"{manifest.arena_nbytes:,} (different allocation granularity)")
    report.alloc_ms = (time.perf_counter() - ta) * 1e3
    tr = time.perf_counter()
    mine = agent.register(session.arena)
    detail["register_ms"] = (time.perf_counter() - tr) * 1e3
    rdv.publish(_gkey(ctx.gen, ctx.schedule, "member", position),
                {"position": position, "pid": os.getpid(), "host": socket.gethostname(),
                 "device": str(dev), "manifest_digest": manifest.digest, "transport": "nixl",
                 "chunk_bytes": plan.chunk_bytes},
                sealed={"nixl": mine})
    report.exchange_ms = (time.perf_counter() - t0) * 1e3 - report.alloc_ms
    report.exchange_detail = {"seed_record_ms": report.manifest_ms, **{k: round(v, 4) for k, v in detail.items()}}
    report.setup_ms = report.exchange_ms - detail.get("records_ms", 0.0)
    if ctx.clones is not None:
        report.barrier_ms = rdv.barrier(_gkey(ctx.gen, ctx.schedule, "start"), ctx.clones, timeout_s=timeout_s)

    tt = time.perf_counter()
    todo = pieces(my_steps, session.arena.segment_bytes)
    for piece in todo:
        piece.src = redirect.get(piece.src, piece.src)

    def reattach(piece, why: str, todo: deque) -> None:
        """A chain source failed: its pieces go to the clone upstream of it (or the clone fails)."""
        from ..report import CloneError

        src = piece.src
        who = sources.who(src)
        report.recovered.append(f"{who} failed at step {piece.step} (bytes [{piece.offset:,}, {piece.end:,})): {why}")
        if not ctx.retry or src == 0:
            raise CloneError(f"clone #{position} on {dev}: {who} failed at step {piece.step} "
                             f"(bytes [{piece.offset:,}, {piece.end:,}) over NIXL): {why}"
                             + ("" if ctx.retry else "; retry is off") + ("; no source upstream of the seed" if src == 0 else ""))
        up = 0 if rdv.lost else src - 1  # without the store no clone's record or progress can be read: the seed's
        for p in todo:
            if p.src == src:
                p.src = up
        ordered = sorted(todo, key=lambda p: p.offset)
        todo.clear()
        todo.extend(ordered)
        sources.drop(src)
        try:
            sources.open(up)
        except (RendezvousError, WaitTimeoutError) as exc:
            raise CloneError(f"clone #{position}: {who} failed at step {piece.step} and its upstream "
                             f"{sources.who(up)} cannot be reached: {exc}") from exc
        report.recovered.append(f"re-attached to {sources.who(up)}")

    reader = Reader(rdv, dev, position, f"clone #{position}", keys.held(position), timeout_s, ctx.hook, reattach,
                    warnings=report.warnings)
    session.wrote = True
    used = read_pieces(reader, agent, sources, session.arena, todo)
    report.transfer_ms = (time.perf_counter() - tt) * 1e3
    report.ready_ms = (time.perf_counter() - ctx.t_start) * 1e3
    report.ready_unix = time.time()
    report.mover = "nixl/UCX"
    report.source = ", ".join(sources.who(p) for p in sorted(used))
    if ctx.verify:
        tv = time.perf_counter()
        _verify(session.arena, manifest, f"clone #{position} on {dev} (nixl)")
        report.verify_ms = (time.perf_counter() - tv) * 1e3
        report.verified = True
    metadata = ctx.read_metadata()
    lost_before = rdv.lost
    try:
        rdv.publish(keys.status(position), {"state": "done", "redone": [], "pid": os.getpid(), "transport": "nixl"})
    except StoreLostError as exc:  # as the mapped transports: the store costs later clones a source, not us our weights
        why = exc if lost_before is None else f"the store at {rdv.address} is gone (see above)"
        report.warnings.append(f"{why}; kept the weights ({manifest.nbytes:,} bytes"
                               f"{', verified' if report.verified else ''}), not announced as a source")
    if ctx.schedule == "chain":
        def successors() -> list[str]:
            joined = max(session.rdv.add(_gkey(ctx.gen, ctx.schedule, "join"), 0), ctx.clones or 0)
            return [keys.status(position + 1)] if joined > position else []
        session.dependents_of = successors
    report.total_ms = (time.perf_counter() - ctx.t_start) * 1e3
    report.finished_unix = time.time()
    return CloneResult(session.arena, _views(session.arena, metadata), report, metadata=metadata, _session=session)


def ring_keys(run: str) -> PeerKeys:
    """Where a ring over NIXL keeps its members' records and progress in the store."""
    return PeerKeys(member=lambda p: f"{run}/member/{p}", held=lambda p: f"{run}/nixl/held/{p}",
                    status=lambda p: f"{run}/status/{p}", who=lambda p: f"ring member {p}")


def ring_member(*, rdv, agent: Agent, run: str, plan, me: int, manifest, dev: Device, arena, image,
                mover, report, timeout_s: float, hook) -> set[int]:
    """One member's part of a ring over NIXL (called by :func:`flashboot.flashclone.ring.ring_load`
    after the start barrier): its own shard from its own copy of the image (``image``, a Span),
    then every other sub-chunk READ from its predecessor as soon as the predecessor's progress
    covers it, so all rounds and all links run at once. A predecessor that fails or leaves: the
    rest comes from our own copy of the image, said in the report. Returns the members read from."""
    from ...schedulers import HOST
    from ._nixl_reads import progress_starts

    members = len(plan.participants)
    pred = (me - 1) % members
    keys = ring_keys(run)
    detail: dict[str, float] = {}
    peers = Peers(rdv, agent, manifest, keys, timeout_s, detail)
    t0 = time.perf_counter()
    peers.open(pred)
    report.exchange_detail = {k: round(v, 4) for k, v in detail.items()}
    report.setup_ms = (time.perf_counter() - t0) * 1e3
    stream = None
    if dev.is_cuda:
        from ...cuda_streams import Stream

        stream = Stream(dev.index)

    def local_copy(piece) -> None:
        mover.copy(arena.span(piece.offset, piece.nbytes), image.sub(piece.offset, piece.nbytes), stream=stream)
        if stream is not None:
            stream.synchronize()

    steps = sorted(plan.steps_into(me), key=lambda s: s.id)  # our progress order: our shard, then round by round
    for s in steps:
        if s.kind == "h2d":
            local_copy(s)
            rdv.add(keys.held(me), s.nbytes)
    held = sum(s.nbytes for s in steps if s.kind == "h2d")
    ours, theirs = progress_starts(steps), progress_starts(plan.steps_into(pred))
    by_id = {s.id: s for s in plan.steps}

    def place(s) -> tuple[int, int]:
        up = by_id[s.waits[0]]  # the step that brought this sub-chunk to our predecessor
        return ours[s.id], theirs[up.id] + (s.offset - up.offset)

    todo = pieces([s for s in steps if s.kind == "copy"], arena.segment_bytes, place=place)

    def from_own_copy(piece, why: str, todo: deque) -> None:
        src = piece.src  # captured: the loop below re-routes `piece` itself too
        report.recovered.append(f"{keys.who(src)} failed at step {piece.step} (bytes [{piece.offset:,}, "
                                f"{piece.end:,})): {why}")
        for p in todo:
            if p.src == src:
                p.src = HOST
        peers.drop(src)
        report.recovered.append("loaded the rest from the host image")

    reader = Reader(rdv, dev, me, f"ring member {me}", keys.held(me), timeout_s, hook, from_own_copy,
                    local_copy=local_copy, held=held, warnings=report.warnings)
    return read_pieces(reader, agent, peers, arena, todo)
