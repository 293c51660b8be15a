"""``pdkv connectors list``: the KV connectors this installation knows, and where each comes from.

    $ pdkv connectors list
    NAME            TARGET                                          ORIGIN
    null            engine.connector.null:NullConnector                   built-in
    shared-dir      connectors.shared_dir:SharedDirConnector        built-in
    multi           connectors.multi:MultiConnector                 built-in
    example-memory  pdkv_example_connector.memory:MemoryConnector   pdkv-example-connector

Plugins come from the entry-point group ``pdkv.kv_connectors`` (see docs/connectors.md).  Nothing is
imported: a plugin whose optional dependency is missing is still listed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("connectors", help="list the KV connectors (built-ins and plugins)")
    sub = parser.add_subparsers(dest="connectors_command", required=True, metavar="ACTION")
    ls = sub.add_parser(
        "list",
        help="show each connector's name, target and origin",
        description="Built-in connectors and those registered by installed distributions in the "
        "entry-point group pdkv.kv_connectors.",
    )
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(func=_list)


def _list(args: argparse.Namespace) -> int:
    from connectors.registry import discover_entries

    entries = discover_entries()
    if args.json:
        print(
            json.dumps([{"name": e.name, "target": e.target, "origin": e.origin} for e in entries], indent=2)
        )
        return 0
    rows = [("NAME", "TARGET", "ORIGIN")] + [(e.name, e.target, e.origin) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, target, origin in rows:
        print(f"{name:<{widths[0]}}  {target:<{widths[1]}}  {origin}")
    return 0
