"""``pdkv plan``: the smallest cluster that meets latency targets on a workload, by simulation.

A cluster *meets* the targets when every request is served and its TTFT p90 and ITL p90 are within
them (``SimResult.meets``).  ``smallest`` searches the node count (bisection: more nodes never make the
targets harder to meet in the simulation's model) of each shape -- colocated, and P/D with the prefill
share of the work set from the profile (and its neighbours tried) -- and reports the smallest that
meets them beside the next smaller.  ``max_rate`` finds the highest request rate (arrival times
compressed by a factor) a given cluster meets the targets at: the goodput figures of ``bench.simulate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.profile import Profile
from planner.sim import ClusterSpec, SimResult, simulate
from planner.trace import Arrival


@dataclass(frozen=True)
class Targets:
    ttft_p90_s: float
    itl_p90_s: float

    def __post_init__(self) -> None:
        if not self.ttft_p90_s > 0 or not self.itl_p90_s > 0:
            raise ValueError("the latency targets must be positive seconds")


@dataclass(frozen=True)
class Outcome:
    spec: ClusterSpec
    result: SimResult
    meets: bool


def at_rate(arrivals: Sequence[Arrival], factor: float) -> list[Arrival]:
    """The workload ``factor`` times as fast (arrival times divided by it)."""
    return [dataclasses.replace(a, arrival_s=a.arrival_s / factor) for a in arrivals]


def run(profile: Profile, spec: ClusterSpec, arrivals: Sequence[Arrival], targets: Targets) -> Outcome:
    result = simulate(profile, spec, arrivals)
    return Outcome(spec, result, result.meets(targets.ttft_p90_s, targets.itl_p90_s))


def prefill_share(profile: Profile, arrivals: Sequence[Arrival]) -> float:
    """The share of a request's node time its prefill takes, with no cache hits (the P/D split)."""
    cost = profile.step
    prefill = sum(cost.prefill_seconds(a.input_tokens) for a in arrivals)
    decode = sum(
        (a.output_tokens - 1)
        * (cost.decode_row_s + cost.decode_context_s * (a.input_tokens + a.output_tokens / 2))
        for a in arrivals
    )
    # Decode steps batch: their fixed cost is shared; count it once a step of a typical batch of 8.
    decode += sum(a.output_tokens for a in arrivals) * cost.decode_base_s / 8
    return prefill / (prefill + decode) if prefill + decode else 0.5


def shapes(kind: str, nodes: int, share: float, base: ClusterSpec) -> list[ClusterSpec]:
    """The clusters of ``nodes`` nodes of one kind: colocated, or P/D splits around ``share``."""
    if kind == "colocated":
        return [dataclasses.replace(base, colocated=nodes, prefill=0, decode=0)]
    if nodes < 2:
        return []
    mid = min(nodes - 1, max(1, round(nodes * share)))
    splits = sorted({p for p in (mid - 1, mid, mid + 1) if 1 <= p <= nodes - 1})
    return [dataclasses.replace(base, colocated=0, prefill=p, decode=nodes - p) for p in splits]


def best_of(
    profile: Profile, specs: Sequence[ClusterSpec], arrivals: Sequence[Arrival], targets: Targets
) -> Outcome | None:
    """The first of ``specs`` that meets the targets, else the one with the lowest TTFT p90."""
    outcomes = [run(profile, s, arrivals, targets) for s in specs]
    if not outcomes:
        return None
    meeting = [o for o in outcomes if o.meets]
    if meeting:
        return min(meeting, key=lambda o: o.result.figures()["ttft_p90_ms"])
    return min(outcomes, key=lambda o: o.result.figures()["ttft_p90_ms"])


def smallest(
    profile: Profile,
    arrivals: Sequence[Arrival],
    targets: Targets,
    base: ClusterSpec,
    kind: str,
    *,
    max_nodes: int = 256,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Outcome | None, Outcome | None]:
    """(the smallest cluster of ``kind`` meeting the targets, the best one with a node less), by
    bisection over the node count; (None, the largest tried) when ``max_nodes`` do not meet them."""
    share = prefill_share(profile, arrivals)
    cache: dict[int, Outcome | None] = {}

    def at(n: int) -> Outcome | None:
        if n not in cache:
            cache[n] = best_of(profile, shapes(kind, n, share, base), arrivals, targets)
            o = cache[n]
            if o is not None:
                progress(f"{o.spec.describe()}: {'meets' if o.meets else 'misses'} the targets")
        return cache[n]

    lo, hi = (2 if kind == "pd" else 1), 1
    while True:  # doubling to a size that meets them
        hi = max(hi * 2, lo)
        top = at(min(hi, max_nodes))
        if top is not None and top.meets:
            hi = min(hi, max_nodes)
            break
        if hi >= max_nodes:
            return None, top
    low = lo
    while low < hi:
        mid = (low + hi) // 2
        o = at(mid)
        if o is not None and o.meets:
            hi = mid
        else:
            low = mid + 1
    smaller = at(hi - 1) if hi - 1 >= lo else None
    return at(hi), smaller


def max_rate(
    profile: Profile,
    spec: ClusterSpec,
    arrivals: Sequence[Arrival],
    targets: Targets,
    *,
    low: float = 1 / 64,
    high: float = 64.0,
    steps: int = 10,
) -> tuple[float, Outcome | None]:
    """The highest rate factor in [low, high] at which ``spec`` meets the targets (bisection in log
    space, ``steps`` runs after the bracket), and the run there; (0, None) when even ``low`` misses."""
    first = run(profile, spec, at_rate(arrivals, low), targets)
    if not first.meets:
        return 0.0, None
    best: tuple[float, Outcome] = (low, first)
    top = run(profile, spec, at_rate(arrivals, high), targets)
    if top.meets:
        return high, top
    lo, hi = low, high
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        o = run(profile, spec, at_rate(arrivals, mid), targets)
        if o.meets:
            lo, best = mid, (mid, o)
        else:
            hi = mid
    return best
