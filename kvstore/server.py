"""The store server: one process holding a tier stack (cpu, disk, optionally fronting Redis) that several
engines on a host share through the ``remote:`` tier.

One ZeroMQ ROUTER socket, one thread, requests served in arrival order (``wire.store_protocol``).  A put is
stored only if every block's header names the block it is put under and its payload has the length the
header gives; payload checksums are left to the readers, which verify every block they load (the server
verifies them too with ``verify_puts``, at a cost of about 7 µs per 256 KiB).  A malformed, oversized or
inconsistent request gets an error reply (``wire.framing.ErrorReply``) and the loop carries on: nothing
a peer sends can stop the server.
Frames above ``2 x max_unit_bytes`` never reach the application (ZeroMQ disconnects the peer).

Replies to a get send the stored payloads without copying; a payload leased from the cpu tier is
released only once ZeroMQ reports the frame sent (a message tracker), so a slot is never recycled under a
send in flight.

The process keeps freed memory instead of handing it back to the kernel (``tune_malloc_for_tensors``):
every put brings ZeroMQ buffers of a block each, and without it each one is page-faulted in anew.

Binds to 127.0.0.1 unless told otherwise.  ``pdkv kvstore serve`` (or ``python -m kvstore.server``) prints
``pdkv kvstore: serving on ENDPOINT`` once it accepts requests and stops cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import zmq

from kvstore.cli import DEFAULT_BIND, READY_PREFIX, add_serve_arguments, metrics_address
from kvstore.health import HealthMonitor
from kvstore.metrics import TierStats
from kvstore.results import MissReason, Unit, release_all
from kvstore.store import TieredStore
from telemetry.exposition import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    MetricsServer,
    gauge,
    metric_name,
)
from telemetry.logs import throttle_noisy_logs
from wire.codec import HEADER_SIZE, HeaderMatcher, verify_payload
from wire.curve import CurveKeys, server_socket, stop_authenticator
from wire.endpoints import check_endpoint, refuse_open_wide_bind
from wire.event_publisher import KVEventPublisher
from wire.framing import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    InfoReply,
    ProtocolError,
    peek_frame_id,
    send_frames,
)
from wire.memory import tune_malloc_for_tensors
from wire.store_protocol import OPS as STORE_OPS
from wire.store_protocol import (
    CountReply,
    Delete,
    Get,
    Limits,
    Lookup,
    Ping,
    Put,
    Stats,
    decode_store_request,
)
from wire.units import unit_header

logger = logging.getLogger(__name__)

STORE_PUBLISHER = "store"  # the publisher name of a store server's KV events (the router's index key)


class StoreServer:
    def __init__(
        self,
        store: TieredStore,
        bind: str = DEFAULT_BIND,
        *,
        limits: Limits | None = None,
        verify_puts: bool = False,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.store = store
        self.limits = limits or Limits()
        self.verify_puts = verify_puts
        self._own_context = context is None
        self._context: zmq.Context[Any] = context or zmq.Context()
        # CURVE with $PDKV_CURVE_DIR: only allow-listed clients complete the handshake (wire/curve.py).
        self._socket = server_socket(self._context, zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 2 * self.limits.max_unit_bytes)
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            if self._own_context:
                stop_authenticator(self._context)
                self._context.term()
            raise OSError(f"cannot listen on {bind}: {exc.strerror}") from exc
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._in_flight: list[tuple[zmq.MessageTracker, list[Unit]]] = []
        self.requests: Counter[str] = Counter()
        self.events: KVEventPublisher | None = None  # publish_events() turns it on
        self.health: HealthMonitor | None = None  # watch_health() turns it on
        self._requests_lock = threading.Lock()  # /metrics reads the counts from its own thread

    # ---- the loop --------------------------------------------------------------------------------------

    def publish_events(self, bind: str, replay_bind: str | None = None) -> KVEventPublisher:
        """Publish the tiers' KV events on ``bind`` (its replay socket on ``replay_bind``, by default a free
        port of the same host)."""
        self.store.enable_events()
        self.events = KVEventPublisher(STORE_PUBLISHER, bind, replay_bind, context=self._context)
        return self.events

    def watch_health(self, interval_s: float = 2.0) -> HealthMonitor:
        """Probe the tiers every ``interval_s`` in the background; pings report the last result."""
        self.health = HealthMonitor(self.store, interval_s=interval_s).start()
        return self.health

    def serve(self, stop: threading.Event, poll_ms: int = 100) -> None:
        """Serve until ``stop`` is set (checked at least every ``poll_ms``)."""
        while not stop.is_set():
            if self._socket.poll(poll_ms, zmq.POLLIN):
                self.serve_pending()
            self._reap()
            if self.events is not None:  # write-downs and evictions change tiers between requests too
                self.events.publish(self.store.take_events())

    def serve_pending(self, limit: int = 64) -> int:
        """Answer up to ``limit`` requests already received; returns how many."""
        served = 0
        while served < limit:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._serve_one(frames)
            served += 1
        return served

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0], frames[1:]
        units: list[Unit] = []
        try:
            reply, units = self._dispatch(body)
        except ProtocolError as exc:
            self._count("refused")
            reply = [ErrorReply(exc.request_id or _peek_id(body), exc.code, str(exc)).encode()]
        except Exception as exc:
            logger.exception("kvstore server: request failed")
            self._count("failed")
            refusal = ErrorReply(_peek_id(body), ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
            reply = [refusal.encode()]
        try:
            # The identity goes as bytes: a received (untracked) frame cannot be part of a tracked send.
            tracker = send_frames(self._socket, [identity.bytes, *reply], track=bool(units))
        except zmq.ZMQError as exc:  # the peer is gone or not keeping up: its loss
            logger.debug("kvstore server: reply not sent: %s", exc)
            release_all(units)
            return
        except Exception:
            logger.exception("kvstore server: reply not sent")
            release_all(units)
            return
        if units:
            assert tracker is not None
            self._in_flight.append((tracker, units))

    def _reap(self) -> None:
        """Release the leases of replies ZeroMQ has finished sending."""
        if not self._in_flight:
            return
        still: list[tuple[zmq.MessageTracker, list[Unit]]] = []
        for tracker, units in self._in_flight:
            if tracker.done:
                release_all(units)
            else:
                still.append((tracker, units))
        self._in_flight = still

    # ---- requests --------------------------------------------------------------------------------------

    def _dispatch(self, body: Sequence[zmq.Frame]) -> tuple[list[Any], list[Unit]]:
        if not body:
            raise ProtocolError("empty message")
        request = decode_store_request(body[0].buffer, self.limits)
        self._count(request.op)
        if not isinstance(request, Put) and len(body) != 1:
            raise ProtocolError(f"{request.op} takes one frame, got {len(body)}", request_id=request.id)
        if isinstance(request, Ping):
            info = {
                "server": "pdkv-kvstore",
                "protocol": PROTOCOL_VERSION,
                "tiers": [t.name for t in self.store.tiers],
                # tier -> why it could not serve at the last check (kvstore/health.py; none: not watched)
                "degraded": self.health.degraded() if self.health is not None else {},
            }
            return [InfoReply(request.id, info).encode()], []
        if isinstance(request, Stats):
            info = self.store.stats().to_dict()
            info["requests"] = self.request_counts()
            return [InfoReply(request.id, info).encode()], []
        if isinstance(request, Lookup):
            return [CountReply(request.id, self.store.contains_prefix(request.run)).encode()], []
        if isinstance(request, Delete):
            return [CountReply(request.id, self.store.delete(request.run)).encode()], []
        if isinstance(request, Get):
            read = self.store.read(request.run, request.layout)
            headers = b"".join(unit.seal() for unit in read.units)
            frames: list[Any] = [
                CountReply(request.id, len(read.units), read.reason).encode(),
                headers,
                *(_wire_frame(unit.payload) for unit in read.units),
            ]
            return frames, read.units
        return self._put(request, body), []

    def _put(self, request: Put, body: Sequence[zmq.Frame]) -> list[Any]:
        run = request.run
        n = len(run)
        if len(body) != 2 + n:
            raise ProtocolError(
                f"put of {n} blocks needs {2 + n} frames (header, unit headers, payloads), got {len(body)}",
                request_id=request.id,
            )
        headers = body[1].buffer
        if headers.nbytes != HEADER_SIZE * n:
            raise ProtocolError(
                f"unit headers frame is {headers.nbytes} bytes; {n} blocks need {HEADER_SIZE * n}",
                request_id=request.id,
            )
        units: list[Unit] = []
        reason: MissReason | None = None
        # Every header must name the run's namespace, its block and the layout the request names: compared
        # with a template's bytes (``HeaderMatcher``).
        matcher = HeaderMatcher(run.namespace, request.layout)
        for i in range(n):
            payload = body[2 + i].buffer
            if payload.nbytes > self.limits.max_unit_bytes:
                raise ProtocolError(
                    f"block {i} is {payload.nbytes} bytes; the limit is {self.limits.max_unit_bytes}",
                    request_id=request.id,
                )
            raw = unit_header(headers, i)
            header = matcher.parse(raw, run.hashes[i])
            if isinstance(header, MissReason):
                reason = header
                break  # store the valid leading blocks only
            if payload.nbytes != header.payload_len:
                reason = MissReason.TRUNCATED if payload.nbytes < header.payload_len else MissReason.CORRUPT
            elif self.verify_puts:
                reason = verify_payload(header, payload)
            if reason is not None:
                break
            # The frame is ours: a memory tier keeps it as it is.
            units.append(Unit(payload, bytes(raw), keep=True, parsed=header))
        stored = self.store.put(run.slice(0, len(units)), units) if units else None
        count = stored.stored if stored is not None else 0
        out_reason = reason if reason is not None else (stored.reason if stored is not None else None)
        return [CountReply(request.id, count, out_reason).encode()]

    def _count(self, what: str) -> None:
        with self._requests_lock:
            self.requests[what] += 1

    def request_counts(self) -> dict[str, int]:
        with self._requests_lock:
            return dict(self.requests)

    def metrics(self) -> list[Metric]:
        """``/metrics``: requests by op, and every tier's counters, misses and latencies."""
        stats = self.store.stats()
        requests = CounterMetricFamily("pdkv_kvstore_requests", "requests served, by op", labels=["op"])
        counts = dict.fromkeys((*STORE_OPS, "refused", "failed"), 0) | self.request_counts()  # all from 0
        for op, n in sorted(counts.items()):
            requests.add_metric([op], float(n))
        families: list[Metric] = [
            requests,
            gauge("pdkv_kvstore_write_queue_depth", "write-down jobs queued now", stats.write_queue_pending),
        ]
        dropped = CounterMetricFamily(
            "pdkv_kvstore_write_jobs_dropped", "write-down jobs dropped: queue full"
        )
        dropped.add_metric([], float(stats.write_jobs_dropped))
        families.append(dropped)
        return families + tier_families(stats.tiers)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.health is not None:
            self.health.close()
        self._socket.close(linger=0)
        for _, units in self._in_flight:
            release_all(units)
        self._in_flight.clear()
        if self._own_context:  # a shared context's ZAP handler serves its other sockets too
            stop_authenticator(self._context)
            self._context.term()


