"""Schedules as data: ``build_plan("chain" | "star" | "ring", n, total_bytes, chunk_bytes)``
returns a validated :class:`Plan` that an executor (GPU movers, host backend, the simulator) runs.
See README.md in this folder for the plan contract."""

from __future__ import annotations

from . import chain, ring, star  # noqa: F401  (each registers its planner)
from .plan import (
    COPY_LANE,
    DEFAULT_CHUNK_BYTES,
    H2D_LANE,
    HOST,
    MAX_PLAN_STEPS,
    Participant,
    Plan,
    PlanError,
    Step,
    split_range,
)
from .registry import build_plan, list_schedules, register_schedule
from .ring import shard_bounds

__all__ = [
    "COPY_LANE", "DEFAULT_CHUNK_BYTES", "H2D_LANE", "HOST", "MAX_PLAN_STEPS", "Participant", "Plan", "PlanError", "Step",
    "build_plan", "list_schedules", "register_schedule", "shard_bounds", "split_range",
]
