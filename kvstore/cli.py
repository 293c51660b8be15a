"""The command line of the store server, shared by ``pdkv kvstore serve`` and ``python -m kvstore.server``.

Only argument definitions live here, so building the ``pdkv`` parser imports neither ZeroMQ nor a tier.
"""

from __future__ import annotations

import argparse

from telemetry.ports import metrics_port
from wire.store_protocol import Limits

DEFAULT_BIND = "tcp://127.0.0.1:7600"
DEFAULT_METRICS_ADDRESS = f"127.0.0.1:{metrics_port('kvstore')}"
READY_PREFIX = "pdkv kvstore: serving on "


def add_serve_arguments(parser: argparse.ArgumentParser, *, metrics: str = DEFAULT_METRICS_ADDRESS) -> None:
    """The store server's options; ``metrics``: the default ``--metrics-address`` ("" = none: the
    tests' and benchmarks' ``python -m kvstore.server`` runs several servers at once)."""
    parser.add_argument(
        "--kv-store",
        required=True,
        metavar="SPEC",
        help="tiers to hold, e.g. cpu:8GiB,disk:/var/cache/pdkv:256GiB (or @file.toml)",
    )
    parser.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        help=f"ZeroMQ endpoint to serve on (default {DEFAULT_BIND}; port 0 picks one)",
    )
    parser.add_argument(
        "--max-blocks", type=int, default=Limits.max_blocks, help="most blocks in one request"
    )
    parser.add_argument(
        "--max-block-bytes", type=int, default=Limits.max_unit_bytes, help="largest block payload accepted"
    )
    parser.add_argument(
        "--verify-puts", action="store_true", help="check payload checksums on put too (readers always do)"
    )
    parser.add_argument(
        "--kv-events",
        default="",
        metavar="ENDPOINT",
        help="publish the tiers' KV events (blocks stored and removed, by tier) on this ZeroMQ endpoint, "
        "for a kv-aware router (port 0 picks one; the ready line names it and its replay socket)",
    )
    parser.add_argument(
        "--kv-events-replay",
        default="",
        metavar="ENDPOINT",
        help="the replay socket of --kv-events (default: a free port on the same host)",
    )
    parser.add_argument(
        "--metrics-address",
        default=metrics,
        metavar="HOST:PORT",
        help=f"serve Prometheus /metrics here (port 0 picks one; 'none': off; default {metrics or 'none'})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --bind without CURVE ($PDKV_CURVE_DIR): only on a network you trust",
    )
    parser.add_argument(
        "--health-interval-ms",
        type=int,
        default=2000,
        help="how often the tiers are probed for the health check (ping), off the serving loop",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, stop serving and write what the write-back queue still holds into the lower "
        "tiers for at most this long (a planned stop; keep it within the orchestrator's grace period)",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")


def metrics_address(args: argparse.Namespace) -> str:
    """``--metrics-address``, "" when it says none."""
    value = str(args.metrics_address or "")
    return "" if value.lower() in ("", "none", "off") else value
