"""``check_integrity()``'s failure: raised, not asserted, so ``python -O`` cannot switch the checks off.

``IntegrityError`` subclasses ``AssertionError``: the books not balancing is a bug, never bad input, and
callers that treat a failed check as a failed assertion keep working.
"""

from __future__ import annotations


class IntegrityError(AssertionError):
    """The books of the block pool, the cache manager or the scheduler do not balance."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
