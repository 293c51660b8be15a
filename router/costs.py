"""What a node's own figures say a request will cost there (``kv-aware`` routing): ``NodeCosts``, measured
from the deltas of two ``Stats`` (a live node's, or a simulated one's: planner/sim) by ``measure_costs``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NodeCosts:
    """What a node's own figures say a request will cost there (``kv-aware`` routing), measured from the
    deltas of its ``Stats`` between two health rounds (smoothed), never set by hand."""

    prefill_s_per_token: float | None = None  # runner seconds per prompt token computed
    load_s_per_token: float | None = None  # seconds per prompt token loaded from its store
    queued_prefill_tokens: float = 0.0  # prompt tokens its waiting and running requests still compute
    measured_at: float = 0.0  # time.monotonic() of the Stats the queue comes from (it drains from then)


SMOOTHING = 0.3  # weight of the newest window in the moving averages


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class HistogramSum(Protocol):
    @property
    def sum(self) -> float: ...


class CostFigures(Protocol):
    """What ``measure_costs`` reads of a node's ``NodeStats`` (a simulated node has the same)."""

    @property
    def counters(self) -> Mapping[str, float]: ...

    @property
    def gauges(self) -> Mapping[str, float]: ...

    @property
    def histograms(self) -> Mapping[str, HistogramSum]: ...


def measure_costs(
    costs: NodeCosts, before: CostFigures | None, now: CostFigures, at: float | None = None
) -> NodeCosts:
    """``costs`` updated with what the node did between two Stats: prefill seconds per computed token,
    store-load seconds per loaded token (the ``offload`` connector's load histogram over the prompt
    tokens it loaded), and the prefill work it has queued now (as of ``at``, default now on the
    monotonic clock)."""
    prefill, load = costs.prefill_s_per_token, costs.load_s_per_token
    if before is not None:
        c, b = now.counters, before.counters
        tokens = c["prefill_compute_tokens"] - b["prefill_compute_tokens"]
        if tokens > 0:
            prefill = _smooth(prefill, (c["prefill_compute_seconds"] - b["prefill_compute_seconds"]) / tokens)
        key = "prompt_tokens.external_kv_transfer"
        loaded = c[key] - b[key]
        if loaded > 0 and "kv_load_seconds.offload" in now.histograms:
            old = (
                before.histograms["kv_load_seconds.offload"].sum
                if "kv_load_seconds.offload" in before.histograms
                else 0.0
            )
            load = _smooth(load, (now.histograms["kv_load_seconds.offload"].sum - old) / loaded)
    measured_at = time.monotonic() if at is None else at
    return NodeCosts(prefill, load, now.gauges["prefill_tokens_queued"], measured_at)
