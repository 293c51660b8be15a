"""``RouterConfig``: which nodes, which mode and policy, and the router's limits; frozen and validated."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from serving.drain import add_drain_arguments
from telemetry.ports import metrics_port
from wire.endpoints import parse_address

MODES = ("disaggregated", "colocated")
POLICIES = ("round-robin", "least-loaded", "kv-aware")
DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_HTTP_ADDRESS = "127.0.0.1:8000"
DEFAULT_METRICS_ADDRESS = f"127.0.0.1:{metrics_port('router')}"
# The line the router prints once it serves: READY_PREFIX + "HOST:PORT mode=... metrics=..."
READY_PREFIX = "pdkv router: serving on "


@dataclass(frozen=True)
class RouterConfig:
    """``disaggregated``: prefill on a ``prefill_nodes`` node, decode on a ``decode_nodes`` node.
    ``colocated``: the whole request on one of ``decode_nodes`` (nodes started with role colocated)."""

    mode: str = "disaggregated"
    prefill_nodes: tuple[str, ...] = ()
    decode_nodes: tuple[str, ...] = ()
    policy: str = "least-loaded"
    # kv-aware: the shared store server's KV events, "PUB_ENDPOINT,REPLAY_ENDPOINT" (its ready line names
    # both); "" = the router knows only the nodes' own caches.
    kv_store_events: str = ""
    model: str | None = None
    address: str = DEFAULT_ADDRESS
    metrics_address: str = "127.0.0.1:0"
    # The OpenAI-compatible HTTP API ("" = off) and the name clients give as "model".
    http_address: str = DEFAULT_HTTP_ADDRESS
    served_model_name: str | None = None
    # The nodes' --max-model-len, when shorter than the model's context: requests that would not fit are
    # refused here, naming the field (None: the model's max_position_embeddings).
    max_model_len: int | None = None
    # Longest an HTTP request may take (the SDK sets no deadline the server can see).
    http_timeout_s: float = 600.0
    # Client calls in flight before RESOURCE_EXHAUSTED.
    max_inflight: int = 256
    # Most output tokens one request may ask for (0: as many as the model's context leaves room for).
    max_tokens_limit: int = 0
    # Most choices one request may ask for (OpenAI's ``n``): each is a sequence decoded in the batch.
    max_n: int = 16
    # Take LoadAdapter / UnloadAdapter (and the HTTP /v1/load_lora_adapter, /v1/unload_lora_adapter): the
    # router has every node load the folder (router/adapters.py).  Off by default.
    allow_runtime_lora: bool = False
    # API keys (router/auth.py): a TOML keys file; "" = $PDKV_API_KEYS_FILE / $PDKV_API_KEYS, or open.
    api_keys_file: str = ""
    # Calls in flight of one tenant (open: one connection) before RESOURCE_EXHAUSTED; 0 = max_inflight/2.
    client_max_inflight: int = 0
    # Return cached-token counts (usage.cached, computed_prompt_tokens): they tell a client what else is
    # cached, so they are off unless the operator turns them on (here, or per tenant in the keys file).
    cache_details: bool = False
    # A stream whose client reads nothing for this long is cut and its request aborted.
    stream_idle_timeout_s: float = 30.0
    # TLS from the cluster's TLS folder (serving/tls.py; "" = $PDKV_TLS_DIR or none): the router's gRPC and
    # HTTP servers, and its channels to the nodes (with its client certificate, for nodes that ask).
    tls_dir: str = ""
    # Listen on a non-loopback address without TLS and API keys: refused unless this says so.
    insecure: bool = False
    # Prefill nodes tried for one request (a node that fails before answering is skipped).
    prefill_attempts: int = 2
    # Decode (or colocated) nodes one request may go through: a node that fails, even mid-stream, hands
    # the request to the next one, which resumes after the tokens the client already has.
    decode_attempts: int = 2
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    # A node whose health checks go unanswered this long (dead, or frozen: a stopped process holds its
    # streams open) has its open calls cancelled and resumed on another node of its kind, if one serves.
    reroute_after_s: float = 5.0
    # Resolve node host names to every address they have (one node per replica), on every health round.
    dns_discovery: bool = False
    # A planned stop (SIGTERM) drains first: new calls are refused UNAVAILABLE, the streams in flight
    # finish, for at most this long (serving/drain.py); then in-flight calls get grace_s.
    drain_timeout_s: float = 30.0
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        for key in ("drain_timeout_s", "grace_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if self.kv_store_events and len(self.kv_store_events.split(",")) != 2:
            raise ValueError(
                f"kv_store_events must be 'PUB_ENDPOINT,REPLAY_ENDPOINT', got {self.kv_store_events!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        object.__setattr__(self, "prefill_nodes", tuple(self.prefill_nodes))
        object.__setattr__(self, "decode_nodes", tuple(self.decode_nodes))
        if self.mode == "disaggregated" and not self.prefill_nodes:
            raise ValueError("disaggregated mode needs at least one prefill node (--prefill HOST:PORT)")
        if not self.decode_nodes:
            raise ValueError(
                "at least one decode node is needed (--decode HOST:PORT; in colocated mode, the nodes)"
            )
        if self.mode == "colocated" and self.prefill_nodes:
            raise ValueError("colocated mode takes its nodes from --decode only; drop --prefill")
        for a in (*self.prefill_nodes, *self.decode_nodes):
            parse_address(a, "node address")
        parse_address(self.address, "address")
        if self.metrics_address:
            parse_address(self.metrics_address, "metrics_address")
        if self.http_address:
            parse_address(self.http_address, "http_address")
        if not self.http_timeout_s > 0:
            raise ValueError(f"http_timeout_s must be positive, got {self.http_timeout_s!r}")
        if not isinstance(self.max_tokens_limit, int) or self.max_tokens_limit < 0:
            raise ValueError(f"max_tokens_limit must be >= 0, got {self.max_tokens_limit!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n!r}")
        if not isinstance(self.client_max_inflight, int) or self.client_max_inflight < 0:
            raise ValueError(f"client_max_inflight must be >= 0, got {self.client_max_inflight!r}")
        if not self.stream_idle_timeout_s > 0:
            raise ValueError(f"stream_idle_timeout_s must be positive, got {self.stream_idle_timeout_s!r}")
        for name in ("max_inflight", "prefill_attempts", "decode_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("health_interval_s", "health_timeout_s", "reroute_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    @property
    def max_workers(self) -> int:
        return self.max_inflight + 16

    @property
    def per_client_limit(self) -> int:
        return self.client_max_inflight or max(1, self.max_inflight // 2)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"HOST:PORT to listen on ({DEFAULT_ADDRESS})"
    )
    parser.add_argument(
        "--metrics-address",
        default=DEFAULT_METRICS_ADDRESS,
        help=f"HOST:PORT for /metrics ({DEFAULT_METRICS_ADDRESS}; port 0 picks one; 'none': off)",
    )
    parser.add_argument(
        "--http-address",
        default=DEFAULT_HTTP_ADDRESS,
        help=f"HOST:PORT of the OpenAI-compatible HTTP API ({DEFAULT_HTTP_ADDRESS}; 'none': off)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model's name in the HTTP API (default: from --model)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="the nodes' --max-model-len: longer requests are refused here (default: the model's context)",
    )
    parser.add_argument("--http-timeout-s", type=float, default=600.0, help="longest HTTP request")
    parser.add_argument("--mode", choices=MODES, default="disaggregated")
    parser.add_argument(
        "--prefill", default="", metavar="ADDRS", help="prefill nodes, comma-separated HOST:PORT list"
    )
    parser.add_argument(
        "--decode", default="", metavar="ADDRS", help="decode (or colocated) nodes, comma-separated"
    )
    parser.add_argument("--policy", choices=POLICIES, default="least-loaded")
    parser.add_argument(
        "--kv-store-events",
        default="",
        metavar="PUB,REPLAY",
        help="with --policy kv-aware: the store server's KV event endpoints (pdkv kvstore serve --kv-events)",
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="the nodes' model (GGUF file or folder, or $PDKV_MODEL), for its tokenizer and template",
    )
    parser.add_argument("--max-inflight", type=int, default=256)
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        default=0,
        metavar="N",
        help="most output tokens one request may ask for (default 0: what the context leaves room for)",
    )
    parser.add_argument(
        "--max-n",
        type=int,
        default=16,
        metavar="N",
        help="most choices one request may ask for (OpenAI's n; default 16)",
    )
    parser.add_argument(
        "--api-keys-file",
        default="",
        metavar="PATH",
        help="TOML file of tenants and their API keys (or $PDKV_API_KEYS_FILE, or KEY=TENANT pairs in "
        "$PDKV_API_KEYS); without keys the router is open",
    )
    parser.add_argument(
        "--client-max-inflight",
        type=int,
        default=0,
        metavar="N",
        help="calls in flight of one tenant (open router: one connection); default max-inflight/2",
    )
    parser.add_argument(
        "--cache-details",
        action="store_true",
        help="return cached-token counts in the usage (they tell a client what else is cached)",
    )
    parser.add_argument(
        "--stream-idle-timeout-s",
        type=float,
        default=30.0,
        help="cut a stream whose client reads nothing for this long, aborting its request",
    )
    parser.add_argument("--prefill-attempts", type=int, default=2, help="prefill nodes tried per request")
    parser.add_argument(
        "--decode-attempts",
        type=int,
        default=2,
        help="decode nodes per request: a failed one hands it to the next, which resumes the stream",
    )
    parser.add_argument(
        "--health-interval-s",
        type=float,
        default=0.5,
        help="seconds between the rounds of health checks of every node (each waits 1 s for its answer; "
        "any answer but SERVING marks the node down at once, a missing one only twice in a row)",
    )
    parser.add_argument(
        "--reroute-after-s",
        type=float,
        default=5.0,
        help="a node that answers no health check for this long (dead, or frozen) has its open calls "
        "resumed on another node of its kind, when one serves",
    )
    parser.add_argument(
        "--dns-discovery", action="store_true", help="one node per address a name resolves to"
    )
    parser.add_argument(
        "--tls-dir",
        default="",
        metavar="DIR",
        help="TLS from the cluster's TLS folder (or $PDKV_TLS_DIR): gRPC, HTTP and the calls to the nodes",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --address/--http-address without TLS and API keys (trusted networks only)",
    )
    add_drain_arguments(parser, "the streams in flight to finish")
    parser.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="take adapter load/unload calls (gRPC LoadAdapter, HTTP /v1/load_lora_adapter) and have every "
        "node load the folder; the nodes need --allow-runtime-lora too.  Off by default",
    )
    parser.add_argument("--log-level", default="WARNING")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    def split(text: str) -> tuple[str, ...]:
        return tuple(a.strip() for a in text.split(",") if a.strip())

    metrics = "" if str(args.metrics_address).lower() in ("", "none", "off") else args.metrics_address
    http = "" if str(args.http_address).lower() in ("", "none", "off") else args.http_address
    return RouterConfig(
        mode=args.mode,
        prefill_nodes=split(args.prefill),
        decode_nodes=split(args.decode),
        policy=args.policy,
        kv_store_events=args.kv_store_events,
        model=args.model,
        address=args.address,
        metrics_address=metrics,
        http_address=http,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        http_timeout_s=args.http_timeout_s,
        max_inflight=args.max_inflight,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        api_keys_file=args.api_keys_file,
        client_max_inflight=args.client_max_inflight,
        cache_details=args.cache_details,
        stream_idle_timeout_s=args.stream_idle_timeout_s,
        tls_dir=args.tls_dir,
        insecure=args.insecure,
        prefill_attempts=args.prefill_attempts,
        decode_attempts=args.decode_attempts,
        health_interval_s=args.health_interval_s,
        reroute_after_s=args.reroute_after_s,
        dns_discovery=args.dns_discovery,
        grace_s=args.grace_s,
        drain_timeout_s=args.drain_timeout_s,
        allow_runtime_lora=args.allow_runtime_lora,
    )
