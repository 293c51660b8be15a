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
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_node.servicer import DecodeNodeServicer
from engine.driver import EngineDriver, EngineSnapshot, snapshot
from engine.llm_engine import LLMEngine
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc
from prefill_node.servicer import PrefillNodeServicer
from serving import convert
from serving.config import READY_PREFIX, NodeConfig, stop_on_signals
from serving.errors import CallRecorder, rpc_errors
from serving.metrics import MetricFamily, MetricsServer, RpcCounters
from serving.reflection import enable_reflection

logger = logging.getLogger(__name__)

_NODE_SERVICES = {
    "prefill": ("pdkv.v1.PrefillNode",),
    "decode": ("pdkv.v1.DecodeNode",),
    "colocated": ("pdkv.v1.PrefillNode", "pdkv.v1.DecodeNode"),
}
STATS_TIMEOUT_S = 5.0


@dataclass
class NodeRuntime:
    """Everything one node owns besides its gRPC server."""

    config: NodeConfig
    driver: EngineDriver
    calls: RpcCounters
    health: health.HealthServicer

    @classmethod
    def build(cls, config: NodeConfig) -> NodeRuntime:
        engine = LLMEngine(config.engine)
        driver = EngineDriver(
            engine, max_num_requests=config.max_num_requests, name=f"{config.node_id}-engine"
        )
        node = cls(config, driver.start(), RpcCounters(), health.HealthServicer())
        node.set_serving(False)  # the health servicer starts out SERVING; say so only once started
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

    def snapshot(self, *, check_integrity: bool = False) -> EngineSnapshot:
        return self.driver.call(
            lambda e: snapshot(e, check_integrity=check_integrity), timeout=STATS_TIMEOUT_S
        )

    def stop(self, server: grpc.Server | None = None, grace_s: float | None = None) -> None:
        """NOT_SERVING first, then in-flight calls get ``grace_s``, then the engine stops."""
        grace = self.config.grace_s if grace_s is None else grace_s
        self.set_serving(False)
        if server is not None:
            server.stop(grace).wait(grace + 1.0)
        self.driver.stop()


class NodeServicer(node_pb2_grpc.NodeServicer):
    """``pdkv.v1.Node``: Abort and Stats."""

    def __init__(self, node: NodeRuntime, calls: CallRecorder) -> None:
        self.node = node
        self.calls = calls

    def Abort(self, request: node_pb2.AbortRequest, context: grpc.ServicerContext) -> node_pb2.AbortResponse:
        with rpc_errors(context, self.calls, "Abort"):
            self.node.driver.abort(convert.request_id(request.request_id))
            return node_pb2.AbortResponse()
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def Stats(self, request: node_pb2.StatsRequest, context: grpc.ServicerContext) -> node_pb2.NodeStats:
        with rpc_errors(context, self.calls, "Stats"):
            snap = self.node.snapshot(check_integrity=request.check_integrity)
            return _stats_proto(self.node, snap)
        raise AssertionError("unreachable: rpc_errors aborts the call")


def _stats_proto(node: NodeRuntime, s: EngineSnapshot) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(
        node_id=node.config.node_id,
        role=node.config.role,
        engine_id=s.engine_id,
        num_requests=node.driver.num_requests,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_loading=s.num_loading,
        num_held=s.num_held,
        num_total_blocks=s.num_total_blocks,
        num_free_blocks=s.num_free_blocks,
        kv_usage=s.kv_usage,
        integrity_checked=s.integrity_error is not None,
        integrity_ok=s.integrity_error == "",
        integrity_error=s.integrity_error or "",
        prompt_tokens_local=s.prompt_tokens_local,
        prompt_tokens_external=s.prompt_tokens_external,
        prompt_tokens_computed=s.prompt_tokens_computed,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions,
        num_lease_expiries=s.num_lease_expiries,
        num_load_failures=s.num_load_failures,
        num_requests_finished=s.num_requests_finished,
        num_generated_tokens=s.num_generated_tokens,
        num_steps=s.num_steps,
        kv_endpoint=s.kv_endpoint,
        connector_stats=s.connector_stats or {},
        model_fingerprint=s.model_fingerprint,
        block_size=s.block_size,
        hash_algo=s.hash_algo,
    )


