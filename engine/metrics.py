"""What a node measures, declared once: the names, kinds and help texts of its counters, gauges and
histograms.  The value types that carry them (``Counters``, ``Histogram``) are ``telemetry/metrics.py``'s.

Every figure flows one way::

    counted (Counters / Histogram)  ->  EngineSnapshot (engine/snapshot.py)  ->  Node/Stats RPC
                                                                        ->  /metrics (telemetry/exposition.py)

A key is a declared name, or ``name.value`` for a metric with a label (``prompt_tokens.local_compute``):
the exporter turns it into ``pdkv_prompt_tokens_total{source="local_compute"}``.  Names follow vLLM's
where the concept is the same (``prefix_cache_queries``, ``num_requests_running``,
``time_to_first_token_seconds``), under the ``pdkv_`` prefix.

**Adding an engine counter is two files**: declare it in ``ENGINE_METRICS`` below, and count it where it
happens (``counters.add("name")`` on a ``Counters(SPECS)``).  The snapshot, the RPC's ``counters`` map
and ``/metrics`` pick it up from the declaration.  A connector's counters are its own (``ConnectorStats``,
one file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from telemetry.metrics import (
    HistogramSnapshot,
    MetricSpec,
    counter,
    gauge,
    histogram,
    lookup,
    merge_histograms,
)

# vLLM's bucket bounds for the same histograms (the prefill time takes the TTFT's, finer than vLLM's).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# Token counts (prompt and output lengths): vLLM's 1-2-5 steps, here up to 200k tokens.
LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))[:-1]  # 1, 2, 5, ..., 200000
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Prompt token sources (vLLM's label values).
LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER, LOCAL_COMPUTE = (
    "local_cache_hit",
    "external_kv_transfer",
    "local_compute",
)

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    # counters
    counter("prompt_tokens", "prompt tokens by where their KV came from", label="source"),
    counter("generation_tokens", "output tokens sampled"),
    counter("prefix_cache_queries", "prompt tokens looked up in the local prefix cache"),
    counter("prefix_cache_hits", "prompt tokens found in the local prefix cache"),
    counter("num_preemptions", "requests preempted for lack of KV blocks"),
    counter("kv_block_evictions", "cached KV blocks evicted to make room"),
    counter("kv_load_failures", "requests whose KV load from a connector failed (recomputed or failed)"),
    counter(
        "connector_lookup_failures",
        "connector lookups that raised or stayed unanswered past LOOKUP_DEADLINE_S (counted as zero hits)",
    ),
    counter(
        "connector_call_failures",
        "scheduler-side connector calls that raised (request_finished, build_connector_meta) or reported "
        "load errors for blocks no request was loading; each logged (docs/connectors.md)",
        label="call",
    ),
    counter("kv_hold_expiries", "holds (KV kept for a connector's transfer) past kv_hold_timeout_s"),
    counter(
        "kv_hold_stop_timeouts",
        "holds freed without the connector's confirmation after kv_stop_timeout_s (a connector bug)",
    ),
    counter("request_success", "requests finished, by finish reason", label="finished_reason"),
    counter("engine_steps", "engine steps run"),
    counter(
        "engine_step_seconds", "seconds spent in the model runner (forward passes and their connector work)"
    ),
    counter(
        "prefill_compute_tokens",
        "prompt tokens computed (prefill chunks), the work a router's cost model counts",
    ),
    counter(
        "prefill_compute_seconds",
        "runner seconds attributed to prefill chunks (each step's time by its share of prefill tokens)",
    ),
    # gauges
    gauge("num_requests_running", "requests computing in the engine"),
    gauge("num_requests_waiting", "requests waiting to be scheduled"),
    gauge("num_requests_loading", "requests waiting for their KV from a connector"),
    gauge("num_requests_held", "finished requests whose KV is held for a connector's transfer"),
    gauge("prefill_tokens_queued", "prompt tokens still to compute for the waiting and running requests"),
    gauge("kv_cache_usage_perc", "fraction of KV blocks in use (0..1)"),
    gauge("kv_cache_free_blocks", "free KV blocks"),
    gauge("kv_cache_blocks", "KV blocks in the pool"),
    # histograms (seconds)
    histogram("time_to_first_token_seconds", "arrival to first output token", TTFT_BUCKETS),
    histogram("inter_token_latency_seconds", "time between two output tokens of a request", TOKEN_BUCKETS),
    histogram(
        "request_time_per_output_token_seconds",
        "per request: (finish - first token) / (output tokens - 1)",
        TOKEN_BUCKETS,
    ),
    histogram("e2e_request_latency_seconds", "arrival to finish", REQUEST_BUCKETS),
    histogram("request_queue_time_seconds", "arrival to admission (KV blocks allocated)", REQUEST_BUCKETS),
    histogram(
        "request_prefill_time_seconds", "per request: first admission to its first output token", TTFT_BUCKETS
    ),
    histogram(
        "request_decode_time_seconds",
        "per request with more than one output token: first to last output token",
        REQUEST_BUCKETS,
    ),
    # histograms (token counts)
    histogram("request_prompt_tokens", "per request: prompt tokens", LENGTH_BUCKETS),
    histogram("request_generation_tokens", "per request: output tokens sampled", LENGTH_BUCKETS),
)

# Observed by connectors (``ConnectorStats.histograms``), declared here so every connector names them alike.
CONNECTOR_METRICS: tuple[MetricSpec, ...] = (
    histogram("kv_load_seconds", "one KV load into the cache, by source", TRANSFER_BUCKETS, label="source"),
    histogram(
        "kv_transfer_seconds",
        "one KV transfer between engines: a pull (recv) or a lease served (send)",
        TRANSFER_BUCKETS,
        label="direction",
    ),
)

SPECS: dict[str, MetricSpec] = {s.name: s for s in (*ENGINE_METRICS, *CONNECTOR_METRICS)}


def spec_of(key: str) -> MetricSpec:
    """The declaration of ``key`` (``name`` or ``name.label_value``); ``KeyError`` if undeclared."""
    return lookup(SPECS, key)


@dataclass(frozen=True)
class StatsSnapshot:
    """Counters, gauges and histograms by declared key, at one moment."""

    counters: Mapping[str, float]
    gauges: Mapping[str, float]
    histograms: Mapping[str, HistogramSnapshot]

    def counter(self, key: str) -> float:
        spec_of(key)  # a typo is an error, not a zero
        return float(self.counters.get(key, 0.0))

    def gauge(self, key: str) -> float:
        spec_of(key)
        return float(self.gauges.get(key, 0.0))

    def merged(self, other: StatsSnapshot) -> StatsSnapshot:
        counters = dict(self.counters)
        for key, value in other.counters.items():
            counters[key] = counters.get(key, 0.0) + value
        return StatsSnapshot(
            counters, {**self.gauges, **other.gauges}, merge_histograms(self.histograms, other.histograms)
        )
