"""The early call (paper section 3.5, issue 19). An engine boots once, so its first
:func:`flashboot.load` is the one that counts, and a cold load pays for reading and validating the metadata, creating and exporting the
arena, the daemon's mapping of it, tens of thousands of views, and the first copy's set-up.
:func:`prepare` starts all of that but the views as soon as the engine starts (before it builds
its model) and returns once the copy runs (or, where a step has to wait, after at most
:data:`PREPARE_RETURN_S`, the rest going on in the background); the chosen source
(:mod:`flashboot.flashload.choose`) then starts the copy as soon as it can, so an engine that
builds its model for longer than the copy takes finds its weights in place. ``flashboot.load(..., prepared=handle)`` (or ``handle.load()``)
makes the views (while the copy runs, if it still does: :meth:`PreparedLoad.wait_viewable` says
why there), waits for that copy, checks that the image was not re-packed since, and verifies:

* served (a ``flashboot preload --serve`` daemon holds the image pinned): as a plain served
  load, the copy comes first, before the metadata is read (the daemon's ``.ready`` vouches for
  the metadata bytes it was staged from): the arena is created at the ``.ready``'s size with its
  first batch of segments, which is exported and attached to the daemon; the daemon checks it
  against what it holds and is asked for its H2D at once (mapping the segments piece by piece as
  it copies); prepare() returns then, and the background thread makes and hands over the later
  batches and reads the metadata (it must be the ``.ready``'s bytes, or that copy is discarded)
  and validates it strictly, while the daemon copies and the engine goes on;
* pinned early (a preloader staged the rank, no daemon): the staged file is mapped and pinned
  in this process (:class:`~flashboot.flashload.stage.StagedImage`); the bulk H2D is issued as
  soon as the pin is done;
* streamed (nothing is or will be staged: see :func:`~flashboot.flashload.sources.disk.stream_reason`):
  the reads start at once, straight into the arena through the bounded ring.

The steps up to the copy's start run on the caller's thread (prepare() waits for them anyway,
and a fresh thread ran them ~2 ms slower), unless one would wait (the preloader still staging,
a pin, the stream): from there, and for the wait for the copy's end, a background thread takes
over. It holds the GIL only for the metadata and the driver calls' Python: it waits in blocking
calls (the driver, the daemon's socket, the files' reads and hashes, the pin, the stream's reads,
the copy's synchronisation) that release it. A handle serves one
load; it is refused for another image, rank or device, or after the image was re-packed (the
bytes copied early are then discarded with the arena).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FlashBootError, LayoutError, WaitTimeoutError
from ..fdshare import readable
from ..gil_time import gil_free_cpu_s
from ..units import check_timeout
from ..memory import Device
from .choose import choose_copy_first, choose_prepared
from .landing import admit, verify_loaded
from .report import LoadedImage, LoadReport
from .stream import StreamConfig
from .views import make_views
from .want import LoadRequest, check_expected_key, count_of, flag_of, image_path, job_dir_of, verify_default

if TYPE_CHECKING:
    from flashboot.layouts.image import FileIdentity

MODES = ("auto", "served", "staged", "stream")
PREPARE_ALLOWANCE_S = 120.0
"""Added to the handle's ``timeout_s`` when a load waits for its preparation (a pin of tens of GB)."""
CLOSE_TIMEOUT_S = 30.0
"""How long :meth:`PreparedLoad.close` (and the exit hook) waits for a copy that is running."""


PREPARE_RETURN_S = 0.25
"""How long :func:`prepare` waits (GIL released) for its background thread to set the copy going
before it returns, where a step had to wait and the thread took the rest over (otherwise the
steps ran on the caller's thread and the copy is going already). Why it waits at all: the steps before the copy (metadata bytes, arena, exports, the
daemon's request) are ~150 short driver calls and some Python; beside an engine's GIL-bound start-up
they crawl (H200, 13.8 GB: the copy started ~145 ms after prepare with W = 0.25 s, against ~30 ms
alone), and every ms the copy starts later is a ms the engine waits at its load. Waiting here
costs the engine those ~15-30 ms once, and the copy then runs beside all of its start-up."""

PREPARE_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's GIL switch interval while an early call works (``sys.setswitchinterval``).

