"""The tier contract: one storage medium for encoded blocks, keyed by ``KeyRun`` (namespace + hash).

Public methods (what the tiered store, the store server and tests call) never raise for a backend failure
and always return by their deadline:

    contains_prefix(run, deadline) -> int
        How many leading blocks of ``run`` the tier holds, in one round trip for a remote backend.
        No side effects (not even an LRU touch): a lookup may be repeated at will.
    get_into(run, buffers, layout, deadline) -> GetResult
        Loads leading blocks' payloads into ``buffers`` (flat writable byte views, one per block, each
        exactly ``layout.payload_nbytes``), verifying each header (namespace, hash, layout) and, where the
        medium is untrusted, the payload checksum.  Stops at the first block it cannot serve and says why.
        Touches the blocks it served (LRU).
    read(run, deadline, layout) -> ReadResult
        The leading units as held, each header checked against the run (namespace, hash) and, when
        given, ``layout`` (the store server passes the layout its client asked for).  Units may hold
        leases: the caller releases them.
    put(run, units, deadline, keepalive) -> PutResult
        Stores units; a block becomes visible to lookups only once its bytes are complete.  A block already
        held is refreshed, not rewritten.  ``keepalive`` is held while the tier may still read payloads.
    delete(run, deadline) -> int
    stats() -> TierStats

A block that fails its check -- damaged, truncated, or a header for another namespace, block or layout --
is *dropped* from the tier (``dropped_blocks``), with the run's blocks after it: left in place it would
hold its key, so the right block could never be stored there and every later request for that prefix
would miss; the blocks after it are put again with it.

Failures become counted misses (``MissReason.TIMEOUT``/``ERROR``) and feed two circuit breakers, one for
reads (lookup, get, read) and one for writes (put, delete): a full disk does not stop reads.  While a
breaker is open the tier is skipped (``UNAVAILABLE``) and retried after its cooldown.

Subclasses implement ``_contains_prefix``, ``_get_into``, ``_read``, ``_put``, ``_delete`` (which may
raise: ``TierTimeout`` or ``TimeoutError`` count as timeouts, anything else as an error) and
``_backend_stats``.  Unless ``inline`` is set (memory tiers, which cannot hang) or the operation is in
``inline_ops``, calls run on per-operation lanes (``kvstore.lane``) so a hung backend cannot hold the
caller past its deadline; ``get_into`` writes caller buffers only through its ``BufferFence``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstore.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvstore.buffers import BufferFence
from kvstore.deadline import Deadline
from kvstore.lane import Lane
from kvstore.metrics import TierMetrics, TierStats
from kvstore.results import (
    GetResult,
    MissReason,
    PutResult,
    ReadResult,
    Unit,
    UnitBatch,
    release_all,
)
from wire.codec import check_header
from wire.keys import KeyRun
from wire.layout import BlockLayout
from wire.reasons import FAILURE_REASONS

logger = logging.getLogger(__name__)

# A block that is not what its key says: it is dropped from the tier where it was found.
BAD_BLOCK_REASONS = frozenset(
    {
        MissReason.CORRUPT,
        MissReason.TRUNCATED,
        MissReason.WRONG_NAMESPACE,
        MissReason.WRONG_LAYOUT,
        MissReason.WRONG_HASH,
    }
)


class TierTimeout(Exception):
    """A backend call ran out of time (raised by tier implementations, counted as a timeout)."""


class TierError(Exception):
    """A backend failed in a way the tier recognised (counted as an error)."""


@dataclass(frozen=True)
class TierPolicy:
    """Default deadlines of one tier's calls (used when the caller passes none) and its breaker policy."""

    lookup_timeout_s: float = 0.05
    get_timeout_s: float = 2.0
    put_timeout_s: float = 2.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        for name in ("lookup_timeout_s", "get_timeout_s", "put_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


class Ghosts:
    """Keys evicted recently (bounded), so a later miss on one reads ``EVICTED`` rather than ``ABSENT``."""

    def __init__(self, capacity: int = 65536) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._capacity = capacity

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def reason(self, key: bytes) -> MissReason:
        return MissReason.EVICTED if key in self._keys else MissReason.ABSENT


class Tier(ABC):
    kind: ClassVar[str] = "tier"
    # Memory tiers run in the caller's thread: they cannot hang and a lane hop would cost more than the call.
    inline: ClassVar[bool] = False
    # Operations that run in the caller's thread even so (they touch only memory, e.g. an index lookup).
    inline_ops: ClassVar[frozenset[str]] = frozenset()
    # Whether get_into verifies payload checksums (media outside this process are not trusted).
    verify_payload: bool = True

    def __init__(
        self, name: str, *, policy: TierPolicy | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        self.name = name
        self.policy = policy or TierPolicy()
        self.metrics = TierMetrics()
        # Told which keys (namespace + hash) this tier gained or lost: "stored" / "removed" (the tiered
        # store turns them into KV events).  Called with tier locks held: it must only record.
        self.on_change: Callable[[str, str, Sequence[bytes]], None] | None = None
        self.read_breaker = CircuitBreaker(self.policy.breaker, clock=clock or time.monotonic)
        self.write_breaker = CircuitBreaker(self.policy.breaker, clock=clock or time.monotonic)
        # get (the engine waiting) and read (write-down sources, the store server) have separate lanes, so
        # background copies never queue ahead of an engine load.
        self._lanes = {op: Lane(f"kvstore-{name}-{op}") for op in ("lookup", "get", "read", "write")}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- public API: never raises for backend failures, returns by the deadline -----------------------

    def contains_prefix(self, run: KeyRun, deadline: Deadline | None = None) -> int:
        if not len(run):
            return 0
        deadline = deadline or Deadline.after(self.policy.lookup_timeout_s)
        hits, reason = self._call(
            "lookup", "lookup", self.read_breaker, lambda: self._contains_prefix(run, deadline), deadline
        )
        hits = hits or 0
        self.metrics.count(lookups=1, lookup_blocks=len(run), lookup_hits=hits)
        if reason is not None:
            self.metrics.miss(reason)
        return hits

    def get_into(
        self,
        run: KeyRun,
        buffers: Sequence[memoryview],
        layout: BlockLayout,
        deadline: Deadline | None = None,
    ) -> GetResult:
        if len(buffers) != len(run):
            raise ValueError(f"get_into: {len(run)} blocks but {len(buffers)} buffers")
        if not len(run):
            return GetResult(0)
        deadline = deadline or Deadline.after(self.policy.get_timeout_s)
        fence = BufferFence(buffers)
        result, reason = self._call(
            "get",
            "get",
            self.read_breaker,
            lambda: self._get_into(run, fence, layout, deadline),
            deadline,
            on_abandon=fence.close,
        )
        if result is None:
            result = GetResult(0, reason)
        elif result.reason in FAILURE_REASONS:
            self.read_breaker.record_failure()
        elif result.reason in BAD_BLOCK_REASONS and result.loaded < len(run):
            self._drop(run, result.loaded, result.reason)
        self.metrics.count(
            gets=1,
            get_blocks=len(run),
            hit_blocks=result.loaded,
            bytes_in=result.loaded * layout.payload_nbytes,
        )
        if result.reason is not None:
            self.metrics.miss(result.reason)
        return result

    def read(
        self, run: KeyRun, deadline: Deadline | None = None, layout: BlockLayout | None = None
    ) -> ReadResult:
        if not len(run):
            return ReadResult([])
        deadline = deadline or Deadline.after(self.policy.get_timeout_s)
        result, reason = self._call(
            "read",
            "read",
            self.read_breaker,
            lambda: self._read(run, deadline, layout),
            deadline,
            on_late=lambda late: release_all(late.units),
        )
        if result is None:
            result = ReadResult([], reason)
        checked = self._check_units(run, result, layout)
        if checked is result and result.reason in BAD_BLOCK_REASONS and len(result.units) < len(run):
            self._drop(run, len(result.units), result.reason)  # the tier itself found the block bad
        result = checked
        nbytes = sum(u.payload.nbytes for u in result.units)
        self.metrics.count(reads=1, read_blocks=len(result.units), bytes_in=nbytes)
        if result.reason is not None:
            self.metrics.miss(result.reason)
        return result

    def _check_units(self, run: KeyRun, result: ReadResult, layout: BlockLayout | None) -> ReadResult:
        """Cut ``result`` at its first unit that is not the block it is keyed as (in ``layout``, when
        given), and drop that block from the tier.  Unsealed units (written by this process from an
        engine's own buffers) carry no header yet: only their size is checked."""
        for i, unit in enumerate(result.units):
            reason: MissReason | None = None
            if unit.header is not None:
                header = check_header(unit.header, run.namespace, run.hashes[i], layout)
                if isinstance(header, MissReason):
                    reason = header
                elif unit.payload.nbytes != header.payload_len:
                    reason = (
                        MissReason.TRUNCATED
                        if unit.payload.nbytes < header.payload_len
                        else MissReason.CORRUPT
                    )
            elif layout is not None and unit.payload.nbytes != layout.payload_nbytes:
                reason = MissReason.WRONG_LAYOUT
            if reason is not None:
                release_all(result.units[i:])
                self._drop(run, i, reason)
                return ReadResult(result.units[:i], reason)
        return result

    def _drop(self, run: KeyRun, i: int, reason: MissReason) -> None:
        """Block ``i`` of ``run`` is not what its key says: remove it from this tier (never served again),
        with the run's blocks after it -- unreachable until it is stored again, and stored again with
        them (the reader recomputes from ``i`` and puts the rest), where a put keeps a block already held:
        kept, each bad one among them cost a request of its own (an outside probe's poisoned run of 6
        blocks took 6 requests to heal, one block each)."""
        logger.warning(
            "kvstore tier %s: dropping block %s (%s) and the %d after it in the run",
            self.name,
            run.hashes[i].hex()[:16],
            reason.value,
            len(run) - i - 1,
        )
        self.metrics.count(dropped_blocks=len(run) - i)
        self.delete(run.slice(i, len(run)))

    def put(
        self,
        run: KeyRun,
        units: Sequence[Unit],
        deadline: Deadline | None = None,
        keepalive: UnitBatch | None = None,
    ) -> PutResult:
        if len(units) != len(run):
            raise ValueError(f"put: {len(run)} blocks but {len(units)} units")
        if not len(run):
            return PutResult(0)
        deadline = deadline or Deadline.after(self.policy.put_timeout_s)
        result, reason = self._call(
            "put",
            "write",
            self.write_breaker,
            lambda: self._put(run, units, deadline),
            deadline,
            keepalive=keepalive,
        )
        if result is None:
            result = PutResult(0, reason)
        elif result.reason in FAILURE_REASONS:
            self.write_breaker.record_failure()
        stored_bytes = sum(u.payload.nbytes for u in units[: result.stored])
        self.metrics.count(puts=1, put_blocks=len(run), stored_blocks=result.stored, bytes_out=stored_bytes)
        if result.reason is not None:
            self.metrics.put_failure(result.reason, len(run) - result.stored)
        if result.stored:
            self._changed("stored", [run.key(i) for i in range(result.stored)])
        return result

    def delete(self, run: KeyRun, deadline: Deadline | None = None) -> int:
        if not len(run):
            return 0
        deadline = deadline or Deadline.after(self.policy.put_timeout_s)
        deleted, reason = self._call(
            "delete", "write", self.write_breaker, lambda: self._delete(run, deadline), deadline
        )
        self.metrics.count(deletes=1, deleted_blocks=deleted or 0)
        if reason is not None:
            self.metrics.put_failure(reason, len(run))
        if deleted:
            self._changed("removed", [run.key(i) for i in range(len(run))])
        return deleted or 0

    def health(self, deadline: Deadline | None = None) -> str | None:
        """None when the tier can serve now; otherwise why not (never raises).  It cannot while a breaker
        of its is open (calls of the data path failed) or while a cheap probe of its backend fails
        (``_probe``).  The probe runs in the caller's thread and leaves the breakers alone: they are the
        data path's, and a probe's failure (a full disk, say) need not stop reads."""
        for what, breaker in (("reads", self.read_breaker), ("writes", self.write_breaker)):
            if breaker.state is BreakerState.OPEN:
                last = self.metrics.last_error or "none kept"
                return f"{what} are cut off after failures (last error: {last})"
        try:
            self._probe(deadline or Deadline.after(self.policy.lookup_timeout_s))
        except Exception as exc:
            return f"probe failed: {type(exc).__name__}: {exc}"
        return None

    def _changed(self, kind: str, keys: Sequence[bytes]) -> None:
        hook = self.on_change
        if hook is not None and keys:
            hook(self.name, kind, keys)

    def stats(self) -> TierStats:
        return self.metrics.snapshot(
            self.name,
            self.kind,
            {"read": self.read_breaker.state.value, "write": self.write_breaker.state.value},
            self._backend_stats(),
        )

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._close()

    # ---- the guard ----------------------------------------------------------------------------------------

    def _call(
        self,
        op: str,
        lane_name: str,
        breaker: CircuitBreaker,
        fn: Callable[[], Any],
        deadline: Deadline,
        *,
        on_abandon: Callable[[], None] | None = None,
        on_late: Callable[[Any], None] | None = None,
        keepalive: UnitBatch | None = None,
    ) -> tuple[Any, MissReason | None]:
        """Run ``fn`` under the breaker and the deadline: ``(value, None)`` or ``(None, reason)``."""
        lane = self._lanes[lane_name]
        inline = self.inline or op in self.inline_ops
        if not inline and lane.stuck():
            return None, MissReason.UNAVAILABLE
        if not breaker.allow():
            return None, MissReason.UNAVAILABLE
        start = time.monotonic()
        try:
            if inline:
                value = fn()
            else:
                task = fn
                if keepalive is not None:
                    keepalive.acquire()
                    task = _releasing(fn, keepalive)
                future = lane.submit(task)
                try:
                    value = future.result(timeout=deadline.remaining())
                except FutureTimeout:
                    lane.abandon(future, on_late)
                    if on_abandon is not None:
                        on_abandon()
                    raise TierTimeout(f"{op} did not finish within its deadline") from None
        except (TierTimeout, TimeoutError) as exc:
            breaker.record_failure()
            self.metrics.error(f"{op}: timeout: {exc}")
            logger.warning("kvstore tier %s: %s timed out (%s)", self.name, op, exc)
            return None, MissReason.TIMEOUT
        except Exception as exc:
            breaker.record_failure()
            self.metrics.error(f"{op}: {type(exc).__name__}: {exc}")
            logger.warning(
                "kvstore tier %s: %s failed: %r",
                self.name,
                op,
                exc,
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            return None, MissReason.ERROR
        breaker.record_success()
        self.metrics.latency(op, time.monotonic() - start)
        return value, None

    # ---- implementation hooks ------------------------------------------------------------------------

    @abstractmethod
    def _contains_prefix(self, run: KeyRun, deadline: Deadline) -> int: ...

    @abstractmethod
    def _get_into(
        self, run: KeyRun, fence: BufferFence, layout: BlockLayout, deadline: Deadline
    ) -> GetResult: ...

    @abstractmethod
    def _read(self, run: KeyRun, deadline: Deadline, layout: BlockLayout | None) -> ReadResult: ...

    @abstractmethod
    def _put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> PutResult: ...

    @abstractmethod
    def _delete(self, run: KeyRun, deadline: Deadline) -> int: ...

    def _probe(self, deadline: Deadline) -> None:
        """Raise when the backend cannot serve (``health``); memory tiers always can."""
        return None

    def _backend_stats(self) -> dict[str, Any]:
        return {}

    def _close(self) -> None:
        return None


def _releasing(fn: Callable[[], Any], batch: UnitBatch) -> Callable[[], Any]:
    def task() -> Any:
        try:
            return fn()
        finally:
            batch.release()

    return task
