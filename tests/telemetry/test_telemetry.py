"""telemetry/: the histogram, the per-request latency clock, the throttled logs."""

from __future__ import annotations

import logging
import sys

import pytest

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
