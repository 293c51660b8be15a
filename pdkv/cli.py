"""``pdkv``: one entry point, one subcommand module per capability.

Each module listed in ``_SUBCOMMANDS`` exposes ``register(subparsers)``, which adds its parser(s) and
sets ``func`` (``args -> int`` exit code) on them.  Modules are imported only to build the parser, and
heavy imports (torch, grpc, zmq) happen inside the ``func`` that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from engine.model.embedded import FetchError

_SUBCOMMANDS = (
    "pdkv.commands.model",
    "pdkv.commands.kvstore",
    "pdkv.commands.connectors",
    "pdkv.commands.serve",
    "pdkv.commands.health",
    "pdkv.commands.up",
    "pdkv.commands.secrets",
)


def build_parser() -> argparse.ArgumentParser:
    from engine.cpu_features import auto_cpu_dtype_note

    parser = argparse.ArgumentParser(
        prog="pdkv",
        description="Disaggregated LLM serving with a tiered KV cache.",
        epilog="Models: the embedded default is SmolLM2-135M-Instruct (fetched once by pdkv fetch-model); "
        f"--model takes a GGUF file or a Hugging Face folder.  dtype {auto_cpu_dtype_note()}.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, FetchError) as exc:
        print(f"pdkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
