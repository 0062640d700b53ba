"""A clone's one-time costs paid before it knows its source: :func:`prepare_clone`, the early call.

In a fresh process a clone's first call pays, besides importing torch for the store: the CUDA
context (~0.3 s on an H200 host), the fd table's growth for the source's segment fds (a wait
for an RCU grace period in a threaded process), the driver's first peer import and mapping, the copy engine's
first driver stream and copy, torch's CUDA state (the views, the digests'
buffer) and the store's client (``torch.distributed``, ~0.1 s in a process that has torch) and, when it verifies, the checksum kernel (its cubin: a few ms; through Triton ~1 s).
None of these needs the source, so they run in background threads (one per stage) started as
early as the caller can (an engine at its start, the CLI before it connects to the store), mostly in driver
calls and imports that overlap the caller's own work. The clone waits for each part only where it
first needs it (:data:`STAGES`): the driver's part before it maps its sources, the copy engine's
stream and torch before the transfer (so they overlap the exchange and its own arena), the checksum kernel before
verifying. Nothing of it runs in the clone's own thread before the store is reached. The report
names each part (``warm_detail``) and how long the clone waited for them (``warm_wait_ms``, by
stage ``warm_waits``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import FlashBootError, WaitTimeoutError
from ..memory import Device
from .report import CloneReport

STAGES = ("map", "copy", "verify")
"""Where a clone waits for its warm-up, in order: before mapping its sources (the driver's
context and first peer import), before the transfer (the mover's and the executor's imports, torch's CUDA state),
before verifying (the checksum kernel). Each wait covers the stages before it."""


class CloneWarmup:
    """The warm-up of clones into ``device`` (see :func:`prepare_clone`): background threads, one
    per stage, started on construction; :meth:`join` waits for a stage (bounded) and fills a report's warm-up
    fields. Best effort: a part that fails is named in the report (``warm_note``) and the clone
    pays that cost itself, raising its own error if it is a real one."""

    def __init__(self, device: Any = None, *, verify: bool = False, mover: Any = None):
        self.device = Device.parse(device)
        self.verify = verify
        name = getattr(mover, "name", mover) or ("copy_engine" if self.device.is_cuda else "host")
        self.parts: dict[str, float] = {}
        self.peers: list[int] = []
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.warm_ms = 0.0
        self._steps = self._plan(name)
        self._stage_done = {stage: threading.Event() for stage in STAGES}
        self._t_start = time.perf_counter()
        # The packages whose __init__ imports their submodules, imported here before any thread
        # starts: the clone's thread imports them too (the mover's check, its arena), and a thread
        # importing a submodule while another runs the package's __init__ can end in Python's
        # _DeadlockError (seen in CI: flashboot.movers.host against flashboot.movers). From
        # bytecode they cost a few ms, which the threads' imports would have held the GIL for anyway.
        import flashboot.arena  # noqa: F401
        import flashboot.movers  # noqa: F401

        self._running = len(STAGES)
        self._lock = threading.Lock()
        # one thread per stage, all at once: the driver's part (calls that release the GIL) runs
        # beside the copy's imports, so the copy's parts are not queued behind the mapping's
        self._threads = [threading.Thread(target=self._run, args=(stage,), name=f"flashboot-clone-warmup-{stage}",
                                          daemon=True) for stage in STAGES]
        for t in self._threads:
            t.start()

    def _plan(self, mover: str) -> list[tuple[str, str, Callable[[], None]]]:
        """``(part, stage, step)``; ``stage`` (one of :data:`STAGES`) is the first thing of the clone
        that needs the part: the clone waits for a stage only there. Each stage's parts run in
        order in a thread of their own, the stages side by side."""
        dev = self.device
        steps = [("fd table", "map", self._fd_table), ("executor lanes", "copy", self._lanes)]
        if not dev.is_cuda:
            steps += [("host copy", "copy", self._host_copy)] if mover == "host" else []
            return steps + ([("host checksum", "verify", self._host_checksum)] if self.verify else [])
        steps.append(("CUDA context + peer import", "map", self._driver))
        if mover == "copy_engine":
            steps.append(("copy stream", "copy", self._copy_stream))
        steps.append(("torch CUDA", "copy", self._torch))
        if self.verify:
            steps.append(("checksum kernel", "verify", self._checksum))
        return steps

    # ------------------------------------------------------------------ parts (background thread)
    def _fd_table(self) -> None:
        # the source's segment fds arrive during the exchange: room for them is made now
        from ..fdshare import grow_fd_table

        grow_fd_table()

    def _lanes(self) -> None:
        # the executor imports its backends on its first run, inside the transfer's time: ~1 ms
        # between the run's start and the first copy of a same-GPU clone on an H200 (its copy ~6.7 ms)
        from . import lanes  # noqa: F401

    def _driver(self) -> None:
        from ..arena import warm_import

        res = warm_import(self.device)
        self.peers = list(res.get("peers", []))
        self.errors += [f"peer import: {e}" for e in res.get("errors", [])]
        self.parts["CUDA context"] = float(res.get("context_ms", 0.0))

    def _checksum(self) -> None:
        from flashboot.kernels.checksum_gpu import prepare_checksum_kernels

        prepare_checksum_kernels(self.device.index)

    def _copy_stream(self) -> None:
        # what the copy engine's first copy pays, paid here: its module and bound driver calls,
        # a private stream and event, the driver's first cuMemcpyAsync (4 bytes within a 16-byte
        # scratch allocation of the device), and a batch's first checks and cuMemcpyBatchAsync,
        # the path the clone's copy takes (its first run in a process cost ~1 ms more on a 2-core host)
        from .. import _cuda
        from ..cuda_streams import Event, Stream
        from ..memory import Span, cuda_device
        from ..movers import create_mover

        index = self.device.index
        drv = _cuda.driver()
        _cuda.use_device(index)  # this thread is ours
        mover = create_mover("copy_engine")
        stream, done = Stream(index), Event(index)
        scratch = int(_cuda.check(drv.cuMemAlloc(16), "cuMemAlloc(16, warm-up scratch)"))
        try:
            dev = cuda_device(index)
            mover.copy(Span(scratch, 4, dev), Span(scratch + 4, 4, dev), stream=stream)
            mover.copy_batch(Span(scratch + 8, 8, dev), Span(scratch, 8, dev), [(0, 0, 4), (4, 4, 4)], stream=stream)
            done.record(stream)
            stream.synchronize()
        finally:
            _cuda.check(drv.cuMemFree(scratch), "cuMemFree(warm-up scratch)")
            stream.close()
            done.close()

    def _torch(self) -> None:
        import torch
        import torch.distributed  # noqa: F401  (the store's client, which the clone imports next)

        torch.empty(1, device=str(self.device))  # torch's lazy CUDA init and its allocator's first block

    def _host_copy(self) -> None:
        from ..movers.host import warm_host_copy

        warm_host_copy()
        self.notes.append("compiled the host mover's parallel loop")

    def _host_checksum(self) -> None:
        import numpy as np

        from flashboot.kernels.checksum_host import chunk_checksums_host

        chunk_checksums_host(np.zeros(1 << 12, np.uint8), 1 << 10)

    def _run(self, stage: str) -> None:
        try:
            for name, step_stage, step in self._steps:
                if step_stage != stage:
                    continue
                t0 = time.perf_counter()
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - best effort: named in the report; the clone raises its own
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                self.parts[name] = (time.perf_counter() - t0) * 1e3
                if name == "CUDA context + peer import" and "CUDA context" in self.parts:
                    self.parts["peer import"] = self.parts.pop(name) - self.parts["CUDA context"]
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self.warm_ms = (time.perf_counter() - self._t_start) * 1e3
            self._stage_done[stage].set()

    # ------------------------------------------------------------------------------ the caller
    def check_device(self, device: Device) -> None:
        if device != self.device:
            raise FlashBootError(f"the clone warm-up was prepared for {self.device}, not for {device}")

    def join(self, report: CloneReport, timeout_s: float, stage: str = "verify") -> None:
        """Wait (WaitTimeoutError past ``timeout_s``) until every part the clone needs at
        ``stage`` (one of :data:`STAGES`: ``"map"`` before mapping its sources, ``"copy"`` before
        the transfer, ``"verify"``, the default, for all) is done, and record it in ``report``:
        ``warm_wait_ms`` (what the caller waited, added up over the stages), ``warm_ms`` (the
        warm-up's own time, once it is over) and ``warm_detail``."""
        if stage not in STAGES:
            raise FlashBootError(f"warm-up stage must be one of {', '.join(STAGES)}, got {stage!r}")
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        for earlier in STAGES[:STAGES.index(stage) + 1]:  # a stage's parts may use the earlier ones'
            if not self._stage_done[earlier].wait(max(0.0, deadline - time.monotonic())):
                raise WaitTimeoutError(f"the clone warm-up on {self.device} did not finish its {earlier!r} parts "
                                       f"within {timeout_s:g} s (done so far: {sorted(self.parts)})")
        waited = (time.perf_counter() - t0) * 1e3
        report.warm_wait_ms += waited
        report.warm_waits[stage] = report.warm_waits.get(stage, 0.0) + waited
        report.warm_ms = self.warm_ms
        report.warm_detail = {k: round(v, 3) for k, v in self.parts.items()}
        note = [f"warmed import+map from {', '.join(f'cuda:{p}' for p in self.peers)}"] if self.peers else []
        report.warm_note = "; ".join(note + self.notes) + (f"; warm-up failed: {'; '.join(self.errors)}"
                                                          if self.errors else "")


def prepare_clone(device: Any = None, *, verify: bool = False, mover: Any = None) -> CloneWarmup:
    """The early call of a clone into ``device``: start paying its one-time costs now, in a
    background threads (the CUDA context, the driver's peer import, the copy engine's first stream and copy,
    torch's CUDA state and, with ``verify``, the checksum kernel; the host mover's and the host
    checksum's compilation on the host backend). Call it as early as possible (before the engine
    builds its model, before connecting to the store), then pass it as
    ``clone(..., prepared=...)``, which joins it before requesting the seed's descriptor.
    ``mover``: the mover the clone will use (default as :func:`~flashboot.flashclone.clone`)."""
    return CloneWarmup(device, verify=verify, mover=mover)


__all__ = ["CloneWarmup", "prepare_clone"]
