"""What every server process of ours does on a signal: stop on SIGTERM / SIGINT (nodes, router,
launcher).  Listen addresses and the open-bind refusal are ``wire.endpoints``."""

from __future__ import annotations

import signal
import threading
from typing import Any


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: a server process waits on it, then stops gracefully."""
    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop
