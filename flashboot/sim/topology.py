"""Topologies for the simulator: typed dataclasses that validate themselves; YAML only fills them.

A topology says how fast bytes move between GPUs and from the host:
- ``p2p_curve``: the measured bandwidth of ONE isolated GPU->GPU copy-engine copy as a function
  of its size (interpolated linearly in time over size, i.e. piecewise ``latency + size/rate``);
- ``launch_latency_us``: the part of an isolated copy's time that a copy queued behind another one
  on the same stream hides (paid once per lane); ``chunk_sync_us``: the cost every step pays on
  its lane (flag write and wait, copy-engine re-arm), the chain's per-chunk overhead;
- ``fabric``: per-GPU port limits (egress, ingress and their sum when both directions are busy)
  and, for direct-link machines, the links with per-direction bandwidth and latency;
- ``host``: the per-GPU host link (PCIe or C2C) with its own H2D curve, host memory bandwidth per
  host, and the pinning rate.
Every number in the shipped YAML files says where it comes from.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from flashboot.errors import FlashBootError, UnknownNameError
from flashboot.units import parse_bytes


class TopologyError(FlashBootError, ValueError):
    """A topology file or dict is malformed; names the field and the value."""


MAX_GBPS = 1e9
"""The fastest rate a topology may state (an exabyte a second): the engine multiplies rates by 1e9
and divides sizes by them, and 1e308 GB/s overflowed to inf and then divided by zero."""

MAX_US = 1e6
"""The longest latency a topology may state (one second): simulated times are floats, and a clock
far out in the seconds loses the nanoseconds a step needs to move forward."""


def _positive(where: str, value: Any, *, allow_zero: bool = False, limit: float = MAX_GBPS) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{where}: expected a number, got {value!r}")
    # NaN fails every comparison, so it must be refused by name: a NaN timer never fired (a hang)
    if isinstance(value, float) and not math.isfinite(value):
        raise TopologyError(f"{where}: must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise TopologyError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    if value > limit:
        raise TopologyError(f"{where}: must be <= {limit:g}, got {value!r}")
    return float(value)


def _from_mapping(cls, data: Any, where: str, convert: Mapping[str, Any] | None = None):
    """Fill dataclass ``cls`` from a plain mapping, refusing unknown keys (typos must not be
    silently ignored). ``convert`` maps field names to functions applied to the raw value."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise TopologyError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - names
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        fn = (convert or {}).get(key)
        kwargs[key] = fn(value, f"{where}.{key}") if fn else value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        raise TopologyError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class CopyCurve:
    """Bandwidth of one isolated copy versus its size: ``points = ((nbytes, gbps), ...)``.

    Interpolation is linear in *time* between points (each segment is ``latency + size/rate``);
    beyond the last point the last segment's marginal rate continues (capped at the best measured
    rate); below the first point the first segment extends down, never below zero time.
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        pts = []
        for i, p in enumerate(self.points):
            if not isinstance(p, (tuple, list)) or len(p) != 2:
                raise TopologyError(f"curve point {i}: expected [size, GB/s], got {p!r}")
            try:
                nbytes = parse_bytes(p[0])
            except FlashBootError as exc:
                raise TopologyError(f"curve point {i}: {exc}") from None
            pts.append((nbytes, _positive(f"curve point {i} GB/s", p[1])))
        if not pts:
            raise TopologyError("a copy curve needs at least one [size, GB/s] point")
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
            raise TopologyError(f"curve sizes must increase strictly: {[p[0] for p in pts]}")
        object.__setattr__(self, "points", tuple(pts))
        object.__setattr__(self, "_sizes", [p[0] for p in pts])
        object.__setattr__(self, "_times", [n / (g * 1e9) for n, g in pts])

    @property
    def peak_gbps(self) -> float:
        """The best measured rate."""
        return max(g for _, g in self.points)

    def seconds(self, nbytes: float) -> float:
        """Time of one isolated copy of ``nbytes``."""
        sizes, times = self._sizes, self._times
        if len(sizes) == 1:
            return nbytes / (self.points[0][1] * 1e9)
        i = bisect.bisect_left(sizes, nbytes)
        lo = min(max(i - 1, 0), len(sizes) - 2)
        slope = (times[lo + 1] - times[lo]) / (sizes[lo + 1] - sizes[lo])
        if i >= len(sizes):  # past the last point: never faster than the best measured rate
            slope = max(slope, 1.0 / (self.peak_gbps * 1e9))
        return max(times[lo] + slope * (nbytes - sizes[lo]), 0.0)

    def gbps(self, nbytes: float) -> float:
        """Bandwidth of one isolated copy of ``nbytes`` in GB/s (never above the best measured)."""
        # seconds() clamps an extrapolated time at 0 (a steep first segment): that was a division by 0
        t = max(self.seconds(nbytes), nbytes / (self.peak_gbps * 1e9))
        return nbytes / t / 1e9 if t > 0 else self.peak_gbps

    @classmethod
    def from_value(cls, value: Any, where: str = "curve") -> "CopyCurve":
        """From a list of ``[size, GB/s]`` pairs (sizes as numbers or strings like ``256MiB``)."""
        if isinstance(value, CopyCurve):
            return value
        if isinstance(value, Mapping) and "points" in value:
            value = value["points"]
        if not isinstance(value, (list, tuple)):
            raise TopologyError(f"{where}: expected a list of [size, GB/s] pairs, got {value!r}")
        try:
            return cls(tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in value))
        except TopologyError as exc:
            raise TopologyError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class Link:
    """A direct GPU<->GPU link (e.g. NVLink bridge): bandwidth per direction and one-way latency."""

    a: int
    b: int
    gbps_a_to_b: float
    gbps_b_to_a: float
    latency_us: float = 1.0

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TopologyError(f"link.{name}: expected a GPU index >= 0, got {v!r}")
        if self.a == self.b:
            raise TopologyError(f"link joins GPU {self.a} to itself")
        _positive("link.gbps_a_to_b", self.gbps_a_to_b)
        _positive("link.gbps_b_to_a", self.gbps_b_to_a)
        _positive("link.latency_us", self.latency_us, allow_zero=True, limit=MAX_US)


@dataclass(frozen=True)
class Fabric:
    """GPU<->GPU interconnect.

    ``kind``: ``"switch"`` (any pair talks through a non-blocking switch; only per-GPU port limits
    apply) or ``"direct"`` (only the listed ``links``; each direction a resource of its own).
    ``egress_gbps`` / ``ingress_gbps``: everything leaving / entering one GPU, all readers
    together (the star bottleneck). ``duplex_gbps``: egress + ingress together when both
    directions of a GPU's port are busy (a chain's middle hop, every ring member).
    ``latency_us``: one-way latency through a switch (signals crossing GPUs pay it).
    """

    kind: str
    egress_gbps: float
    ingress_gbps: float
    duplex_gbps: float
    latency_us: float = 1.0
    links: tuple[Link, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("switch", "direct"):
            raise TopologyError(f"fabric.kind: expected 'switch' or 'direct', got {self.kind!r}")
        for name in ("egress_gbps", "ingress_gbps", "duplex_gbps"):
            _positive(f"fabric.{name}", getattr(self, name))
        _positive("fabric.latency_us", self.latency_us, allow_zero=True, limit=MAX_US)
        # the engine charges every GPU->GPU flow to its ends' duplex budget whether or not the other
        # direction is busy: a duplex below a one-way limit silently lowered that limit (a star's
        # seed, which only sends, ran at the duplex figure)
        if self.duplex_gbps < max(self.egress_gbps, self.ingress_gbps):
            raise TopologyError(
                f"fabric.duplex_gbps ({self.duplex_gbps:g}) is egress + ingress with both directions busy and "
                f"cannot be below egress_gbps ({self.egress_gbps:g}) or ingress_gbps ({self.ingress_gbps:g})")
        links = tuple(_from_mapping(Link, l, f"fabric.links[{i}]") for i, l in enumerate(self.links))
        object.__setattr__(self, "links", links)
        if self.kind == "direct" and not links:
            raise TopologyError("fabric.kind 'direct' needs at least one link")
        if self.kind == "switch" and links:
            raise TopologyError("fabric.kind 'switch' takes no links (every pair goes through the switch)")


@dataclass(frozen=True)
class Host:
    """Host side of one GPU: its link (PCIe or C2C), its H2D curve, the host memory it shares with
    ``gpus_per_host - 1`` other GPUs, and the pinning (``cudaHostRegister``) rate."""

    link: str
    link_gbps: float
    h2d_curve: CopyCurve
    memory_gbps: float
    gpus_per_host: int
    pin_gbps: float

    def __post_init__(self) -> None:
        if self.link not in ("pcie", "c2c"):
            raise TopologyError(f"host.link: expected 'pcie' or 'c2c', got {self.link!r}")
        for name in ("link_gbps", "memory_gbps", "pin_gbps"):
            _positive(f"host.{name}", getattr(self, name))
        if isinstance(self.gpus_per_host, bool) or not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 1:
            raise TopologyError(f"host.gpus_per_host: expected an int >= 1, got {self.gpus_per_host!r}")
        object.__setattr__(self, "h2d_curve", CopyCurve.from_value(self.h2d_curve, "host.h2d_curve"))


MAX_GPUS = 100_000
"""More GPUs than any machine has; 1e9 had the engine build per-GPU state until memory ran out."""


@dataclass(frozen=True)
class Topology:
    """A machine for the simulator. Build with :func:`load_topology` or :meth:`from_dict`."""

    name: str
    gpus: int
    fabric: Fabric
    p2p_curve: CopyCurve
    local_copy_gbps: float
    host: Host
    launch_latency_us: float
    chunk_sync_us: float
    description: str = ""
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"topology name must be a non-empty string, got {self.name!r}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or not 1 <= self.gpus <= MAX_GPUS:
            raise TopologyError(f"{self.name}: gpus must be an int in [1, {MAX_GPUS}], got {self.gpus!r}")
        object.__setattr__(self, "fabric", _from_mapping(Fabric, self.fabric, f"{self.name}.fabric"))
        object.__setattr__(self, "p2p_curve", CopyCurve.from_value(self.p2p_curve, f"{self.name}.p2p_curve"))
        object.__setattr__(self, "host", _from_mapping(Host, self.host, f"{self.name}.host"))
        _positive(f"{self.name}.local_copy_gbps", self.local_copy_gbps)
        _positive(f"{self.name}.launch_latency_us", self.launch_latency_us, allow_zero=True, limit=MAX_US)
        _positive(f"{self.name}.chunk_sync_us", self.chunk_sync_us, allow_zero=True, limit=MAX_US)
        for link in self.fabric.links:
            if max(link.a, link.b) >= self.gpus:
                raise TopologyError(f"{self.name}: link {link.a}<->{link.b} names a GPU beyond the {self.gpus} it has")
        if not isinstance(self.sources, Mapping):
            raise TopologyError(f"{self.name}.sources: expected a mapping of field -> where the number comes from")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        """Fill a topology from a plain dict (what ``yaml.safe_load`` returns); unknown keys refused."""
        return _from_mapping(cls, data, str(data.get("name", "topology")) if isinstance(data, Mapping) else "topology")

    def link_between(self, src_gpu: int, dst_gpu: int) -> tuple[float, float] | None:
        """``(gbps, latency_us)`` of the direct link src->dst, or None (switch fabric or no link)."""
        for link in self.fabric.links:
            if (link.a, link.b) == (src_gpu, dst_gpu):
                return link.gbps_a_to_b, link.latency_us
            if (link.b, link.a) == (src_gpu, dst_gpu):
                return link.gbps_b_to_a, link.latency_us
        return None

    def latency_us(self, src_gpu: int, dst_gpu: int) -> float:
        """One-way latency for a signal between two GPUs (0 on the same GPU)."""
        if src_gpu == dst_gpu:
            return 0.0
        direct = self.link_between(src_gpu, dst_gpu)
        return direct[1] if direct else self.fabric.latency_us

    def dma_gbps(self, nbytes: float) -> float:
        """Rate of a GPU->GPU copy of ``nbytes`` queued behind another on its stream: the isolated
        curve with the launch latency taken out, never above the best measured rate."""
        t = self.p2p_curve.seconds(nbytes) - self.launch_latency_us * 1e-6
        floor = nbytes / (self.p2p_curve.peak_gbps * 1e9)
        t = max(t, floor)
        return nbytes / t / 1e9 if t > 0 else self.p2p_curve.peak_gbps

    def h2d_gbps(self, nbytes: float) -> float:
        """Rate of a host->GPU copy of ``nbytes`` (same treatment of the launch latency)."""
        curve = self.host.h2d_curve
        t = max(curve.seconds(nbytes) - self.launch_latency_us * 1e-6, nbytes / (curve.peak_gbps * 1e9))
        return nbytes / t / 1e9 if t > 0 else curve.peak_gbps


def _topology_dir():
    return resources.files("flashboot.sim") / "topologies"


def list_topologies() -> list[str]:
    """Names of the topologies shipped with the package."""
    return sorted(p.name[: -len(".yaml")] for p in _topology_dir().iterdir() if p.name.endswith(".yaml"))


def load_topology(spec: Any) -> Topology:
    """A :class:`Topology` from a shipped name (``"h200-x2"``), a YAML path, a plain dict, or a
    Topology (returned as is). Raises UnknownNameError for an unknown name, TopologyError for a
    malformed file."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, Mapping):
        return Topology.from_dict(spec)
    text = str(spec)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise TopologyError(f"topology file {text} does not exist")
        source, raw = text, path.read_text()
    else:
        res = _topology_dir() / f"{text}.yaml"
        if not res.is_file():
            raise UnknownNameError("topology", text, list_topologies())
        source, raw = f"{text}.yaml", res.read_text()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise TopologyError(f"{source}: expected a mapping at the top, got {type(data).__name__}")
    return Topology.from_dict(data)


__all__ = ["CopyCurve", "Fabric", "Host", "Link", "Topology", "TopologyError", "list_topologies", "load_topology"]
