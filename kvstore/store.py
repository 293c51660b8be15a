"""The tiered store: an ordered stack of tiers that answers as one.

``TieredStore`` works on encoded blocks of any namespace (the store server uses it as is);
``kvstore.engine_view.KVStore`` binds it to one engine's namespace and block layout and speaks block
hashes and buffers.

Lookups are prefix-contiguous across tiers.  The first tier answers for its leading run, the next one
continues from there, and the first block no tier holds ends the answer:

    blocks     0 1 2 3 4 5
    cpu        ■ ■ · · ■ ·     asked from block 0: 2
    disk       ■ ■ ■ ■ · ·     asked from block 2: 2
    redis      ■ ■ ■ ■ · ·     asked from block 4: 0
    cpu again                  asked from block 4: 1; disk and redis, asked from block 5: 0  ->  5 blocks

A tier is asked again only from a block it has not already said it lacks, so in the usual case (lower
tiers hold supersets of the upper ones, as write-through makes them) the bottom tier is asked once.

Reads walk the stack the same way and *promote*: blocks found below are copied into the tiers above them
once the read is done (so a promotion never evicts what the read had still to load): into memory tiers
from the caller's buffers, into other tiers by a background copy.  Writes go to the top
tier that takes them, synchronously, and flow down in the background through a bounded queue
(``write_policy="through"``); when the queue is full the write-down is dropped and counted, never waited
for.  With ``write_policy="back"`` nothing flows down at write time; instead a memory tier *demotes* the
blocks it evicts to the tier below (under write-through too, to every tier below, for blocks whose
write-down was dropped or came too late).

Every call has a deadline, shared by the tiers it visits.  A tier that fails or times out counts as zero
hits for that call and its circuit breaker keeps it out of later calls until a probe succeeds; the engine
recomputes what the store did not return.  Nothing here raises for a backend failure.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvstore.config import StoreConfig
from kvstore.deadline import Deadline
from kvstore.metrics import TierStats
from kvstore.results import GetResult, MissReason, PutResult, ReadResult, Unit, UnitBatch, release_all
from kvstore.tiers.base import Tier, TierPolicy
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.factory import build_tier
from kvstore.writeback import WriteQueue
from wire.codec import pack_header, payload_checksum
from wire.keys import BlockHash, KeyRun
from wire.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from wire.layout import BlockLayout


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    write_queue_depth: int
    write_queue_pending: int
    write_jobs_dropped: int

    def tier(self, name: str) -> TierStats:
        for stats in self.tiers:
            if stats.name == name:
                return stats
        raise KeyError(f"no tier named {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "tiers": [t.to_dict() for t in self.tiers],
            "write_queue": {
                "depth": self.write_queue_depth,
                "pending": self.write_queue_pending,
                "dropped_jobs": self.write_jobs_dropped,
            },
        }


class TieredStore:
    """An ordered stack of tiers, top (fastest) first (module docstring)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        policy: TierPolicy | None = None,
        write_policy: str = "through",
        write_queue_depth: int = 1024,
    ) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        if write_policy not in ("through", "back"):
            raise ValueError(f"write_policy {write_policy!r} is unknown; choose through or back")
        self.tiers = list(tiers)
        self.policy = policy or TierPolicy()
        self.write_policy = write_policy
        self._writer = WriteQueue(write_queue_depth)
        for i, tier in enumerate(self.tiers[:-1]):
            if isinstance(tier, CpuTier):
                tier.set_evict_hook(partial(self._demote, i))
        # KV events of the tiers (stored / removed blocks, by tier), for a publisher; off until asked.
        self._events_lock = threading.Lock()
        self._events: deque[KVCacheEvent] | None = None
        self.num_events_dropped = 0

    def enable_events(self, max_pending: int = 65536) -> None:
        """Record every block a tier gains or loses, as KV events (``take_events``), at most
        ``max_pending`` of them between two takes (the oldest are dropped beyond, and counted)."""
        with self._events_lock:
            self._events = deque(maxlen=max_pending)
        for tier in self.tiers:
            tier.on_change = self._tier_changed

    def _tier_changed(self, tier: str, kind: str, keys: Sequence[bytes]) -> None:
        hashes = [BlockHash(k[16:]) for k in keys]  # a key is namespace (16 bytes) + block hash
        event: KVCacheEvent = (
            BlockStored(hashes, None, [], 0, medium=tier)
            if kind == "stored"
            else BlockRemoved(hashes, medium=tier)
        )
        with self._events_lock:
            if self._events is None:
                return
            if len(self._events) == self._events.maxlen:
                self.num_events_dropped += 1
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        with self._events_lock:
            if not self._events:
                return []
            events = list(self._events)
            self._events.clear()
            return events

    @classmethod
    def from_config(
        cls, config: StoreConfig | str, *, clock: Callable[[], float] | None = None
    ) -> TieredStore:
        if isinstance(config, str):
            config = StoreConfig.load(config)
        policy = config.policy
        tiers: list[Tier] = []
        try:
            for tier_config in config.tiers:
                tiers.append(build_tier(tier_config, policy, clock=clock))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        return cls(
            tiers, policy=policy, write_policy=config.write_policy, write_queue_depth=config.write_queue_depth
        )

    # ---- lookups -------------------------------------------------------------------------------------

    def contains_prefix(self, run: KeyRun, deadline: Deadline | None = None) -> int:
        """How many leading blocks of ``run`` the stack holds (no side effects)."""
        deadline = deadline or Deadline.after(self.policy.lookup_timeout_s)
        found = 0
        gaps = [-1] * len(self.tiers)  # gaps[k]: a block tier k is known to lack (asked there, it stopped)
        while found < len(run) and not deadline.expired():
            before = found
            for k, tier in enumerate(self.tiers):
                if found == len(run) or gaps[k] == found:
                    continue
                if deadline.expired():
                    return found
                found += tier.contains_prefix(run.slice(found), deadline)
                gaps[k] = found
            if found == before:
                break
        return found

    # ---- reads ---------------------------------------------------------------------------------------

    def get_into(
        self,
        run: KeyRun,
        buffers: Sequence[memoryview],
        layout: BlockLayout,
        deadline: Deadline | None = None,
    ) -> GetResult:
        """Load leading blocks into ``buffers`` (flat writable views), promoting what came from below."""
        deadline = deadline or Deadline.after(self.policy.get_timeout_s)
        loaded = 0
        checksums: list[int | None] = []
        reason: MissReason | None = None
        gaps = [-1] * len(self.tiers)
        found_below: list[tuple[int, int, GetResult]] = []  # (tier, first block, result)
        while loaded < len(run):
            before = loaded
            for k, tier in enumerate(self.tiers):
                if loaded == len(run) or gaps[k] == loaded:
                    continue
                if deadline.expired():
                    reason = MissReason.TIMEOUT
                    break
                result = tier.get_into(run.slice(loaded), buffers[loaded:], layout, deadline)
                if result.loaded:
                    if k > 0:
                        found_below.append((k, loaded, result))
                    loaded += result.loaded
                    checksums.extend(result.checksums)
                gaps[k] = loaded
                reason = result.reason
            if loaded == before or reason is MissReason.TIMEOUT:
                break
        # Promote only now: a promotion may evict, and must not evict what this call had still to read.
        for k, first, result in found_below:
            got = run.slice(first, first + result.loaded)
            self._promote(k, got, buffers[first : first + result.loaded], result.checksums, layout, deadline)
        return GetResult(loaded, reason if loaded < len(run) else None, tuple(checksums))

    def read(
        self, run: KeyRun, layout: BlockLayout | None = None, deadline: Deadline | None = None
    ) -> ReadResult:
        """The leading units as stored (the store server's GET), each checked against the run's namespace
        and hashes and ``layout``; a block that fails is dropped from its tier, never returned or
        promoted.  The caller releases the units."""
        deadline = deadline or Deadline.after(self.policy.get_timeout_s)
        units: list[Unit] = []
        reason: MissReason | None = None
        gaps = [-1] * len(self.tiers)
        found_below: list[tuple[int, int, int]] = []  # (tier, first block, blocks)
        while len(units) < len(run) and not deadline.expired():
            before = len(units)
            for k, tier in enumerate(self.tiers):
                if len(units) == len(run) or gaps[k] == len(units) or deadline.expired():
                    continue
                sub = run.slice(len(units))
                result = tier.read(sub, deadline, layout)
                if result.units:
                    if k > 0:
                        found_below.append((k, len(units), len(result.units)))
                    units.extend(result.units)
                gaps[k] = len(units)
                reason = result.reason
            if len(units) == before:
                break
        for k, first, count in found_below:
            self._promote_units(k, run.slice(first, first + count), units[first : first + count], deadline)
        return ReadResult(units, reason if len(units) < len(run) else None)

    def _promote(
        self,
        k: int,
        run: KeyRun,
        buffers: Sequence[memoryview],
        checksums: Sequence[int | None],
        layout: BlockLayout,
        deadline: Deadline,
    ) -> None:
        """Blocks tier ``k`` just loaded into ``buffers`` go to the tiers above it."""
        units = [
            Unit(
                view.toreadonly(),
                pack_header(run.namespace, h, layout, payload_checksum(view) if c is None else c),
            )
            for view, h, c in zip(buffers, run.hashes, checksums, strict=True)
        ]
        self._promote_units(k, run, units, deadline)

    def _promote_units(self, k: int, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> None:
        source = self.tiers[k]
        for j in range(k):
            upper = self.tiers[j]
            if upper.inline:
                stored = upper.put(run, units, deadline).stored
                upper.metrics.count(promotions=stored)
                if stored and isinstance(upper, CpuTier) and j + 1 == k:
                    upper.mark_below(run, stored)
                if stored == len(run):
                    source = upper  # later copies read from memory, not from tier k again
            else:
                self._offer(partial(self._copy_job, source, run, [upper], promotion=True), [upper], len(run))

    # ---- writes ----------------------------------------------------------------------------------------

    def put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline | None = None) -> PutResult:
        """Store in the top tier that takes the blocks; the tiers below receive them in the background."""
        deadline = deadline or Deadline.after(self.policy.put_timeout_s)
        result = PutResult(0, MissReason.UNAVAILABLE)
        for i, tier in enumerate(self.tiers):
            if deadline.expired():
                break
            result = tier.put(run, units, deadline)
            if result.stored:
                below = self.tiers[i + 1 :]
                if below and self.write_policy == "through":
                    stored = run.slice(0, result.stored)
                    self._offer(partial(self._copy_job, tier, stored, below), below, len(stored))
                break
        return result

    def delete(self, run: KeyRun, deadline: Deadline | None = None) -> int:
        """Remove the blocks from every tier; returns how many (block, tier) copies were deleted."""
        deadline = deadline or Deadline.after(self.policy.put_timeout_s)
        return sum(tier.delete(run, deadline) for tier in self.tiers)

    def _offer(self, job: Callable[[], None], dests: Sequence[Tier], blocks: int) -> bool:
        if self._writer.offer(job):
            return True
        for dest in dests:
            dest.metrics.count(dropped_writes=blocks)
        return False

    def _copy_job(self, source: Tier, run: KeyRun, dests: Sequence[Tier], promotion: bool = False) -> None:
        """Background: read ``run`` from ``source`` once and put it into each of ``dests``, in order.

        Blocks the source no longer holds (evicted since) are skipped and counted as ``lost_writes``; the
        contiguous pieces around them are still copied.
        """
        pos = 0
        while pos < len(run):
            read = source.read(run.slice(pos), Deadline.after(self.policy.get_timeout_s))
            if read.units:
                self._copy_units(source, run.slice(pos, pos + len(read.units)), read.units, dests, promotion)
                pos += len(read.units)
            if pos < len(run):
                lost = 1 if read.reason in (MissReason.ABSENT, MissReason.EVICTED) else len(run) - pos
                for dest in dests:
                    dest.metrics.count(lost_writes=lost)
                pos += lost

    def _copy_units(
        self, source: Tier, run: KeyRun, units: list[Unit], dests: Sequence[Tier], promotion: bool
    ) -> None:
        batch = UnitBatch(units)
        try:
            for n, dest in enumerate(dests):
                stored = dest.put(
                    run, units, Deadline.after(self.policy.put_timeout_s), keepalive=batch
                ).stored
                if promotion:
                    dest.metrics.count(promotions=stored)
                elif n == 0 and stored and isinstance(source, CpuTier):
                    source.mark_below(run, stored)  # dests[0] is the tier right below the source
        finally:
            batch.release()

    def _demote(self, index: int, evicted: list[tuple[KeyRun, Unit]]) -> None:
        """Evict hook of memory tier ``index``: its evicted blocks (those not yet written below) go down,
        in the background -- under write-back to the tier below; under write-through to every tier below,
        as the write-down they were evicted before would have (a disk tier demotes nothing further, so a
        cpu tier smaller than a request's blocks had left the tiers under the disk all but empty)."""
        dests = (
            self.tiers[index + 1 :] if self.write_policy == "through" else self.tiers[index + 1 : index + 2]
        )
        if not self._offer(partial(self._demote_job, dests, evicted), dests, len(evicted)):
            release_all(unit for _, unit in evicted)

    def _demote_job(self, dests: Sequence[Tier], evicted: list[tuple[KeyRun, Unit]]) -> None:
        for run, unit in evicted:
            batch = UnitBatch([unit])
            try:
                for dest in dests:
                    stored = dest.put(
                        run, [unit], Deadline.after(self.policy.put_timeout_s), keepalive=batch
                    ).stored
                    dest.metrics.count(demotions=stored)
            finally:
                batch.release()

    # ---- housekeeping --------------------------------------------------------------------------------

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued background writes (tests, shutdown); ``False`` if they did not finish in time."""
        return self._writer.drain(timeout_s)

    def health(self, timeout_s: float = 1.0) -> dict[str, str]:
        """The tiers that cannot serve now, by name, with why (empty: all can): ``Tier.health`` of each,
        with its own ``timeout_s``.  It waits on the backends: call it off any latency-bound path
        (kvstore/health.py does)."""
        reasons = {t.name: t.health(Deadline.after(timeout_s)) for t in self.tiers}
        return {name: why for name, why in reasons.items() if why is not None}

    def stats(self) -> StoreStats:
        return StoreStats(
            tuple(t.stats() for t in self.tiers),
            self._writer.depth,
            self._writer.pending(),
            self._writer.dropped_jobs,
        )

    def close(self, drain_timeout_s: float = 5.0) -> int:
        """Write what the write-back queue holds into the lower tiers (for at most ``drain_timeout_s``),
        then close every tier.  Returns how many jobs the deadline left unwritten."""
        left = 0 if self._writer.close(drain_timeout_s) else self._writer.pending()
        for tier in self.tiers:
            tier.close()
        return left
