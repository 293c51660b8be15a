"""A circuit breaker: stop calling a backend that fails, and try it again later.

    closed ──failure × failures_to_open──▶ open ──cooldown elapsed──▶ half-open (one probe call)
       ▲                                     ▲                              │
       └──────────── probe succeeds ─────────┼──────── probe fails ─────────┘
                                             (cooldown doubles, up to max_cooldown_s)

``allow()`` says whether a call may go to the backend now; the caller reports the outcome with
``record_success()`` / ``record_failure()``.  While half-open exactly one probe is in flight; the others are
refused.  Thread-safe.  The clock is injectable so tests step time instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    """How eagerly a failing backend is cut off and how soon it is retried."""

    failures_to_open: int = 1
    cooldown_s: float = 1.0
    max_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.failures_to_open, int) or self.failures_to_open < 1:
            raise ValueError(f"breaker failures_to_open must be an int >= 1, got {self.failures_to_open!r}")
        if not self.cooldown_s > 0:
            raise ValueError(f"breaker cooldown_s must be positive, got {self.cooldown_s!r}")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError(
                f"breaker max_cooldown_s ({self.max_cooldown_s}) must be >= cooldown_s ({self.cooldown_s})"
            )


class CircuitBreaker:
    def __init__(
        self, config: BreakerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._cooldown = self.config.cooldown_s
        self._retry_at = 0.0
        self._probe_in_flight = False
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self._clock() >= self._retry_at:
                return BreakerState.HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """May a call go to the backend now?  In half-open state, only one probe at a time."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN:
                if self._clock() < self._retry_at:
                    return False
                self._state = BreakerState.HALF_OPEN
                self._probe_in_flight = False
            if self._probe_in_flight:
                return False
            self._probe_in_flight = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._cooldown = self.config.cooldown_s
            self._probe_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                # The probe failed: back off longer before the next one.
                self._cooldown = min(self._cooldown * 2, self.config.max_cooldown_s)
                self._open()
                return
            if self._state is BreakerState.OPEN:
                return  # a late failure of a call let through before the breaker opened
            self._failures += 1
            if self._failures >= self.config.failures_to_open:
                self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._retry_at = self._clock() + self._cooldown
        self._probe_in_flight = False
        self._failures = 0
        self.times_opened += 1
