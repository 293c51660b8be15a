"""A planned stop that costs nothing: what every server process does between SIGTERM and its exit.

    drain = Drain("decode-0", progress, timeout_s=30)
    report = drain.run()          # returns when nothing is left, or at the deadline
    ... stop the server, the engine ...
    print(report.summary())

Each process says what "nothing left" means by its ``progress`` callback (a ``DrainProgress``):

    node        new Prefill / Decode calls are refused UNAVAILABLE (the router sends them elsewhere);
                requests: admitted and unfinished (decode streams, prefills computing);
                holds: finished prefills whose KV a decode node has yet to pull or release
    router      new Generate calls are refused UNAVAILABLE; requests: streams in flight
    store       (no drain loop: it flushes its write-back queue, ``kvstore/server.py``)

Health says NOT_SERVING from the first moment, so routers and orchestrators stop sending work; a call
that arrives before they notice is refused, not lost.  Progress goes to stdout (``pdkv drain: ...``, once
a second) and to ``/metrics`` (``metrics``); what the deadline cut is the report's ``left`` and is
printed at exit, so an operator (and the rolling-restart test) can see that a planned stop cost nothing.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from telemetry.exposition import Metric, gauge

DRAIN_PREFIX = "pdkv drain: "
LINGER_S = 1.5  # the longest a drained node waits for a health check to see it stopping (rounds: 0.5 s)
UNWATCHED_S = 1.0  # no health check for this long: nobody watches (the router stopped first): no wait


@dataclass(frozen=True)
class DrainProgress:
    """What a draining process still waits for."""

    requests: int = 0  # admitted and unfinished (streams in flight, prefills computing)
    holds: int = 0  # finished requests whose KV a reader has yet to pull or release
    # A health check has seen it stopping (or LINGER_S passed): the router waits for its return then,
    # where it is the last node of its kind, instead of taking its exit for a failure (router/room.py).
    seen: bool = True

    @property
    def done(self) -> bool:
        return self.requests == 0 and self.holds == 0 and self.seen

    def __str__(self) -> str:
        unseen = "" if self.seen else ", not yet seen stopping by a health check"
        return f"{self.requests} requests, {self.holds} holds left{unseen}"


@dataclass(frozen=True)
class DrainReport:
    name: str
    seconds: float
    left: DrainProgress  # what the deadline cut: nothing when it drained in time
    timeout_s: float

    @property
    def in_time(self) -> bool:
        return self.left.done

    def summary(self) -> str:
        if self.in_time:
            return (
                f"{DRAIN_PREFIX}{self.name} drained in {self.seconds:.2f}s (0 requests cut, 0 holds dropped)"
            )
        return (
            f"{DRAIN_PREFIX}{self.name} hit its deadline ({self.timeout_s:.0f}s): {self.left.requests} "
            f"requests cut, {self.left.holds} holds dropped"
        )


class Drain:
    """One process's drain: ``start`` it (from any thread), ``run`` it, read ``metrics`` meanwhile."""

    def __init__(
        self,
        name: str,
        progress: Callable[[], DrainProgress],
        timeout_s: float,
        *,
        poll_s: float = 0.05,
        report_every_s: float = 1.0,
        out: Callable[[str], None] | None = None,
    ) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"the drain timeout must be >= 0 seconds, got {timeout_s!r}")
        self.name = name
        self.timeout_s = timeout_s
        self._progress = progress
        self._poll_s = poll_s
        self._report_every_s = report_every_s
        self._out = out or (lambda line: print(line, flush=True))
        self._lock = threading.Lock()
        self._started: float | None = None
        self._left = DrainProgress()
        self.report: DrainReport | None = None

    @property
    def draining(self) -> bool:
        return self._started is not None

    def run(self) -> DrainReport:
        """Wait until ``progress`` says nothing is left or ``timeout_s`` passed; the report says which."""
        start = time.monotonic()
        with self._lock:
            self._started = start
        deadline = start + self.timeout_s
        next_report = start
        while True:
            left = self._read()
            now = time.monotonic()
            if left.done or now >= deadline:
                break
            if now >= next_report:
                self._out(
                    f"{DRAIN_PREFIX}{self.name} draining: {left} ({deadline - now:.0f}s to its deadline)"
                )
                next_report = now + self._report_every_s
            time.sleep(min(self._poll_s, max(0.0, deadline - now)))
        self.report = DrainReport(self.name, time.monotonic() - start, left, self.timeout_s)
        self._out(self.report.summary())
        return self.report

    def _read(self) -> DrainProgress:
        left = self._progress()
        with self._lock:
            self._left = left
        return left

    def metrics(self, prefix: str) -> list[Metric]:
        """``PREFIX_draining`` (1 from SIGTERM on), ``PREFIX_drain_requests_left`` and
        ``PREFIX_drain_holds_left``."""
        with self._lock:
            draining, left = self._started is not None, self._left
        return [
            gauge(f"{prefix}_draining", "1 while the process drains for a planned stop", float(draining)),
            gauge(
                f"{prefix}_drain_requests_left",
                "admitted requests a draining process still finishes",
                float(left.requests if draining else 0),
            ),
            gauge(
                f"{prefix}_drain_holds_left",
                "KV holds a draining prefill node still waits to see pulled or released",
                float(left.holds if draining else 0),
            ),
        ]


def add_drain_arguments(parser: argparse.ArgumentParser, waits_for: str) -> None:
    """``--drain-timeout-s`` and ``--grace-s`` of a serving process; ``waits_for``: what its drain
    waits for, as its help says it."""
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help=f"on SIGTERM, refuse new calls and wait this long at most for {waits_for} (a planned stop; "
        "keep it within the orchestrator's grace period)",
    )
    parser.add_argument(
        "--grace-s", type=float, default=5.0, help="seconds in-flight calls get on shutdown, after the drain"
    )
