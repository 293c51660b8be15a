"""Streams whose client stopped reading are cut after an idle limit.

A gRPC stream's handler hands each message to gRPC and waits until the transport took it; a client that
never reads fills its flow-control window and the wait lasts for ever, holding a router slot (and the
request on the nodes).  ``StreamWatch`` times those waits: one that passes ``idle_timeout_s`` cancels
the call, which aborts the request downstream (the pipeline's cancellation) and frees the slot.  Time the
router spends waiting on the nodes does not count: only waits for the client do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class StreamWatch:
    """One watcher thread for every stream of the router."""

    def __init__(self, idle_timeout_s: float) -> None:
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s!r}")
        self.idle_timeout_s = idle_timeout_s
        self.cut = 0  # streams cut so far
        self._lock = threading.Lock()
        self._streams: dict[int, Watched] = {}
        self._next_id = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-watch", daemon=True)
        self._thread.start()

    def watch(self, cancel: Callable[[], object]) -> Watched:
        with self._lock:
            self._next_id += 1
            watched = Watched(self, self._next_id, cancel)
            self._streams[watched.id] = watched
        return watched

    def record_cut(self) -> None:
        """Count a stream cut elsewhere (the HTTP API's own sends)."""
        with self._lock:
            self.cut += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _forget(self, watched: Watched) -> None:
        with self._lock:
            self._streams.pop(watched.id, None)

    def _run(self) -> None:
        interval = min(1.0, self.idle_timeout_s / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                stalled = [
                    w
                    for w in self._streams.values()
                    if w.since is not None and now - w.since > self.idle_timeout_s
                ]
                for w in stalled:
                    del self._streams[w.id]
                self.cut += len(stalled)
            for w in stalled:
                logger.warning(
                    "a client read nothing of its stream for %.0fs; cutting the call, aborting its request",
                    self.idle_timeout_s,
                )
                try:
                    w.cancel()
                except Exception:
                    logger.exception("cancelling a stalled stream failed")


class Watched:
    """One stream: ``sending()`` before handing a message to the transport, ``sent()`` after."""

    def __init__(self, owner: StreamWatch, id: int, cancel: Callable[[], object]) -> None:
        self.owner = owner
        self.id = id
        self.cancel = cancel
        self.since: float | None = None

    def sending(self) -> None:
        self.since = time.monotonic()

    def sent(self) -> None:
        self.since = None

    def close(self) -> None:
        self.owner._forget(self)
