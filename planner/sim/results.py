"""What a simulation measured: per-request records and the nodes' token gaps, made into the figures a
run on real nodes reports (``bench.replay``'s: TTFT / ITL / e2e quantiles, hit rates by source,
goodput)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.sim.job import Record

QUANTILES = (0.5, 0.9, 0.99)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (``statistics.quantiles(method="inclusive")``, as
    ``bench.replay`` computes its figures); NaN for no values."""
    if not len(values):
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q * 100))


def weighted_quantile(values: Sequence[float], weights: Sequence[int], q: float) -> float:
    """The smallest value with at least a ``q`` share of the weight at or below it."""
    if not len(values):
        return float("nan")
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    i = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(v[order][min(i, len(v) - 1)])


@dataclass
class SimResult:
    records: list[Record]
    itl: list[tuple[float, int]]  # every node's token gaps: (seconds, how many tokens had it)
    refused: int  # requests no node could ever hold (prompt and output over a node's KV cache)
    overloaded: bool  # stopped early: the queued prompts would take the nodes the spec's give_up_s
    stuck: bool  # requests left that no event would ever move (a model bug, or a cache too small)
    span_s: float  # first arrival to last finish
    busy_s: float  # node-seconds spent stepping, over every node
    nodes: int
    steps: int

    @property
    def done(self) -> list[Record]:
        return [r for r in self.records if r.finish_s >= 0]

    def ttft(self) -> list[float]:
        return [r.first_token_s - r.sent_s for r in self.done]

    def tpot(self, r: Record) -> float:
        return (r.finish_s - r.first_token_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0

    def goodput(self, slo_ttft_s: float, slo_itl_s: float) -> float:
        """Requests a second that met both targets: TTFT, and their mean gap between tokens."""
        if self.span_s <= 0:
            return 0.0
        good = sum(
            1 for r in self.done if r.first_token_s - r.sent_s <= slo_ttft_s and self.tpot(r) <= slo_itl_s
        )
        return good / self.span_s

    def figures(self, prefix: str = "") -> dict[str, float]:
        done = self.done
        prompt = sum(r.input_tokens for r in done) or 1
        span = self.span_s
        out = {
            f"{prefix}requests": float(len(done)),
            f"{prefix}refused": float(self.refused),
            f"{prefix}overloaded": float(self.overloaded),
            f"{prefix}stuck": float(self.stuck),
            f"{prefix}hit_local": sum(r.local_tokens for r in done) / prompt,
            f"{prefix}hit_store": sum(r.store_tokens for r in done) / prompt,
            f"{prefix}hit_remote_prefill": sum(r.remote_tokens for r in done) / prompt,
            f"{prefix}preemptions": float(sum(r.preemptions for r in done)),
            f"{prefix}span_s": span,
            f"{prefix}throughput_tok_s": sum(r.output_tokens for r in done) / span if span else 0.0,
            f"{prefix}node_busy_fraction": self.busy_s / (span * self.nodes) if span else 0.0,
        }
        ttft = self.ttft()
        e2e = [r.finish_s - r.sent_s for r in done]
        gaps = [g for g, _ in self.itl]
        weights = [w for _, w in self.itl]
        for q in QUANTILES:
            p = round(q * 100)
            out[f"{prefix}ttft_p{p}_ms"] = quantile(ttft, q) * 1e3
            out[f"{prefix}itl_p{p}_ms"] = weighted_quantile(gaps, weights, q) * 1e3
            out[f"{prefix}e2e_p{p}_ms"] = quantile(e2e, q) * 1e3
        return out

    def meets(self, slo_ttft_p90_s: float, slo_itl_p90_s: float) -> bool:
        """The targets hold: TTFT p90 and ITL p90 within them, and every request served."""
        if self.overloaded or self.stuck or self.refused or len(self.done) < len(self.records):
            return False
        f = self.figures()
        return f["ttft_p90_ms"] <= slo_ttft_p90_s * 1e3 and not f["itl_p90_ms"] > slo_itl_p90_s * 1e3
