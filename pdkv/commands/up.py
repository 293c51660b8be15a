"""``pdkv up``: the whole topology (store, nodes, router) as local processes, until Ctrl-C or SIGTERM.

    pdkv up                                   # 1 prefill + 1 decode, embedded model, cpu + disk store
    pdkv up --prefill 2 --decode 2 --redis    # adds a local redis-server tier
    pdkv up --mode colocated --decode 2       # two nodes each running whole requests (the baseline)
    pdkv up --oneshot "The quick brown fox"   # start, generate once through the router, stop
    pdkv up --oneshot "What is 2+2?" --chat   # the same, as a chat message (the model's template)
    pdkv up --config cluster.toml             # [up], and each child's own tables: [router], [node], ...

It waits until the router reports SERVING (every node healthy), prints where the router listens and
where every child serves /metrics, and stops every child cleanly on exit.  ``pdkv generate --server
ADDRESS PROMPT`` talks to it.  With a config file (pdkv/settings.py) every child gets ``--config FILE``
and reads its own tables; what ``pdkv up`` sets itself (addresses, the model, the connectors) a child's
table may not set, and every child's settings are checked before anything starts (up_settings.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run router + prefill/decode nodes + KV store as local processes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="prefill nodes (default 1; disaggregated mode only)",
    )
    parser.add_argument("--decode", type=int, default=1, metavar="M", help="decode (or colocated) nodes")
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="a local GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--kv-store",
        default="cpu:256MiB,disk:{run_dir}/kvstore:1GiB",
        metavar="SPEC",
        help="tiers of the shared store server ('none': no store); {run_dir} is the launcher's folder",
    )
    parser.add_argument(
        "--redis", action="store_true", help="start a local redis-server as the store's last tier"
    )
    parser.add_argument(
        "--router-address", default="127.0.0.1:50051", help="where the router listens (port 0: any)"
    )
    parser.add_argument(
        "--http-port",
        default="8000",
        metavar="PORT",
        help="the OpenAI-compatible HTTP API's port on the router's host (0: any; 'none': off)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name in the HTTP API and the metrics' model_name label (router and nodes)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="the context the nodes hold and the router admits (default: the model's)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="the router's API keys (a TOML keys file, docs/security.md); --secure writes its own",
    )
    parser.add_argument(
        "--kv-connector", default=None, metavar="SPEC", help="override every node's connector stack"
    )
    parser.add_argument(
        "--node-args",
        default="",
        metavar="ARGS",
        help="extra options for every node, e.g. '--num-blocks 512'",
    )
    parser.add_argument(
        "--policy",
        choices=("round-robin", "least-loaded", "kv-aware"),
        default="least-loaded",
        help="the router's node choice; kv-aware routes on the nodes' KV events and measured costs",
    )
    parser.add_argument(
        "--secure",
        action="store_true",
        help="generate a CA and certificates, CURVE keys, an API key and the cluster secret into the run "
        "folder and turn everything on (TLS, mutual TLS to the nodes, API keys, CURVE, sealed transfers)",
    )
    parser.add_argument(
        "--no-cache-details",
        action="store_true",
        help="the router returns no cached-token counts (with --secure they are off unless --cache-details)",
    )
    parser.add_argument(
        "--cache-details", action="store_true", help="with --secure: return cached-token counts"
    )
    parser.add_argument(
        "--metrics-ports",
        choices=("fixed", "any", "none"),
        default="fixed",
        help="each child's /metrics: fixed (router 9400, store 9401, prefill 9410+i, decode 9430+i, "
        "colocated 9450+i; docs/metrics.md), any (free ports: another cluster on this host), none",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="every child's drain on SIGTERM (pdkv restart, Ctrl-C): new work goes elsewhere while the "
        "admitted requests finish and held KV is pulled, for at most S seconds (docs/deploy.md)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds in-flight calls still get after the drain, before a child stops",
    )
    from serving.lora_flags import add_lora_arguments

    add_lora_arguments(parser, engine=False)
    parser.add_argument("--log-dir", default=None, metavar="DIR", help="keep the children's logs here")
    parser.add_argument("--startup-timeout", type=float, default=180.0, metavar="S")
    parser.add_argument(
        "--oneshot", metavar="PROMPT", help="generate PROMPT once through the router, then stop"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="with --oneshot")
    parser.add_argument(
        "--chat", action="store_true", help="with --oneshot: send PROMPT as a user message (chat template)"
    )
    from pdkv.commands.up_settings import check_up
    from pdkv.settings import env_variables

    # The children do not inherit pdkv up's own variables ($PDKV_PREFILL is a count here, the router's
    # nodes there): what they meant reaches the children as flags.
    parser.set_defaults(func=_up, check=check_up, unset_env=tuple(sorted(env_variables(parser))))


def _up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdkv.launcher import Cluster, Topology, run_until_signal
    from router.auth import KEYS_ENV
    from wire.endpoints import parse_address

    host, port = parse_address(args.router_address, "--router-address")
    if args.model:  # a bad model is refused before anything starts (headers only: no weight is read)
        from engine.model.loader import inspect_model

        inspect_model(args.model)
    if args.secure and os.environ.get(KEYS_ENV):
        # The router would take these keys beside the cluster's own: tenants nobody asked for.
        raise ValueError(f"${KEYS_ENV} is set and --secure uses the cluster's own API key; unset it")
    if args.mode == "colocated" and args.prefill is not None:  # it was dropped without a word
        raise ValueError("--prefill: colocated nodes prefill and decode; give their number with --decode")
    topology = Topology(
        mode=args.mode,
        num_prefill=(1 if args.prefill is None else args.prefill) if args.mode == "disaggregated" else 0,
        num_decode=args.decode,
        model=args.model,
        kv_store=None if args.kv_store.lower() == "none" else args.kv_store,
        redis=args.redis,
        host=host,
        router_port=port,
        http_port=None if args.http_port.lower() == "none" else int(args.http_port),
        kv_connector=args.kv_connector,
        policy=args.policy,
        metrics_ports=args.metrics_ports,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        api_keys_file=Path(args.api_keys_file).expanduser().resolve() if args.api_keys_file else None,
        config_file=Path(args.config).expanduser().resolve() if args.config else None,
        unset_env=args.unset_env,
        node_args=tuple(shlex.split(args.node_args)),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        startup_timeout_s=args.startup_timeout,
        drain_timeout_s=args.drain_timeout_s,
        grace_s=args.grace_s,
        secure=args.secure,
        cache_details=(args.cache_details or not args.secure) and not args.no_cache_details,
        loras=tuple(args.lora),
        allow_runtime_lora=args.allow_runtime_lora,
    )
    settings = f", settings from {topology.config_file}" if topology.config_file else ""
    print(f"pdkv up: starting {_summary(topology)}{settings} ...", file=sys.stderr, flush=True)
    try:
        cluster = Cluster.start(topology)
    except (RuntimeError, TimeoutError) as exc:  # a child that did not come up: its log, no traceback
        print(f"pdkv up: error: {exc}", file=sys.stderr)
        return 1
    if args.oneshot is not None:
        try:
            return _oneshot(cluster, args.oneshot, args.max_tokens, chat=args.chat)
        finally:
            cluster.stop()

    def ready(c: Cluster) -> None:
        print(c.describe(), file=sys.stderr)
        _addresses(c, sys.stdout)
        if c.secrets is not None:
            s = c.secrets
            print(
                f"pdkv up: secure: TLS (CA {s.tls_dir}/ca.pem), API key in {s.folder}/api-key\n"
                f"pdkv up:   PDKV_API_KEY=$(cat {s.folder}/api-key) PDKV_TLS_DIR={s.tls_dir} "
                f'pdkv generate --server {c.router_address} "Hello"\n'
                f"pdkv up:   curl --cacert {s.tls_dir}/ca.pem "
                f'-H "Authorization: Bearer $(cat {s.folder}/api-key)" https://{c.http_address}/v1/models',
                flush=True,
            )
        else:  # a secure cluster's try line is the one above, with its key and CA
            print(
                f'pdkv up: try: pdkv generate --server {c.router_address} "Hello"'
                "   (Ctrl-C stops everything)",
                file=sys.stderr,
                flush=True,
            )

    return run_until_signal(cluster, ready)


def _addresses(cluster: Any, out: Any) -> None:
    """Where the router listens, its OpenAI API, and every child's /metrics."""
    print(f"pdkv up: router listening on {cluster.router_address}", file=out, flush=True)
    if cluster.http_address:
        scheme = "https" if cluster.secrets is not None else "http"
        print(f"pdkv up: OpenAI API on {scheme}://{cluster.http_address}/v1", file=out, flush=True)
    for name, address in cluster.metrics_addresses().items():
        print(f"pdkv up: metrics of {name} on http://{address}/metrics", file=out, flush=True)


