"""``pdkv restart NAME``: replace one child of a running ``pdkv up`` gracefully (a rolling restart).

    pdkv restart decode-0        # drain decode-0 (its streams finish), start it again, wait until routed
    pdkv restart all             # every node, then the store, one at a time
    pdkv restart --list          # the children's names

The child drains on SIGTERM (``serving/drain.py``): a planned restart resumes no stream and redoes no
prefill.  The launcher is found by its control socket (``pdkv/launcher/control.py``); with several
``pdkv up`` running, say which with ``--control PATH`` (each prints its own).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "restart",
        help="replace a child of a running pdkv up gracefully (drain, restart, wait until routed again)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "name", nargs="?", metavar="NAME", help="a child (prefill-0, decode-1, kvstore, ...) or all"
    )
    parser.add_argument("--list", action="store_true", help="list the children a restart takes")
    parser.add_argument(
        "--control",
        default=None,
        metavar="PATH",
        help="the launcher's control socket (default: the only pdkv up of this user that runs)",
    )
    parser.set_defaults(func=_restart)


def _restart(args: argparse.Namespace) -> int:
    from pdkv.launcher.control import control_dir, running_launchers, send

    if not args.list and not args.name:
        raise ValueError("say which child to restart (a name, or all), or --list")
    if args.control:
        path = Path(args.control)
    else:
        found = running_launchers()
        if not found:
            print(
                f"pdkv restart: no running pdkv up found (no control socket in {control_dir()})",
                file=sys.stderr,
            )
            return 1
        if len(found) > 1:
            names = ", ".join(str(p) for p in found)
            print(f"pdkv restart: several pdkv up run; choose one with --control ({names})", file=sys.stderr)
            return 1
        path = found[0]
    request = "list" if args.list else f"restart {args.name}"
    try:
        ok = send(path, request, lambda line: print(line, flush=True))
    except OSError as exc:
        print(f"pdkv restart: cannot reach the launcher at {path}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1
