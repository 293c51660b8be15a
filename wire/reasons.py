"""Why a block was not served: the one vocabulary every tier, the codec and the protocol speak.

Its own module so the codec (which decides most of them) and the result types (which carry them) both
import it without importing each other.
"""

from __future__ import annotations

from enum import Enum


class MissReason(str, Enum):
    """Why a block was not served.  The values are the counter names in ``stats()``."""

    ABSENT = "absent"  # never stored, or gone without a trace (TTL, another process evicted it)
    EVICTED = "evicted"  # this tier held it and evicted it for space
    CORRUPT = "corrupt"  # bad magic, header or payload checksum mismatch
    TRUNCATED = "truncated"  # fewer bytes than the header promises
    WRONG_NAMESPACE = "wrong_namespace"  # a header for another model / hash namespace
    WRONG_LAYOUT = "wrong_layout"  # the same model with another layout (dtype, heads, block size...)
    WRONG_HASH = "wrong_hash"  # the header names another block
    TIMEOUT = "timeout"  # the backend did not answer before the deadline
    ERROR = "error"  # the backend failed (connection refused, I/O error, protocol error)
    UNAVAILABLE = "unavailable"  # skipped: circuit breaker open, or an abandoned call still running


# Reasons that say the backend is unhealthy (they trip the circuit breaker), as opposed to a plain miss.
FAILURE_REASONS = frozenset({MissReason.TIMEOUT, MissReason.ERROR})


__all__ = ["FAILURE_REASONS", "MissReason"]
