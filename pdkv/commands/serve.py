"""``pdkv serve-prefill | serve-decode | serve-colocated | serve-router``: one process of the topology.

    pdkv serve-prefill --address 127.0.0.1:50061 --kv-connector p2p
    pdkv serve-decode  --address 127.0.0.1:50071 --kv-connector p2p
    pdkv serve-router  --address 127.0.0.1:50051 --prefill 127.0.0.1:50061 --decode 127.0.0.1:50071

Each prints one ready line (``pdkv node: serving on HOST:PORT ...`` / ``pdkv router: serving on ...``)
once it accepts calls, and exits 0 on SIGTERM or SIGINT after a grace period for in-flight calls.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

_NODE_HELP = {
    "prefill": "run a prefill node: computes prompts and holds their KV for decode nodes",
    "decode": "run a decode node: pulls prefilled KV and streams output tokens",
    "colocated": "run a node that serves both phases (colocated mode)",
}


def register(subparsers: Any) -> None:
    from node.config import add_node_arguments
    from router.config import add_router_arguments

    for role, help_text in _NODE_HELP.items():
        parser = subparsers.add_parser(f"serve-{role}", help=help_text, description=help_text)
        add_node_arguments(parser, role)
        parser.set_defaults(func=_serve_node, check=_check_node, role=role)
    router = subparsers.add_parser(
        "serve-router",
        help="run the router: the client-facing pdkv.v1.Generation service",
        description="Tokenize, pick a prefill and a decode node, run prefill then decode, relay the stream.",
    )
    add_router_arguments(router)
    router.set_defaults(func=_serve_router, check=_check_router)


def _logging(level: str) -> None:
    from telemetry.logs import throttle_noisy_logs

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    throttle_noisy_logs()  # bad input: one line a minute per kind, not a traceback per request


def _check_node(args: argparse.Namespace) -> None:
    """The node's config, built as ``_serve_node`` will: a bad setting fails before the model loads."""
    from node.config import node_config_from_args

    node_config_from_args(args, args.role)


def _check_router(args: argparse.Namespace) -> None:
    from router.config import router_config_from_args

    router_config_from_args(args)


def _serve_node(args: argparse.Namespace) -> int:
    from node.config import node_config_from_args
    from node.process import run_node

    _logging(args.log_level)
    return run_node(node_config_from_args(args, args.role))


def _serve_router(args: argparse.Namespace) -> int:
    from router.config import router_config_from_args
    from router.server import run_router

    _logging(args.log_level)
    return run_router(router_config_from_args(args))