def _summary(t: Any) -> str:
    nodes = (
        f"{t.num_prefill} prefill + {t.num_decode} decode"
        if t.mode == "disaggregated"
        else f"{t.num_decode} colocated"
    )
    store = "no store" if t.kv_store is None else "store" + (" + redis" if t.redis else "")
    return f"{nodes} node(s), {store}"


def _oneshot(cluster: Any, prompt: str, max_tokens: int, *, chat: bool) -> int:
    import grpc

    from engine.sampling_params import SamplingParams
    from serving.client import cached_summary, generate_request

    _addresses(cluster, sys.stderr)
    what: Any = [{"role": "user", "content": prompt}] if chat else prompt
    request = generate_request(what, SamplingParams(max_tokens=max_tokens))

    def show(delta: Any) -> None:
        sys.stdout.write(delta.text)
        sys.stdout.flush()

    with cluster.client() as client:
        try:
            out = client.generate(request, timeout=120.0, on_delta=show)
        except grpc.RpcError as exc:
            from router.node_messages import rpc_code_details

            code, details = rpc_code_details(exc)  # one line, as pdkv generate --server prints it
            print(f"\npdkv up: generate failed: {code.name}: {details}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    u = out.usage
    assert u is not None
    print(
        f"[pdkv] via router {cluster.router_address}: prompt_tokens={u.prompt_tokens} output_tokens="
        f"{u.completion_tokens} {cached_summary(u)} ttft_ms={u.time_to_first_token_s * 1e3:.1f} "
        f"finish_reason={out.finish_reason}",
        file=sys.stderr,
    )
    return 0
