"""Node configuration: one frozen ``NodeConfig`` per node process, built from the command line.

    pdkv serve-prefill --address 0.0.0.0:50061 --model DIR --kv-connector '{"name": "multi", ...}'

The connector stack is one option, ``--kv-connector SPEC``: ``none``, a registered name (``p2p``), a JSON
object ``{"name": ..., "options": {...}}`` (``multi`` takes a list of children), or ``@file.json``.  In
the spec, ``{hostname}`` and ``{ip}`` stand for this machine's name and address, so one spec serves every
replica of a scaled service (each advertises its own KV endpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors.registry import KVConnectorConfig
from engine.cpu_features import auto_cpu_dtype_note
from engine.engine_config import (
    DETERMINISTIC_COST,
    DETERMINISTIC_SWITCH,
    WEIGHT_FORMATS,
    WEIGHTS_HELP,
    EngineConfig,
    deterministic_from_switch,
)
from engine.model.embedded import model_name
from serving.drain import add_drain_arguments
from serving.lora_flags import add_lora_arguments, lora_engine_options
from telemetry.ports import metrics_port
from wire.endpoints import check_endpoint, parse_address

ROLES = ("prefill", "decode", "colocated")


def _dtype_help() -> str:
    return f"weights and KV cache dtype; {auto_cpu_dtype_note()}; on CUDA the checkpoint's 16-bit dtype"


# The line a node prints once it serves:
# READY_PREFIX + "HOST:PORT role=... node_id=... metrics=... kv_endpoint=... threads=..."
READY_PREFIX = "pdkv node: serving on "
DEFAULT_PORTS = {"prefill": 50061, "decode": 50071, "colocated": 50081}


def own_ip() -> str:
    """This machine's address as its host name resolves (a container's address in compose)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def parse_connector_spec(spec: str | None) -> KVConnectorConfig | None:
    """``--kv-connector``: none | NAME | JSON object | @file.json -> a connector config (None: no-op)."""
    text = (spec or "").strip()
    if text.lower() in ("", "none", "null"):
        return None
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--kv-connector {spec}: cannot read {path} ({exc.strerror})") from exc
    if "{hostname}" in text:
        text = text.replace("{hostname}", socket.gethostname())
    if "{ip}" in text:
        text = text.replace("{ip}", own_ip())
    if not text.lstrip().startswith("{"):
        return KVConnectorConfig(name=text)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f'--kv-connector: not valid JSON ({exc}); e.g. \'{{"name": "p2p"}}\'') from exc
    extra = sorted(set(raw) - {"name", "options"})
    if extra or "name" not in raw:
        raise ValueError(
            "--kv-connector: a JSON spec is an object with 'name' and optional 'options'"
            + (f"; unknown key {extra[0]!r}" if extra else "")
        )
    return KVConnectorConfig(name=raw["name"], options=raw.get("options") or {})


