"""What ``pdkv up`` runs (``Topology``), how it restarts a child (``RestartPolicy``), and the connector
stack each node gets from what the registry has."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.ports import NODES_PER_KIND, metrics_port

MODES = ("disaggregated", "colocated")
# Where each child serves /metrics: "fixed" (telemetry/ports.py's documented ports, node i of a kind on
# base + i: what `pdkv up` does), "any" (free ports: several clusters on one host, the tests), "none".
METRICS_PORTS = ("fixed", "any", "none")
DEFAULT_STORE = "cpu:256MiB,disk:{run_dir}/kvstore:1GiB"
# p2p leases must end before the engine's own reclaim deadline (see connectors/p2p.py).
P2P_LEASE_S = 30.0


@dataclass(frozen=True)
class RestartPolicy:
    """When ``supervise`` restarts a dead child: after ``backoff_s`` doubled per death in the window (at
    most ``max_backoff_s``); ``max_deaths`` deaths within ``window_s`` stop the cluster instead."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_deaths: int = 5
    window_s: float = 120.0

    def delay(self, deaths: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, deaths - 1))


@dataclass(frozen=True)
class Topology:
    """What to run.  ``kv_store``: tiers of the shared store server (``{run_dir}`` is replaced), or None
    for no store.  ``kv_connector`` overrides the connector stack the launcher derives for every node."""

    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    model: str | None = None
    kv_store: str | None = DEFAULT_STORE
    redis: bool = False
    host: str = "127.0.0.1"
    router_port: int = 0
    # The router's OpenAI-compatible HTTP API on ``host`` (0: any free port; None: off).
    http_port: int | None = 0
    kv_connector: str | None = None
    # /metrics of every child: one of METRICS_PORTS.
    metrics_ports: str = "any"
    # The router's node-selection policy; "kv-aware" also makes every node publish its KV events.
    policy: str = "least-loaded"
    # The router returns cached-token counts in the usage (one user on loopback: nothing to hide).
    cache_details: bool = True
    # Everything on (``Secrets``): TLS on gRPC and HTTP (mutual between router and nodes), an API key,
    # CURVE on the store and p2p, sealed transfer params.
    secure: bool = False
    # Compute threads per node (``--threads``); None: each node's default, one per core.
    node_threads: int | None = None
    # The model's name to clients and in the metrics' model_name label, and the context the nodes hold
    # (router and nodes alike; None: the model's own).
    served_model_name: str | None = None
    max_model_len: int | None = None
    # The router's API keys (a TOML keys file, router/auth.py); with ``secure`` the generated one.
    api_keys_file: Path | None = None
    # A config file every child reads its own tables of (pdkv/settings.py); the launcher's flags win.
    config_file: Path | None = None
    # Environment variables the children do not inherit: those that were the launcher's own options
    # (pdkv up's $PDKV_PREFILL means a count, the router's an address list).
    unset_env: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = 180.0
    # Every child's --drain-timeout-s (a planned stop: serving/drain.py) and --grace-s (after it).
    drain_timeout_s: float = 30.0
    grace_s: float = 5.0
    restart_policy: RestartPolicy = RestartPolicy()
    # LoRA adapters every node serves from the start (name, PEFT folder), and whether the router and
    # the nodes take run-time loads (docs/lora.md).
    loras: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if self.num_decode < 1:
            raise ValueError(f"--decode must be at least 1, got {self.num_decode}")
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise ValueError(f"--prefill must be at least 1 in disaggregated mode, got {self.num_prefill}")
        if self.redis and self.kv_store is None:
            raise ValueError("--redis adds a tier to the KV store: it needs --kv-store (not 'none')")
        if self.redis and self.kv_store is not None and self.kv_store.startswith("@"):
            raise ValueError(
                f"--redis adds a tier to a --kv-store string, not to a file ({self.kv_store}): list the "
                "redis tier in the file"
            )
        for name, port in (("router", self.router_port), ("http", self.http_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} port {port} is not a port")
        for key in ("drain_timeout_s", "grace_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)!r}")
        if self.metrics_ports not in METRICS_PORTS:
            choose = ", ".join(METRICS_PORTS)
            raise ValueError(f"metrics_ports {self.metrics_ports!r} is unknown; choose one of {choose}")
        if self.metrics_ports == "fixed" and max(self.num_prefill, self.num_decode) > NODES_PER_KIND:
            raise ValueError(
                f"fixed metrics ports leave room for {NODES_PER_KIND} nodes of a kind on one host; "
                "use --metrics-ports any for more"
            )
        if self.api_keys_file is not None and self.secure:
            raise ValueError(
                "--api-keys-file and --secure: --secure writes and uses the cluster's own API key; drop one"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len}")
        if self.node_threads is not None and self.node_threads < 1:
            raise ValueError(f"node_threads must be at least 1, got {self.node_threads}")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")

    def config_args(self) -> tuple[str, ...]:
        """``--config FILE`` for every child, when there is a file."""
        return ("--config", str(self.config_file)) if self.config_file is not None else ()

    def lora_args(self, role: str) -> tuple[str, ...]:
        """The LoRA flags of a child: the adapters (nodes) and the run-time switch (nodes and router)."""
        runtime = ("--allow-runtime-lora",) if self.allow_runtime_lora else ()
        if role == "router":
            return runtime
        return (
            *(f"--lora={name}={Path(path).expanduser().resolve()}" for name, path in self.loras),
            *runtime,
        )

    def stop_args(self) -> tuple[str, ...]:
        """How long a child drains on SIGTERM and then gives in-flight calls (the store: drains only)."""
        return ("--drain-timeout-s", f"{self.drain_timeout_s:g}")

    @property
    def stop_timeout_s(self) -> float:
        """How long a SIGTERMed child may take before it is killed: its drain, its grace, a margin."""
        return self.drain_timeout_s + self.grace_s + 10.0

    def model_args(self) -> tuple[str, ...]:
        """The router's and the nodes' shared model settings."""
        name = ("--served-model-name", self.served_model_name) if self.served_model_name else ()
        length = ("--max-model-len", str(self.max_model_len)) if self.max_model_len is not None else ()
        return (*name, *length)

    def metrics_address(self, kind: str, index: int = 0) -> str:
        """The ``--metrics-address`` of child ``index`` of ``kind`` (router, kvstore, a node role)."""
        if self.metrics_ports == "none":
            return "none"
        return f"{self.host}:{metrics_port(kind, index) if self.metrics_ports == 'fixed' else 0}"


def available_connectors() -> set[str]:
    from connectors.registry import discover

    return set(discover())


def connector_stack(role: str, mode: str, store_spec: str | None, known: set[str]) -> str:
    """The ``--kv-connector`` spec of a node, from what the registry has: ``offload`` (the store) where
    prompts are computed (prefill, colocated), ``p2p`` in disaggregated mode; ``none`` when neither
    applies.  A decode node takes its prompt KV from the prefill node only."""
    children: list[dict[str, Any]] = []
    if store_spec is not None and "offload" in known and role != "decode":
        children.append({"name": "offload", "options": {"kv_store": store_spec}})
    if mode == "disaggregated" and "p2p" in known:
        children.append({"name": "p2p", "options": {"lease_s": P2P_LEASE_S}})
    if not children:
        return "none"
    if len(children) == 1:
        return json.dumps(children[0])
    return json.dumps({"name": "multi", "options": {"connectors": children}})
