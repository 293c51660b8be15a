"""A node process: engine + driver + gRPC server (by role) + health + reflection + /metrics.

    node = NodeRuntime.build(config)        # loads the model: seconds
    server, port = create_server(node, "127.0.0.1:0")
    server.start(); ...; node.stop(server)

Services by role (every node also serves ``pdkv.v1.Node``: Abort, Stats)::

    prefill     pdkv.v1.PrefillNode
    decode      pdkv.v1.DecodeNode
    colocated   both

Health: every registered service name and "" report SERVING once the engine runs, NOT_SERVING from the
moment the node starts shutting down (or its engine loop dies), so routers stop sending it work before
in-flight calls get their grace period.

SIGTERM is a planned stop: the node drains (``serving/drain.py``) -- new Prefill / Decode calls are
refused UNAVAILABLE, admitted requests finish, KV held for decode nodes is pulled or released -- for at
most ``--drain-timeout-s``, then stops.  Its last lines say what the drain cut and the request totals a
planned stop must leave at zero (``kv_load_failures``: prompts a decode node recomputed).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_node.servicer import DecodeNodeServicer
from engine.driver import EngineDriver
from engine.llm_engine import LLMEngine
from engine.metrics import SPECS
from engine.snapshot import EngineSnapshot, snapshot
from node.config import READY_PREFIX, NodeConfig
from node.stall import StallWatch
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc, types_pb2
from prefill_node.servicer import PrefillNodeServicer
from serving import convert
from serving import lora as lora_rpc
from serving.drain import DRAIN_PREFIX, LINGER_S, UNWATCHED_S, Drain, DrainProgress, DrainReport
from serving.errors import CallRecorder, UndecodableRequests, rpc_errors
from serving.health import HealthStatus
from serving.reflection import enable_reflection
from serving.runtime import stop_on_signals
from serving.signing import TransferSigner, load_cluster_secret
from serving.tls import TLSFolder, add_port
from telemetry.exposition import Metric, MetricsServer, RpcCounters, counter_families, gauge, stats_families
from wire.curve import CurveKeys
from wire.endpoints import refuse_open_wide_bind
from wire.event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)

_NODE_SERVICES = {
    "prefill": ("pdkv.v1.PrefillNode",),
    "decode": ("pdkv.v1.DecodeNode",),
    "colocated": ("pdkv.v1.PrefillNode", "pdkv.v1.DecodeNode"),
}
STATS_TIMEOUT_S = 5.0
# How long /metrics and Stats wait for the engine's figures before answering with the last ones read (a
# prefill step of 2048 tokens takes seconds on two cores: a scrape must not fail for it).
RECENT_WAIT_S = 0.5


@dataclass
class NodeRuntime:
    """Everything one node owns besides its gRPC server."""

    config: NodeConfig
    driver: EngineDriver
    calls: RpcCounters
    health: HealthStatus
    events: KVEventPublisher | None = None
    signer: TransferSigner | None = None  # seals / checks transfer params (with a cluster secret)
    tls: TLSFolder | None = None
    drainer: Drain | None = None  # set by build
    _last: tuple[float, EngineSnapshot] | None = None  # the last snapshot read, and when (monotonic)
    _drain_started: float = 0.0  # monotonic

    @classmethod
    def build(cls, config: NodeConfig) -> NodeRuntime:
        # Before the model loads: a misconfigured node fails in a second, not after it.
        secret = load_cluster_secret(config.cluster_secret_file or None)
        tls = TLSFolder.from_option(config.tls_dir or None)
        # Wide open needs mutual TLS: with TLS alone anyone could call Prefill with any tenant's salt.
        refuse_open_wide_bind(
            config.address, "gRPC", tls is not None and config.mtls, config.insecure, "TLS with --mtls"
        )
        if config.kv_events_bind:
            curve = CurveKeys.from_env() is not None
            refuse_open_wide_bind(config.kv_events_bind, "KV events", curve, config.insecure, "CURVE")
        engine = LLMEngine(config.engine)
        events: KVEventPublisher | None = None
        if config.kv_events_bind:
            events = KVEventPublisher(config.engine.engine_id, config.kv_events_bind)
        publisher = events

        def publish_events(e: LLMEngine) -> None:
            if publisher is not None:
                publisher.publish(e.take_kv_events())

        driver = EngineDriver(
            engine,
            max_num_requests=config.max_num_requests,
            name=f"{config.node_id}-engine",
            after_step=publish_events if events is not None else None,
        )
        signer = TransferSigner(secret) if secret is not None else None
        node = cls(config, driver.start(), RpcCounters(), HealthStatus(), events, signer, tls)
        node.set_serving(False)  # the health servicer starts out SERVING; say so only once started
        node.snapshot()  # the first figures: what a scrape during the first long step answers with
        node.drainer = Drain(config.node_id, node.drain_progress, config.drain_timeout_s)
        return node

    @property
    def service_names(self) -> tuple[str, ...]:
        return (*_NODE_SERVICES[self.config.role], "pdkv.v1.Node")

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def snapshot(self, *, check_integrity: bool = False, wait_s: float = STATS_TIMEOUT_S) -> EngineSnapshot:
        """The engine's figures now, read on its thread (after the step it runs): TimeoutError past
        ``wait_s`` -- the read still happens, and is kept as the last one."""

        def read(engine: LLMEngine) -> EngineSnapshot:
            s = snapshot(engine, check_integrity=check_integrity)
            self._last = (time.monotonic(), s)
            return s

        return self.driver.call(read, timeout=wait_s)

    def recent_snapshot(self) -> tuple[EngineSnapshot, float]:
        """The engine's figures and their age in seconds: now's if the engine answers within
        ``RECENT_WAIT_S``, else the last ones read -- a long step must not fail a scrape or a Stats."""
        try:
            return self.snapshot(wait_s=RECENT_WAIT_S), 0.0
        except TimeoutError:
            last = self._last
            if last is None:
                return self.snapshot(), 0.0  # none read yet: wait as long as a fresh read may
            return last[1], time.monotonic() - last[0]

    def drain_progress(self) -> DrainProgress:
        """Admitted unfinished requests, and finished ones whose KV a reader has yet to pull or release.
        While the engine is inside a step longer than ``RECENT_WAIT_S`` the holds are unknown: 1, not done
        (a long prefill on a loaded host took over 5 s, and the drain died of the read's TimeoutError)."""
        # the requests first: a step ending between the two reads made its holds before it finished them
        requests = self.driver.num_requests
        holds = 1
        with contextlib.suppress(TimeoutError):  # asked again at the drain's next poll
            holds = self.driver.call(lambda e: len(e.scheduler.holds), timeout=RECENT_WAIT_S)
        now = time.monotonic()
        seen = (
            self.health.told_stopping.is_set()
            or now - self._drain_started >= LINGER_S
            or now - self.health.last_check >= UNWATCHED_S  # a cluster's stop: its router went first
        )
        return DrainProgress(requests=requests, holds=holds, seen=seen)

    def drain(self) -> DrainReport:
        """A planned stop's first half: NOT_SERVING, refuse new requests, wait for the admitted ones and
        the holds (at most ``drain_timeout_s``).  ``stop`` is the second half."""
        assert self.drainer is not None
        self._drain_started = time.monotonic()
        self.set_serving(False)
        self.driver.drain()
        return self.drainer.run()

    def totals_line(self) -> str:
        """What the node's life cost that a planned stop must not: prompts recomputed because their KV
        failed to load, holds that expired unread."""
        try:  # a drain cut by its deadline leaves a step running: the last figures then
            counters = self.recent_snapshot()[0].stats.counters
        except TimeoutError:  # none read yet, and the step outlasts a fresh read's wait
            return f"{DRAIN_PREFIX}{self.config.node_id} totals: unknown (the engine is inside a step)"
        keys = ("kv_load_failures", "kv_hold_expiries")
        totals = ", ".join(f"{k} {int(counters.get(k, 0))}" for k in keys)
        return f"{DRAIN_PREFIX}{self.config.node_id} totals: {totals}"

    def stop(self, server: grpc.Server | None = None, grace_s: float | None = None) -> None:
        """NOT_SERVING first, then in-flight calls get ``grace_s``, then the engine stops."""
        grace = self.config.grace_s if grace_s is None else grace_s
        self.set_serving(False)
        if server is not None:
            server.stop(grace).wait(grace + 1.0)
        self.driver.stop()
        if self.events is not None:
            self.events.close()


class NodeServicer(node_pb2_grpc.NodeServicer):
    """``pdkv.v1.Node``: Abort and Stats."""

    def __init__(self, node: NodeRuntime, calls: CallRecorder) -> None:
        self.node = node
        self.calls = calls

    def Abort(self, request: node_pb2.AbortRequest, context: grpc.ServicerContext) -> node_pb2.AbortResponse:
        with rpc_errors(context, self.calls, "Abort"):
            # No known_fields_only here nor in Stats: control calls that change no output, which a newer
            # router may send an older node in a rolling upgrade -- an abort refused would leave its KV held.
            self.node.driver.abort(convert.request_id(request.request_id))
            return node_pb2.AbortResponse()
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def Stats(self, request: node_pb2.StatsRequest, context: grpc.ServicerContext) -> node_pb2.NodeStats:
        with rpc_errors(context, self.calls, "Stats"):
            if request.check_integrity:
                snap, age = self.node.snapshot(check_integrity=True), 0.0
            else:
                snap, age = self.node.recent_snapshot()
            return _stats_proto(self.node, snap, age)
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def LoadAdapter(self, request: types_pb2.LoadAdapterRequest, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, self.calls, "LoadAdapter"):
            convert.known_fields_only(request)
            lora, allowed = self.node.driver.engine.lora, self.node.config.runtime_lora
            return lora_rpc.load_adapter(lora, allowed, request.name, request.path)
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def UnloadAdapter(self, request: types_pb2.UnloadAdapterRequest, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, self.calls, "UnloadAdapter"):
            convert.known_fields_only(request)
            lora_rpc.unload_adapter(self.node.driver.engine.lora, self.node.config.runtime_lora, request.name)
            return types_pb2.UnloadAdapterResponse()
        raise AssertionError("unreachable: rpc_errors aborts the call")


def _stats_proto(node: NodeRuntime, s: EngineSnapshot, age_s: float) -> node_pb2.NodeStats:
    """The snapshot as the RPC carries it: counters and gauges by their declared keys, unchanged."""
    return node_pb2.NodeStats(
        node_id=node.config.node_id,
        role=node.config.role,
        engine_id=s.engine_id,
        num_requests=node.driver.num_requests,
        integrity_checked=s.integrity_error is not None,
        integrity_ok=s.integrity_error == "",
        integrity_error=s.integrity_error or "",
        kv_endpoint=s.kv_endpoint,
        connector_stats={str(k): float(v) for k, v in s.connector.counters.items()},
        model_fingerprint=s.model_fingerprint,
        block_size=s.block_size,
        hash_algo=s.hash_algo,
        dtype=s.dtype,
        deterministic=s.deterministic,
        adapters=[lora_rpc.adapter_info(a) for a in node.driver.engine.lora.adapters()],
        runtime_lora=node.config.runtime_lora,
        max_lora_rank=node.driver.engine.lora.max_lora_rank,
        stats_age_s=age_s,
        max_model_len=node.driver.engine.max_model_len,
        kv_events_endpoint=node.events.endpoint if node.events is not None else "",
        kv_events_replay_endpoint=node.events.replay_endpoint if node.events is not None else "",
        kv_events_epoch=node.events.epoch if node.events is not None else "",
        counters=dict(s.stats.counters),
        gauges=dict(s.stats.gauges),
        histograms={
            key: node_pb2.Histogram(bounds=h.bounds, counts=h.counts, sum=h.total)
            for key, h in s.histograms.items()
        },
    )


def create_server(node: NodeRuntime, address: str) -> tuple[grpc.Server, int]:
    """A gRPC server with the node's services, health and reflection, bound to ``address`` (not started).

    Returns the server and the port it bound (``address`` may say port 0)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=node.config.max_workers, thread_name_prefix="node-rpc"),
        options=[("grpc.so_reuseport", 0)],
        interceptors=[UndecodableRequests()],  # bytes that do not parse: INVALID_ARGUMENT, not INTERNAL
    )
    role = node.config.role
    if role in ("prefill", "colocated"):
        prefill = PrefillNodeServicer(node.driver, node.calls, node.signer)
        node_pb2_grpc.add_PrefillNodeServicer_to_server(prefill, server)
    if role in ("decode", "colocated"):
        decode = DecodeNodeServicer(node.driver, node.calls, node.signer)
        node_pb2_grpc.add_DecodeNodeServicer_to_server(decode, server)
    node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node, node.calls), server)
    health_pb2_grpc.add_HealthServicer_to_server(node.health, server)
    enable_reflection((*node.service_names, health.SERVICE_NAME), server)
    port = add_port(server, address, node.tls, mutual=node.config.mtls)
    if port == 0:
        raise OSError(f"cannot listen on {address}: the address is in use or not local")
    return server, port


def node_metrics(node: NodeRuntime) -> list[Metric]:
    """The node's Prometheus metrics: every declared engine metric (``engine/metrics.py``) and the
    connector's histograms under their names, the connector's own counters as ``pdkv_connector_*``,
    the node's admitted requests and its gRPC calls."""
    s, age = node.recent_snapshot()
    return [
        *stats_families(s.stats, s.histograms, specs=SPECS),
        gauge(
            "pdkv_node_stats_age_seconds",
            "how old the engine's figures in this scrape are (0: read now; while a long step runs, the "
            "last read)",
            age,
        ),
        gauge("pdkv_node_requests", "unfinished requests admitted by the node", node.driver.num_requests),
        *(node.drainer.metrics("pdkv_node") if node.drainer is not None else ()),
        *counter_families(s.connector.counters, "pdkv_connector_", "connector counter"),
        *node.calls.families("pdkv_node"),
    ]


def run_node(config: NodeConfig) -> int:
    """Serve until SIGTERM or SIGINT; print one ready line (``READY_PREFIX``...) once serving."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    node = NodeRuntime.build(config)
    server, port = create_server(node, config.address)
    metrics: MetricsServer | None = None
    if config.metrics_address:
        labels = {"model_name": config.model_name}
        metrics = MetricsServer(config.metrics_address, lambda: node_metrics(node), labels).start()
    server.start()
    # What is built by now lives as long as the process (modules, the model, the engine): out of the
    # collector's sight, a full collection no longer walks its ~300,000 objects (~180 ms, a pause of
    # every running stream, measured with SmolLM2 loaded) -- only what serving makes after it.
    gc.collect()
    gc.freeze()
    node.set_serving(True)
    stop = stop_on_signals()
    host = config.address.rpartition(":")[0]
    kv_endpoint = node.snapshot().kv_endpoint
    print(
        f"{READY_PREFIX}{host}:{port} role={config.role} node_id={config.node_id} "
        f"metrics={metrics.address if metrics else '-'} kv_endpoint={kv_endpoint or '-'} "
        f"threads={torch.get_num_threads()}",
        flush=True,
    )
    stall = StallWatch(node.driver, node.set_serving)
    try:
        while not stop.wait(0.5):
            if node.driver.error is not None:
                logger.error("engine loop died (%s); stopping the node", node.driver.error)
                node.set_serving(False)
                return 1
            stall.check()  # after the error: a stalled step that ends by raising never serves again
        node.drain()
        print(node.totals_line(), flush=True)
    finally:
        node.stop(server)
        if metrics is not None:
            metrics.close()
    return 0
