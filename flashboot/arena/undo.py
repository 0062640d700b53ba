"""The undo list: releases of everything an arena acquired, run newest first."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable

from .. import _cuda
from ..errors import ArenaError, FlashBootError


class _Undo:
    """Releases of everything an arena acquired, run newest first.

    Owned by an :class:`Arena` and referenced by its views (so the memory outlives the last view
    when the arena is dropped without ``close()``); never references the arena itself.
    """

    def __init__(self, what: str, before_release: Callable[[], None] | None = None):
        self.what = what
        self._steps: list[tuple[str, Callable[[], None]]] = []
        self._before_release = before_release
        self._lock = threading.Lock()
        self._dropped_release = False

    def push(self, name: str, release: Callable[[], None]) -> None:
        self._steps.append((name, release))

    def __len__(self) -> int:
        return len(self._steps)

    def commit_into(self, owner: "_Undo") -> None:
        """Move every step of this (transaction) list onto ``owner``, in order; this list is left
        empty. A multi-step acquisition builds its own list, releases it on failure and commits it
        on success only (the shape of cuda_core's virtual memory resource)."""
        with self._lock:
            steps, self._steps = self._steps, []
        with owner._lock:
            owner._steps.extend(steps)

    def release_when_dropped(self) -> None:
        """Run the releases when the last reference to this list goes (a view that outlived its
        closed arena), without the warning that an arena dropped unclosed gets."""
        self._dropped_release = True

    def forget(self) -> None:
        """Drop every step without running it: another step now releases the same resources."""
        with self._lock:
            self._steps = []

    @_cuda.keeps_context
    def release(self, timings: dict[str, float] | None = None) -> None:
        """Run every release in reverse order; all run even if one fails, the first error is raised.

        ``timings`` (optional dict) gains the ms each step took, summed by step name (what a
        sleep's report shows of its unmap and release)."""
        with self._lock:
            steps, self._steps = self._steps, []
        if not steps:
            return
        first: BaseException | None = None
        if self._before_release is not None:
            try:
                self._before_release()
            except BaseException as exc:  # still release what we can
                first = exc
        for name, release in reversed(steps):
            t0 = time.perf_counter()
            try:
                release()
            except BaseException as exc:
                if first is None:
                    first = exc
            if timings is not None:
                timings[name] = timings.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        if first is not None:
            if isinstance(first, FlashBootError):
                raise first
            raise ArenaError(f"releasing {self.what} failed: {type(first).__name__}: {first}") from first

    def __del__(self) -> None:
        if self._steps:
            if not self._dropped_release:
                warnings.warn(f"{self.what} was not closed; releasing it now", ResourceWarning, stacklevel=2)
            try:
                self.release()
            except Exception:  # noqa: BLE001 - nobody to report to from a finalizer (the warning above names
                pass  # the arena); at interpreter teardown the modules a release needs may be gone already
