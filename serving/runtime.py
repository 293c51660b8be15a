"""What every server process of ours does: read its listen addresses, refuse an open bind without
security, and stop on SIGTERM / SIGINT (nodes, router, store server, launcher)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from kvstore.curve import is_loopback


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); port 0 means "pick a free one"."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} {text!r} must look like HOST:PORT, e.g. 127.0.0.1:50061")
    return host.strip("[]"), int(port)


def refuse_open_wide_bind(address: str, what: str, secured: bool, insecure: bool, how: str) -> None:
    """A listener on a non-loopback ``address`` (HOST:PORT, or a ZeroMQ tcp:// endpoint) with its
    security off is refused unless ``insecure``.  ipc:// endpoints are files: never "wide"."""
    if address.startswith("ipc://"):
        return
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if secured or insecure or is_loopback(host):
        return
    raise ValueError(
        f"refusing to serve {what} on {address} without {how}: anyone who reaches that address could use "
        "it. Turn security on (pdkv up --secure writes what it needs), bind a loopback address, or pass "
        "--insecure on a network you trust"
    )


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: a server process waits on it, then stops gracefully."""
    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop
