"""telemetry/: the histogram, the per-request latency clock, /metrics and its labels, the throttled logs."""

from __future__ import annotations

import logging
import sys
import urllib.request
from pathlib import Path

import pytest

from engine.model.embedded import DEFAULT_MODEL_NAME, default_model_path, model_name
from telemetry.exposition import Metric, MetricsServer, RpcCounters, stats_families
from telemetry.exposition import gauge as gauge_family
from telemetry.latency import (
    DECODE_TIME,
    E2E,
    GENERATION_TOKENS,
    ITL,
    PREFILL_TIME,
    PROMPT_TOKENS,
    REQUEST_LATENCIES,
    REQUEST_LENGTHS,
    TPOT,
    TTFT,
    LatencyTracker,
)
from telemetry.logs import Throttle
from telemetry.metrics import Counters, Histogram, counter, gauge, merge_histograms


def test_histogram_buckets_are_le_and_snapshots_merge() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 1, 1) and snap.count == 4 and snap.total == pytest.approx(2.65)
    assert snap.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    merged = merge_histograms({"a": snap}, {"a": snap, "b": snap})
    assert merged["a"].counts == (4, 2, 2) and merged["b"] == snap
    with pytest.raises(ValueError):
        snap.merged(Histogram((0.2,)).snapshot())
    with pytest.raises(ValueError):
        Histogram((1.0, 0.1))


def test_counters_refuse_what_their_specs_do_not_declare() -> None:
    declared = (counter("hits", "h"), counter("loads", "l", label="source"), gauge("g", "g"))
    specs = {s.name: s for s in declared}
    counters = Counters(specs)
    assert counters.snapshot() == {"hits": 0.0}  # exported before its first event; a label's values later
    counters.add("hits")
    counters.add("loads.disk", 2)
    assert counters.snapshot() == {"hits": 1.0, "loads.disk": 2.0}
    for bad in ("typo", "hits.x", "loads", "g"):
        with pytest.raises(KeyError):
            counters.add(bad)


def test_a_request_clock_observes_ttft_itl_tpot_and_e2e() -> None:
    tracker = LatencyTracker({name: Histogram((1.0, 10.0)) for name in REQUEST_LATENCIES})
    latency = tracker.start(100.0)
    latency.tokens(1, 100.5)  # ttft 0.5
    latency.tokens(2, 102.5)  # itl 2.0
    latency.tokens(1, 103.5)  # itl 1.0
    latency.finish(104.0)  # e2e 4.0; tpot (103.5 - 100.5) / 3
    snap = tracker.snapshot()
    assert snap[TTFT].total == 0.5 and snap[TTFT].count == 1
    assert snap[ITL].total == 3.0 and snap[ITL].count == 2
    assert snap[E2E].total == 4.0
    assert snap[TPOT].total == pytest.approx(1.0) and snap[TPOT].count == 1


def test_a_request_of_several_choices_has_one_first_token_and_each_choice_s_own_gaps() -> None:
    """n choices interleave: the request's first token is its TTFT, once; a gap is between two tokens of
    one choice (one choice's token after another's is no inter-token latency of either)."""
    tracker = LatencyTracker({name: Histogram((1.0, 10.0)) for name in REQUEST_LATENCIES})
    latency = tracker.start(100.0)
    latency.tokens(1, 100.5, choice=0)  # ttft 0.5
    latency.tokens(1, 100.7, choice=1)  # choice 1's first token: no gap
    latency.tokens(1, 101.5, choice=0)  # choice 0: 1.0
    latency.tokens(1, 101.9, choice=1)  # choice 1: 1.2
    latency.finish(102.0)
    snap = tracker.snapshot()
    assert snap[TTFT].count == 1 and snap[TTFT].total == 0.5
    assert snap[ITL].count == 2 and snap[ITL].total == pytest.approx(2.2)
    assert snap[E2E].count == 1
    # Time per output token: the choices' mean (1.0 and 1.2), not the request's span over all its tokens.
    assert snap[TPOT].count == 1 and snap[TPOT].total == pytest.approx(1.1)


def test_a_request_without_tokens_observes_only_its_end() -> None:
    tracker = LatencyTracker({name: Histogram((1.0,)) for name in REQUEST_LATENCIES})
    tracker.start(0.0).finish(3.0)
    snap = tracker.snapshot()
    assert [snap[n].count for n in REQUEST_LATENCIES] == [0, 0, 0, 1]
    with pytest.raises(ValueError):
        LatencyTracker({TTFT: Histogram((1.0,))})


