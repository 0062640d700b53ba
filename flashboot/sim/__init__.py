"""Rack-scale simulator: runs the schedulers' plans on topologies described in YAML.

    from flashboot.sim import load_topology, simulate
    from flashboot.schedulers import build_plan
    result = simulate(build_plan("chain", 8, 217 * 10**9), load_topology("gb300-nvl72"))
    result.per_clone_gbps, result.last_clone_s
"""

from __future__ import annotations

from .engine import SimError, SimOptions, SimResult, simulate
from .sweeps import simulate_schedule, sweep_chunks, sweep_clones
from .topology import CopyCurve, Fabric, Host, Link, Topology, TopologyError, list_topologies, load_topology

__all__ = [
    "CopyCurve", "Fabric", "Host", "Link", "SimError", "SimOptions", "SimResult", "Topology", "TopologyError",
    "list_topologies", "load_topology", "simulate", "simulate_schedule", "sweep_chunks", "sweep_clones",
]
