"""The router process: pools + health monitor + pipeline + gRPC server (Generation, health, reflection).

The router reports SERVING on its health service when every pool it needs has a healthy node, so
``pdkv health ROUTER`` (and ``pdkv up``) wait for the whole topology, not just the router.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.metrics import SPECS, StatsSnapshot
from engine.tokenizer import Tokenizer
from pdkv_proto.pdkv.v1 import generation_pb2_grpc
from router.adapters import RouterAdapters
from router.admission import Admission
from router.auth import Access, load_access
from router.config import READY_PREFIX, RouterConfig
from router.kv_index import KVEventSubscriber, KVIndex, Publisher
from router.nodes import HealthMonitor, NodePool, served_context
from router.pipeline import Pipeline
from router.policy import STORE, NodeSelector, pool_selector
from router.servicer import GenerationServicer
from router.streams import StreamWatch
from router.tokenizer import RouterModel, load_model, model_path
from serving.drain import Drain, DrainProgress, DrainReport
from serving.errors import UndecodableRequests
from serving.health import HealthStatus
from serving.reflection import enable_reflection
from serving.runtime import stop_on_signals
from serving.signing import load_cluster_secret
from serving.tls import TLSFolder, add_port
from telemetry.exposition import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    MetricsServer,
    RpcCounters,
    gauge,
    stats_families,
)
from wire.endpoints import refuse_open_wide_bind

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdkv.v1.Generation"


@dataclass
class RouterRuntime:
    """Everything the router owns besides its gRPC server."""

    config: RouterConfig
    model: RouterModel
    pools: tuple[NodePool, ...]
    pipeline: Pipeline
    monitor: HealthMonitor
    health: HealthStatus
    calls: RpcCounters
    access: Access
    streams: StreamWatch
    admission: Admission
    tls: TLSFolder | None = None
    kv_index: KVIndex | None = None
    kv_events: KVEventSubscriber | None = None
    drainer: Drain | None = None  # set by build

    @classmethod
    def build(cls, config: RouterConfig) -> RouterRuntime:
        access = load_access(
            config.api_keys_file or None,
            client_max_inflight=config.per_client_limit,
            cache_details=config.cache_details,
            cluster_secret=load_cluster_secret(None),  # $PDKV_CLUSTER_SECRET(_FILE): keys the salts
        )
        tls = TLSFolder.from_option(config.tls_dir or None)
        secured = tls is not None and not access.open
        for address in filter(None, (config.address, config.http_address)):
            refuse_open_wide_bind(
                address, "the router", secured, config.insecure, "TLS (--tls-dir) and API keys"
            )
        model = load_model(model_path(config.model), config.served_model_name, config.max_model_len)
        decode_service = "pdkv.v1.DecodeNode"
        decode = NodePool(
            "decode" if config.mode == "disaggregated" else "colocated",
            config.decode_nodes,
            decode_service,
            dns_discovery=config.dns_discovery,
            tls=tls,
        )
        prefill = (
            NodePool(
                "prefill",
                config.prefill_nodes,
                "pdkv.v1.PrefillNode",
                dns_discovery=config.dns_discovery,
                tls=tls,
            )
            if config.mode == "disaggregated"
            else None
        )
        pools = (decode,) if prefill is None else (prefill, decode)
        # kv-aware: an index of the nodes' KV events chooses the node that computes the prompt (prefill,
        # or colocated); the decode node of a disaggregated request stays least-loaded.
        index = KVIndex() if config.policy == "kv-aware" else None
        routed = prefill if prefill is not None else decode

        def new_selector(pool: NodePool) -> NodeSelector:
            return pool_selector(config.policy, index, computes_prompt=pool is routed)

        pipeline = Pipeline(
            mode=config.mode,
            prefill_pool=prefill,
            decode_pool=decode,
            new_selector=new_selector,
            prefill_attempts=config.prefill_attempts,
            decode_attempts=config.decode_attempts,
            max_inflight=config.max_inflight,
        )
        servicer = HealthStatus()
        _publish_health(servicer, pools, pipeline)  # NOT_SERVING until a health round found the nodes up
        adapters = RouterAdapters(pools, allow_runtime=config.allow_runtime_lora, base_name=model.name)

        def after_round() -> None:
            _publish_health(servicer, pools, pipeline)
            adapters.reconcile()

        monitor = HealthMonitor(
            pools,
            interval=config.health_interval_s,
            timeout=config.health_timeout_s,
            reroute_after_s=config.reroute_after_s,
            on_round=after_round,
        )
        subscriber = None
        if index is not None:
            store: list[Publisher] = []
            if config.kv_store_events:
                pub, replay = config.kv_store_events.split(",")
                store.append(Publisher(STORE, STORE, pub.strip(), replay.strip()))

            def publishers() -> list[Publisher]:
                return [n.kv_events for n in routed.healthy() if n.kv_events is not None] + store

            subscriber = KVEventSubscriber(index, publishers).start()
        streams = StreamWatch(config.stream_idle_timeout_s)
        runtime = cls(
            config,
            model,
            pools,
            pipeline,
            monitor,
            servicer,
            RpcCounters(),
            access,
            streams,
            # n choices take n of the max_inflight slots: more could never be admitted
            Admission(
                model,
                config.max_tokens_limit,
                max_n=min(config.max_n, config.max_inflight),
                adapters=adapters,
                node_context=lambda: served_context(pools),
            ),
            tls,
            index,
            subscriber,
        )
        runtime.drainer = Drain(
            "router", lambda: DrainProgress(requests=pipeline.inflight), config.drain_timeout_s
        )
        return runtime

    def drain(self) -> DrainReport:
        """A planned stop's first half: NOT_SERVING, admit nothing, let the streams in flight finish (at
        most ``drain_timeout_s``)."""
        assert self.drainer is not None
        self.pipeline.drain()
        self.update_health()
        return self.drainer.run()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def healthy(self) -> bool:
        """Every pool (prefill and decode, or the colocated nodes) has a healthy node."""
        return _all_healthy(self.pools)

    def http_app(self) -> object:
        from router.openai_api import create_app

        return create_app(
            self.pipeline,
            self.model,
            healthy=self.healthy,
            admission=self.admission,
            request_timeout_s=self.config.http_timeout_s,
            access=self.access,
            streams=self.streams,
            calls=self.calls,
        )

    def update_health(self) -> None:
        _publish_health(self.health, self.pools, self.pipeline)

    def metrics(self) -> list[Metric]:
        latency = self.pipeline.latency.snapshot()
        resumes = CounterMetricFamily(
            "pdkv_router_decode_resumes",
            "decode streams resumed on another node after theirs failed mid-stream (one per resume)",
        )
        resumes.add_metric([], float(self.pipeline.resumed))
        whole = CounterMetricFamily(
            "pdkv_router_requests_run_whole",
            "disaggregated requests run whole on a decode node: no healthy prefill node ran its model",
        )
        whole.add_metric([], float(self.pipeline.run_whole))
        cut = CounterMetricFamily(
            "pdkv_router_streams_cut",
            f"streams cut because their client read nothing for {self.config.stream_idle_timeout_s:g}s",
        )
        cut.add_metric([], float(self.streams.cut))
        families: list[Metric] = [
            gauge("pdkv_router_inflight_requests", "client calls in flight", self.pipeline.inflight),
            resumes,
            whole,
            cut,
            *stats_families(StatsSnapshot({}, {}, latency), specs=SPECS, prefix="pdkv_router_"),
        ]
        for pool in self.pools:
            up = GaugeMetricFamily(
                f"pdkv_router_{pool.kind}_node_up",
                f"1 when the {pool.kind} node answers its health check",
                labels=["node"],
            )
            inflight = GaugeMetricFamily(
                f"pdkv_router_{pool.kind}_node_inflight",
                f"router calls in flight on each {pool.kind} node",
                labels=["node"],
            )
            for n in pool.nodes():
                up.add_metric([n.address], 1.0 if n.healthy else 0.0)
                inflight.add_metric([n.address], float(n.inflight))
            families += [up, inflight]
        if self.kv_index is not None:
            counters = CounterMetricFamily(
                "pdkv_router_kv_index_events", "KV event batches by outcome", labels=["outcome"]
            )
            for outcome, count in sorted(self.kv_index.counters.items()):
                counters.add_metric([outcome], float(count))
            blocks = GaugeMetricFamily(
                "pdkv_router_kv_index_blocks", "blocks the index holds per node", labels=["node"]
            )
            for node in self.kv_index.nodes():
                blocks.add_metric([node], float(self.kv_index.num_blocks(node)))
            families += [counters, blocks]
        drain = self.drainer.metrics("pdkv_router") if self.drainer is not None else []
        return families + drain[:2] + self.calls.families("pdkv_router")

    def stop(self, server: grpc.Server | None = None, grace_s: float | None = None) -> None:
        grace = self.config.grace_s if grace_s is None else grace_s
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if server is not None:
            server.stop(grace).wait(grace + 1.0)
        self.monitor.stop()
        self.streams.close()
        if self.kv_events is not None:
            self.kv_events.close()
        for pool in self.pools:
            pool.close()


def _all_healthy(pools: tuple[NodePool, ...]) -> bool:
    return all(pool.healthy() for pool in pools)


def _publish_health(servicer: HealthStatus, pools: tuple[NodePool, ...], pipeline: Pipeline) -> None:
    """SERVING when every pool has at least one healthy node, and the router is not draining."""
    ready = _all_healthy(pools) and not pipeline.draining
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        servicer.set(name, status)


def create_server(runtime: RouterRuntime, address: str) -> tuple[grpc.Server, int]:
    """The router's gRPC server bound to ``address`` (port 0 picks one), not started."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=runtime.config.max_workers, thread_name_prefix="router-rpc"),
        options=[("grpc.so_reuseport", 0)],
        interceptors=[UndecodableRequests()],  # bytes that do not parse: INVALID_ARGUMENT, not INTERNAL
    )
    servicer = GenerationServicer(
        runtime.pipeline,
        runtime.model,
        runtime.calls,
        runtime.pools,
        runtime.access,
        runtime.streams,
        admission=runtime.admission,
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(runtime.health, server)
    enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    port = add_port(server, address, runtime.tls)
    if port == 0:
        raise OSError(f"cannot listen on {address}: the address is in use or not local")
    return server, port


def run_router(config: RouterConfig) -> int:
    """Serve until SIGTERM or SIGINT; print one ready line once listening."""
    runtime = RouterRuntime.build(config)
    server, port = create_server(runtime, config.address)
    runtime.update_health()
    metrics = None
    if config.metrics_address:
        labels = {"model_name": runtime.model.name}  # the served name, as the nodes' (--served-model-name)
        metrics = MetricsServer(config.metrics_address, runtime.metrics, labels).start()
    http = None
    if config.http_address:
        from router.openai_api import HttpServer

        http = HttpServer(runtime.http_app(), config.http_address, tls=runtime.tls).start()
    server.start()
    runtime.monitor.start()
    stop = stop_on_signals()
    host = config.address.rpartition(":")[0]
    print(
        f"{READY_PREFIX}{host}:{port} mode={config.mode} metrics={metrics.address if metrics else '-'} "
        f"http={http.address if http else '-'} tls={'on' if runtime.tls else 'off'} "
        f"auth={'open' if runtime.access.open else 'api-keys'}",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
        runtime.drain()
    finally:
        runtime.stop(server)
        if http is not None:
            http.close()
        if metrics is not None:
            metrics.close()
    return 0
