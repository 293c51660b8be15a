"""``pdkv health HOST:PORT``: exit 0 when a pdkv server reports SERVING (container health checks).

A router reports SERVING only when it has a healthy node of every kind it needs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("health", help="check a node's or router's gRPC health service")
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help="a service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    parser.add_argument("--wait", type=float, default=0.0, metavar="S", help="retry for up to S seconds")
    parser.add_argument(
        "--tls-dir",
        default="",
        metavar="DIR",
        help="the cluster's TLS folder (or $PDKV_TLS_DIR): check over TLS",
    )
    parser.set_defaults(func=_health)


def _health(args: argparse.Namespace) -> int:
    from serving.health import SERVING, check, wait_healthy
    from serving.tls import TLSFolder
    from wire.endpoints import parse_address

    parse_address(args.address)
    tls = TLSFolder.from_option(args.tls_dir)
    if args.wait > 0:
        try:
            wait_healthy(args.address, timeout=args.wait, service=args.service, tls=tls)
        except TimeoutError as exc:
            print(f"pdkv health: {exc}", file=sys.stderr)
            return 1
        print(SERVING)
        return 0
    status = check(args.address, service=args.service, timeout=args.timeout, tls=tls)
    print(status)
    return 0 if status == SERVING else 1
