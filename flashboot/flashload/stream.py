"""Stream one rank's image straight from disk into its arena, in bounded host memory.

The reader of the disk source (:mod:`flashboot.flashload.sources.disk`, which says when a load
streams) and of a wake from the disk (:mod:`flashboot.flashload.lifecycle`).

The image is read through a small **ring** of slots (one anonymous mapping, page-aligned as
``O_DIRECT`` needs, pinned once with ``cuMemHostRegister`` on CUDA), never larger than
``buffer_bytes`` whatever the image's size. Several reader threads each take the next chunk,
wait for a free slot, read the chunk into it (``O_DIRECT`` where the filesystem allows it,
buffered otherwise) and hand it over; the loading thread copies each filled slot to the chunk's
offset in the arena (CUDA: ``cudaMemcpyAsync`` on one stream and an event recorded after it;
host backend: the numba host copy into the memfd arena) and returns the slot to the free list.
On CUDA a reader that takes a slot first synchronises that slot's event, so no slot is
overwritten while its copy is in flight. Reads of later chunks overlap the copies of earlier
ones; the disk is the bottleneck, the copy runs ~50x faster than a disk reads.

Peak extra host memory is the ring (plus a few pages per thread), measured by the tests with
``VmHWM`` in a fresh process.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import _cuda
from ..errors import CapabilityError, FlashBootError, ImageReadError, LayoutError, OutOfMemoryError, WaitTimeoutError
from ..fileio import DirectReadRefused, io_buffer, open_for_reads, read_exactly
from ..memory import Device
from ..units import check_timeout
from .read_depth import ReadDepth, ReadSetting

DEFAULT_BUFFER_BYTES = 256 << 20
"""The cap on the ring's host memory by default (the ring takes :data:`RING_SLOTS` slots at most:
64 MiB of 4 MiB slots)."""
BUFFER_ENV = "FLASHBOOT_STREAM_BUFFER_BYTES"
"""Environment variable that overrides :data:`DEFAULT_BUFFER_BYTES` (engines cannot always pass options)."""
SLOT_BYTES = 4 << 20
"""One read by default: small, so that the few slots the readers take in turn (newest first:
:class:`_FreeSlots`) stay in the machine's caches. On the lent H200 VMs, whose disk is a file of
the host written into guest memory on every read, one ``O_DIRECT`` read at a time ran faster into
one 16 MiB buffer than into two in turn (2.59 vs 1.90, 1.67 vs 1.43 GB/s) or into one of 64 MiB
(1.89, 1.90), and the loader at one 4 MiB read in flight beat itself at 16 MiB by 15-18 % in both
rounds (2.05 vs 1.73, 2.19 vs 1.90 GB/s; ``benchmarks/probes/disk_depth.py``, 2026-12-04). Four
reads of 4 MiB in flight (setting A of :mod:`~flashboot.flashload.read_depth`) still keep an NVMe
queue busy."""
RING_SLOTS = 16
"""Slots at most: the reads in flight and the copies behind them use a few, and every slot is
pinned (populated and registered) before the first read, in the load's own time."""
MIN_SLOTS = 4
"""Slots at the least: two reads in flight while one slot is copied and one waits."""
DEFAULT_THREADS = 4
"""Reader threads (reads in flight); capped at the slot count minus one."""
PROBE_WINDOW_BYTES = 256 << 20
"""One window of the read-depth probe (:mod:`flashboot.flashload.read_depth`): ~0.1 s of a 2 GB/s disk."""
ALIGNMENT = 4096
"""O_DIRECT wants buffers, offsets and lengths aligned to the logical block size (<= 4096)."""
MIN_BUFFER_BYTES = 2 * ALIGNMENT
MAX_OVERHEAD_BYTES = 16 << 20
"""Of the cap, what is kept back for the load's own memory beside the ring (the strict parse of
``metadata.json``, the views' objects, reader stacks: 0.3-5 MB measured for 3,170 tensors), so
that the ring plus that stays under the cap: 1/8 of the cap, at most this."""
IO_MODES = ("auto", "direct", "buffered")

_JOIN_S = 30.0
"""How long cleanup waits for the readers to finish their reads in progress, all of them together."""

# Module-level so tests can inject a read error mid-stream.
_preadv = os.preadv