def tier_families(tiers: Sequence[TierStats]) -> list[Metric]:
    """Per-tier families, labelled by tier: ``pdkv_kvstore_tier_<counter>_total``, misses and put
    failures by reason, the breakers' state, and latency histograms by operation (the tiers' log2
    microsecond buckets: bucket ``i`` ends at ``2**(i+1)`` µs)."""
    counters: dict[str, CounterMetricFamily] = {}
    misses = CounterMetricFamily(
        "pdkv_kvstore_tier_misses", "calls that stopped short, by tier and reason", labels=["tier", "reason"]
    )
    put_failures = CounterMetricFamily(
        "pdkv_kvstore_tier_put_failures", "blocks not stored, by tier and reason", labels=["tier", "reason"]
    )
    breakers = GaugeMetricFamily(
        "pdkv_kvstore_tier_breaker_open",
        "1 while a circuit breaker skips the tier",
        labels=["tier", "breaker"],
    )
    latency = HistogramMetricFamily(
        "pdkv_kvstore_tier_op_seconds", "tier call latency, by tier and operation", labels=["tier", "op"]
    )
    for tier in tiers:
        for name, value in sorted(tier.counters.items()):
            family = counters.get(name)
            if family is None:
                family = counters[name] = CounterMetricFamily(
                    f"pdkv_kvstore_tier_{metric_name(name)}", f"tier counter {name!r}", labels=["tier"]
                )
            family.add_metric([tier.name], float(value))
        for reason, n in sorted(tier.misses.items()):
            misses.add_metric([tier.name, reason], float(n))
        for reason, n in sorted(tier.put_failures.items()):
            put_failures.add_metric([tier.name, reason], float(n))
        for breaker, state in sorted(tier.breakers.items()):
            breakers.add_metric([tier.name, breaker], 0.0 if state == "closed" else 1.0)
        for op, snap in sorted(tier.latency.items()):
            latency.add_metric([tier.name, op], snap.cumulative(), sum_value=snap.total)
    return [*counters.values(), misses, put_failures, breakers, latency]


