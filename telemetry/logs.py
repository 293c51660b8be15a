"""Logging that a flood of bad input cannot turn into a flood of log lines.

gRPC logs every request it cannot deserialize with a full traceback (serving/errors.py's
``UndecodableRequests`` answers them now, and logs each); the ZeroMQ servers log every request that
fails.  ``throttle_noisy_logs`` lets the first such record through each interval, without its traceback,
and says how many like it were dropped since.  (Neither gRPC's record nor ZeroMQ's says who sent the
bytes, so the key is the logger and the message, not the peer.)
"""

from __future__ import annotations

import logging
import threading
import time

NOISY_LOGGERS = (
    "grpc._common",
    "grpc._server",
    "serving.errors",
    "kvstore.server",
    "connectors.p2p_server",
    "engine.snapshot",  # a plugin's get_stats that raises, read at every Stats call and scrape
)


class Throttle(logging.Filter):
    """Of the records that carry a traceback (``logger.exception``: a request that could not be read or
    served), pass one per (logger, message) each ``interval_s``, without the traceback; other records
    pass untouched."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last, dropped = self._seen.get(key, (float("-inf"), 0))
            if now - last < self.interval_s:
                self._seen[key] = (last, dropped + 1)
                return False
            self._seen[key] = (now, 0)
        error = record.exc_info[1]
        message = record.getMessage()  # the args are folded in now: what is appended holds no %-codes
        if error is not None:
            message = f"{message} ({type(error).__name__}: {error})"
        record.msg, record.args = message, ()
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        if dropped:
            record.msg = (
                f"{record.msg} [{dropped} more like it in the last {self.interval_s:.0f}s not logged]"
            )
        return True


def throttle_noisy_logs(interval_s: float = 60.0) -> Throttle:
    """Install one ``Throttle`` on the loggers bad input makes noisy."""
    throttle = Throttle(interval_s)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(throttle)
    return throttle
