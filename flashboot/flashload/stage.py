"""Pin early: map a staged image and page-lock it in the background while the engine builds its model.

``cuMemHostRegister`` runs at about a third of the H2D rate, so an engine that pins at load time
pays it on the critical path. :func:`stage` starts that work at engine start-up and returns at
once; :func:`flashboot.load` (``staged=``) then waits only for whatever is left of it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ..errors import FlashBootError, WaitTimeoutError
from ..memory import CPU, Device, Span, thread_refused
from ..units import check_timeout

PIN_ALLOWANCE_S = 120.0
"""Added to the ``.ready`` timeout when waiting for the pin: 8 GB pin in ~0.4 s, so only a hung
driver gets near it."""


class StagedImage:
    """One staged rank, mapped from shared memory and (on CUDA) page-locked, in this process.

    Built by :func:`stage`. The work runs in a background thread: waiting for the preloader's
    ``.ready`` file, mapping the staged file (same pages, no copy), then ``cuMemHostRegister``.
    :meth:`wait` blocks until it is done and raises what it raised. Attributes once done:
    ``nbytes``, ``source`` (the validated :class:`~flashboot.flashload.shm.RankSource`), ``ready``
    (:class:`~flashboot.flashload.shm.ReadyInfo`), ``wait_ms`` (waiting for ``.ready`` and mapping),
    ``pin_ms``, ``pinned``. :meth:`close` unpins and unmaps.
    """

    def __init__(self, image_dir, rank: int, device: Any, *, timeout_s: float, shm_dir=None, pin: bool = True,
                 source=None):
        self.image_dir, self.rank, self.shm_dir = str(image_dir), rank, shm_dir
        self.device = Device.parse(device)
        self.timeout_s = check_timeout(timeout_s, "stage timeout_s")
        self.pin = pin and self.device.is_cuda
        self.source = source
        self.ready = None
        self.nbytes = source.nbytes if source is not None else 0
        self.wait_ms = self.pin_ms = 0.0
        self._mapping = None
        self._pinned = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._stop = threading.Event()  # set by close: the wait for .ready ends then, not at its timeout
        self._validated = threading.Event()  # self.source is set (or the work failed)
        if source is not None:
            self._validated.set()
        self._closed = False
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=f"flashboot-stage-rank{rank}", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # a bare "can't start new thread" named no limit
            raise thread_refused(f"staging rank {rank} of {self.image_dir}", exc) from None

    def _run(self) -> None:
        from ..pinning import MappedFile, register_host
        from .shm import check_ready, open_staged, rank_source, staged_paths, wait_ready

        try:
            t0 = time.perf_counter()
            if self.source is None:
                self.source = rank_source(self.image_dir, self.rank)
            self.nbytes = self.source.nbytes
            self._validated.set()
            self.ready = wait_ready(self.image_dir, self.rank, timeout_s=self.timeout_s, shm_dir=self.shm_dir,
                                    stop=self._stop)
            check_ready(self.ready, self.source)
            if self._stop.is_set():  # closed meanwhile: nothing is mapped for a close that has gone
                raise FlashBootError(f"staged image of rank {self.rank} of {self.image_dir} was closed")
            # the .ready read again with the image, from one checked open of their folder: the image
            # opened by its path could be of a folder swapped in since the wait's check
            paths = staged_paths(self.image_dir, self.rank, self.shm_dir)
            try:
                self.ready, fd = open_staged(paths, os.O_RDWR)
            except FileNotFoundError as exc:  # removed since the wait (an unstage): as MappedFile said it
                raise FlashBootError(f"cannot open {exc.filename} to map it: {exc.strerror}") from None
            try:
                check_ready(self.ready, self.source)
                self._mapping = MappedFile(str(paths.image), self.nbytes, fd=fd)
            finally:
                os.close(fd)
            t1 = time.perf_counter()
            self.wait_ms = (t1 - t0) * 1e3
            if self.pin:
                self._pinned = register_host(self._mapping.ptr, self.nbytes, self.device, path=self._mapping.path)
                self.pin_ms = self._pinned.pin_ms
        except BaseException as exc:  # handed to whoever waits
            self._error = exc
        finally:
            self._validated.set()
            self._done.set()

    @property
    def done(self) -> bool:
        """True once the background work has finished (successfully or not)."""
        return self._done.is_set()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has begun: a copy through a span taken before is refused by name
        (:func:`~flashboot.memory.check_backed`), where it read unmapped memory (a segfault)."""
        return self._closed

    @property
    def pinned(self) -> bool:
        return self._pinned is not None and self._pinned.registered

    def wait(self, timeout_s: float | None = None) -> "StagedImage":
        """Block until the image is mapped (and pinned); returns self.

        Raises what the background work raised (WaitTimeoutError naming the ``.ready`` path,
        LayoutError for a staged copy of another pre-pack, CudaError from the pin), or
        WaitTimeoutError when it has not finished within ``timeout_s`` (default: the ``.ready``
        timeout plus :data:`PIN_ALLOWANCE_S`).
        """
        limit = self.timeout_s + PIN_ALLOWANCE_S if timeout_s is None else timeout_s
        if not self._done.wait(limit):
            what = "pinning" if self._mapping is not None else "the preloader's .ready file"
            raise WaitTimeoutError(f"staging rank {self.rank} of {self.image_dir} did not finish within {limit:g} s "
                                   f"(still waiting for {what})")
        if self._error is not None:
            raise self._error
        if self._closed:
            raise FlashBootError(f"staged image of rank {self.rank} of {self.image_dir} is closed")
        return self

    def wait_source(self, timeout_s: float | None = None):
        """The validated :class:`~flashboot.flashload.shm.RankSource` (strict reader, rank checked), as
        soon as the background work has it: before ``.ready`` appears and the pin ends.

        Raises what the validation raised, or WaitTimeoutError after ``timeout_s`` (default as
        :meth:`wait`)."""
        limit = self.timeout_s + PIN_ALLOWANCE_S if timeout_s is None else timeout_s
        if not self._validated.wait(limit):
            raise WaitTimeoutError(f"validating rank {self.rank} of {self.image_dir} did not finish within {limit:g} s")
        if self.source is None:
            raise self._error
        return self.source

    def span(self) -> Span:
        """The staged bytes as a host :class:`~flashboot.memory.Span` (``pinned`` when registered)."""
        self.wait()
        return Span(self._mapping.ptr, self.nbytes, CPU, pinned=self.pinned, owner=self)

    def array(self):
        """The staged bytes as a flat numpy uint8 array (zero copy)."""
        self.wait()
        return self._mapping.array()

    def close(self) -> float:
        """Unpin and unmap (idempotent); returns the milliseconds the unpin took.

        Stops a wait for the preloader's ``.ready`` and waits for the background work to end
        (bounded like :meth:`wait`: a pin under way is let finish, then undone)."""
        if self._closed:
            return 0.0
        self._stop.set()
        self._done.wait(self.timeout_s + PIN_ALLOWANCE_S)
        self._closed = True
        unpin_ms = 0.0
        try:
            if self._pinned is not None:
                unpin_ms = self._pinned.unregister()
        finally:
            if self._mapping is not None:
                self._mapping.close()
        return unpin_ms

    def close_in_background(self) -> threading.Thread:
        """:meth:`close` in a thread: unpinning 8 GB takes ~170 ms the engine need not wait for."""
        t = threading.Thread(target=self.close, name=f"flashboot-unstage-rank{self.rank}", daemon=False)
        t.start()
        return t

    def __enter__(self) -> "StagedImage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "failed" if self._error else
                 ("pinned" if self.pinned else "mapped") if self.done else "staging")
        return f"StagedImage(rank {self.rank} of {self.image_dir!r} for {self.device}, {self.nbytes:,} bytes, {state})"


def stage(image_dir, rank: int = 0, device: Any = None, *, timeout_s: float = 60.0, shm_dir=None,
          pin: bool = True) -> StagedImage:
    """Start mapping and pinning rank ``rank`` of ``image_dir`` for ``device``; returns at once.

    Call it at engine start-up, before building the model; pass the result to
    ``flashboot.load(..., staged=...)``. The preloader (``flashboot preload``) must stage the rank;
    the background work waits up to ``timeout_s`` for its ``.ready`` file. On the host backend
    (``device="cpu"``) nothing is pinned. Errors surface from :meth:`StagedImage.wait`.
    """
    return StagedImage(image_dir, rank, device, timeout_s=timeout_s, shm_dir=shm_dir, pin=pin)


__all__ = ["StagedImage", "stage"]
