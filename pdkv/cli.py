"""``pdkv``: one entry point, one subcommand module per capability.

Each module listed in ``_SUBCOMMANDS`` exposes ``register(subparsers)``, which adds its parser(s) and
sets ``func`` (``args -> int`` exit code) on them, and may set ``check`` (``args -> None``, raising
``ValueError``): the settings checked before ``func`` runs (a server's config built from its options),
so that a bad setting fails before anything starts.  Modules are imported only to build the parser, and
heavy imports (torch, grpc, zmq) happen inside the functions that need them.

Every command also takes its options from a config file and the environment (``pdkv/settings.py``):
``main`` applies them before it parses the command line, which overrides them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from engine.model.embedded import FetchError
from pdkv import settings

_SUBCOMMANDS = (
    "pdkv.commands.model",
    "pdkv.commands.kvstore",
    "pdkv.commands.connectors",
    "pdkv.commands.serve",
    "pdkv.commands.health",
    "pdkv.commands.up",
    "pdkv.commands.restart",
    "pdkv.commands.secrets",
    "pdkv.commands.planning",
)


def build_parser() -> argparse.ArgumentParser:
    from engine.cpu_features import auto_cpu_dtype_note
    from engine.engine_config import DETERMINISTIC_COST

    parser = argparse.ArgumentParser(
        prog="pdkv",
        description="Disaggregated LLM serving with a tiered KV cache.",
        epilog="Models: the embedded default is SmolLM2-135M-Instruct (fetched once by pdkv fetch-model); "
        f"--model takes a GGUF file or a Hugging Face folder.  dtype {auto_cpu_dtype_note()}.  "
        "--deterministic auto|on|off (serve-prefill, serve-decode, serve-colocated; pdkv up --node-args): a "
        "request's bfloat16 tokens and logprobs the same bits whatever runs beside it. "
        + DETERMINISTIC_COST  # argparse %-formats an epilog only where it names %(prog)
        + ".",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    settings.install(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        applied = settings.apply(parser, argv, os.environ)
    except settings.SettingsError as exc:
        print(f"pdkv: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    # the options a config file or $PDKV_* set (not this command line): a command may read them differently
    args.from_settings = frozenset(applied.sources) if applied is not None else frozenset()
    try:
        if applied is not None:
            applied.check(args)
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, FetchError) as exc:
        # A SettingsError names where its setting came from already: explaining it again would prefix
        # any file key whose name the message happens to contain ("[up] prefill" for "prefill nodes").
        if applied is not None and not isinstance(exc, settings.SettingsError):
            message = applied.explain(str(exc), args)
        else:
            message = str(exc)
        print(f"pdkv {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine's answer (an address in use, a disk full): one line, not a traceback
        logging.getLogger("pdkv").debug("pdkv %s failed", args.command, exc_info=True)
        message = exc.strerror if exc.strerror and exc.filename is None else str(exc)
        print(f"pdkv {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
