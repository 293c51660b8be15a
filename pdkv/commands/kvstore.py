"""``pdkv kvstore``: run and probe the KV store server.

    pdkv kvstore serve --kv-store cpu:8GiB,disk:/var/cache/pdkv:256GiB --bind tcp://127.0.0.1:7600
    pdkv kvstore ping --connect tcp://127.0.0.1:7600

``serve`` prints ``pdkv kvstore: serving on ENDPOINT`` once it accepts requests and exits 0 on SIGTERM or
SIGINT.  ``ping`` exits 0 when the server answers within ``--timeout-ms`` (a health check for scripts).
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
    serve.set_defaults(func=_serve)
    ping = sub.add_parser("ping", help="check that a store server answers")
    ping.add_argument("--connect", required=True, metavar="ENDPOINT", help="e.g. tcp://127.0.0.1:7600")
    ping.add_argument("--timeout-ms", type=int, default=1000)
    ping.add_argument("--stats", action="store_true", help="also print the server's counters as JSON")
    ping.set_defaults(func=_ping)


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
        info = tier.ping(Deadline.after(args.timeout_ms / 1000))
        if args.stats:
            info = {"ping": info, "stats": tier.server_stats(Deadline.after(args.timeout_ms / 1000))}
    except (TierError, TierTimeout) as exc:
        print(f"pdkv kvstore ping: {args.connect}: {exc}")
        return 1
    finally:
        tier.close()
    print(json.dumps(info, indent=2, sort_keys=True, default=str))
    return 0
