"""Prometheus metrics over HTTP, without a client library: the text exposition format (0.0.4).

A process hands ``MetricsServer`` a ``collect()`` function returning ``MetricFamily`` objects; each scrape
of ``GET /metrics`` calls it and renders the result.  ``RpcCounters`` counts a server's calls by method and
status code (the error counts operators alert on).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serving.config import parse_address

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricFamily:
    """One metric: ``kind`` is "gauge" or "counter" (counter names end in ``_total``)."""

    name: str
    kind: str
    help: str
    samples: tuple[tuple[Labels, float], ...]

    @classmethod
    def single(cls, name: str, kind: str, help: str, value: float) -> MetricFamily:
        return cls(name, kind, help, (((), float(value)),))


def render(families: Iterable[MetricFamily]) -> str:
    lines: list[str] = []
    for f in families:
        lines.append(f"# HELP {f.name} {_escape(f.help)}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{f.name}{{{label_text}}} {value!r}" if label_text else f"{f.name} {value!r}")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class RpcCounters:
    """Calls by (method, status code name), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: Counter[tuple[str, str]] = Counter()

    def record(self, method: str, code: str) -> None:
        with self._lock:
            self._calls[(method, code)] += 1

    def families(self, prefix: str) -> list[MetricFamily]:
        with self._lock:
            calls = dict(self._calls)
        samples = tuple(((("method", m), ("code", c)), float(n)) for (m, c), n in sorted(calls.items()))
        errors = tuple(s for s in samples if s[0][1][1] != "OK")
        return [
            MetricFamily(f"{prefix}_rpcs_total", "counter", "gRPC calls by method and status code", samples),
            MetricFamily(f"{prefix}_errors_total", "counter", "gRPC calls that ended with an error", errors),
        ]


class MetricsServer:
    """``GET /metrics`` on ``address`` (HOST:PORT, port 0 picks one), served from a daemon thread."""

    def __init__(self, address: str, collect: Callable[[], Sequence[MetricFamily]]) -> None:
        host, port = parse_address(address, "metrics address")
        handler = _handler(collect)
        self._server = ThreadingHTTPServer((host, port), handler)
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


def _handler(collect: Callable[[], Sequence[MetricFamily]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = render(collect()).encode()
            except Exception as exc:
                logger.exception("collecting metrics failed")
                self.send_error(503, f"collecting metrics failed: {exc!r}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("metrics: " + format, *args)

    return Handler
