"""Convenience runs over the simulator: one schedule, a chunk-size sweep, a scaling sweep.
The notebooks and the CLI call these; they define nothing of their own."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from flashboot.schedulers import build_plan

from .engine import SimError, SimOptions, SimResult, simulate
from .topology import load_topology


def _values(value: Any, what: str) -> list:
    """A list of sweep values; a bare number is refused by name (it had raised "'int' object is
    not iterable")."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SimError(f"expected a list of {what}, got {value!r}")
    return list(value)


def simulate_schedule(topology: Any, schedule: str, n: int, total_bytes: int, chunk_bytes: int | None = None,
                      options: SimOptions | Mapping[str, Any] | None = None) -> SimResult:
    """Build the plan of ``schedule`` for ``n`` clones (ring: members) and simulate it."""
    return simulate(build_plan(schedule, n, total_bytes, chunk_bytes), topology, options)


def sweep_chunks(topology: Any, schedule: str, n: int, total_bytes: int, chunk_sizes: Iterable[int],
                 options: SimOptions | Mapping[str, Any] | None = None) -> list[SimResult]:
    """One simulation per chunk size (same topology, schedule, clones and image)."""
    topo = load_topology(topology)
    return [simulate_schedule(topo, schedule, n, total_bytes, c, options) for c in _values(chunk_sizes, "chunk sizes")]


def sweep_clones(topology: Any, schedules: Iterable[str], clone_counts: Iterable[int], total_bytes: int,
                 chunk_bytes: int | None = None,
                 options: SimOptions | Mapping[str, Any] | None = None) -> dict[str, list[SimResult]]:
    """``{schedule: [result per clone count]}``: star vs chain vs ring as N grows. ``schedules``
    may be one name (``"chain"`` had been swept letter by letter: "unknown schedule 'c'")."""
    topo = load_topology(topology)
    schedules = [schedules] if isinstance(schedules, str) else _values(schedules, "schedule names")
    counts = _values(clone_counts, "clone counts")
    return {s: [simulate_schedule(topo, s, n, total_bytes, chunk_bytes, options) for n in counts] for s in schedules}


__all__ = ["simulate_schedule", "sweep_chunks", "sweep_clones"]
