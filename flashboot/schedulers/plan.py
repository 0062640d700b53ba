"""The plan model: a schedule is pure data that an executor (GPU streams, host backend, the
simulator) runs step by step. See ``README.md`` beside this file for the contract.

A :class:`Plan` names its participants (arenas of identical layout), and lists :class:`Step`
objects, each copying one byte range ``[offset, offset + nbytes)`` from ``src`` to ``dst`` (same
offset on both sides). A step may start once every step in ``waits`` has completed and every
earlier step of the same ``(dst, lane)`` has completed; on completion it raises flag ``signal``
of its destination.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from flashboot.errors import FlashBootError

HOST = -1
"""``src`` of a step that reads the host image (kind ``"h2d"``), not another participant."""

ROLES = ("seed", "clone", "shard")
KINDS = ("copy", "h2d")

DEFAULT_CHUNK_BYTES = 256 << 20
"""The chain/ring chunk when none is given. The paper's optimum on GB300 (Figure 18) and close to
best in our H200 x2 chain measurement (64 MiB 335, 256 MiB 357, 1 GiB 333 GB/s per clone); the
lead replaces it with the figure of a measured sweep."""

SINGLE_HOP_CHUNK_BYTES = 1 << 30
"""The chunk when none is given and no clone feeds another (a star, or a chain of one clone):
there a chunk pipelines nothing downstream and costs a copy's per-call overhead. Refit of 13.76 GB
on one H200 (a chain of one, 2026-12-01), copy wall time x the D2D ceiling for 64 MiB / 256 MiB /
1 GiB / 4 GiB chunks: atomic 0.72 / 0.85 / 0.87 / 0.85, in place 0.72 / 0.82 / 0.87 / 0.88."""


def default_chunk_bytes(schedule: str, n: int) -> int:
    """:data:`SINGLE_HOP_CHUNK_BYTES` for a star or a chain of one clone, else :data:`DEFAULT_CHUNK_BYTES`."""
    return SINGLE_HOP_CHUNK_BYTES if schedule == "star" or (schedule == "chain" and n == 1) else DEFAULT_CHUNK_BYTES

COPY_LANE = 0
"""Lane of a participant's reads from another participant."""
H2D_LANE = 1
"""Lane of a participant's loads from the host image (runs beside the copy lane)."""


_INT_FIELDS = ("id", "src", "dst", "offset", "nbytes", "lane", "signal")
"""The :class:`Step` fields that must be ints (waits: a tuple of ints)."""


def _is_int(value: Any) -> bool:
    """An int, not a bool (True had passed as 1)."""
    return type(value) is int


class PlanError(FlashBootError, ValueError):
    """A plan (or a request to build one) is malformed; names the step and the numbers."""


@dataclass(frozen=True)
class Participant:
    """One arena in the plan. ``role``: ``"seed"`` (holds every byte at the start and is only read),
    ``"clone"`` (star/chain receiver) or ``"shard"`` (ring member, starts empty)."""

    index: int
    name: str
    role: str


