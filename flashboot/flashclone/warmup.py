"""A clone's one-time costs paid before it knows its source (the driver warm-up)."""

from __future__ import annotations

import threading

from ..errors import WaitTimeoutError
from ..memory import Device
from .report import CloneReport


class _Warmup:
    """A one-time cost paid in a background thread, started before the descriptor is requested
    (overlapping connecting to the store), joined before it is, so that neither the exchange nor
    the transfer pays it: on CUDA :func:`flashboot.arena.warm_import` (a first peer mapping's
    driver cost), with the host mover its parallel loop's compilation (numba: ~0.6 s, which was a
    2 MB clone's whole transfer time)."""

    def __init__(self, dev: Device, mover=None):
        self.result: dict = {}
        self._thread = None
        if dev.is_cuda:
            self._thread = threading.Thread(target=self._run, args=(dev,), name="flashboot-warm-import", daemon=True)
        elif getattr(mover, "name", None) == "host":
            self._thread = threading.Thread(target=self._run_host, name="flashboot-warm-host-copy", daemon=True)
        if self._thread is not None:
            self._thread.start()

    def _run(self, dev: Device) -> None:
        from ..arena import warm_import

        try:
            self.result = warm_import(dev)
        except Exception as exc:  # noqa: BLE001 - best effort: named in the report; the real open raises its own
            self.result = {"warm_ms": 0.0, "errors": [f"{type(exc).__name__}: {exc}"]}

    def _run_host(self) -> None:
        from ..movers.host import warm_host_copy

        try:
            self.result = {"warm_ms": warm_host_copy(), "note": "compiled the host mover's parallel loop"}
        except Exception as exc:  # noqa: BLE001 - best effort, as above: the copy compiles it itself
            self.result = {"warm_ms": 0.0, "errors": [f"{type(exc).__name__}: {exc}"]}

    def join(self, report: "CloneReport", timeout_s: float) -> None:
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WaitTimeoutError(f"the warm-up on {report.device} did not finish within {timeout_s:g} s")
        self._thread = None
        report.warm_ms = float(self.result.get("warm_ms", 0.0))
        peers = self.result.get("peers", [])
        errors = self.result.get("errors", [])
        report.warm_note = (f"warmed import+map from {', '.join(f'cuda:{p}' for p in peers)}" if peers
                            else self.result.get("note", "")) + \
            (f"; warm-up failed: {'; '.join(errors)}" if errors else "")
