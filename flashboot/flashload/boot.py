"""The early call: every one-time cost of a load, and the copy itself, started at engine start-up.

An engine boots once, so its first :func:`flashboot.load` is the one that counts, and a cold load
pays for reading and validating the metadata, creating and exporting the arena, the daemon's
mapping of it, tens of thousands of views, and the first copy's set-up. :func:`prepare` starts
all of that in a background thread as soon as the engine starts (before it builds its model) and
returns at once; the copy then starts as soon as it can, so an engine that builds its model for
longer than the copy takes finds its weights in place. ``flashboot.load(..., prepared=handle)``
(or ``handle.load()``) only waits for that copy, checks that the image was not re-packed since,
and verifies:

* served (a ``flashboot preload --serve`` daemon holds the image pinned): the arena is created,
  exported and attached to the daemon, which checks it against what it holds, maps it and is
  asked for its H2D at once; the views are built while it copies;
* pinned early (a preloader staged the rank, no daemon): the staged file is mapped and pinned
  in this process (:class:`~flashboot.flashload.stage.StagedImage`); the bulk H2D is issued as
  soon as the pin is done;
* streamed (nothing is or will be staged: see :func:`~flashboot.flashload.stream.stream_reason`):
  the reads start at once, straight into the arena through the bounded ring.

The background thread holds the GIL only for the metadata and the views: it waits in blocking
calls (the daemon's socket, the pin, the stream's reads, the copy's synchronisation) that
release it. A handle serves one load; it is refused for another image, rank or device, or after
the image was re-packed (the bytes copied early are then discarded with the arena).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..errors import FlashBootError, LayoutError, WaitTimeoutError
from ..memory import Device

MODES = ("auto", "served", "staged", "stream")
PREPARE_ALLOWANCE_S = 120.0
"""Added to the handle's ``timeout_s`` when a load waits for its preparation (a pin of tens of GB)."""
CLOSE_TIMEOUT_S = 30.0
"""How long :meth:`PreparedLoad.close` (and the exit hook) waits for a copy that is running."""


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


@contextlib.contextmanager
def _prompt_gil_handover():
    """Lower the switch interval to :data:`PREPARE_SWITCH_INTERVAL_S` for the duration (shared by
    concurrent prepares: the last one out restores the interval it found, unless someone else has
    changed it meanwhile)."""
    global _handover_users, _handover_saved
    with _handover_lock:
        if _handover_users == 0:
            before = sys.getswitchinterval()
            ours = min(before, PREPARE_SWITCH_INTERVAL_S)
            sys.setswitchinterval(ours)
            _handover_saved = (before, ours)
        _handover_users += 1
    try:
        yield
    finally:
        with _handover_lock:
            _handover_users -= 1
            if _handover_users == 0 and _handover_saved is not None:
                before, ours = _handover_saved
                if sys.getswitchinterval() == ours:
                    sys.setswitchinterval(before)
                _handover_saved = None


