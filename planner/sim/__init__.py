"""The discrete-event cluster simulator (``cluster.simulate``): nodes (``node``), caches (``cache``),
figures (``results``)."""

from planner.sim.cluster import ClusterSpec, SimInfo, Simulation, simulate
from planner.sim.results import SimResult

__all__ = ["ClusterSpec", "SimInfo", "SimResult", "Simulation", "simulate"]
