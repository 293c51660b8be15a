"""``/metrics`` for every pdkv process, through ``prometheus_client``.

Each process keeps its figures where they are counted (the engine's declared in ``engine/metrics.py``, a
store's tiers in ``kvstore/metrics.py``, all in the value types of ``telemetry/metrics.py``) and gives
``MetricsServer`` a ``collect()`` function that turns one snapshot of them into ``prometheus_client``
metric families at scrape time (a custom collector: nothing is counted twice, and a scrape reads one
consistent snapshot).  ``stats_families`` does that for declared metrics (counters as
``pdkv_<name>_total``, gauges, histograms); ``RpcCounters`` counts a server's calls by method and status
code (the error counts operators alert on).

Labels every series of a process carries (the ``model_name`` of an engine or a router, vLLM's label) are
given to ``MetricsServer`` once and added to every sample at scrape time, so no family declares them.

The HTTP side is ``prometheus_client``'s exposition (``generate_latest``) on a small threaded server
whose connections time out: a client that connects and never sends cannot hold a thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from telemetry.metrics import HistogramSnapshot, Kind, MetricSpec

logger = logging.getLogger(__name__)

PREFIX = "pdkv_"
READ_TIMEOUT_S = 10.0


def metric_name(text: str) -> str:
    """``text`` as a Prometheus metric name fragment (anything but [a-zA-Z0-9_] becomes ``_``)."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in text)


def _families(
    values: Mapping[str, float] | Mapping[str, HistogramSnapshot],
    kind: Kind,
    prefix: str,
    specs: Mapping[str, MetricSpec],
) -> list[Metric]:
    """One family per declared name; a labelled key (``name.value``) is one sample of it."""
    by_name: dict[str, list[tuple[str, Any]]] = {}
    for key, value in sorted(values.items()):
        name, _, label_value = key.partition(".")
        spec = specs.get(name)
        if spec is None or spec.kind is not kind:
            logger.debug("metrics: %r is not a declared %s; not exported", key, kind.value)
            continue
        by_name.setdefault(name, []).append((label_value, value))
    out: list[Metric] = []
    for name, samples in by_name.items():
        spec = specs[name]
        labels = [spec.label] if spec.label else []
        full = f"{prefix}{name}"
        family: Any
        if kind is Kind.COUNTER:
            family = CounterMetricFamily(full, spec.help, labels=labels)
        elif kind is Kind.GAUGE:
            family = GaugeMetricFamily(full, spec.help, labels=labels)
        else:
            family = HistogramMetricFamily(full, spec.help, labels=labels)
        for label_value, value in samples:
            label_values = [label_value] if spec.label else []
            if kind is Kind.HISTOGRAM:
                family.add_metric(label_values, buckets=value.cumulative(), sum_value=value.total)
            else:
                family.add_metric(label_values, float(value))
        out.append(family)
    return out


class Stats(Protocol):
    """Counters, gauges and histograms by declared key, at one moment (the engine's ``StatsSnapshot``)."""

    @property
    def counters(self) -> Mapping[str, float]: ...
    @property
    def gauges(self) -> Mapping[str, float]: ...
    @property
    def histograms(self) -> Mapping[str, HistogramSnapshot]: ...


def stats_families(
    stats: Stats,
    histograms: Mapping[str, HistogramSnapshot] | None = None,
    *,
    specs: Mapping[str, MetricSpec],
    prefix: str = PREFIX,
) -> list[Metric]:
    """The declared counters, gauges and histograms of ``stats`` (plus ``histograms``, if given)."""
    hist = stats.histograms if histograms is None else histograms
    return [
        *_families(stats.counters, Kind.COUNTER, prefix, specs),
        *_families(stats.gauges, Kind.GAUGE, prefix, specs),
        *_families(hist, Kind.HISTOGRAM, prefix, specs),
    ]


def counter_families(counters: Mapping[str, float], prefix: str, help_text: str) -> list[Metric]:
    """Free-form counters (a connector's own): one ``<prefix><key>_total`` family each."""
    out: list[Metric] = []
    for key, value in sorted(counters.items()):
        family = CounterMetricFamily(f"{prefix}{metric_name(key)}", f"{help_text} {key!r}")
        family.add_metric([], float(value))
        out.append(family)
    return out


def gauge(name: str, help_text: str, value: float, labels: Mapping[str, str] | None = None) -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), float(value))
    return family


class RpcCounters:
    """Calls by (method, status code name), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: Counter[tuple[str, str]] = Counter()

    def record(self, method: str, code: str) -> None:
        with self._lock:
            self._calls[(method, code)] += 1

    def families(self, prefix: str) -> list[Metric]:
        with self._lock:
            calls = sorted(self._calls.items())
        rpcs = CounterMetricFamily(
            f"{prefix}_rpcs",
            "calls by method and status code (gRPC; HTTP on the router)",
            labels=["method", "code"],
        )
        errors = CounterMetricFamily(
            f"{prefix}_errors", "calls that ended with an error", labels=["method", "code"]
        )
        for (method, code), n in calls:
            rpcs.add_metric([method, code], float(n))
            if code != "OK":
                errors.add_metric([method, code], float(n))
        return [rpcs, errors]


class _Collector:
    """A ``prometheus_client`` collector over a function that builds the families at scrape time, adding
    ``labels`` to every sample."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], labels: Mapping[str, str]) -> None:
        self._collect = collect
        self._labels = dict(labels)

    def collect(self) -> Iterable[Metric]:
        families = list(self._collect())
        if self._labels:
            for family in families:
                family.samples = [s._replace(labels={**self._labels, **s.labels}) for s in family.samples]
        return families


def registry_of(
    collect: Callable[[], Iterable[Metric]], labels: Mapping[str, str] | None = None
) -> CollectorRegistry:
    """A registry of its own (several nodes may share a test process) holding ``collect``; ``labels`` go
    on every sample."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(collect, labels or {}))  # type: ignore[arg-type]
    return registry


class MetricsServer:
    """``GET /metrics`` on ``address`` (HOST:PORT, port 0 picks one), served from a daemon thread;
    ``labels`` (e.g. ``{"model_name": ...}``) go on every series it serves."""

    def __init__(
        self,
        address: str,
        collect: Callable[[], Sequence[Metric]],
        labels: Mapping[str, str] | None = None,
    ) -> None:
        host, port = _host_port(address)
        self.registry = registry_of(collect, labels)
        try:
            self._server = ThreadingHTTPServer((host, port), _handler(self.registry))
        except OSError as exc:  # the flag's address named: the bare "[Errno 98]" does not say which
            raise OSError(f"cannot listen on {address} for /metrics: {exc.strerror}") from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port), as ``serving.runtime.parse_address`` reads it
    (this leaf cannot import it; the node and router configs have checked the address with it already)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics address {address!r} must look like HOST:PORT, e.g. 127.0.0.1:50061")
    return host.strip("[]"), int(port)


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # socket timeout: a silent client frees its thread

        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = generate_latest(registry)
            except Exception as exc:
                logger.exception("collecting metrics failed")
                self.send_error(503, f"collecting metrics failed: {exc!r}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("metrics: " + format, *args)

    return Handler
