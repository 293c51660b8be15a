"""Per-tier counters and latency histograms, and the immutable snapshots ``stats()`` returns.

Counter names (``TierMetrics.count``):

    lookups, lookup_blocks, lookup_hits     calls, blocks asked, leading blocks found
    gets, get_blocks, hit_blocks, bytes_in  calls, blocks asked, blocks loaded, payload bytes read
    puts, put_blocks, stored_blocks, bytes_out
    reads, read_blocks                      unit reads (write-down sources, the store server)
    deletes, deleted_blocks
    evictions, promotions, demotions        blocks evicted / promoted into / demoted into this tier
    dropped_writes                          blocks not written down to this tier: queue full
    lost_writes                             blocks not written down: the source evicted them first

``misses`` counts, by ``MissReason``, the calls that stopped short (one per call: the reason of the first
block not served); ``put_failures`` does the same for writes.  Latencies are ``telemetry`` histograms
over log2 microsecond buckets: bucket ``i`` counts calls that took up to ``2**(i+1)`` µs.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvstore.results import MissReason
from telemetry.metrics import Histogram, HistogramSnapshot

OPS = ("lookup", "get", "read", "put", "delete")
# The counters every tier keeps (a kind may add its own: evictions, discarded files), exported from 0 --
# a dashboard's rate() over a counter that appears only at its first use reads "no data" until then.
COUNTERS = (
    "lookups",
    "lookup_blocks",
    "lookup_hits",
    "gets",
    "get_blocks",
    "hit_blocks",
    "reads",
    "read_blocks",
    "bytes_in",
    "puts",
    "put_blocks",
    "stored_blocks",
    "bytes_out",
    "deletes",
    "deleted_blocks",
)
# Log2 buckets in microseconds: bucket ``i`` ends at ``2**(i+1)`` µs, 1 µs .. 2**26 µs (about 67 s);
# slower calls land in the last (+Inf) bucket.
LATENCY_BOUNDS = tuple(2 ** (i + 1) / 1e6 for i in range(26))


def quantile(snap: HistogramSnapshot, q: float) -> float:
    """Upper bound (seconds) of the log2 bucket holding quantile ``q``; 0.0 with no samples."""
    if snap.count == 0:
        return 0.0
    rank = q * snap.count
    seen = 0
    for i, n in enumerate(snap.counts):
        seen += n
        if seen >= rank and n:
            return (2 ** (i + 1)) / 1e6
    return (2 ** len(snap.counts)) / 1e6


def latency_dict(snap: HistogramSnapshot) -> dict[str, Any]:
    return {
        "count": snap.count,
        "mean_s": snap.total / snap.count if snap.count else 0.0,
        "p50_s": quantile(snap, 0.5),
        "p99_s": quantile(snap, 0.99),
        "buckets_us_log2": list(snap.counts),
    }


@dataclass(frozen=True)
class TierStats:
    """One tier's counters at one moment, plus what the backend reports about itself (``backend``)."""

    name: str
    kind: str
    counters: dict[str, int]
    misses: dict[str, int]
    put_failures: dict[str, int]
    latency: dict[str, HistogramSnapshot]
    breakers: dict[str, str]
    backend: dict[str, Any] = field(default_factory=dict)
    last_error: str = ""

    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)

    def missed(self, reason: MissReason) -> int:
        return self.misses.get(reason.value, 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "counters": dict(self.counters),
            "misses": dict(self.misses),
            "put_failures": dict(self.put_failures),
            "latency": {op: latency_dict(snap) for op, snap in self.latency.items()},
            "breakers": dict(self.breakers),
            "backend": dict(self.backend),
            "last_error": self.last_error,
        }


class TierMetrics:
    """Thread-safe counters of one tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._misses: Counter[str] = Counter()
        self._put_failures: Counter[str] = Counter()
        self._latency = {op: Histogram(LATENCY_BOUNDS) for op in OPS}
        self.last_error = ""

    def count(self, **increments: int) -> None:
        with self._lock:
            self._counters.update(increments)

    def miss(self, reason: MissReason, n: int = 1) -> None:
        with self._lock:
            self._misses[reason.value] += n

    def put_failure(self, reason: MissReason, n: int = 1) -> None:
        with self._lock:
            self._put_failures[reason.value] += n

    def latency(self, op: str, seconds: float) -> None:
        self._latency[op].observe(seconds)  # a Histogram takes its own lock

    def error(self, message: str) -> None:
        with self._lock:
            self.last_error = message

    def snapshot(self, name: str, kind: str, breakers: dict[str, str], backend: dict[str, Any]) -> TierStats:
        with self._lock:
            return TierStats(
                name=name,
                kind=kind,
                counters=dict(self._counters),
                misses=dict(self._misses),
                put_failures=dict(self._put_failures),
                latency={op: h.snapshot() for op, h in self._latency.items()},
                breakers=breakers,
                backend=backend,
                last_error=self.last_error,
            )