# ============================================================================ configuration
@dataclass
class StreamConfig:
    """How :func:`flashboot.load` streams an image from disk. Validates itself.

    ``buffer_bytes``: the cap on extra host memory (default :data:`DEFAULT_BUFFER_BYTES`, or
    ``$FLASHBOOT_STREAM_BUFFER_BYTES``): the ring takes it less 1/8 (at most 16 MiB) kept for the
    load's own objects, and holds at most :data:`RING_SLOTS` slots; ``slot_bytes``: one read
    (default ``min(4 MiB, ring / 4)`` rounded down to 4096: :data:`SLOT_BYTES`); ``threads``: reads in
    flight; ``io``: ``auto`` (O_DIRECT, buffered where refused; the report says which),
    ``direct`` or ``buffered``; ``stall_timeout_s``: how long the load waits for any one read
    before it gives up (WaitTimeoutError); ``adapt_reads``: a long stream measures ``threads``
    reads in flight against one read at a time on its first bytes and keeps the faster
    (:mod:`flashboot.flashload.read_depth`; False keeps ``threads``); ``probe_window_bytes``: one
    window of that measure.
    """

    buffer_bytes: int | None = None
    slot_bytes: int | None = None
    threads: int = DEFAULT_THREADS
    io: str = "auto"
    stall_timeout_s: float = 60.0
    adapt_reads: bool = True
    probe_window_bytes: int = PROBE_WINDOW_BYTES

    def __post_init__(self):
        source = "stream buffer_bytes"
        if self.buffer_bytes is None:
            env = os.environ.get(BUFFER_ENV)
            try:
                self.buffer_bytes = int(env) if env else DEFAULT_BUFFER_BYTES
            except ValueError:
                raise FlashBootError(f"${BUFFER_ENV} must be a number of bytes, got {env!r}") from None
            if env:  # a caller who passed nothing is told where the bad size came from
                source = f"${BUFFER_ENV} (the stream's buffer_bytes)"
        b = self.buffer_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < MIN_BUFFER_BYTES:
            raise FlashBootError(f"{source} must be an int >= {MIN_BUFFER_BYTES:,}, got {b!r}")
        ring = self.ring_bytes
        if self.slot_bytes is None:
            self.slot_bytes = max(ALIGNMENT, min(SLOT_BYTES, ring // MIN_SLOTS) // ALIGNMENT * ALIGNMENT)
        s = self.slot_bytes
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0 or s % ALIGNMENT or 2 * s > ring:
            raise FlashBootError(f"stream slot_bytes must be a positive multiple of {ALIGNMENT} and at most half of "
                                 f"the ring's {ring:,} bytes (buffer_bytes {b:,}), got {s!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise FlashBootError(f"stream threads must be an int >= 1, got {self.threads!r}")
        if self.io not in IO_MODES:
            raise FlashBootError(f"stream io must be one of {', '.join(IO_MODES)}, got {self.io!r}")
        check_timeout(self.stall_timeout_s, "stream stall_timeout_s")
        if not isinstance(self.adapt_reads, bool):
            raise FlashBootError(f"stream adapt_reads must be True or False, got {self.adapt_reads!r}")
        w = self.probe_window_bytes
        if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
            raise FlashBootError(f"stream probe_window_bytes must be a positive int, got {w!r}")

    @classmethod
    def of(cls, value: Any) -> "StreamConfig":
        """A config from None (defaults), an int (``buffer_bytes``), a dict or a StreamConfig."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(buffer_bytes=value)
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise FlashBootError(f"unknown stream options {sorted(unknown)}; known: {', '.join(sorted(known))}")
            return cls(**value)
        raise FlashBootError(f"stream options must be None, an int (buffer bytes), a dict or a StreamConfig, "
                             f"got {type(value).__name__}")

    @property
    def ring_bytes(self) -> int:
        """The most the ring may take: ``buffer_bytes`` less the loader's own allowance
        (:data:`MAX_OVERHEAD_BYTES`)."""
        overhead = min(self.buffer_bytes // 8, MAX_OVERHEAD_BYTES) // ALIGNMENT * ALIGNMENT
        return self.buffer_bytes - overhead

    def slots_for(self, nbytes: int) -> int:
        """Slots the ring gets for an image of ``nbytes``: as many as fit, at most :data:`RING_SLOTS`
        and no more than it has chunks."""
        return max(1, min(RING_SLOTS, self.ring_bytes // self.slot_bytes, -(-nbytes // self.slot_bytes)))

    def slot_bytes_for(self, nbytes: int) -> int:
        """One slot's bytes for an image of ``nbytes``: :attr:`slot_bytes`, cut to the image (whole
        blocks) where it is smaller: a slot larger than the image holds nothing more (a 64 GiB slot
        for a 127 KB image had been mapped, and failed with a raw ENOMEM)."""
        return min(self.slot_bytes, -(-nbytes // ALIGNMENT) * ALIGNMENT)

    def readers_for(self, nbytes: int) -> int:
        """Reader threads (reads in flight) for an image of ``nbytes``: :attr:`threads`, but fewer
        than the slots, so one slot is always free to be copied."""
        slots = self.slots_for(nbytes)
        return max(1, min(self.threads, slots - 1 if slots > 1 else 1))


# ============================================================================ the ring
class _Slot:
    __slots__ = ("index", "ptr", "view", "copied")

    def __init__(self, index: int, ptr: int, view: memoryview):
        self.index, self.ptr, self.view = index, ptr, view
        self.copied = None  # CUDA: the event recorded after this slot's last copy


class Ring:
    """``slots`` buffers of ``slot_bytes`` in one page-aligned anonymous mapping; pinned once
    (``cuMemHostRegister``) for a CUDA ``device``. Counts the slots in use and their peak.
    :meth:`close` unpins and unmaps (idempotent)."""

    def __init__(self, slots: int, slot_bytes: int, device: Device):
        import ctypes

        self.slot_bytes, self.nbytes = slot_bytes, slots * slot_bytes
        self.device = device
        self._mm = io_buffer(self.nbytes)
        # The ctypes object exports the mmap's buffer only for this line: the slots' views are made
        # from the address, so an error's traceback holding a slice never blocks close().
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.pinned = None
        self.pin_ms = 0.0
        self.leak = False
        """Set when a reader could not be stopped: the mapping is then left in place, not unmapped."""
        try:
            if device.is_cuda:
                from ..pinning import populate, register_host

                t0 = time.perf_counter()
                populate(self._mm)  # faulted in by threads first: registered in a third of the time
                self.pinned = register_host(self.ptr, self.nbytes, device)
                self.pin_ms = (time.perf_counter() - t0) * 1e3
        except BaseException:
            self._mm.close()
            raise
        self.slots = [_Slot(i, p, memoryview((ctypes.c_char * slot_bytes).from_address(p)).cast("B"))
                      for i, p in ((i, self.ptr + i * slot_bytes) for i in range(slots))]
        self._lock = threading.Lock()
        self.in_use = self.peak_in_use = 0

    def acquired(self) -> None:
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)

    def released(self) -> None:
        with self._lock:
            self.in_use -= 1

    @property
    def peak_bytes(self) -> int:
        """Most bytes of the ring held at once (reading, waiting or being copied)."""
        return self.peak_in_use * self.slot_bytes

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        if self._mm is None:
            return
        try:
            if self.pinned is not None:
                self.pinned.unregister()
        finally:
            self._mm.close()  # the readers have stopped (or the ring is leaked instead of closed)
            self._mm = None


# ============================================================================ the stream
@dataclass
class StreamStats:
    """What one streamed read did: bytes, time, I/O mode (and why), the ring."""

    path: str
    nbytes: int
    seconds: float
    """From the first read issued to the last copy finished (reads and copies overlap)."""
    io_mode: str
    io_reason: str
    buffer_bytes: int
    """The ring's size: the extra host memory (pinned on CUDA)."""
    peak_buffer_bytes: int
    """Most ring bytes in use at once."""
    buffer_cap_bytes: int
    slots: int
    slot_bytes: int
    threads: int
    chunks: int
    copy_s: float
    """Time the copies out of the ring took (CUDA: sum of event-timed copies; host: of the host copies)."""
    pin_ms: float = 0.0
    reads: dict = dataclasses.field(default_factory=dict)
    """The reads in flight kept, and what the read-depth probe measured (:meth:`ReadDepth.summary`)."""

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @property
    def copy_gbps(self) -> float:
        return self.nbytes / self.copy_s / 1e9 if self.copy_s > 0 else float("inf")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "read_gbps": self.read_gbps, "copy_gbps": self.copy_gbps}


class _Copier:
    """Copies filled slots into the arena: CUDA on one private stream with a timed pair of events
    per copy (through the driver, :mod:`flashboot.cuda_streams`: no CuPy, whose import and first
    use an engine would pay inside its first streamed load), or the host copy."""

    def __init__(self, arena):
        self.arena = arena
        self.cuda = arena.device.is_cuda
        self.copy_s = 0.0
        self._timed: list = []
        if self.cuda:
            from ..cuda_streams import lend_stream

            self.stream = lend_stream(arena.device.index)

    def copy(self, slot: _Slot, offset: int, nbytes: int) -> None:
        dst = self.arena.span(offset, nbytes)
        if not self.cuda:
            from ..movers.host import host_copy

            t0 = time.perf_counter()
            host_copy(dst.ptr, slot.ptr, nbytes)
            self.copy_s += time.perf_counter() - t0
            return
        start, end = self._issue(dst.ptr, slot.ptr, nbytes)
        slot.copied = end
        self._timed.append((start, end))

    @_cuda.keeps_context  # this runs on the loading thread, which may be the engine's
    def _issue(self, dst: int, src: int, nbytes: int):
        """``cuMemcpyAsync`` of the slot at ``src`` to ``dst`` between two recorded events, in the
        arena's device context; returns the events."""
        from ..cuda_streams import Event

        index = self.arena.device.index
        _cuda.use_device(index)
        start, end = Event(index, timing=True), Event(index, timing=True)
        start.record(self.stream)
        _cuda.check(_cuda.driver().cuMemcpyAsync(dst, src, nbytes, self.stream.ptr),
                    f"cuMemcpyAsync({nbytes:,} bytes of a stream slot to cuda:{index})")
        end.record(self.stream)
        return start, end

    def finish(self) -> None:
        """Wait for every copy; add the CUDA copies' event times to ``copy_s``; hand the stream back."""
        if not self.cuda:
            return
        self.stream.synchronize()
        self.copy_s += sum(a.elapsed_ms(b) for a, b in self._timed) * 1e-3
        self._release()

    def settle(self) -> None:
        """After a failure: wait for what was enqueued (the arena and ring are released next)."""
        if self.cuda:
            self.stream.synchronize()
            self._release()

    def _release(self) -> None:
        from ..cuda_streams import give_back

        for pair in self._timed:
            for ev in pair:
                ev.close()
        self._timed.clear()
        give_back(self.stream)  # its work has run


class _FreeSlots:
    """The ring's free slots, the most recently freed taken first: a slot read into again soon
    after its last read is still warm in the machine's caches. On a lent H200 VM, one 16 MiB
    ``O_DIRECT`` read at a time ran 2.11-2.54 GB/s into one pinned slot and 1.96-2.08 into 7
    slots in turn (benchmarks/probes/disk_depth.py, 2026-12-04), and a FIFO of free slots makes
    every read go to the coldest. A slot whose copy to the device still runs is passed over for
    an older one whose copy has ended, so a reader need not wait for it."""

    def __init__(self, slots: list[_Slot]):
        self._slots = list(slots)
        self._cond = threading.Condition()

    def put(self, slot: _Slot) -> None:
        with self._cond:
            self._slots.append(slot)
            self._cond.notify()

    def take(self, stop: threading.Event) -> _Slot | None:
        """A free slot, or None once ``stop`` is set."""
        with self._cond:
            while not stop.is_set():
                for k in range(len(self._slots) - 1, -1, -1):
                    copied = self._slots[k].copied
                    if copied is None or copied.done:
                        return self._slots.pop(k)
                if self._slots:  # every free slot's copy still runs: the newest (the reader waits for it)
                    return self._slots.pop()
                self._cond.wait(0.05)
            return None


def _read_chunk(fd: int, slot: _Slot, off: int, want: int, setting: ReadSetting, *, direct: bool, path: str,
                file_nbytes: int, depth: ReadDepth) -> None:
    """Fill ``slot`` with the ``want`` bytes at ``off``, as ``setting``'s sequential reads of equal
    4096-aligned size (O_DIRECT asks whole blocks; the file's last read may come back short);
    ``depth`` counts the disk's idle time between reads."""
    piece = setting.piece_bytes(len(slot.view))
    for start in range(0, want, piece):
        need = min(piece, want - start)
        ask = -(-need // ALIGNMENT) * ALIGNMENT if direct else need
        depth.read_started()
        try:
            read_exactly(fd, slot.view[start:start + ask], off + start, need, direct=direct, path=path,
                         file_nbytes=file_nbytes, preadv=_preadv)
        finally:
            depth.read_ended()


def _run(fd: int, path: str, nbytes: int, arena, ring: Ring, config: StreamConfig, threads: int, *, direct: bool,
         on_start: Callable[[], None] | None, cancel: threading.Event | None = None
         ) -> tuple[float, float, int, ReadDepth]:
    """Read ``nbytes`` of ``fd`` through ``ring`` into ``arena``; returns (seconds, copy seconds,
    chunks, the reads-in-flight gate). When this returns or raises, every reader has stopped and
    every copy has finished."""
    slot_bytes = ring.slot_bytes
    n_chunks = -(-nbytes // slot_bytes)
    stall_timeout_s = config.stall_timeout_s
    depth = ReadDepth(threads, n_chunks, slot_bytes, window_bytes=config.probe_window_bytes, probe=config.adapt_reads)
    free = _FreeSlots(ring.slots)
    filled: queue.Queue = queue.Queue()
    stop = threading.Event()
    lock = threading.Lock()
    state = {"next": 0, "error": None}
    copier = _Copier(arena)
    failed = object()
    ring.in_use = 0  # a retry (buffered after O_DIRECT was refused) starts with every slot free

    def take() -> int | None:
        with lock:
            if state["next"] >= n_chunks:
                return None
            state["next"] += 1
            return state["next"] - 1

    def reader() -> None:
        try:
            if copier.cuda:
                _cuda.use_device(arena.device.index)  # this thread owns its context: synchronising events needs one
            while (ticket := depth.enter(stop)) is not None:
                try:  # the chunk is taken once the gate lets a read start: at one in flight, in file order
                    if (i := take()) is None or (slot := free.take(stop)) is None:
                        return
                    ring.acquired()
                    if slot.copied is not None:
                        slot.copied.synchronize()  # its previous copy must end before the slot is overwritten
                        slot.copied = None
                    off = i * slot_bytes
                    want = min(slot_bytes, nbytes - off)
                    _read_chunk(fd, slot, off, want, ticket[1], direct=direct, path=path, file_nbytes=nbytes,
                                depth=depth)
                    read_end = time.perf_counter()
                finally:
                    depth.leave()
                filled.put((i, slot, want, ticket, read_end))
        except BaseException as exc:  # handed to the loading thread
            with lock:
                if state["error"] is None:
                    state["error"] = exc
            stop.set()
            filled.put(failed)

    pool = [threading.Thread(target=reader, name=f"flashboot-stream-{k}", daemon=True)
            for k in range(max(1, min(threads, n_chunks)))]
    t0 = time.perf_counter()
    try:
        for t in pool:
            t.start()
        if on_start is not None:
            on_start()
        done = 0
        while done < n_chunks:
            try:
                item = filled.get(timeout=stall_timeout_s)
            except queue.Empty:
                raise WaitTimeoutError(f"{path}: no read completed within {stall_timeout_s:g} s ({done} of {n_chunks} "
                                       f"chunks of {slot_bytes:,} bytes streamed)") from None
            if item is failed:
                raise state["error"]
            i, slot, want, ticket, read_end = item
            copier.copy(slot, i * slot_bytes, want)
            ring.released()
            free.put(slot)
            depth.completed(ticket, want, read_end)
            done += 1
            if cancel is not None and cancel.is_set() and done < n_chunks:
                raise FlashBootError(f"{path}: the stream was cancelled after {done} of {n_chunks} chunks of "
                                     f"{slot_bytes:,} bytes (its prepared load was closed)")
        copier.finish()
        return time.perf_counter() - t0, copier.copy_s, n_chunks, depth
    except BaseException:
        stop.set()
        try:
            copier.settle()
        except Exception:
            pass  # the first error is the one to report
        raise
    finally:
        stop.set()
        depth.wake()
        joined_by = time.monotonic() + _JOIN_S  # one bound for all: each stuck reader had added its own
        for t in pool:
            t.join(max(0.0, joined_by - time.monotonic()))
        for each in ring.slots:  # the copies' events are closed: a retry through this ring must not wait on them
            each.copied = None
        stuck = [t.name for t in pool if t.is_alive()]
        if stuck:  # a read still writes into the ring: it must not be unmapped under it
            ring.leak = True
            raise ImageReadError(path, 0, nbytes, f"reader threads {stuck} did not finish within {_JOIN_S:g} s; "
                                 f"the {ring.nbytes:,}-byte ring buffer is left mapped")


def stream_image(path, nbytes: int, arena, config: StreamConfig | None = None, *,
                 on_start: Callable[[], None] | None = None, identity=None,
                 cancel: threading.Event | None = None) -> StreamStats:
    """Read the image file ``path`` (``nbytes``, a multiple of 4096 or not) into ``arena`` from
    byte 0, through a ring of at most ``config.buffer_bytes``.

    ``on_start()`` runs on this thread once the file is open, its size checked and the reads
    started (the views are built there while the bytes arrive). Raises LayoutError when the file
    is not ``nbytes`` long (before any read) or ends early; ImageReadError on an I/O error;
    CapabilityError when ``io='direct'`` and the filesystem refuses O_DIRECT; WaitTimeoutError
    when no read completes within ``stall_timeout_s``. The ring is released either way; the
    arena is the caller's. ``identity`` (the image's
    :class:`~flashboot.layouts.image.FileIdentity`, where known): the file opened must be the one
    its metadata was validated against, and unchanged once read, else LayoutError. ``cancel``:
    once set, the stream stops after the chunk in hand (FlashBootError), its reads stopped.
    """
    config = StreamConfig.of(config)
    path = str(path)
    if nbytes > arena.nbytes:
        raise LayoutError(f"{path}: image of {nbytes:,} bytes does not fit the {arena.nbytes:,}-byte arena")
    try:
        fd, mode, reason = open_for_reads(path, config.io)
    except OSError as exc:
        raise ImageReadError(path, 0, nbytes, f"open failed: {exc.strerror or exc}") from None
    ring = None
    try:
        st = os.fstat(fd)
        if identity is not None:
            identity.check(st, "since its metadata was read")
        size = st.st_size
        if size != nbytes:
            what = "truncated" if size < nbytes else "longer than recorded"
            raise LayoutError(f"{path}: {what}: {nbytes:,} bytes expected, the file has {size:,}; nothing was loaded")
        slots, slot_bytes = config.slots_for(nbytes), config.slot_bytes_for(nbytes)
        try:
            ring = Ring(slots, slot_bytes, arena.device)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            from ..arena.backing_host import _host_mem_available

            raise OutOfMemoryError(f"{path}: the stream's ring of {slots} slot(s) of {slot_bytes:,} bytes",
                                   slots * slot_bytes, _host_mem_available()) from None
        threads = config.readers_for(nbytes)
        try:
            seconds, copy_s, chunks, depth = _run(fd, path, nbytes, arena, ring, config, threads,
                                                  direct=mode == "o_direct", on_start=on_start, cancel=cancel)
        except DirectReadRefused as exc:
            if config.io == "direct":
                raise CapabilityError(f"{path}: reads under O_DIRECT fail ({exc}) and io='direct' was asked") from None
            os.close(fd)
            fd = -1
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:  # gone since (a re-pack): named as the first open's failure is, not a bare OSError
                raise ImageReadError(path, 0, nbytes, f"reopening it for buffered reads after O_DIRECT was refused "
                                     f"failed: {exc.strerror or exc}") from None
            if identity is not None:
                identity.check(os.fstat(fd), "since its metadata was read")
            mode, reason = "buffered", f"filesystem refuses O_DIRECT reads ({exc})"
            seconds, copy_s, chunks, depth = _run(fd, path, nbytes, arena, ring, config, threads, direct=False,
                                                  on_start=None, cancel=cancel)
        if identity is not None:  # written to while it was read: the arena may hold a mix
            identity.check(os.fstat(fd), "while it was read")
        return StreamStats(path, nbytes, seconds, mode, reason, ring.nbytes, ring.peak_bytes, config.buffer_bytes,
                           slots, ring.slot_bytes, threads, chunks, copy_s, ring.pin_ms, depth.summary())
    finally:
        if ring is not None and not ring.leak:
            ring.close()
        if fd >= 0:
            os.close(fd)


__all__ = ["StreamConfig", "StreamStats", "Ring", "stream_image", "DEFAULT_BUFFER_BYTES", "BUFFER_ENV"]