The prepare thread makes ~150 short driver calls for a 13.8 GB arena (create, map, export,
attach), each of which releases the GIL; beside an engine's GIL-bound Python, every one of them
then waits up to the default 5 ms switch interval to get it back (CPython's convoy effect). On
the CPU machine 100 calls of 0.1 ms beside a pure-Python loop took 538 ms at 5 ms and 89 ms at
0.5 ms (17 ms alone), and on the H200 the early copy of 13.8 GB had not even started after a
second of engine work. The interval is lowered while any prepare thread runs and restored after;
a thread blocked in C (the copy's wait) asks for nothing, so the engine is not disturbed then."""

_handover_lock = threading.Lock()
_handover_users = 0
_handover_saved: tuple[float, float] | None = None  # (the interval before, the one we set)


class _PromptHandover:
    """Lowers the switch interval to :data:`PREPARE_SWITCH_INTERVAL_S` from entry until
    :meth:`release` or exit, whichever comes first (shared by concurrent prepares: the last one
    out restores the interval it found, unless someone else has changed it meanwhile). A prepare
    releases it as soon as its thread only waits in C (served: once the metadata is validated), so the
    load's own threads (the views) run at the interval the engine chose."""

    def __init__(self):
        self._held = False

    def __enter__(self) -> "_PromptHandover":
        global _handover_users, _handover_saved
        with _handover_lock:
            if _handover_users == 0:
                before = sys.getswitchinterval()
                ours = min(before, PREPARE_SWITCH_INTERVAL_S)
                sys.setswitchinterval(ours)
                _handover_saved = (before, ours)
            _handover_users += 1
            self._held = True
        return self

    def release(self) -> None:
        global _handover_users, _handover_saved
        with _handover_lock:
            if not self._held:
                return
            self._held = False
            _handover_users -= 1
            if _handover_users == 0 and _handover_saved is not None:
                before, ours = _handover_saved
                if sys.getswitchinterval() == ours:
                    sys.setswitchinterval(before)
                _handover_saved = None

    def __exit__(self, *exc) -> None:
        self.release()


class PreparedLoad:
    """A load made ready ahead of time (see the module docstring); built by :func:`prepare`.

    Attributes once :meth:`wait` returns: ``mode`` (``"served"``, ``"staged"`` or ``"stream"``), ``why`` (how
    the mode was chosen), ``load_source`` (the :class:`~flashboot.flashload.sources.base.Source`
    of that mode), ``rank_source`` (the validated image), ``arena``, ``metadata``, ``tensors``
    (the views, once the load made them: :meth:`wait_viewable`), ``nbytes``, ``phases_ms`` (what
    the preparation paid, by phase, the early copy included) and ``copy`` (what the early copy
    measured: ``h2d_ms``, the daemon's reply or the stream's stats).
    :meth:`close` releases everything if the handle is dropped without a load; at interpreter
    exit every live handle is settled the same way (bounded), so no background work outlives it.
    """

    def __init__(self, image_dir, rank: int, device: Any, *, mode: str, timeout_s: float, shm_dir, tp, ep,
                 expected_key, stream_buffer_bytes=None, verify: bool | None = None):
        if mode not in MODES:
            raise FlashBootError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        # checked as a load checks them (want.py): a bytes path had been looked for as "b'/path'", a
        # numpy rank refused, a bad tp/ep/key surfaced only at the load, and a rank's directory
        # named for its job had been refused by the load that was given it too
        rank = count_of(rank, "rank", 0, LayoutError, optional=False)
        tp, ep = count_of(tp, "tp", 1), count_of(ep, "ep", 1)
        check_expected_key(expected_key)
        verify = flag_of(verify, "verify")  # verify="false" had verified
        self.image_dir, self.rank, self.device = job_dir_of(image_path(image_dir), rank), rank, Device.parse(device)
        self.real_dir = os.path.realpath(self.image_dir)
        self.timeout_s, self.shm_dir = check_timeout(timeout_s, "prepare timeout_s"), shm_dir
        self.tp, self.ep, self.expected_key = tp, ep, expected_key
        # None: chosen once the mode is known (a served copy is verified by the daemon, cheaply)
        self.asked_verify = None if verify is None else bool(verify)
        self.verify, self.verify_skipped = bool(verify), "verify=False"

        self.stream_config = StreamConfig.of(stream_buffer_bytes)  # a bad option is refused at once
        self.requested_mode, self.mode, self.why = mode, "", ""
        self.load_source = None  # the Source chosen (sources/), once the metadata is read
        self.arena = self.metadata = self.image = self.tensors = self.rank_source = None
        self.metadata_file = None  # the metadata bytes (layouts.image.MetadataFile): read first, or beside the copy
        self.resolved = None  # the rank directory and its job (layouts.image.resolve_rank)
        self.session = self.staged = self.mover = None
        self.release_thread: threading.Thread | None = None
        self.nbytes = 0
        self.metadata_sha256 = ""
        self.phases_ms: dict[str, float] = {}
        self.copy: dict[str, Any] = {}
        self._identity: dict[Path, FileIdentity] = {}
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._issued = threading.Event()  # the copy runs (or failed): what prepare() returns after
        self._waits_in_c = False  # the background thread has only C waits left (copy_issued)
        self._viewable = threading.Event()  # the arena and the validated metadata exist, or the preparation ended
        self._cancel = threading.Event()
        self._claim = threading.Lock()
        self._claimed_by: str | None = None
        self._closed = False
        # _ended: the preparation has decided whether its end releases (see _finish); _released:
        # what it holds is released (or being released), so that happens once
        self._ended = self._released = False
        self._handover = _PromptHandover()
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._thread: threading.Thread | None = None
        self.thread_cpu_ms = 0.0  # the background thread's CPU time (see _run)
        # of it, inside calls that release the GIL (driver calls, sends: flashboot.gil_time)
        self.thread_gil_free_cpu_ms = 0.0
        # of it, a served load's hand-over of its later batches: driver calls and sends, which
        # release the GIL (on the H200: 7.8 ms of CPU for A's 13.8 GB, 5.4-10.0 ms for B's 11.8 GB)
        self.handover_cpu_ms = 0.0
        # The load's wait for the copy's end (see wait_in_load): the steps the background thread
        # hands to the load's thread, whether the load waits, the eventfd that wakes the thread's
        # poll, and set once the thread has ended or handed its steps over.
        self._parked = None
        self._load_waits = False
        self.handed_to_load = False  # whether the load's thread ran the steps from the copy's end on
        self._nudge: int | None = None
        self._turn = threading.Event()
        _live.add(self)
        self._start()

    # ---- the work: on the caller's thread up to the first hand-off, then in the background ----
    def _start(self) -> None:
        """Run the preparation's steps on the caller's thread until one hands the rest to the
        background (:meth:`Source.start_prepared`'s ``yield``: before a wait, a pin, the copy's
        end), then start the thread that runs the rest. Why the caller's thread: :func:`prepare`
        waits for the copy to start anyway, and the same steps ran ~2 ms slower in a fresh thread
        than in the caller's (H200, 13.8 GB served: the copy was asked for 15.7 ms after the call
        against 13.9 for a plain load), which made the early call lose to a plain load at W = 0."""
        steps = self._prepare()
        try:
            waiting = next(steps)
        except StopIteration:
            self._finish(None)
            return
        except Exception as exc:  # handed to whoever waits, as the background thread's are
            self._finish(exc)
            return
        except BaseException as exc:  # an interrupt in the caller: released, and raised there
            self._finish(exc)
            raise
        self._thread = threading.Thread(target=self._run, args=(steps, waiting),
                                        name=f"flashboot-prepare-rank{self.rank}", daemon=True)
        self._thread.start()

    def _run(self, steps, waiting) -> None:
        """The steps from the first hand-off on. A step that is about to block on a file (the
        daemon's reply) yields that file first: :meth:`_handed_to_load` waits for it there, and
        hands the rest of the steps to the load's thread if the load is waiting for them."""
        error, handed = None, False
        cpu0, free0 = time.thread_time(), gil_free_cpu_s()
        try:
            # the switch interval lowered only while steps before the copy's start run here
            with self._handover if not self._waits_in_c else contextlib.nullcontext():
                for waiting in itertools.chain((waiting,), steps):
                    if waiting is not None and self._handed_to_load(steps, waiting):
                        handed = True
                        break
        except BaseException as exc:  # handed to whoever waits
            error = exc
        # this thread's CPU time: a bound on the GIL it can have taken from the engine meanwhile
        self.thread_cpu_ms = (time.thread_time() - cpu0) * 1e3
        self.thread_gil_free_cpu_ms = (gil_free_cpu_s() - free0) * 1e3  # so the GIL held is at most the difference
        if not handed:  # otherwise the load's thread ends the steps (and finishes)
            self._finish(error)

    def _handed_to_load(self, steps, waiting) -> bool:
        """Wait (GIL released) until ``waiting`` (a file: the daemon's reply; ``fileno()`` and a
        ``deadline`` in ``time.monotonic()``) is readable, its deadline passes, or the
        load waits for the copy's end; True when the load waits: the steps are then parked for
        its thread (:meth:`wait_in_load`), which blocks on that file itself. Why: the reply then
        wakes the thread the engine waits in, not this one, which would have to hand the GIL and
        an event to it (~0.1-0.3 ms on the critical path of a load called during the copy)."""
        with self._claim:
            if not self._load_waits:
                self._nudge = os.eventfd(0, os.EFD_CLOEXEC)
        if self._nudge is not None:
            try:
                readable([waiting.fileno(), self._nudge], waiting.deadline - time.monotonic())
            finally:
                with self._claim:
                    os.close(self._nudge)
                    self._nudge = None
        with self._claim:
            if self._load_waits:
                self._parked, self.handed_to_load = steps, True
                self._turn.set()
                return True
        return False  # readable (or its deadline passed: the step's own wait says so)

    def _finish(self, error: BaseException | None) -> None:
        if error is not None:
            self._error = error
            self._release()
        self._issued.set()
        self._viewable.set()
        self.finished = time.perf_counter()
        with self._claim:
            self._ended = True  # a close from here on releases itself (it had been left to no one)
            closed_meanwhile = self._closed and self._error is None
        if closed_meanwhile:  # close() gave up waiting: the memory is released now the copy has ended
            self._release()
        self._done.set()
        self._turn.set()

    def copy_issued(self, *, waits_in_c: bool = False) -> None:
        """Called by the source once its copy runs without this process's Python (the daemon
        copies, the pin or the reads are under way): :func:`prepare` returns then.
        ``waits_in_c``: from here the thread makes no more GIL-releasing calls (driver calls,
        reads, numpy passes) but its wait in C (the daemon's reply), so the lowered switch
        interval (:class:`_PromptHandover`) is restored now, not when it ends, and then the
        views can be made (a metadata opened with ``viewable=False``)."""
        if waits_in_c:
            self._waits_in_c = True
            self._handover.release()
            self._note_viewable()
        self._issued.set()

    def phase(self, name: str, t0: float) -> float:
        """Add the time since ``t0`` to phase ``name``; returns now. Refuses to go on once closed."""
        if self._cancel.is_set():
            raise FlashBootError(f"the prepared load of rank {self.rank} of {self.image_dir} was closed during "
                                 f"its {name} phase")
        now = time.perf_counter()
        self.phases_ms[name] = self.phases_ms.get(name, 0.0) + (now - t0) * 1e3
        return now

    def _prepare(self):
        """The steps, a generator: each ``yield`` hands what follows to the background thread."""
        from flashboot.layouts.image import resolve_rank

        t = time.perf_counter()
        self.resolved = resolve_rank(self.image_dir, self.rank)
        daemon = None  # the preloader's status, read once for both choices
        if self.requested_mode == "auto":
            from .shm import service_status

            daemon = service_status(self.image_dir, self.shm_dir)
        first = choose_copy_first(self.requested_mode, self.image_dir, self.rank, self.shm_dir, daemon)
        if first is not None:
            # The daemon's .ready vouches for the bytes it holds: its copy starts first, and the
            # metadata is read (it must be the .ready's bytes) and strictly validated while it
            # copies (as a plain served load); the job's tp/ep/key are refused before.
            t = self.phase("metadata", t)  # the bytes are read beside the copy: added to it there
            source, self.why = first
        else:
            self.read_metadata_file()
            self.open_metadata()
            t = self.phase("metadata", t)
            source, self.why = choose_prepared(self.requested_mode, self.rank_source, self.shm_dir, daemon)
        self.load_source, self.mode = source, source.mode
        if self.asked_verify is None:
            self.verify, self.verify_skipped = verify_default(self.device, by_daemon=source.verified_by_daemon)
        t = self.phase("mode", t)
        if first is None:
            yield  # the arena, the pin or the reads: made in the background thread, which keeps its CUDA state
            self.create_arena(self.nbytes)
            t = self.phase("arena", t)
        # Each source starts its copy as soon as it can (the load makes the views meanwhile).
        t_copy = yield from source.start_prepared(self, t)
        self.copy["started_after_prepare_ms"] = (t_copy - self.started) * 1e3
        t = self.phase("copy", t_copy)
        if self.verify:  # checked here too, so the load has nothing left but to report it
            checked = LoadReport(mode="", device=str(self.device), rank=self.rank, nbytes=self.nbytes)
            where = (f"{source.bytes_from(self.image.path, self.image_dir, self.rank, self.shm_dir)} (rank "
                     f"{self.rank}) copied into {self.device} by flashboot.prepare")
            source.verify_prepared(self, where, checked)
            self.copy["verified"] = checked.details["verified"]
            self.phase("verify", t)

    def read_metadata_file(self) -> None:
        """The metadata bytes read and hashed, the table decoded beside the hash
        (:attr:`metadata_file`, :attr:`metadata_sha256`)."""
        from flashboot.layouts.image import read_metadata_file

        self.metadata_file = read_metadata_file(self.image_dir, self.rank, decode=True, resolved=self.resolved)
        self.metadata_sha256 = self.metadata_file.sha256

    def open_metadata(self, nbytes: int | None = None, *, viewable: bool = True) -> None:
        """The strict read of the metadata bytes read first (:attr:`metadata_file`): image,
        metadata, size and the files' identity (a re-pack is refused at the load). ``nbytes``:
        the size the arena was made for (a copy-first source's), which the image must have.
        ``viewable=False``: the views wait for :meth:`copy_issued` (``waits_in_c``)."""
        from flashboot.layouts.image import FileIdentity, open_image

        from .shm import RankSource

        mf = self.metadata_file
        image = open_image(mf, self.rank, tp=self.tp, ep=self.ep, expected_key=self.expected_key)
        if nbytes is not None and image.nbytes != nbytes:
            raise LayoutError(f"the arena was made for {nbytes:,} bytes (the preloader's .ready); {mf.where} records "
                              f"{image.nbytes:,}")
        self.image, self.metadata, self.nbytes = image, image.metadata, image.nbytes
        self.rank_source = RankSource(str(self.image_dir), self.rank, image, mf.sha256)  # as a plain load reads it
        # the image file as its metadata was validated against it; metadata.json as it is now
        self._identity[Path(image.path)] = image.file_identity
        self._identity[Path(image.metadata_path)] = FileIdentity.of(image.metadata_path)
        if self.nbytes == 0:
            raise LayoutError(f"{image.path}: empty image, nothing to load")
        if viewable:
            self._note_viewable()

    def create_arena(self, nbytes: int, *, flat: bool = True, segments_now: int | None = None) -> None:
        """Admit ``nbytes`` on the device (OutOfMemoryError with the numbers, before any
        allocation), then create the arena and (``flat``) its flat tensor, which the views are cut
        from. A source whose copy needs no tensor here (the daemon's) passes False and makes it
        once the copy runs: its first call in a process costs ~1-2 ms, before the copy otherwise.
        ``segments_now``: as ``Arena.create``'s (the daemon's copy starts on the first ones)."""
        from ..arena import Arena

        admit(nbytes, self.device)
        self.nbytes = nbytes
        self.arena = Arena.create(nbytes, self.device, segments_now=segments_now)
        if flat:
            self.arena.bytes()
        self._note_viewable()

    def _note_viewable(self) -> None:
        if self.arena is not None and self.metadata is not None:
            self._viewable.set()

    @property
    def wait_bound_s(self) -> float:
        """How long a wait for this preparation lasts unless told otherwise: the handle's
        ``timeout_s`` plus :data:`PREPARE_ALLOWANCE_S` (the pin of tens of GB)."""
        return self.timeout_s + PREPARE_ALLOWANCE_S

    def wait_viewable(self, timeout_s: float | None = None) -> bool:
        """Block until the views can be made (the arena and the validated metadata exist; the
        copy may still run) or the preparation has ended; True in the first case.

        The load makes the views, not this handle's thread: the views are one torch tensor each,
        made with the GIL held (1-2 us apiece), so in the background they take that long from
        the engine's own start-up work and more (every hand-over of the GIL costs it a wait),
        while in the load they cost exactly their time, and run while the copy does if it has
        not ended. WaitTimeoutError after :meth:`wait`'s bound."""
        limit = self.wait_bound_s if timeout_s is None else timeout_s
        if not self._viewable.wait(limit):
            raise WaitTimeoutError(f"preparing the load of rank {self.rank} of {self.image_dir} onto {self.device} had "
                                   f"not its arena and metadata within {limit:g} s (phases so far: {self._phases_text()})")
        with self._claim:
            return self._error is None and self.arena is not None and self.metadata is not None and \
                not self.arena.closed

    def _release(self) -> None:
        """Release what the preparation holds; only once no copy writes into the arena (the
        background thread calls it when it ends, the caller's side only after :meth:`wait`). Once."""
        with self._claim:
            if self._released:
                return
            self._released = True
        if self.session is not None:
            self.session.close()
        if self.release_thread is not None:
            self.release_thread.join(CLOSE_TIMEOUT_S)  # the unpin already under way
        elif self.staged is not None:
            self.staged.close()
        if self.arena is not None and not self.arena.closed:
            self.arena.close()
        self.tensors = None
        _live.discard(self)

    def _release_when_done(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Release what the preparation holds once its background work (the copy) has ended: here
        if it ends within ``timeout_s``, else by the background thread when it does. Memory a copy
        still writes into is never unmapped."""
        with self._claim:
            self._closed = True  # the thread's end releases it if this stops waiting first
            ended = self._ended  # unless its end had already passed that check: then here
        self._cancel.set()
        if ended or self._done.wait(timeout_s):
            self._release()

    # ---- the caller's side -------------------------------------------------------------------
    @property
    def cancelled(self) -> threading.Event:
        """Set once the handle is closed unused: a copy that can stop early (the stream) stops."""
        return self._cancel

    @property
    def done(self) -> bool:
        """Whether the preparation, the early copy included, has ended (ready or failed)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> "PreparedLoad":
        """Block until the preparation and its early copy are done; returns self or raises what it
        raised (WaitTimeoutError after ``timeout_s``, default the handle's plus
        :data:`PREPARE_ALLOWANCE_S`)."""
        limit = (self.wait_bound_s if timeout_s is None else
                 check_timeout(timeout_s, "wait timeout_s", zero_ok=True))
        if not self._done.wait(limit):
            raise WaitTimeoutError(f"preparing the load of rank {self.rank} of {self.image_dir} onto {self.device} did "
                                   f"not finish within {limit:g} s (phases so far: {self._phases_text()})")
        if self._error is not None:
            raise self._error
        if self._closed:
            raise FlashBootError(f"the prepared load of rank {self.rank} of {self.image_dir} is closed")
        return self

    def wait_in_load(self, timeout_s: float | None = None) -> "PreparedLoad":
        """:meth:`wait`, for the load that claimed this handle: where the background thread only
        waits for the copy's end (the daemon's reply), it hands the rest of its steps over and
        they run here, so the reply wakes this thread (see :meth:`_handed_to_load`)."""
        limit = self.wait_bound_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        with self._claim:
            self._load_waits = True
            if self._nudge is not None:
                os.eventfd_write(self._nudge, 1)
        turned = self._turn.wait(limit)
        with self._claim:
            steps, self._parked = self._parked, None
            if steps is None and not turned:
                self._load_waits = False  # gave up: the background thread keeps the steps and ends them
        if steps is not None:
            self._run_here(steps)
        return self.wait(max(0.0, limit - (time.monotonic() - t0)))

    def _run_here(self, steps) -> None:
        """The rest of the steps, handed over by the background thread, on this thread."""
        error = None
        try:
            for _ in steps:  # a later wait blocks here: this thread waits for the copy anyway
                pass
        except BaseException as exc:
            error = exc
        self._finish(error)
        if error is not None and not isinstance(error, Exception):
            raise error  # an interrupt in the caller: released, and raised there

    def check_request(self, image_dir, rank: int, device: Device) -> None:
        """FlashBootError naming what differs when a load asks this handle for another image, rank or
        device than it was prepared for."""
        diffs = []
        real = os.path.realpath(str(image_dir))
        if real != self.real_dir:
            # one path whose link was moved since: it had read 'image /x/current (prepared: /x/current)'
            moved = (f", which resolved to {self.real_dir} then and resolves to {real} now"
                     if os.path.abspath(str(image_dir)) == os.path.abspath(self.image_dir) else "")
            diffs.append(f"image {image_dir} (prepared: {self.image_dir}{moved})")
        if rank != self.rank:
            diffs.append(f"rank {rank} (prepared: {self.rank})")
        if device != self.device:
            diffs.append(f"device {device} (prepared: {self.device})")
        if diffs:
            raise FlashBootError("this prepared load cannot serve " + "; ".join(diffs))

    def check_unchanged(self) -> None:
        """LayoutError when the image's files changed since the preparation read them (re-packed)."""
        from flashboot.layouts.image import FileIdentity

        for path, seen in self._identity.items():
            try:
                now = FileIdentity.of(path).key
            except OSError:  # gone, or its directory replaced by a file
                now = None
            if now != seen.key:
                what = "is gone" if now is None else f"changed (device, inode, size, mtime_ns {seen.key} -> {now})"
                raise LayoutError(f"{path} {what} since flashboot.prepare read it: the image was re-packed; the "
                                  "bytes copied early are discarded; prepare again")

    def claim(self, who: str) -> None:
        """One load per handle: a second one is refused, never interleaved with the first."""
        with self._claim:
            if self._closed:
                raise FlashBootError(f"the prepared load of rank {self.rank} of {self.image_dir} is closed")
            if self._claimed_by is not None:
                raise FlashBootError(f"this prepared load of rank {self.rank} of {self.image_dir} already served "
                                     f"{self._claimed_by}; a prepared load serves one load (call prepare again)")
            self._claimed_by = who

    @property
    def load_called(self) -> bool:
        """Whether a load has claimed this handle (it then waits for what is left of the preparation)."""
        return self._claimed_by is not None

    def load(self, *, verify: bool | None = None):
        """``flashboot.load(image_dir, rank, device, prepared=self, verify=verify)``."""
        from .pipeline import load

        return load(self.image_dir, self.rank, self.device, prepared=self, verify=verify)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Release the arena, the daemon's attachment and the pin of a handle that no load used
        (idempotent; a loaded image owns the arena once the load returned).

        The preparation stops at its next phase; a copy already running (the daemon's H2D, the
        bulk copy, the stream) cannot be cut short, so this waits for it up to ``timeout_s``. If it
        is still running then, WaitTimeoutError, and the background thread releases the memory
        when the copy ends: memory a copy still writes into is never unmapped."""
        check_timeout(timeout_s, "close timeout_s", zero_ok=True)  # NaN had waited forever, inf OverflowError
        with self._claim:
            if self._closed or self._claimed_by is not None:
                return
            self._closed = True
            ended = self._ended  # the thread's end no longer releases: this does, at once
        self._cancel.set()
        if not ended and not self._done.wait(timeout_s):
            raise WaitTimeoutError(f"closing the prepared load of rank {self.rank} of {self.image_dir}: its copy "
                                   f"still ran after {timeout_s:g} s (phases so far: {self._phases_text()}); it "
                                   "releases the arena itself when the copy ends")
        self._release()

    def __enter__(self) -> "PreparedLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _phases_text(self) -> str:
        return ", ".join(f"{k} {v:.1f} ms" for k, v in self.phases_ms.items()) or "none"

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "failed" if self._error else "used" if self._claimed_by else
                 "ready" if self.done else "preparing")
        return (f"PreparedLoad(rank {self.rank} of {self.image_dir!r} -> {self.device}, {self.mode or '?'}, "
                f"{self.nbytes:,} bytes, {state})")


_live: "weakref.WeakSet[PreparedLoad]" = weakref.WeakSet()
"""Handles whose background work may still run or hold memory; settled at interpreter exit."""


@atexit.register
def _settle_at_exit() -> None:
    """Stop every live handle's background work before the interpreter tears down: a thread still
    inside torch or a driver call while the runtime is destroyed aborts the process ("terminate
    called without an active exception"). Unused handles are closed; used ones have ended."""
    handles = list(_live)
    for handle in handles:  # every unused one told to stop first: closed one at a time, a later one had
        with handle._claim:  # gone on meanwhile (into its verify: numba imported while the interpreter exits)
            unused = not handle._closed and handle._claimed_by is None
        if unused:
            handle._cancel.set()
    for handle in handles:
        try:
            handle.close(timeout_s=CLOSE_TIMEOUT_S)
        except Exception:  # at exit there is no caller left to tell; the wait was bounded
            pass
        if handle._thread is not None:
            handle._thread.join(CLOSE_TIMEOUT_S if handle._thread.is_alive() else 0)


def prepare(image_dir, rank: int = 0, device: Any = None, *, mode: str = "auto", timeout_s: float = 60.0,
            shm_dir=None, tp: int | None = None, ep: int | None = None, expected_key=None,
            hold_s: float | None = None, stream_buffer_bytes=None, verify: bool | None = None) -> PreparedLoad:
    """Start making rank ``rank`` of ``image_dir`` ready to load onto ``device``; returns once its
    copy is under way and, served, its metadata read while the daemon copies. The steps up to
    there run on the caller's thread; where one would wait (the preloader still staging, a pin,
    the stream), a background thread takes over and this returns after at most
    :data:`PREPARE_RETURN_S`. The wait for the copy's end runs in the background.

    Call it when the engine starts, before it builds its model, then pass the handle to
    ``flashboot.load(image_dir, rank, device, prepared=handle)``. It reads and
    validates the metadata (refusing a wrong ``tp``/``ep``/``expected_key`` at once), admits the
    image against the device's free memory, creates the arena, then either hands it to the
    served-load daemon, which copies at once (``mode="served"``, or ``"auto"`` when one runs), starts pinning the
    staged image here (``"staged"``, or ``"auto"`` when a preloader staged it), or readies a load
    streamed from disk (``"stream"``, or ``"auto"`` when nothing is or will be staged; the ring is
    at most ``stream_buffer_bytes``) and warms the copy path (the load makes the views). ``timeout_s``
    bounds each wait (the preloader's ``.ready``, the daemon's socket); ``hold_s``: no longer used
    (the daemon copies at once; kept so existing callers work). ``verify``: recompute
    the chunk checksums once the copy ends, in the background too (None: on CUDA, where it costs
    ~2 % of the copy; not on the host backend, where it costs ~2x); a load asking for it then
    only reports it, and a mismatch surfaces from the load.

    Errors surface from the load (or :meth:`PreparedLoad.wait`), with their own class.
    """
    handle = PreparedLoad(image_dir, rank, device, mode=mode, timeout_s=timeout_s, shm_dir=shm_dir, tp=tp, ep=ep,
                          expected_key=expected_key, stream_buffer_bytes=stream_buffer_bytes,
                          verify=verify)
    handle._issued.wait(PREPARE_RETURN_S)
    return handle


# ==================================================================== the load of a handle
def load_prepared(request: LoadRequest) -> LoadedImage:
    """Wait for the copy a :func:`flashboot.prepare` handle started itself (everything else was
    paid at start-up), check that the image is still the one it copied, verify (``None``: as the
    handle chose once it knew its mode)."""
    from flashboot.layouts.image import check_request

    prepared, image_dir, rank, dev, t_start = (request.prepared, request.image_dir, request.rank, request.device,
                                               request.t_start)
    verify, tp, ep, expected_key = request.verify, request.tp, request.ep, request.expected_key
    prepared.check_request(image_dir, rank, dev)
    prepared.claim(f"the load called at {time.strftime('%H:%M:%S')}")
    report = LoadReport(mode="", device=str(dev), rank=rank, nbytes=0)
    try:
        ready_before = prepared.done
        t0 = time.perf_counter()
        tensors = None
        # the load's own timeout bounds its waits (load() defaults it to the handle's wait_bound_s)
        def left_s() -> float:
            return max(0.0, request.timeout_s - (time.perf_counter() - t_start))

        # the views are made here, while the copy runs (see PreparedLoad.wait_viewable)
        if prepared.wait_viewable(left_s()):
            check_request(prepared.metadata, str(prepared.image.metadata_path), tp=tp, ep=ep,
                          expected_key=expected_key)
            t1 = time.perf_counter()
            tensors = make_views(prepared.arena, prepared.metadata)
            report.bind_ms = (time.perf_counter() - t1) * 1e3
        prepared.wait_in_load(left_s())
        prepared.tensors = tensors
        report.wait_ms = (time.perf_counter() - t0) * 1e3 - report.bind_ms
        if verify is None:
            verify = prepared.verify
        arena, meta = prepared.arena, prepared.metadata
        check_request(meta, str(prepared.image.metadata_path), tp=tp, ep=ep, expected_key=expected_key)
        prepared.check_unchanged()  # a re-packed image: the early copy's bytes are discarded with the arena
        report.nbytes, report.tensors = prepared.nbytes, len(meta.tensors)
        copy = prepared.copy
        report.h2d_ms = copy["h2d_ms"]
        report.overlapped = ["h2d"]  # the copy ran before the call or while the load waited: in wait_ms, not added
        report.details = {"prepared": dict(prepared.phases_ms), "prepared_mode_why": prepared.why,
                          "prepare_total_ms": (prepared.finished - prepared.started) * 1e3,
                          # the GIL prepare held: its call on the caller's thread, and at most this in its own
                          "prepare_thread_cpu_ms": prepared.thread_cpu_ms,
                          "prepare_handover_cpu_ms": prepared.handover_cpu_ms,
                          "prepare_thread_gil_free_cpu_ms": prepared.thread_gil_free_cpu_ms,
                          "prepared_before_load": ready_before,
                          # "load": the copy's end was awaited on the load's thread (wait_in_load)
                          "copy_end_awaited_on": "load" if prepared.handed_to_load else "prepare's thread",
                          "copy_started_after_prepare_ms": copy["started_after_prepare_ms"],
                          # > 0: the weights were in place that long before the load was called
                          "ready_before_load_ms": max(0.0, (t_start - prepared.finished) * 1e3)}
        prepared.load_source.report_prepared(report, prepared, dev)
        if copy.get("verified"):  # checked: said whether or not this load asked (it had said "not verified")
            report.details["verified"] = copy["verified"] + " (checked by flashboot.prepare once its copy ended)"
        elif verify:
            where = prepared.load_source.bytes_from(prepared.image.path, image_dir, rank, prepared.shm_dir)
            verify_loaded(arena, meta, f"{where} (rank {rank}) loaded into {dev}", report)
    except WaitTimeoutError:
        prepared._release_when_done(0)  # released by its own thread once it ends: no copy is cut short
        if prepared.done:
            raise  # the preparation's own wait (a .ready, the daemon) timed out
        raise WaitTimeoutError(f"the load of rank {rank} of {image_dir} waited its timeout_s of "
                               f"{request.timeout_s:g} s for flashboot.prepare() to end; it still runs (phases so far: "
                               f"{prepared._phases_text()}) and releases what it holds once it ends") from None
    except BaseException:
        prepared._release_when_done()  # refused while the copy ran (its tp, say): the copy ends first
        raise
    report.total_ms = (time.perf_counter() - t_start) * 1e3
    return LoadedImage(arena, tensors, meta, report, prepared.rank_source, prepared.release_thread)


__all__ = ["MODES", "PreparedLoad", "load_prepared", "prepare"]
