"""Fakes the router's unit tests share."""

from __future__ import annotations


class OpenScope:
    """A client call's scope as the pipeline reads it: no deadline, the client still there."""

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: object) -> bool:
        return True

    def is_active(self) -> bool:
        return True