def create_server(node: NodeRuntime, address: str) -> tuple[grpc.Server, int]:
    """A gRPC server with the node's services, health and reflection, bound to ``address`` (not started).

    Returns the server and the port it bound (``address`` may say port 0)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=node.config.max_workers, thread_name_prefix="node-rpc"),
        options=[("grpc.so_reuseport", 0)],
    )
    role = node.config.role
    if role in ("prefill", "colocated"):
        node_pb2_grpc.add_PrefillNodeServicer_to_server(PrefillNodeServicer(node.driver, node.calls), server)
    if role in ("decode", "colocated"):
        node_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeNodeServicer(node.driver, node.calls), server)
    node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node, node.calls), server)
    health_pb2_grpc.add_HealthServicer_to_server(node.health, server)
    enable_reflection((*node.service_names, health.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}: the address is in use or not local")
    return server, port


def node_metrics(node: NodeRuntime) -> list[MetricFamily]:
    """The node's Prometheus metrics: queue depth, running requests, KV usage, prompt tokens by source,
    transfer counters of the connector, lease expiries and errors."""
    s = node.snapshot()
    g, c = "gauge", "counter"
    one = MetricFamily.single
    families = [
        one("pdkv_node_requests", g, "unfinished requests admitted by the node", node.driver.num_requests),
        one("pdkv_node_running_requests", g, "requests computing in the engine", s.num_running),
        one("pdkv_node_queue_depth", g, "requests waiting to be scheduled", s.num_waiting),
        one("pdkv_node_loading_requests", g, "requests waiting for KV from a connector", s.num_loading),
        one("pdkv_node_held_requests", g, "finished requests whose KV is held for a decode node", s.num_held),
        one("pdkv_node_kv_usage_ratio", g, "fraction of KV blocks in use", s.kv_usage),
        one("pdkv_node_kv_free_blocks", g, "free KV blocks", s.num_free_blocks),
        one("pdkv_node_kv_blocks", g, "KV blocks in the pool", s.num_total_blocks),
        MetricFamily(
            "pdkv_node_prompt_tokens_total",
            c,
            "prompt tokens by where their KV came from (local prefix cache, connector, computed)",
            (
                ((("source", "local"),), float(s.prompt_tokens_local)),
                ((("source", "external"),), float(s.prompt_tokens_external)),
                ((("source", "computed"),), float(s.prompt_tokens_computed)),
            ),
        ),
        one("pdkv_node_prefix_cache_queries_total", c, "prefix cache lookups", s.prefix_cache_queries),
        one("pdkv_node_prefix_cache_hits_total", c, "prefix cache lookups with a hit", s.prefix_cache_hits),
        one(
            "pdkv_node_lease_expiries_total",
            c,
            "held KV reclaimed because no reader came",
            s.num_lease_expiries,
        ),
        one("pdkv_node_kv_load_failures_total", c, "connector loads that failed", s.num_load_failures),
        one("pdkv_node_preemptions_total", c, "requests preempted for lack of blocks", s.num_preemptions),
        one("pdkv_node_generated_tokens_total", c, "output tokens sampled", s.num_generated_tokens),
        one("pdkv_node_requests_finished_total", c, "requests finished", s.num_requests_finished),
    ]
    for key, value in sorted((s.connector_stats or {}).items()):
        name = "pdkv_node_connector_" + "".join(ch if ch.isalnum() else "_" for ch in key)
        families.append(one(name, g, f"connector counter {key!r}", value))
    return families + node.calls.families("pdkv_node")


def run_node(config: NodeConfig) -> int:
    """Serve until SIGTERM or SIGINT; print one ready line (``READY_PREFIX``...) once serving."""
    node = NodeRuntime.build(config)
    server, port = create_server(node, config.address)
    metrics: MetricsServer | None = None
    if config.metrics_address:
        metrics = MetricsServer(config.metrics_address, lambda: node_metrics(node)).start()
    server.start()
    node.set_serving(True)
    stop = stop_on_signals()
    host = config.address.rpartition(":")[0]
    kv_endpoint = node.snapshot().kv_endpoint
    print(
        f"{READY_PREFIX}{host}:{port} role={config.role} node_id={config.node_id} "
        f"metrics={metrics.address if metrics else '-'} kv_endpoint={kv_endpoint or '-'}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            if node.driver.error is not None:
                logger.error("engine loop died (%s); stopping the node", node.driver.error)
                node.set_serving(False)
                return 1
    finally:
        node.stop(server)
        if metrics is not None:
            metrics.close()
    return 0
