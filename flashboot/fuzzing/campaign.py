"""A campaign: readers of outside bytes, fed inputs, each outcome counted (parsed, refused,
crash, wrong), and the probes that catch an fd or mapping left open."""

from __future__ import annotations

import os
import random
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import FlashBootError
from .mutate import mutate_document


@dataclass
class Outcome:
    """How one input went: ``parsed`` (and no invariant broken), ``refused``, ``wrong`` or ``crash``."""

    kind: str
    detail: str = ""


@dataclass
class Reader:
    """One reader of outside bytes: its seeds, how to mutate them and how to feed it one input.

    ``feed(data)`` returns the parsed object (or raises); ``check(obj, data)`` returns a broken
    invariant of a parsed object, or None; ``leaks`` (a :class:`LeakProbe`) looks for fds and
    mappings an input left open.
    """

    name: str
    seeds: list[bytes]
    feed: Callable[[bytes], Any]
    check: Callable[[Any, bytes], str | None] = lambda obj, data: None
    mutate: Callable[[bytes, random.Random], bytes] = mutate_document
    leaks: "LeakProbe | None" = None

    def warm_up(self) -> None:
        """Feed every seed once (lazy imports, caches): what a first use opens for good is no leak."""
        for s in self.seeds:
            self.run_one(s)

    def run_one(self, data: bytes) -> Outcome:
        if self.leaks is not None:
            self.leaks.before()
        try:
            obj = self.feed(data)
        except FlashBootError:
            outcome = Outcome("refused")
        except Exception as exc:  # noqa: BLE001 - the point: any other exception is a finding
            outcome = Outcome("crash", "".join(traceback.format_exception_only(type(exc), exc)).strip()[:400]
                              + "\n" + _where(exc))
        else:
            problem = self.check(obj, data)
            outcome = Outcome("wrong", problem) if problem else Outcome("parsed")
        if self.leaks is not None:
            leak = self.leaks.after()
            if leak:
                outcome = Outcome("crash", f"leak: {leak}")
        return outcome


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb[-4:]))


@dataclass
class Finding:
    reader: str
    kind: str
    detail: str
    data: bytes


@dataclass
class Counts:
    """Per reader: inputs tried, parsed, refused with a FlashBootError, crashes, accepted-but-wrong."""

    tried: int = 0
    parsed: int = 0
    refused: int = 0
    crash: int = 0
    wrong: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)


def run_campaign(readers: list[Reader], inputs: int, seed: int = 0, *, keep: int = 20,
                 progress: Callable[[str, Counts], None] | None = None) -> dict[str, Counts]:
    """Feed ``inputs`` mutated inputs to each reader (seeded: the same inputs every run); returns
    the counts per reader, with up to ``keep`` distinct findings (crash or wrong) each."""
    out = {}
    for reader in readers:
        rng = random.Random(f"{seed}/{reader.name}")
        reader.warm_up()
        c = Counts()
        seen: set[str] = set()
        t0 = time.perf_counter()
        for i in range(inputs):
            data = reader.mutate(rng.choice(reader.seeds), rng)
            o = reader.run_one(data)
            c.tried += 1
            setattr(c, o.kind, getattr(c, o.kind) + 1)
            if o.kind in ("crash", "wrong"):
                first = o.detail.splitlines()[0]
                sig = first[:70] + o.detail.splitlines()[-1] if o.kind == "crash" else first.split(":")[0]
                if sig not in seen and len(c.findings) < keep:
                    seen.add(sig)
                    c.findings.append(Finding(reader.name, o.kind, o.detail, data))
            if progress is not None and ((i + 1) % 10_000 == 0 or i + 1 == inputs):
                progress(reader.name, c)
        c.seconds = time.perf_counter() - t0
        out[reader.name] = c
    return out


def format_counts(counts: dict[str, Counts]) -> str:
    """A table: reader, tried, parsed, refused, crashes, wrong, seconds."""
    rows = [("reader", "tried", "parsed", "refused", "crashes", "wrong", "s")]
    for name, c in counts.items():
        rows.append((name, f"{c.tried:,}", f"{c.parsed:,}", f"{c.refused:,}", f"{c.crash:,}", f"{c.wrong:,}",
                     f"{c.seconds:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                     for r in rows)


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def mappings_of(path_part: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if path_part in line)


class LeakProbe:
    """fds one input left open (every input) and mappings of files whose path contains
    ``path_part`` (every ``maps_every``-th input: /proc/self/maps of a torch process is ~1 ms)."""

    def __init__(self, path_part: str, maps_every: int = 16):
        self.path_part, self.maps_every, self.calls = path_part, maps_every, 0
        self._fds: set[int] = set()
        self._maps: int | None = None

    def before(self) -> None:
        self.calls += 1
        self._fds = open_fds()
        self._maps = mappings_of(self.path_part) if self.calls % self.maps_every == 0 else None

    def after(self) -> str | None:
        leaked = open_fds() - self._fds
        maps = 0 if self._maps is None else mappings_of(self.path_part) - self._maps
        if leaked or maps > 0:
            targets = sorted({_fd_target(fd) for fd in leaked})[:3]
            return f"{len(leaked)} fd(s) {targets} and {maps} mapping(s) of {self.path_part} left open"
        return None


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
