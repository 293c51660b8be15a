"""What store and tier calls hand back: miss reasons, results, and the in-memory form of a stored block.

Store calls never raise for a backend failure: a lookup answers a count, a read answers how many leading
blocks it loaded and, when it stopped early, a ``MissReason``.  Every reason is also counted in the tier's
metrics, so an operator can tell an empty cache from a sick one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wire.reasons import MissReason

if TYPE_CHECKING:
    from wire.codec import BlockHeader


@dataclass(frozen=True, slots=True)
class GetResult:
    """``loaded`` leading blocks were written into the caller's buffers and verified.

    ``reason`` says why block ``loaded`` was not (``None`` when every block was loaded).  ``checksums``
    holds the payload checksum of each loaded block where the tier knew it (``None`` where it did not), so
    a caller can re-seal the blocks without hashing them again.
    """

    loaded: int
    reason: MissReason | None = None
    checksums: tuple[int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class PutResult:
    """``stored`` blocks are now visible in the tier; ``reason`` says why the others were not stored."""

    stored: int
    reason: MissReason | None = None


@dataclass(slots=True, eq=False)
class Unit:
    """One encoded block in memory: a 96-byte header and a view of the payload bytes.

    A unit made from an engine block starts unsealed (``header is None``): the first tier that holds a
    stable copy of the payload computes the checksum over its copy (hot in cache) and seals the unit, so the
    checksum is computed once per block and the lower tiers reuse the header.

    A unit read from a tier may hold a lease on the tier's memory (``release`` set): the holder must call
    ``release()`` exactly once when it no longer reads ``payload``.

    ``keep`` marks a payload that nobody will ever write again (a received ZeroMQ frame): a memory tier
    may keep the buffer itself instead of copying it.  ``parsed`` is ``header`` already parsed and checked
    against the key the unit is put under, so a memory tier need not parse it again.
    """

    payload: memoryview
    header: bytes | None = None
    sealer: Callable[[memoryview], bytes] | None = field(default=None, repr=False)
    release_fn: Callable[[], None] | None = field(default=None, repr=False)
    keep: bool = False
    parsed: BlockHeader | None = field(default=None, repr=False)

    def seal(self, stable_copy: memoryview | None = None) -> bytes:
        """The header, computing it over ``stable_copy`` (or the payload itself) the first time."""
        if self.header is None:
            assert self.sealer is not None, "an unsealed unit carries its sealer"
            self.header = self.sealer(self.payload if stable_copy is None else stable_copy)
        return self.header

    def release(self) -> None:
        fn, self.release_fn = self.release_fn, None
        if fn is not None:
            fn()


def release_all(units: Iterable[Unit]) -> None:
    for unit in units:
        unit.release()


@dataclass(slots=True)
class ReadResult:
    """Leading units of a run, as the tier holds them (the caller releases them); see ``Unit``."""

    units: list[Unit]
    reason: MissReason | None = None


class UnitBatch:
    """Shared ownership of leased units: they are released when the last holder lets go.

    A write-down job holds the batch while it writes the units to several tiers; a tier call that may
    outlive its deadline holds it too, so a tier still reading a payload never sees it recycled.
    """

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self._lock = threading.Lock()
        self._holders = 1

    def acquire(self) -> None:
        with self._lock:
            assert self._holders > 0, "acquire after the last release"
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            release_all(self.units)
