"""Per-request latencies, one way for every process that streams tokens (the engine, the router).

A ``LatencyTracker`` holds a process's latency histograms (names follow vLLM's); ``start`` opens one
request's clock, which observes from the tokens it is told about::

    start ──tokens──▶ first token   time_to_first_token_seconds = first - start
          ──tokens──▶ each later    inter_token_latency_seconds = now - previous
          ──finish──▶               e2e_request_latency_seconds = now - start
                                    request_time_per_output_token_seconds
                                        = (last - first) / (tokens - 1), with more than one token
                                    request_decode_time_seconds = last - first, likewise
                                    request_prefill_time_seconds = first - scheduled, when told
                                    request_prompt_tokens, request_generation_tokens, when told

The last four are vLLM's per-request phase and length histograms.  A tracker holds them where its owner
knows the figures (the engine knows when it scheduled a request, the router does not): ``finish``
observes a figure it is given into its histogram, which must then exist, and the decode time where the
tracker holds it.

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
PREFILL_TIME = "request_prefill_time_seconds"
DECODE_TIME = "request_decode_time_seconds"
PROMPT_TOKENS = "request_prompt_tokens"
GENERATION_TOKENS = "request_generation_tokens"
REQUEST_LENGTHS = (PROMPT_TOKENS, GENERATION_TOKENS)


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

    __slots__ = ("_choices", "_h", "first", "last", "start", "tokens_seen")

    def __init__(self, tracker: LatencyTracker, start: float) -> None:
        self._h = tracker.histograms
        self.start = start
        self.first: float | None = None
        self.last = start
        self.tokens_seen = 0
        # Once a second choice shows (a request of n): choice -> [its first token's time, its last's, tokens]
        self._choices: dict[int, list[float]] | None = None

    def tokens(self, n: int, now: float, choice: int = 0) -> None:
        """``n`` (> 0) new tokens of the request's ``choice`` (of its n) reached its consumer at ``now``.
        The request's first token is its time to first token; each choice's later tokens are that
        choice's inter-token gaps (choices interleave: a gap between two of them is no gap of either)."""
        if self.first is None:
            self.first = now
            self._h[TTFT].observe(now - self.start)
        elif choice == 0 and self._choices is None:
            self._h[ITL].observe(now - self.last)
        if choice or self._choices is not None:
            if self._choices is None:  # choice 0's tokens so far, if any, as one run
                seen = float(self.tokens_seen)
                self._choices = {0: [self.first, self.last, seen]} if seen else {}
            run = self._choices.get(choice)
            if run is None:
                self._choices[choice] = [now, now, float(n)]
            else:
                self._h[ITL].observe(now - run[1])
                run[1], run[2] = now, run[2] + n
        self.last = now
        self.tokens_seen += n

    def _per_token(self) -> float | None:
        """Time per output token after the first: the request's, or its choices' mean (each its own)."""
        if self._choices is None:
            if self.first is None or self.tokens_seen <= 1:
                return None
            return (self.last - self.first) / (self.tokens_seen - 1)
        each = [(last - first) / (count - 1) for first, last, count in self._choices.values() if count > 1]
        return sum(each) / len(each) if each else None

    def finish(
        self,
        now: float,
        *,
        scheduled: float | None = None,
        prompt_tokens: int | None = None,
        generation_tokens: int | None = None,
    ) -> None:
        """The request ended at ``now`` (call once).  ``scheduled``: when it was first scheduled (the
        prefill phase runs from there to the first token); the lengths: its prompt and its output."""
        self._h[E2E].observe(now - self.start)
        per_token = self._per_token()
        if per_token is not None and self.first is not None:
            self._h[TPOT].observe(per_token)
            # One token is no decode phase (a prefill node's requests): nothing to observe, not a zero.
            if DECODE_TIME in self._h:
                self._h[DECODE_TIME].observe(self.last - self.first)
        if self.first is not None and scheduled is not None:
            self._h[PREFILL_TIME].observe(self.first - scheduled)
        if prompt_tokens is not None:
            self._h[PROMPT_TOKENS].observe(prompt_tokens)
        if generation_tokens is not None:
            self._h[GENERATION_TOKENS].observe(generation_tokens)
