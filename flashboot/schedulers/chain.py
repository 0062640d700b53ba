"""Chain: seed -> clone0 -> clone1 -> ..., the image streamed in fixed chunks.

Each clone reads only its predecessor, so every link carries one reader and per-clone bandwidth
stays near the single-link rate however long the chain (paper §3.8: ~715 GB/s flat on GB300).
Hop k copies chunk j as soon as hop k-1 has signalled it; the only cost is the pipeline fill.
"""

from __future__ import annotations

from .plan import Participant, Plan, PlanBuilder, check_request, split_range
from .registry import register_schedule


@register_schedule("chain")
def plan_chain(n: int, total_bytes: int, chunk_bytes: int) -> Plan:
    """Seed (participant 0) and ``n`` clones in a line; clone ``k`` is participant ``k+1`` and
    reads from participant ``k``. Step for (chunk j, clone k) waits on (chunk j, clone k-1)."""
    check_request("chain", n, total_bytes, chunk_bytes)
    participants = [Participant(0, "seed", "seed")] + [Participant(k + 1, f"clone{k}", "clone") for k in range(n)]
    b = PlanBuilder(len(participants))
    for off, nb in split_range(0, total_bytes, chunk_bytes):
        upstream: tuple[int, ...] = ()  # the seed holds every chunk from the start
        for k in range(n):
            upstream = (b.add("copy", k, k + 1, off, nb, waits=upstream),)
    return Plan("chain", tuple(participants), total_bytes, chunk_bytes, tuple(b.steps), exclusive_sources=True)