def test_a_request_clock_observes_its_phases_and_lengths_when_told() -> None:
    names = (*REQUEST_LATENCIES, PREFILL_TIME, DECODE_TIME, *REQUEST_LENGTHS)
    tracker = LatencyTracker({name: Histogram((1.0, 10.0, 100.0)) for name in names})
    latency = tracker.start(100.0)
    latency.tokens(1, 100.5)
    latency.tokens(3, 103.5)
    latency.finish(104.0, scheduled=100.25, prompt_tokens=40, generation_tokens=4)
    one = tracker.start(200.0)  # one output token: a prefill, no decode phase
    one.tokens(1, 201.0)
    one.finish(201.0, scheduled=200.5, prompt_tokens=7, generation_tokens=1)
    snap = tracker.snapshot()
    assert snap[PREFILL_TIME].count == 2 and snap[PREFILL_TIME].total == 0.25 + 0.5
    assert snap[DECODE_TIME].count == 1 and snap[DECODE_TIME].total == 3.0
    assert snap[PROMPT_TOKENS].counts == (0, 1, 1, 0) and snap[PROMPT_TOKENS].total == 47
    assert snap[GENERATION_TOKENS].counts == (1, 1, 0, 0)
    # Never scheduled (aborted while waiting) and never a token: only its end and its lengths.
    tracker.start(300.0).finish(301.0, scheduled=None, prompt_tokens=3, generation_tokens=0)
    snap = tracker.snapshot()
    assert snap[PREFILL_TIME].count == 2 and snap[E2E].count == 3 and snap[GENERATION_TOKENS].count == 3


def test_a_figure_without_its_histogram_is_an_error_not_a_silent_drop() -> None:
    tracker = LatencyTracker({name: Histogram((1.0,)) for name in REQUEST_LATENCIES})
    latency = tracker.start(0.0)
    latency.tokens(2, 1.0)
    with pytest.raises(KeyError):
        latency.finish(2.0, prompt_tokens=3)


def test_metrics_server_puts_its_labels_on_every_series() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import SPECS, StatsSnapshot

    calls = RpcCounters()
    calls.record("Generate", "OK")
    h = Histogram(SPECS["request_prompt_tokens"])
    h.observe(12)

    def collect() -> list[Metric]:
        stats = StatsSnapshot(
            {"prompt_tokens.local_compute": 12.0}, {}, {"request_prompt_tokens": h.snapshot()}
        )
        return [
            gauge_family("pdkv_x", "x", 1.0),
            *stats_families(stats, specs=SPECS),
            *calls.families("pdkv_t"),
        ]

    server = MetricsServer("127.0.0.1:0", collect, {"model_name": "smol"}).start()
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        server.close()
    samples = [s for f in text_string_to_metric_families(body) for s in f.samples]
    names = {s.name for s in samples}
    assert {
        "pdkv_x",
        "pdkv_prompt_tokens_total",
        "pdkv_request_prompt_tokens_bucket",
        "pdkv_t_rpcs_total",
    } <= names
    assert all(s.labels.get("model_name") == "smol" for s in samples), body
    # A family's own labels stay.
    assert any(s.labels.get("source") == "local_compute" for s in samples)
    assert any(s.labels.get("le") == "20.0" and s.value == 1 for s in samples)


def test_a_model_s_default_name_is_the_same_for_the_router_and_the_nodes(tmp_path: Path) -> None:
    (tmp_path / "my-model").mkdir()
    (tmp_path / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    assert model_name(tmp_path / "my-model") == "my-model"
    assert model_name(str(tmp_path / "tiny.Q8_0.gguf")) == "tiny.Q8_0"
    assert model_name(None) == model_name(default_model_path()) == DEFAULT_MODEL_NAME


def test_throttle_passes_one_traceback_per_interval_without_it() -> None:
    throttle = Throttle(interval_s=3600.0)

    def record(msg: str) -> logging.LogRecord:
        try:
            raise ValueError("bad bytes")
        except ValueError:
            return logging.LogRecord("x", logging.ERROR, __file__, 1, msg, (), sys.exc_info())

    first = record("request failed")
    assert throttle.filter(first)
    assert first.exc_info is None and first.msg == "request failed (ValueError: bad bytes)"
    assert not throttle.filter(record("request failed"))
    assert throttle.filter(record("another failure"))
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "no traceback", (), None)
    assert throttle.filter(plain) and throttle.filter(plain)
