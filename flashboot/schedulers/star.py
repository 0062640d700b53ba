"""Star (pull): every clone reads every chunk straight from the seed.

Simplest schedule and one hop per byte, but all clones share the seed's egress, so per-clone
bandwidth falls as ~egress/N (paper §3.8: ~838/N GB/s on GB300). No exclusive-source promise.
"""

from __future__ import annotations

from .plan import Participant, Plan, PlanBuilder, check_request, split_range
from .registry import register_schedule


@register_schedule("star")
def plan_star(n: int, total_bytes: int, chunk_bytes: int) -> Plan:
    """Seed (participant 0) and ``n`` clones; clone ``k`` (participant ``k+1``) copies chunk
    0, 1, ... from the seed on its copy lane, with no waits."""
    check_request("star", n, total_bytes, chunk_bytes)
    participants = [Participant(0, "seed", "seed")] + [Participant(k + 1, f"clone{k}", "clone") for k in range(n)]
    b = PlanBuilder(len(participants))
    for k in range(n):
        for off, nb in split_range(0, total_bytes, chunk_bytes):
            b.add("copy", 0, k + 1, off, nb)
    return Plan("star", tuple(participants), total_bytes, chunk_bytes, tuple(b.steps), exclusive_sources=False)
