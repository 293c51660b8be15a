"""What ``pdkv up`` checks of its children's settings before it starts anything.

Each child reads the config file's own tables and inherits the environment (less ``pdkv up``'s own
variables), so a bad setting for the router would only show once the store and the nodes had started.
``check_up`` finds it first, two ways:

- a child's table may not set what ``pdkv up`` sets itself on the child's command line (where it
  listens, the model, the connector stack, ...): the launcher's flag would override it without a word.
  The error names the ``pdkv up`` option that sets it;
- every child's command is parsed and its config built (``check`` of ``serve-router``, ``serve-prefill``,
  ``kvstore serve``, ...) from the file and the environment, with placeholder addresses, as the child will:
  an error names the key and the file.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any, NoReturn

from pdkv import settings

# Options of a child that pdkv up puts on its command line -> the pdkv up option that says it (None:
# pdkv up picks it).  A [node] entry holds for [prefill], [decode] and [colocated] too.
_NODE = {
    "address": None,
    "node-id": None,
    "metrics-address": "metrics-ports",
    "kv-connector": "kv-connector",
    "model": "model",
    "kv-events": "policy",
    "mtls": "secure",
    "tls-dir": "secure",
    "served-model-name": "served-model-name",
    "max-model-len": "max-model-len",
    "drain-timeout-s": "drain-timeout-s",
    "grace-s": "grace-s",
}
SET_BY_UP: dict[str, dict[str, str | None]] = {
    "router": {
        "address": "router-address",
        "mode": "mode",
        "prefill": "prefill",
        "decode": "decode",
        "model": "model",
        "metrics-address": "metrics-ports",
        "http-address": "http-port",
        "policy": "policy",
        "kv-store-events": "policy",
        "cache-details": "cache-details",
        "api-keys-file": "api-keys-file",
        "tls-dir": "secure",
        "served-model-name": "served-model-name",
        "max-model-len": "max-model-len",
        "drain-timeout-s": "drain-timeout-s",
        "grace-s": "grace-s",
    },
    "node": _NODE,
    "prefill": _NODE,
    "decode": _NODE,
    "colocated": _NODE,
    "kvstore": {
        "kv-store": "kv-store",
        "bind": None,
        "metrics-address": "metrics-ports",
        "kv-events": "policy",
        "kv-events-replay": "policy",
        "drain-timeout-s": "drain-timeout-s",
    },
}
# Where a child's command needs an address before it can be built; pdkv up gives the real ones.
_PLACEHOLDER = "127.0.0.1:1"


def check_up(args: argparse.Namespace) -> None:
    """Refuse what would fail in a child, before anything starts (``cli.main`` runs it before ``_up``)."""
    path = Path(args.config).expanduser().resolve() if args.config else None
    if path is not None:
        _refuse_what_up_sets(path)
    env = {k: v for k, v in os.environ.items() if k not in args.unset_env}
    for what, argv in _children(args):
        _check_child(what, [*argv, *(("--config", str(path)) if path else ())], env)


def _refuse_what_up_sets(path: Path) -> None:
    data = settings.read_file(path)
    for section, table in data.items():
        for key in table or {}:
            if settings.option_key(str(key)) not in SET_BY_UP.get(section, {}):
                continue
            by = SET_BY_UP[section][settings.option_key(str(key))]
            how = f"from its --{by}: set {by} in [up]" if by else "it picks it"
            raise settings.SettingsError(
                f"config file {path}: [{section}] {key}: pdkv up sets this itself ({how})"
            )


def _children(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Each kind of child's command as pdkv up will start it, less what it only knows then."""
    disaggregated = args.mode == "disaggregated"
    roles = ("prefill", "decode") if disaggregated else ("colocated",)
    router = ["serve-router", "--mode", args.mode, "--decode", _PLACEHOLDER]
    router += ["--prefill", _PLACEHOLDER] if disaggregated else []
    model = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    model += ["--max-model-len", str(args.max_model_len)] if args.max_model_len is not None else []
    try:
        node_args = shlex.split(args.node_args)
    except ValueError as exc:  # an unbalanced quote
        raise settings.SettingsError(f"--node-args {args.node_args!r}: {exc}") from None
    out = [(f"{role} nodes", [f"serve-{role}", *model, *node_args]) for role in roles]
    out.append(("router", [*router, *model]))
    if args.kv_store.lower() != "none":
        tiers = args.kv_store.replace("{run_dir}", "/tmp/pdkv-up")  # the run folder pdkv up makes
        out.insert(0, ("store server", ["kvstore", "serve", "--kv-store", tiers]))
    return out


def _check_child(what: str, argv: list[str], env: dict[str, str]) -> None:
    from pdkv.cli import build_parser

    parser = build_parser()
    applied = settings.apply(parser, argv, env)
    assert applied is not None, argv
    _raise_instead_of_exit(parser, what)  # a bad --node-args: an error of pdkv up's, before anything starts
    child: Any = parser.parse_args(argv)
    try:
        child.check(child)
    except ValueError as exc:
        raise settings.SettingsError(f"pdkv up's {what}: {applied.explain(str(exc), child)}") from None


def _raise_instead_of_exit(parser: argparse.ArgumentParser, what: str) -> None:
    """argparse exits on a bad option (printing the child's usage as pdkv up's): raise, naming the child."""

    def error(message: str) -> NoReturn:
        raise settings.SettingsError(f"pdkv up's {what}: {message}")

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _raise_instead_of_exit(sub, what)
