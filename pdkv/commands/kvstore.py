"""``pdkv kvstore``: run and probe the KV store server.

    pdkv kvstore serve --kv-store cpu:8GiB,disk:/var/cache/pdkv:256GiB --bind tcp://127.0.0.1:7600
    pdkv kvstore ping --connect tcp://127.0.0.1:7600

``serve`` prints ``pdkv kvstore: serving on ENDPOINT`` once it accepts requests and exits 0 on SIGTERM or
SIGINT.  ``ping`` is a health check: it exits 0 when the server answers within ``--timeout-ms`` and every
tier can serve (a Redis tier answers its PING, a disk tier's folder is writable and not full), 1 otherwise,
naming each failing tier.  With ``--liveness`` an answering server is enough (for orchestrators that
restart what fails a check: a store whose Redis is down still serves its other tiers).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    from kvstore.cli import add_serve_arguments

    parser = subparsers.add_parser("kvstore", help="run or probe the shared KV store server")
    sub = parser.add_subparsers(dest="kvstore_command", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="serve cpu/disk (and Redis-fronting) tiers to engines over ZeroMQ")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve, check=_check_serve)
    ping = sub.add_parser("ping", help="check that a store server answers")
    ping.add_argument("--connect", required=True, metavar="ENDPOINT", help="e.g. tcp://127.0.0.1:7600")
    ping.add_argument("--timeout-ms", type=int, default=1000)
    ping.add_argument("--stats", action="store_true", help="also print the server's counters as JSON")
    ping.add_argument(
        "--liveness",
        action="store_true",
        help="exit 0 when the server answers, even with a tier that cannot serve (default: exit 1 then)",
    )
    ping.set_defaults(func=_ping)


def _check_serve(args: argparse.Namespace) -> None:
    """The tiers and limits, as the server will read them, before it starts."""
    from kvstore.config import StoreConfig

    StoreConfig.load(args.kv_store)  # a string of tiers, or @file.toml (the store-wide options too)
    if args.health_interval_ms <= 0:
        raise ValueError(f"health_interval_ms must be positive, got {args.health_interval_ms}")


def _serve(args: argparse.Namespace) -> int:
    from kvstore.server import run_server

    return run_server(args)


def _ping(args: argparse.Namespace) -> int:
    from kvstore.config import RemoteTierConfig
    from kvstore.deadline import Deadline
    from kvstore.tiers.base import TierError, TierTimeout
    from kvstore.tiers.remote import RemoteTier

    tier = RemoteTier(RemoteTierConfig(args.connect, timeout_s=args.timeout_ms / 1000))
    try:
        pong = tier.ping(Deadline.after(args.timeout_ms / 1000))
        info: dict[str, Any] = pong
        if args.stats:
            info = {"ping": pong, "stats": tier.server_stats(Deadline.after(args.timeout_ms / 1000))}
    except (TierError, TierTimeout) as exc:
        print(f"pdkv kvstore ping: {args.connect}: {exc}")
        return 1
    finally:
        tier.close()
    print(json.dumps(info, indent=2, sort_keys=True, default=str))
    degraded = pong.get("degraded") or {}
    for name, why in sorted(degraded.items()):
        print(f"pdkv kvstore ping: {args.connect}: tier {name} cannot serve: {why}")
    return 0 if args.liveness or not degraded else 1
