"""``pdkv secrets write DIR``: a secure cluster's credentials, for deployments other than ``pdkv up``.

Compose runs it once into the ``pdkv-secrets`` volume (its ``secrets`` service); every other service
mounts that volume read-only and finds its part through environment variables (serving/secrets.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("secrets", help="write a secure cluster's credentials")
    sub = parser.add_subparsers(dest="action", required=True)
    write = sub.add_parser(
        "write",
        help="a CA and certificates, CURVE keys, an API key and the cluster secret into DIR (0700/0600)",
    )
    write.add_argument("folder", metavar="DIR")
    write.add_argument(
        "--hosts",
        default="",
        help="comma-separated names and addresses the server certificate is for (localhost always)",
    )
    write.add_argument(
        "--clients",
        default="router,prefill,decode,colocated,kvstore",
        help="CURVE client identities, one per kind of process ($PDKV_CURVE_NAME picks one)",
    )
    write.add_argument(
        "--cache-details", action="store_true", help="the API key's tenant sees cached-token counts"
    )
    write.add_argument(
        "--keep",
        action="store_true",
        help="do nothing when DIR holds a whole set of credentials (part of one: refused)",
    )
    write.set_defaults(func=_write)


def _write(args: argparse.Namespace) -> int:
    from serving.secrets import Secrets, credentials_in

    folder = Path(args.folder)
    missing = credentials_in(folder) if folder.is_dir() else None
    if missing:  # a write cut short, or files removed: neither kept nor overwritten blindly
        print(
            f"pdkv secrets: {folder} holds part of a cluster's credentials (no {', '.join(missing)}): "
            "complete it, or empty it for a new set",
            file=sys.stderr,
        )
        return 1
    if missing is not None:
        if args.keep:
            print(f"pdkv secrets: {folder} already holds credentials; kept", file=sys.stderr)
            return 0
        print(f"pdkv secrets: {folder} already holds credentials (--keep leaves them)", file=sys.stderr)
        return 1
    split = [h.strip() for h in args.hosts.split(",") if h.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    Secrets.write(folder, clients, split, args.cache_details)
    print(f"pdkv secrets: wrote {folder} (API key in {folder / 'api-key'})", file=sys.stderr)
    return 0