def _wire_frame(payload: memoryview) -> Any:
    """What to send for a stored payload: the ZeroMQ frame it arrived in when the cpu tier kept that frame
    whole (ZeroMQ then shares its buffer by reference count: no new frame, no release to track for it),
    else the view itself (sent without a copy)."""
    frame = payload.obj
    if isinstance(frame, zmq.Frame) and payload.nbytes == len(frame):
        return frame
    return payload


def _peek_id(body: Sequence[zmq.Frame]) -> int:
    """The request id of a message we refuse, when one can be read (else 0)."""
    return peek_frame_id(body[0].buffer) if body else 0


# ---- command line -----------------------------------------------------------------------------------------


def run_server(args: argparse.Namespace) -> int:
    """Serve ``args.kv_store`` on ``args.bind`` until SIGTERM or SIGINT."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    throttle_noisy_logs()  # bad input: one line a minute per kind, not a traceback per request
    curve = CurveKeys.from_env()
    endpoints = (
        ("--bind", args.bind),
        ("--kv-events", args.kv_events),
        ("--kv-events-replay", args.kv_events_replay),
    )
    for option, endpoint in endpoints:
        if endpoint:  # its form first: a refusal for security would mislead about an address that is none
            check_endpoint(endpoint, option)
    refuse_open_wide_bind(
        args.bind, "the KV store", curve is not None, args.insecure, "CURVE ($PDKV_CURVE_DIR)"
    )
    limits = Limits(max_blocks=args.max_blocks, max_unit_bytes=args.max_block_bytes)
    if args.health_interval_ms <= 0:
        raise SystemExit(f"--health-interval-ms must be positive, got {args.health_interval_ms}")
    if not args.drain_timeout_s >= 0:
        raise SystemExit(f"--drain-timeout-s must be >= 0, got {args.drain_timeout_s}")
    tune_malloc_for_tensors()
    store = TieredStore.from_config(args.kv_store)
    metrics: MetricsServer | None = None
    server: StoreServer | None = None
    try:
        server = StoreServer(store, args.bind, limits=limits, verify_puts=args.verify_puts)
        server.watch_health(args.health_interval_ms / 1000)
        if metrics_address(args):
            metrics = MetricsServer(metrics_address(args), server.metrics).start()
        if args.kv_events:
            for endpoint in filter(None, (args.kv_events, args.kv_events_replay)):  # the replay socket too
                refuse_open_wide_bind(endpoint, "KV events", curve is not None, args.insecure, "CURVE")
            server.publish_events(args.kv_events, args.kv_events_replay or None)
    except BaseException:  # a later bind failed: what is up already goes too (its sockets, its threads)
        if metrics is not None:
            metrics.close()
        if server is not None:
            server.close()
        store.close()
        raise
    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    metrics_note = f" metrics={metrics.address}" if metrics is not None else ""
    if server.events is not None:
        metrics_note += f" kv_events={server.events.endpoint},{server.events.replay_endpoint}"
    metrics_note += f" curve={'on' if curve is not None else 'off'}"
    print(f"{READY_PREFIX}{server.endpoint}{metrics_note}", flush=True)
    try:
        server.serve(stop)
    finally:
        if metrics is not None:
            metrics.close()
        server.close()
        queued = store.stats().write_queue_pending
        start = time.monotonic()
        left = store.close(drain_timeout_s=args.drain_timeout_s)
        print(
            f"pdkv drain: kvstore flushed {queued - left} of {queued} write-back jobs in "
            f"{time.monotonic() - start:.2f}s ({left} dropped at the deadline)",
            flush=True,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.server", description="Serve a pdkv KV store.")
    add_serve_arguments(parser, metrics="")
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
