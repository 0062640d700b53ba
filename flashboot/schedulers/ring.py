"""Ring all-gather: shard load from the host, then predecessor-only reads (paper §3.6, §6.2).

Member i loads byte shard i of the image from the host (h2d steps, on its h2d lane), then in
rounds r = 1..N-1 reads shard (i - r) mod N from its predecessor (i - 1) mod N, sub-chunk by
sub-chunk: a sub-chunk is read as soon as the predecessor holds it, so rounds overlap and no
member is ever read by more than one peer.
"""

from __future__ import annotations

from .plan import COPY_LANE, H2D_LANE, HOST, Participant, Plan, PlanBuilder, PlanError, check_request, split_range
from .registry import register_schedule

DEFAULT_ALIGN_BYTES = 4096
"""Shard boundaries fall on multiples of this; with ``chunk_bytes`` a multiple of it too, every
sub-chunk keeps the alignment movers need."""


def shard_bounds(total_bytes: int, n: int, align_bytes: int = DEFAULT_ALIGN_BYTES) -> list[tuple[int, int]]:
    """``[(offset, nbytes)] * n``: byte shards as equal as ``align_bytes`` allows. A shard is empty
    (``nbytes == 0``) only when the image has fewer aligned blocks than members."""
    # True had aligned to 1 byte; n = 0 or -1 returned no shard at all, float bounds came back as floats
    for label, value in (("align_bytes", align_bytes), ("member count", n)):
        if type(value) is not int or value <= 0:
            raise PlanError(f"ring: {label} must be a positive int, got {value!r}")
    if type(total_bytes) is not int or total_bytes < 0:
        raise PlanError(f"ring: total_bytes must be an int >= 0, got {total_bytes!r}")
    cuts = [((i * total_bytes) // n) // align_bytes * align_bytes for i in range(n)] + [total_bytes]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(n)]


@register_schedule("ring")
def plan_ring(n: int, total_bytes: int, chunk_bytes: int, align_bytes: int = DEFAULT_ALIGN_BYTES) -> Plan:
    """``n`` members (participants 0..n-1, role ``"shard"``), all starting empty.

    Steps: first every member's h2d loads of its shard in ``chunk_bytes`` sub-chunks (lane
    ``H2D_LANE``), then round by round the copies from the predecessor (lane ``COPY_LANE``), each
    waiting on the step that brought that sub-chunk to the predecessor.
    """
    # every member gets every shard, each shard in its own sub-chunks: at most one more chunk per shard
    check_request("ring", n, total_bytes, chunk_bytes, extra_steps=n * n)
    participants = [Participant(i, f"shard{i}", "shard") for i in range(n)]
    shards = [split_range(off, nb, chunk_bytes) for off, nb in shard_bounds(total_bytes, n, align_bytes)]
    b = PlanBuilder(n)
    # holder[(member, shard)] = step ids that brought each sub-chunk of that shard to the member
    holder: dict[tuple[int, int], list[int]] = {}
    for i in range(n):
        holder[(i, i)] = [b.add("h2d", HOST, i, off, nb, lane=H2D_LANE) for off, nb in shards[i]]
    for r in range(1, n):
        for i in range(n):
            pred, shard = (i - 1) % n, (i - r) % n
            holder[(i, shard)] = [
                b.add("copy", pred, i, off, nb, waits=(upstream,), lane=COPY_LANE)
                for (off, nb), upstream in zip(shards[shard], holder[(pred, shard)])
            ]
    return Plan("ring", tuple(participants), total_bytes, chunk_bytes, tuple(b.steps), exclusive_sources=True)