def _file_identity(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class PreparedLoad:
    """A load made ready ahead of time (see the module docstring); built by :func:`prepare`.

    Attributes once :meth:`wait` returns: ``mode`` (``"served"``, ``"staged"`` or ``"stream"``), ``why`` (how
    the mode was chosen), ``arena``, ``metadata``, ``tensors`` (the views), ``nbytes``,
    ``phases_ms`` (what the preparation paid, by phase, the early copy included) and ``copy``
    (what the early copy measured: ``h2d_ms``, the daemon's reply or the stream's stats).
    :meth:`close` releases everything if the handle is dropped without a load; at interpreter
    exit every live handle is settled the same way (bounded), so no background work outlives it.
    """

    def __init__(self, image_dir, rank: int, device: Any, *, mode: str, timeout_s: float, shm_dir, tp, ep,
                 expected_key, hold_s: float | None, stream_buffer_bytes=None, verify: bool | None = None):
        if mode not in MODES:
            raise FlashBootError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise LayoutError(f"rank must be a non-negative int, got {rank!r}")
        self.image_dir, self.rank, self.device = str(image_dir), rank, Device.parse(device)
        self.real_dir = os.path.realpath(self.image_dir)
        self.timeout_s, self.shm_dir, self.hold_s = float(timeout_s), shm_dir, hold_s
        self.tp, self.ep, self.expected_key = tp, ep, expected_key
        from .stream import StreamConfig

        # None: chosen once the mode is known (a served copy is verified by the daemon, cheaply)
        self.asked_verify = None if verify is None else bool(verify)
        self.verify, self.verify_skipped = bool(verify), "verify=False"

        self.stream_config = StreamConfig.of(stream_buffer_bytes)  # a bad option is refused at once
        self.requested_mode, self.mode, self.why = mode, "", ""
        self.arena = self.metadata = self.image = self.tensors = None
        self.session = self.staged = self.mover = None
        self.release_thread: threading.Thread | None = None
        self.nbytes = 0
        self.metadata_sha256 = ""
        self.phases_ms: dict[str, float] = {}
        self.copy: dict[str, Any] = {}
        self._identity: dict[Path, tuple[int, int, int]] = {}
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._claim = threading.Lock()
        self._claimed_by: str | None = None
        self._closed = False
        self.started = time.perf_counter()
        self.finished: float | None = None
        _live.add(self)
        self._thread = threading.Thread(target=self._run, name=f"flashboot-prepare-rank{rank}", daemon=True)
        self._thread.start()

    # ---- the background work -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with _prompt_gil_handover():
                self._prepare()
        except BaseException as exc:  # handed to whoever waits
            self._error = exc
            self._release()
        finally:
            self.finished = time.perf_counter()
            with self._claim:
                closed_meanwhile = self._closed and self._error is None
            if closed_meanwhile:  # close() gave up waiting: the memory is released now the copy has ended
                self._release()
            self._done.set()

    def _phase(self, name: str, t0: float) -> float:
        if self._cancel.is_set():
            raise FlashBootError(f"the prepared load of rank {self.rank} of {self.image_dir} was closed during "
                                 f"its {name} phase")
        now = time.perf_counter()
        self.phases_ms[name] = self.phases_ms.get(name, 0.0) + (now - t0) * 1e3
        return now

    def _prepare(self) -> None:
        from flashboot.layouts.image import open_image, read_metadata_file

        from ..arena import Arena
        from .load import _mover_for, admit

        t = time.perf_counter()
        mf = read_metadata_file(self.image_dir, self.rank)
        image = open_image(mf, self.rank, tp=self.tp, ep=self.ep, expected_key=self.expected_key)
        self.image, self.metadata, self.nbytes = image, image.metadata, image.nbytes
        self.metadata_sha256 = mf.sha256
        for path in (image.metadata_path, image.path):
            self._identity[Path(path)] = _file_identity(Path(path))
        if self.nbytes == 0:
            raise LayoutError(f"{image.path}: empty image, nothing to load")
        t = self._phase("metadata", t)
        self.mode, self.why = self._choose_mode()
        if self.asked_verify is None:
            from .load import _verify_default

            self.verify, self.verify_skipped = _verify_default(self.device, by_daemon=self.mode == "served")
        t = self._phase("mode", t)
        admit(self.nbytes, self.device)  # before any allocation: OutOfMemoryError with the numbers
        self.arena = Arena.create(self.nbytes, self.device)
        self.arena.bytes()  # the flat tensor made on this thread (torch device state is per thread)
        t = self._phase("arena", t)
        # Each mode starts its copy as soon as it can and builds the views while it runs.
        if self.mode == "served":
            self._attach()
            t = self._phase("attach", t)
            self.session.start_copy()
            t_copy = t
            self._views()
            reply = self.session.wait_copy(timeout_s=self.timeout_s + 60)
            self.copy = {"h2d_ms": reply["h2d_ms"], "reply": reply}
        elif self.mode == "staged":
            self._stage()
            t = self._phase("stage_start", t)
            self.mover = _mover_for(self.device)
            _warm_copy(self.device, self.mover)
            t = self._phase("warm", t)
            self._views()
            t = time.perf_counter()
            self.staged.wait()
            t_copy = self._phase("pin_wait", t)
            chunks, _ = _bulk_copy_of(self)
            self.copy = {"h2d_ms": (time.perf_counter() - t_copy) * 1e3, "chunks": chunks,
                         "pinned": self.staged.pinned, "pin_ms": self.staged.pin_ms}
            self.release_thread = self.staged.close_in_background()  # the unpin (~170 ms for 8 GB) is nobody's wait
        else:
            from .load import _Beside
            from .stream import stream_image

            side = None

            def start_views():
                nonlocal side
                side = _Beside(self._views)

            t_copy = t
            try:
                stats = stream_image(self.image.path, self.nbytes, self.arena, self.stream_config,
                                     on_start=start_views)
            finally:
                if side is not None:
                    side.join()  # the views go with the arena, whether the stream failed or not
            if side is None:
                self._views()
            self.copy = {"h2d_ms": stats.seconds * 1e3, "stats": stats}
        self.copy["started_after_prepare_ms"] = (t_copy - self.started) * 1e3
        t = self._phase("copy", t_copy)
        if self.verify:  # checked here too, so the load has nothing left but to report it
            from .load import LoadReport, verify_loaded

            checked = LoadReport(mode="", device=str(self.device), rank=self.rank, nbytes=self.nbytes)
            where = f"{self.image.path} (rank {self.rank}) copied into {self.device} by flashboot.prepare"
            if self.mode == "served":
                from .client import check_daemon_digests

                check_daemon_digests(self.copy["reply"], self.metadata, where, checked)
            else:
                verify_loaded(self.arena, self.metadata, where, checked)
            self.copy["verified"] = checked.details["verified"]
            self._phase("verify", t)

    def _views(self) -> None:
        from .views import make_views

        t = time.perf_counter()
        self.tensors = make_views(self.arena, self.metadata)
        self.phases_ms["views"] = (time.perf_counter() - t) * 1e3

    def _choose_mode(self) -> tuple[str, str]:
        if self.requested_mode != "auto":
            return self.requested_mode, "asked for"
        from .service import service_status
        from .shm import RankSource
        from .stream import stream_reason

        st = service_status(self.image_dir, self.shm_dir)
        if st.running and st.serve:
            return "served", f"a served-load daemon runs (pid {st.pid})"
        source = RankSource(self.image_dir, self.rank, self.image, self.metadata_sha256)
        why = stream_reason(self.image_dir, self.rank, source, shm_dir=self.shm_dir)
        if why is not None:
            return "stream", why
        if st.running:
            return "staged", f"a preloader without --serve runs (pid {st.pid}): pinning its staged copy here"
        return "staged", "no served-load daemon runs: pinning the staged copy here"

    def _attach(self) -> None:
        from .client import attach_served, served_ready

        where = str(self.image.metadata_path)
        served_ready(self.image_dir, self.rank, self.metadata_sha256, where, timeout_s=self.timeout_s,
                     shm_dir=self.shm_dir)
        self.session = attach_served(self.arena, image_dir=self.image_dir, rank=self.rank, nbytes=self.nbytes,
                                     metadata_sha256=self.metadata_sha256, timeout_s=self.timeout_s,
                                     shm_dir=self.shm_dir, hold_s=self.hold_s, verify=self.verify)
        self.phases_ms["daemon_map"] = float(self.session.attach_reply.get("map_ms", 0.0))

    def _stage(self) -> None:
        from .shm import RankSource
        from .stage import StagedImage

        source = RankSource(self.image_dir, self.rank, self.image, self.metadata_sha256)
        self.staged = StagedImage(self.image_dir, self.rank, self.device, timeout_s=self.timeout_s,
                                  shm_dir=self.shm_dir, source=source)

    def _release(self) -> None:
        """Release what the preparation holds; only once no copy writes into the arena (the
        background thread calls it when it ends, the caller's side only after :meth:`wait`)."""
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

    # ---- the caller's side -------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether the preparation, the early copy included, has ended (ready or failed)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> "PreparedLoad":
        """Block until the preparation and its early copy are done; returns self or raises what it
        raised (WaitTimeoutError after ``timeout_s``, default the handle's plus
        :data:`PREPARE_ALLOWANCE_S`)."""
        limit = self.timeout_s + PREPARE_ALLOWANCE_S if timeout_s is None else timeout_s
        if not self._done.wait(limit):
            raise WaitTimeoutError(f"preparing the load of rank {self.rank} of {self.image_dir} onto {self.device} did "
                                   f"not finish within {limit:g} s (phases so far: {self._phases_text()})")
        if self._error is not None:
            raise self._error
        if self._closed:
            raise FlashBootError(f"the prepared load of rank {self.rank} of {self.image_dir} is closed")
        return self

    def check_request(self, image_dir, rank: int, device: Device) -> None:
        """FlashBootError naming what differs when a load asks this handle for another image, rank or
        device than it was prepared for."""
        diffs = []
        if os.path.realpath(str(image_dir)) != self.real_dir:
            diffs.append(f"image {image_dir} (prepared: {self.image_dir})")
        if rank != self.rank:
            diffs.append(f"rank {rank} (prepared: {self.rank})")
        if device != self.device:
            diffs.append(f"device {device} (prepared: {self.device})")
        if diffs:
            raise FlashBootError("this prepared load cannot serve " + "; ".join(diffs))

    def check_unchanged(self) -> None:
        """LayoutError when the image's files changed since the preparation read them (re-packed)."""
        for path, seen in self._identity.items():
            try:
                now = _file_identity(path)
            except FileNotFoundError:
                now = None
            if now != seen:
                what = "is gone" if now is None else (f"changed (inode, size, mtime_ns {seen} -> {now})")
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

    def load(self, *, verify: bool | None = None):
        """``flashboot.load(image_dir, rank, device, prepared=self, verify=verify)``."""
        from .load import load

        return load(self.image_dir, self.rank, self.device, prepared=self, verify=verify)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Release the arena, the daemon's attachment and the pin of a handle that no load used
        (idempotent; a loaded image owns the arena once the load returned).

        The preparation stops at its next phase; a copy already running (the daemon's H2D, the
        bulk copy, the stream) cannot be cut short, so this waits for it up to ``timeout_s``. If it
        is still running then, WaitTimeoutError, and the background thread releases the memory
        when the copy ends: memory a copy still writes into is never unmapped."""
        with self._claim:
            if self._closed or self._claimed_by is not None:
                return
            self._closed = True
        self._cancel.set()
        if not self._done.wait(timeout_s):
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
        state = ("failed" if self._error else "closed" if self._closed else "used" if self._claimed_by else
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
    for handle in list(_live):
        try:
            handle.close(timeout_s=CLOSE_TIMEOUT_S)
        except Exception:  # at exit there is no caller left to tell; the wait was bounded
            pass
        handle._thread.join(CLOSE_TIMEOUT_S if handle._thread.is_alive() else 0)


def _bulk_copy_of(handle: PreparedLoad):
    """The staged image -> the arena, in 1 GiB chunks (see :func:`flashboot.flashload.load._bulk_copy`)."""
    from .load import DEFAULT_CHUNK_BYTES, _bulk_copy

    return _bulk_copy(handle.mover, handle.arena, handle.staged.span(), handle.nbytes, DEFAULT_CHUNK_BYTES)


def _warm_copy(device: Device, mover) -> None:
    """One small pinned H2D on a fresh stream of ``device``: the copy path's first-use costs (the
    stream, the copy engine's first launch) are paid here, not by the load's first chunk. On the
    host backend: one copy large enough to compile the host mover's parallel loop."""
    if not device.is_cuda:
        import numpy as np

        mover.copy(np.zeros(2 << 20, np.uint8), np.ones(2 << 20, np.uint8), stream=None)
        return
    import cupy

    with cupy.cuda.Device(device.index):  # this thread's current device only: the caller's is untouched
        host = cupy.cuda.alloc_pinned_memory(1 << 16)
        dev = cupy.cuda.alloc(1 << 16)
        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.runtime.memcpyAsync(dev.ptr, host.ptr, 1 << 16, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()


def prepare(image_dir, rank: int = 0, device: Any = None, *, mode: str = "auto", timeout_s: float = 60.0,
            shm_dir=None, tp: int | None = None, ep: int | None = None, expected_key=None,
            hold_s: float | None = None, stream_buffer_bytes=None, verify: bool | None = None) -> PreparedLoad:
    """Start making rank ``rank`` of ``image_dir`` ready to load onto ``device``; returns at once.

    Call it when the engine starts, before it builds its model, then pass the handle to
    ``flashboot.load(image_dir, rank, device, prepared=handle)``. In the background it reads and
    validates the metadata (refusing a wrong ``tp``/``ep``/``expected_key`` at once), admits the
    image against the device's free memory, creates the arena, then either attaches it to the
    served-load daemon (``mode="served"``, or ``"auto"`` when one runs), starts pinning the
    staged image here (``"staged"``, or ``"auto"`` when a preloader staged it), or readies a load
    streamed from disk (``"stream"``, or ``"auto"`` when nothing is or will be staged; the ring is
    at most ``stream_buffer_bytes``), builds the views and warms the copy path. ``timeout_s``
    bounds each wait (the preloader's ``.ready``, the daemon's socket); ``hold_s``: how long the
    daemon keeps the arena attached waiting for the load (default an hour). ``verify``: recompute
    the chunk checksums once the copy ends, in the background too (None: on CUDA, where it costs
    ~2 % of the copy; not on the host backend, where it costs ~2x); a load asking for it then
    only reports it, and a mismatch surfaces from the load.

    Errors surface from the load (or :meth:`PreparedLoad.wait`), with their own class.
    """
    return PreparedLoad(image_dir, rank, device, mode=mode, timeout_s=timeout_s, shm_dir=shm_dir, tp=tp, ep=ep,
                        expected_key=expected_key, hold_s=hold_s, stream_buffer_bytes=stream_buffer_bytes,
                        verify=verify)


__all__ = ["MODES", "PreparedLoad", "prepare"]
