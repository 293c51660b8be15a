"""Deadlines: every store and tier call carries one, as an absolute time on the monotonic clock."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Deadline:
    """The monotonic time by which a call must have returned."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left (0.0 once passed)."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def clamp(self, seconds: float, floor: float = 0.001) -> float:
        """``seconds`` capped by the time left, but at least ``floor`` (a socket timeout must be positive)."""
        return max(floor, min(seconds, self.remaining()))