@dataclass(frozen=True)
class Step:
    """Copy ``[offset, offset + nbytes)`` of ``src``'s arena into the same range of ``dst``'s.

    ``kind`` is ``"copy"`` (participant to participant) or ``"h2d"`` (``src == HOST``).
    ``waits``: ids of steps that must have completed before this one starts (their destination
    holds what this step reads, or any other ordering the schedule needs); always smaller than
    ``id``. ``lane``: steps with the same ``(dst, lane)`` run one at a time in id order (one
    stream). ``signal``: the index, in ``dst``'s flag array, of the flag raised on completion;
    flags of a participant are numbered 0.. in the id order of the steps into it.
    """

    id: int
    kind: str
    src: int
    dst: int
    offset: int
    nbytes: int
    waits: tuple[int, ...] = ()
    lane: int = COPY_LANE
    signal: int = 0

    @property
    def end(self) -> int:
        """One past the last byte the step writes."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Plan:
    """A validated schedule. Build one with :func:`flashboot.schedulers.build_plan`.

    ``exclusive_sources`` is the schedule's promise that no participant is ever read by two
    steps at once (chain, ring); star makes no such promise. Host reads are not counted: each
    participant reaches the host over its own link.
    """

    schedule: str
    participants: tuple[Participant, ...]
    total_bytes: int
    chunk_bytes: int
    steps: tuple[Step, ...]
    exclusive_sources: bool = False
    _flags: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "participants", tuple(self.participants))
        object.__setattr__(self, "steps", tuple(self.steps))
        self.validate()

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`PlanError` unless the plan is well formed: participants numbered 0..n-1
        with known roles; every step inside ``[0, total_bytes)``, from a valid source to a
        non-seed destination, waiting only on earlier steps (so the wait graph, and with lanes in
        id order the whole graph, has no cycle); flags numbered 0.. per destination."""
        if not isinstance(self.total_bytes, int) or self.total_bytes <= 0:
            raise PlanError(f"plan {self.schedule!r}: total_bytes must be a positive int, got {self.total_bytes!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0:
            raise PlanError(f"plan {self.schedule!r}: chunk_bytes must be a positive int, got {self.chunk_bytes!r}")
        if not isinstance(self.exclusive_sources, bool):  # from JSON, "false" had read as True
            raise PlanError(f"plan {self.schedule!r}: exclusive_sources must be true or false, got {self.exclusive_sources!r}")
        names = set()
        for i, p in enumerate(self.participants):
            if not _is_int(p.index) or p.index != i:
                raise PlanError(f"plan {self.schedule!r}: participant {p.name!r} has index {p.index!r}, expected {i}")
            if not isinstance(p.name, str):
                raise PlanError(f"plan {self.schedule!r}: participant {i} has name {p.name!r}; names are strings")
            if p.role not in ROLES:
                raise PlanError(f"plan {self.schedule!r}: participant {p.name!r} has role {p.role!r}; roles: {', '.join(ROLES)}")
            if p.name in names:
                raise PlanError(f"plan {self.schedule!r}: participant name {p.name!r} used twice")
            names.add(p.name)
        n = len(self.participants)
        next_signal = [0] * n
        for i, s in enumerate(self.steps):
            where = f"plan {self.schedule!r} step {i}"
            # whole numbers only: a plan from JSON with offset 3000.5 validated and failed in the
            # mover mid-run, signal 3.0 in the executor's flag indexing, lane 0.5 ran as a lane of its own
            # (type() is int: a bool is no int here, and the check costs little on 2,000,000 steps)
            if not (type(s.id) is type(s.src) is type(s.dst) is type(s.offset) is type(s.nbytes) is type(s.lane)
                    is type(s.signal) is int) or type(s.waits) not in (tuple, list):
                bad = next((f for f in _INT_FIELDS if not _is_int(getattr(s, f))), "waits")
                raise PlanError(f"{where}: {bad} {getattr(s, bad)!r}; {', '.join(_INT_FIELDS)} must be ints, "
                                "waits a tuple of ints")
            if s.id != i:
                raise PlanError(f"{where}: has id {s.id}; steps must be numbered 0.. in order")
            if s.kind not in KINDS:
                raise PlanError(f"{where}: kind {s.kind!r}; kinds: {', '.join(KINDS)}")
            if (s.kind == "h2d") != (s.src == HOST):
                raise PlanError(f"{where}: kind {s.kind!r} with src {s.src}; h2d steps and only they read the host (src {HOST})")
            if not (0 <= s.dst < n) or not (s.src == HOST or 0 <= s.src < n) or s.src == s.dst:
                raise PlanError(f"{where}: src {s.src} -> dst {s.dst} is not a pair of distinct participants of {n}")
            if self.participants[s.dst].role == "seed":
                raise PlanError(f"{where}: writes into seed {self.participants[s.dst].name!r}")
            if s.nbytes <= 0 or s.offset < 0 or s.end > self.total_bytes:
                raise PlanError(
                    f"{where}: bytes {s.offset:,}..{s.end:,} ({s.nbytes:,} bytes) are not inside the "
                    f"{self.total_bytes:,}-byte image"
                )
            if any(type(w) is not int or not (0 <= w < i) for w in s.waits) or len(set(s.waits)) != len(s.waits):
                raise PlanError(f"{where}: waits {list(s.waits)} must be distinct ids of earlier steps (< {i})")
            if s.lane < 0:
                raise PlanError(f"{where}: lane {s.lane} is negative")
            if s.signal != next_signal[s.dst]:
                raise PlanError(f"{where}: signal {s.signal}, expected flag {next_signal[s.dst]} of participant {s.dst}")
            next_signal[s.dst] += 1

    # -- queries ------------------------------------------------------------------------------
    @property
    def n_participants(self) -> int:
        return len(self.participants)

    def participant(self, name_or_index) -> Participant:
        """The participant with that index or name; PlanError if none."""
        for p in self.participants:
            if p.index == name_or_index or p.name == name_or_index:
                return p
        raise PlanError(f"plan {self.schedule!r} has no participant {name_or_index!r}")

    def receivers(self) -> list[Participant]:
        """Participants that receive bytes (everyone but the seeds), in index order."""
        return [p for p in self.participants if p.role != "seed"]

    def steps_into(self, dst: int) -> list[Step]:
        """Steps writing into participant ``dst``, in id order."""
        return [s for s in self.steps if s.dst == dst]

    def lanes(self) -> dict[tuple[int, int], list[Step]]:
        """``{(dst, lane): [steps in run order]}``: one stream each."""
        out: dict[tuple[int, int], list[Step]] = {}
        for s in self.steps:
            out.setdefault((s.dst, s.lane), []).append(s)
        return out

    def flag_count(self, index: int) -> int:
        """How many flags participant ``index`` needs (one per step into it)."""
        if not self._flags:
            counts = [0] * self.n_participants
            for s in self.steps:
                counts[s.dst] += 1
            self._flags.update(enumerate(counts))
        if isinstance(index, bool) or index not in self._flags:  # a raw KeyError had named only the number
            raise PlanError(f"plan {self.schedule!r} has no participant {index!r} (indices 0..{self.n_participants - 1})")
        return self._flags[index]

    @functools.cached_property
    def awaited(self) -> frozenset[int]:
        """Ids of the steps some step waits for (computed once: an executor asks on every run)."""
        return frozenset(w for s in self.steps for w in s.waits)

    def flag_of(self, step_id: int) -> tuple[int, int]:
        """``(participant, flag index)`` raised when step ``step_id`` completes."""
        if type(step_id) is not int or not 0 <= step_id < len(self.steps):  # -1 had answered for the last step
            raise PlanError(f"plan {self.schedule!r} has no step {step_id!r} (ids 0..{len(self.steps) - 1})")
        s = self.steps[step_id]
        return s.dst, s.signal

    def bytes_moved(self) -> int:
        """Sum of all step sizes (host loads included)."""
        return sum(s.nbytes for s in self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    # -- serialisation (plans cross process boundaries as JSON) --------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` inverts it."""
        return {
            "schedule": self.schedule,
            "total_bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "exclusive_sources": self.exclusive_sources,
            "participants": [asdict(p) for p in self.participants],
            "steps": [[s.id, s.kind, s.src, s.dst, s.offset, s.nbytes, list(s.waits), s.lane, s.signal] for s in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Rebuild (and re-validate) a plan from :meth:`to_dict` output."""
        try:
            return cls(
                schedule=data["schedule"],
                participants=tuple(Participant(**p) for p in data["participants"]),
                total_bytes=data["total_bytes"],
                chunk_bytes=data["chunk_bytes"],
                steps=tuple(
                    Step(id=i, kind=k, src=src, dst=dst, offset=o, nbytes=nb, waits=tuple(w), lane=lane, signal=sig)
                    for i, k, src, dst, o, nb, w, lane, sig in data["steps"]
                ),
                exclusive_sources=data.get("exclusive_sources", False),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"not a plan dict: {exc!r}") from exc


class PlanBuilder:
    """Appends steps with consecutive ids and per-destination flag numbers (planners' helper)."""

    def __init__(self, n_participants: int):
        self.steps: list[Step] = []
        self._signals = [0] * n_participants

    def add(self, kind: str, src: int, dst: int, offset: int, nbytes: int,
            waits: tuple[int, ...] = (), lane: int = COPY_LANE) -> int:
        sid = len(self.steps)
        self.steps.append(Step(sid, kind, src, dst, offset, nbytes, tuple(waits), lane, self._signals[dst]))
        self._signals[dst] += 1
        return sid


MAX_PLAN_STEPS = 2_000_000
"""The most steps a plan may hold (~250 bytes each in Python: ~0.5 GB). A 217 GB image in 1 MiB
chunks to 8 clones is 1.65 million; a 1-byte chunk would be a plan that never finishes building."""


def check_request(schedule: str, n: int, total_bytes: int, chunk_bytes: int, *, extra_steps: int = 0) -> None:
    """Refuse a nonsensical planner request with the numbers in the message, before any step is
    built: non-positive counts, and a plan of more than :data:`MAX_PLAN_STEPS` steps (``n`` members
    x the image's chunks, plus ``extra_steps``)."""
    for label, value in (("participant count", n), ("total_bytes", total_bytes), ("chunk_bytes", chunk_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PlanError(f"{schedule}: {label} must be a positive int, got {value!r}")
    chunks = -(-total_bytes // chunk_bytes)
    steps = n * chunks + extra_steps
    if steps > MAX_PLAN_STEPS:
        what = (f"{schedule}: {n:,} receivers x {chunks:,} chunks of {chunk_bytes:,} bytes ({total_bytes:,}-byte "
                f"image) is {steps:,} steps, over the {MAX_PLAN_STEPS:,} a plan may hold")
        if extra_steps >= MAX_PLAN_STEPS:
            raise PlanError(f"{what}; {n:,} members alone make {extra_steps:,}")
        fits = -(-n * total_bytes // (MAX_PLAN_STEPS - extra_steps))
        raise PlanError(f"{what}; use chunks of at least {fits:,} bytes")


def split_range(offset: int, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[(offset, nbytes), ...]`` covering ``[offset, offset + nbytes)`` in pieces of at most
    ``chunk_bytes`` (the last one shorter); empty for ``nbytes == 0``. PlanError for a chunk that
    is no positive int (0 had raised range()'s ValueError, a negative one returned no piece), and
    for an offset or size that is no int >= 0 (-5 bytes had returned no piece, a negative offset
    pieces before the range's start, 0.5 range()'s TypeError)."""
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise PlanError(f"split_range: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise PlanError(f"split_range: offset and nbytes must be ints >= 0, got offset {offset!r}, nbytes {nbytes!r}")
    return [(o, min(chunk_bytes, offset + nbytes - o)) for o in range(offset, offset + nbytes, chunk_bytes)]


__all__ = [
    "COPY_LANE", "DEFAULT_CHUNK_BYTES", "H2D_LANE", "HOST", "KINDS", "MAX_PLAN_STEPS", "Participant", "Plan",
    "PlanBuilder", "PlanError", "ROLES", "Step", "check_request", "split_range",
]
