"""The store server's view of its tiers' health, kept fresh by a thread of its own.

A health check (``pdkv kvstore ping``) must answer at once: the server has one loop thread, and an engine's
lookup waiting behind a probe of a hung Redis would time out.  So the tiers are probed here, every
``interval_s``, off the loop, and a ping reads the last result.  A tier cannot serve while a breaker of
its is open (real calls failed) or while its probe fails (``Tier.health``); the probes never touch the
breakers, which belong to the data path.
"""

from __future__ import annotations

import logging
import threading

from kvstore.store import TieredStore

logger = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, store: TieredStore, *, interval_s: float = 2.0, timeout_s: float = 1.0) -> None:
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"health interval and timeout must be positive, got {interval_s}, {timeout_s}")
        self.store = store
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._degraded: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HealthMonitor:
        """Check once now (so the first ping already knows), then every ``interval_s`` in the background."""
        self.check()
        self._thread = threading.Thread(target=self._run, name="kvstore-health", daemon=True)
        self._thread.start()
        return self

    def check(self) -> dict[str, str]:
        """Probe every tier now; returns (and keeps) the ones that cannot serve, with why."""
        degraded = self.store.health(self.timeout_s)
        with self._lock:
            for name in degraded.keys() - self._degraded.keys():
                logger.warning("kvstore tier %s cannot serve: %s", name, degraded[name])
            for name in self._degraded.keys() - degraded.keys():
                logger.warning("kvstore tier %s serves again", name)
            self._degraded = degraded
        return dict(degraded)

    def degraded(self) -> dict[str, str]:
        """The tiers that could not serve at the last check, by name, with why (empty: all could)."""
        with self._lock:
            return dict(self._degraded)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + self.timeout_s * len(self.store.tiers) + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a bug here must not end the checks: the last result stays
                logger.exception("kvstore health check failed")