@dataclass(frozen=True)
class NodeConfig:
    """One node process: its role, where it listens, its engine, and its limits."""

    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    address: str = "127.0.0.1:0"
    # Where /metrics is served over HTTP ("" disables it); port 0 picks a free one.
    metrics_address: str = "127.0.0.1:0"
    node_id: str = ""
    # The model's name in the metrics' model_name label (the router's --served-model-name); None: the
    # model's own (engine/model/embedded.py: model_name).
    served_model_name: str | None = None
    # Where the engine's KV events are published (a ZeroMQ PUB endpoint, "tcp://HOST:PORT", port 0 picks
    # one; its replay socket binds the same host on a free port); "" publishes none.
    kv_events_bind: str = ""
    # Unfinished requests the engine takes before RESOURCE_EXHAUSTED.
    max_num_requests: int = 64
    # A planned stop (SIGTERM) drains first: new calls are refused, admitted requests finish and held KV
    # is pulled, for at most this long (serving/drain.py); then in-flight RPCs get grace_s to end.
    drain_timeout_s: float = 30.0
    # Seconds in-flight RPCs get to finish when the node stops (after the drain).
    grace_s: float = 5.0
    # The cluster secret that seals transfer params (serving/signing.py): a file ("" = the environment's
    # $PDKV_CLUSTER_SECRET_FILE / $PDKV_CLUSTER_SECRET, or none).
    cluster_secret_file: str = ""
    # gRPC TLS from the cluster's TLS folder (serving/tls.py; "" = $PDKV_TLS_DIR or none); mtls: serve only
    # clients with a certificate of the cluster's CA (the router).
    tls_dir: str = ""
    mtls: bool = False
    # Listen on a non-loopback address without TLS: refused unless this says the network is trusted.
    insecure: bool = False
    # torch's intra-op threads for this process (the matmuls and the native kernels); None: torch's
    # default, one per core.  Nodes sharing a machine should split its cores (Topology.node_threads).
    threads: int | None = None
    # Take LoadAdapter / UnloadAdapter calls (serving/lora.py): off by default.
    runtime_lora: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is unknown; choose one of {', '.join(ROLES)}")
        parse_address(self.address, "address")
        if self.metrics_address:
            parse_address(self.metrics_address, "metrics_address")
        if self.kv_events_bind:
            check_endpoint(self.kv_events_bind, "kv_events_bind")
        if not isinstance(self.max_num_requests, int) or self.max_num_requests <= 0:
            raise ValueError(f"max_num_requests must be a positive integer, got {self.max_num_requests!r}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        for name, _ in self.engine.loras:
            if name == self.model_name:  # requests naming it run the base: the adapter could never be reached
                raise ValueError(f"--lora {name}=...: {name!r} is the base model's name; pick another")
        if not self.node_id:
            object.__setattr__(self, "node_id", f"{self.role}-{socket.gethostname()}-{os.getpid()}")

    @property
    def model_name(self) -> str:
        """The ``model_name`` label on every series of this node's ``/metrics``."""
        return self.served_model_name or model_name(self.engine.model)

    @property
    def max_workers(self) -> int:
        """Server threads: one per admitted request plus room for health, stats and abort calls."""
        return self.max_num_requests + 16


def add_node_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--address",
        default=f"127.0.0.1:{DEFAULT_PORTS[role]}",
        help=f"gRPC HOST:PORT to listen on (default 127.0.0.1:{DEFAULT_PORTS[role]}; port 0 picks one)",
    )
    metrics = f"127.0.0.1:{metrics_port(role)}"
    parser.add_argument(
        "--metrics-address",
        default=metrics,
        help=f"HOST:PORT for Prometheus /metrics (default {metrics}; port 0 picks one; 'none' disables)",
    )
    parser.add_argument(
        "--node-id", default="", help="name in logs, stats and metrics (default ROLE-HOST-PID)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name in the metrics' model_name label, as the router's (default: from --model)",
    )
    parser.add_argument(
        "--kv-connector",
        default="none",
        metavar="SPEC",
        help="the KV connector stack: none | NAME | JSON {'name': ..., 'options': {...}} | @file.json",
    )
    parser.add_argument(
        "--kv-events",
        default="",
        metavar="ENDPOINT",
        help="publish the engine's KV cache events on this ZeroMQ endpoint, e.g. tcp://0.0.0.0:5557 (port "
        "0 picks one; Node/Stats names it); a kv-aware router subscribes (default: off)",
    )
    parser.add_argument(
        "--max-num-requests",
        type=int,
        default=64,
        help="requests before RESOURCE_EXHAUSTED (the router waits for room)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads (default: one per core; nodes sharing a machine should split its cores)",
    )
    add_drain_arguments(parser, "admitted requests to finish and held KV to be pulled")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--cluster-secret-file",
        default="",
        metavar="PATH",
        help="the cluster secret that seals transfer params between prefill and decode nodes (or "
        "$PDKV_CLUSTER_SECRET_FILE / $PDKV_CLUSTER_SECRET); a decode node with it pulls KV only as "
        "sealed params say",
    )
    parser.add_argument(
        "--tls-dir",
        default="",
        metavar="DIR",
        help="serve gRPC over TLS from the cluster's TLS folder (or $PDKV_TLS_DIR)",
    )
    parser.add_argument(
        "--mtls",
        action="store_true",
        help="with --tls-dir: serve only clients holding a certificate of the CA",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --address without TLS (only on a network you trust)",
    )
    add_engine_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's options: a node's, and ``pdkv profile``'s (which times the engine a node would run)."""
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a local GGUF file or Hugging Face folder (or $PDKV_MODEL; default: the embedded SmolLM2)",
    )
    engine.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help=_dtype_help()
    )
    engine.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default="auto", help=WEIGHTS_HELP.replace("%", "%%")
    )
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    engine.add_argument(
        "--deterministic",
        choices=DETERMINISTIC_SWITCH,
        default="auto",
        help="batch-invariant forward passes: a request's tokens and logprobs the same bits whatever runs "
        "beside it, however it is chunked, cached, loaded or resumed (engine/determinism.py); served in "
        "bfloat16 on a CPU with AVX-512 or AVX2 + FMA (on refuses to start elsewhere; auto: on where "
        "served, else off). " + DETERMINISTIC_COST.replace("%", "%%"),
    )
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-bytes", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest request, prompt and output (default: the model's context, cut to what the KV "
        "cache holds; more than either is refused)",
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--kv-hold-timeout-s",
        type=float,
        default=120.0,
        help="a finished request's blocks held for a connector's transfer (a decode node's pull) are "
        "asked back after this long; keep it above the connector's own lease",
    )
    engine.add_argument("--engine-id", default="", help="this engine's name to its peers (default: node id)")
    add_lora_arguments(parser.add_argument_group("LoRA adapters (docs/lora.md)"))


def engine_config_from_args(args: argparse.Namespace, **more: Any) -> EngineConfig:
    """The ``EngineConfig`` of ``add_engine_arguments``' options, and ``more``."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        weights=args.weights,
        device=args.device,
        deterministic=deterministic_from_switch(args.deterministic),
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        kv_hold_timeout_s=args.kv_hold_timeout_s,
        **lora_engine_options(args),
        **more,
    )


def node_config_from_args(args: argparse.Namespace, role: str) -> NodeConfig:
    metrics = "" if str(args.metrics_address).lower() in ("", "none", "off") else args.metrics_address
    node_id = args.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
    engine = engine_config_from_args(
        args,
        enable_kv_events=bool(args.kv_events),
        kv_connector=parse_connector_spec(args.kv_connector),
        engine_id=args.engine_id or node_id,
    )
    return NodeConfig(
        role=role,
        engine=engine,
        address=args.address,
        metrics_address=metrics,
        node_id=node_id,
        served_model_name=args.served_model_name,
        kv_events_bind=args.kv_events,
        max_num_requests=args.max_num_requests,
        grace_s=args.grace_s,
        drain_timeout_s=args.drain_timeout_s,
        cluster_secret_file=args.cluster_secret_file,
        tls_dir=args.tls_dir,
        mtls=args.mtls,
        insecure=args.insecure,
        threads=args.threads,
        runtime_lora=args.allow_runtime_lora,
    )
