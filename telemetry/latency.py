"""Per-request latencies, one way for every process that streams tokens (the engine, the router).

A ``LatencyTracker`` holds a process's latency histograms (names follow vLLM's); ``start`` opens one
request's clock, which observes from the tokens it is told about::

    start ──tokens──▶ first token   time_to_first_token_seconds = first - start
          ──tokens──▶ each later    inter_token_latency_seconds = now - previous
          ──finish──▶               e2e_request_latency_seconds = now - start
                                    request_time_per_output_token_seconds
                                        = (last - first) / (tokens - 1), with more than one token

Times are whatever clock the caller reads (the engine's ``time.monotonic``, the router's
``time.perf_counter``), passed in, so one reading serves every histogram an event touches.
"""

from __future__ import annotations

from collections.abc import Mapping

from telemetry.metrics import Histogram, HistogramSnapshot

TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
TPOT = "request_time_per_output_token_seconds"
E2E = "e2e_request_latency_seconds"
REQUEST_LATENCIES = (TTFT, ITL, TPOT, E2E)


class LatencyTracker:
    """The latency histograms by name: the four of ``REQUEST_LATENCIES`` and any others the owner observes
    itself (the engine's queue time).  Safe to observe from any thread (each histogram locks)."""

    def __init__(self, histograms: Mapping[str, Histogram]) -> None:
        missing = [name for name in REQUEST_LATENCIES if name not in histograms]
        if missing:
            raise ValueError(f"a latency tracker needs the histograms {missing}")
        self.histograms = dict(histograms)

    def start(self, at: float) -> RequestLatency:
        """One request's clock, started at ``at``."""
        return RequestLatency(self, at)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {name: hist.snapshot() for name, hist in self.histograms.items()}


class RequestLatency:
    """One request's clock.  Not thread-safe: the request's owner calls it."""

    __slots__ = ("_h", "first", "last", "start", "tokens_seen")

    def __init__(self, tracker: LatencyTracker, start: float) -> None:
        self._h = tracker.histograms
        self.start = start
        self.first: float | None = None
        self.last = start
        self.tokens_seen = 0

    def tokens(self, n: int, now: float) -> None:
        """``n`` (> 0) new tokens reached the request's consumer at ``now``."""
        if self.first is None:
            self.first = now
            self._h[TTFT].observe(now - self.start)
        else:
            self._h[ITL].observe(now - self.last)
        self.last = now
        self.tokens_seen += n

    def finish(self, now: float) -> None:
        """The request ended at ``now`` (call once)."""
        self._h[E2E].observe(now - self.start)
        if self.first is not None and self.tokens_seen > 1:
            self._h[TPOT].observe((self.last - self.first) / (self.tokens_seen - 1))
