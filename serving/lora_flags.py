"""The LoRA flags of the nodes, the router and ``pdkv up`` (imports nothing heavy: the CLI builds them).

``--lora NAME=PATH`` (repeatable) serves a PEFT folder from the start; ``--allow-runtime-lora`` takes
``LoadAdapter`` / ``UnloadAdapter`` calls (off by default: loading reads the server's file system);
``--max-loras``, ``--max-cpu-loras`` and ``--max-lora-rank`` size the engine's slots (docs/lora.md).
"""

from __future__ import annotations

import argparse
from typing import Any


def parse_lora(value: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); argparse reports the ValueError's message."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora takes NAME=PATH (a PEFT adapter folder), got {value!r}")
    return name, path


def add_lora_arguments(parser: argparse.ArgumentParser | Any, *, engine: bool = True) -> None:
    """The LoRA flags; ``engine`` False adds only what a router takes (names and the switch)."""
    parser.add_argument(
        "--lora",
        action="append",
        type=parse_lora,
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT adapter in folder PATH as NAME (repeatable); clients select it by name "
        "(OpenAI: model)",
    )
    parser.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="take LoadAdapter/UnloadAdapter calls (HTTP: /v1/load_lora_adapter, /v1/unload_lora_adapter); "
        "off by default: a load reads a folder on the server",
    )
    if not engine:
        return
    parser.add_argument("--max-loras", type=int, default=4, help="adapters one step may mix (slots)")
    parser.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in memory (default max(max-loras, 8))"
    )
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")


def lora_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig options from the flags: LoRA is on with adapters or with runtime loading."""
    return {
        "loras": tuple(args.lora),
        "enable_lora": bool(args.lora) or args.allow_runtime_lora,
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_cpu_loras,
        "max_lora_rank": args.max_lora_rank,
    }
