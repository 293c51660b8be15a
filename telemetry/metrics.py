"""The value types every pdkv figure is kept in: metric declarations (``MetricSpec``), monotonic
``Counters`` by declared key, and the fixed-bucket ``Histogram`` with its immutable ``HistogramSnapshot``.

What a package measures (the names, kinds, help texts and buckets) is declared in that package (the
engine's in ``engine/metrics.py``); the mechanism that counts and merges them is here, once.

A key is a declared name, or ``name.value`` for a metric with a label (``prompt_tokens.local_compute``):
the exporter (``telemetry/exposition.py``) turns it into ``pdkv_prompt_tokens_total{source="local_compute"}``.
"""

from __future__ import annotations

import bisect
import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # without the pdkv_ prefix and, for counters, without _total
    kind: Kind
    help: str
    label: str | None = None  # the one label a keyed metric has ("source" for prompt_tokens.<source>)
    buckets: tuple[float, ...] = ()  # histogram bucket upper bounds: seconds, or token counts


def counter(name: str, help: str, label: str | None = None) -> MetricSpec:
    return MetricSpec(name, Kind.COUNTER, help, label)


def gauge(name: str, help: str) -> MetricSpec:
    return MetricSpec(name, Kind.GAUGE, help)


def histogram(name: str, help: str, buckets: tuple[float, ...], label: str | None = None) -> MetricSpec:
    return MetricSpec(name, Kind.HISTOGRAM, help, label, buckets)


def lookup(specs: Mapping[str, MetricSpec], key: str) -> MetricSpec:
    """The declaration of ``key`` (``name`` or ``name.label_value``) in ``specs``; ``KeyError`` if
    undeclared, or if the key's label does not match the declaration's."""
    name, _, value = key.partition(".")
    spec = specs[name]
    if (spec.label is None) != (not value):
        raise KeyError(f"{key!r}: {name} {'takes a' if spec.label else 'has no'} label")
    return spec


class Counters:
    """Monotonic counters by key declared in ``specs``.  Not thread-safe: one owner thread.

    Every declared counter without a label starts at 0, so that ``/metrics`` exports it before its first
    event: Prometheus' ``rate()`` misses the increment that creates a series, and a dashboard query of a
    counter nothing has counted yet (no preemption so far) would find no series at all."""

    def __init__(self, specs: Mapping[str, MetricSpec]) -> None:
        self._specs = specs
        self._values = {n: 0.0 for n, s in specs.items() if s.kind is Kind.COUNTER and s.label is None}

    def add(self, key: str, n: float = 1.0) -> None:
        if key not in self._values:
            spec = lookup(self._specs, key)  # an undeclared key is a bug: fail where it is counted
            if spec.kind is not Kind.COUNTER:
                raise KeyError(f"{key!r} is a {spec.kind.value}, not a counter")
            self._values[key] = 0.0
        self._values[key] += n

    def get(self, key: str) -> float:
        return self._values.get(key, 0.0)

    def snapshot(self) -> dict[str, float]:
        return dict(self._values)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Bucket bounds, the count in each bucket (the last one is +Inf), the sum of observed values."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def merged(self, other: HistogramSnapshot) -> HistogramSnapshot:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be merged")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramSnapshot(self.bounds, counts, self.total + other.total)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ``+Inf`` last: the Prometheus bucket samples."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class Histogram:
    """A fixed-bucket histogram (of seconds, or of token counts), safe to observe from any thread."""

    def __init__(self, spec_or_bounds: MetricSpec | tuple[float, ...]) -> None:
        bounds = spec_or_bounds.buckets if isinstance(spec_or_bounds, MetricSpec) else spec_or_bounds
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram buckets must be increasing and non-empty")
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # le semantics: value <= bound
        with self._lock:
            self._counts[i] += 1
            self._total += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.bounds, tuple(self._counts), self._total)


def merge_histograms(
    *groups: Mapping[str, HistogramSnapshot],
) -> dict[str, HistogramSnapshot]:
    """Histograms by key, summed where two groups have the same key."""
    out: dict[str, HistogramSnapshot] = {}
    for group in groups:
        for key, snap in group.items():
            out[key] = out[key].merged(snap) if key in out else snap
    return out
