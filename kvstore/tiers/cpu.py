"""The ``cpu`` tier: encoded blocks in this process's memory, bounded by bytes, LRU.

Memory is kept in *slots*, one per block, allocated once (pinned when this process uses CUDA, so a later
host-to-device copy runs at full speed) and recycled: fresh memory costs page faults that make a copy
several times slower than into memory already touched (``/work/shared/design/FLOORS.md``).

    slot states     free list ──reserve──▶ filling ──commit──▶ live (in the LRU index)
                        ▲                                         │ evict / delete
                        └──────── last lease released ◀── leased (readers, demotion, a send in flight)

A put copies the payload into a reserved slot outside the lock and only then publishes it in the index,
so a lookup never sees a partial block.  Readers lease a slot; an evicted slot is recycled only after its
last lease is released, so a reader (a store-server reply still being sent, a write-down job) never reads
recycled bytes.  ``capacity_bytes`` bounds the payload memory of all slots, free ones included.

A block put by this process's engine is stored *unsealed*: the copy is all the put costs, and the
payload checksum its header needs is computed later, once, over the slot, by whichever reader needs it
first (a write-down job in the background, usually).  Blocks put with a header (promotions, the store
server) keep it, and ``get_into`` checks it.

Eviction is LRU over the index (``get_into`` and ``put`` touch, lookups do not).  Blocks that were never
written to the tier below (write-back policy, or a write-down dropped under load) are offered to the evict
hook, which the tiered store uses to demote them.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvstore.buffers import BufferFence, copy_bytes
from kvstore.config import CpuTierConfig
from kvstore.deadline import Deadline
from kvstore.results import GetResult, MissReason, PutResult, ReadResult, Unit
from kvstore.tiers.base import Ghosts, Tier, TierPolicy
from wire.codec import BlockHeader, check_header, header_checksum, verify_payload
from wire.keys import KeyRun
from wire.layout import BlockLayout

EvictHook = Callable[[list[tuple[KeyRun, Unit]]], None]


@dataclass(slots=True, eq=False)
class _Slot:
    memory: Any  # a bytearray, a pinned torch tensor, or an adopted buffer (``Unit.keep``)
    view: memoryview
    size: int
    leases: int = 0
    live: bool = False
    adopted: bool = False  # not ours to recycle: dropped when its block goes


@dataclass(slots=True, eq=False)
class _Entry:
    header: bytes | None  # None until sealed (see the module docstring)
    slot: _Slot
    nbytes: int
    start: int  # chain index and anchor: enough to rebuild the block's KeyRun for a demotion
    anchor: bytes
    sealer: Callable[[memoryview], bytes] | None = None
    parsed: BlockHeader | None = None  # ``header`` parsed and checked once, on first read
    below: bool = False  # known to be held by the next tier down


class CpuTier(Tier):
    kind = "cpu"
    inline = True

    def __init__(
        self,
        config: CpuTierConfig,
        *,
        policy: TierPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config.name, policy=policy, clock=clock)
        self.config = config
        self.capacity_bytes = config.capacity_bytes
        self.verify_payload = config.verify_payload
        self.pin_memory = _cuda_in_use() if config.pin_memory is None else config.pin_memory
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._free: dict[int, list[_Slot]] = {}
        self._allocated = 0  # bytes of every slot: live, filling, free, and evicted-but-leased
        self._in_flight = 0  # bytes of evicted slots still leased (a demotion or a send in progress)
        self._used = 0  # bytes of live entries
        self._ghosts = Ghosts()
        self._evictions = 0
        self._evict_hook: EvictHook | None = None

    def set_evict_hook(self, hook: EvictHook | None) -> None:
        """``hook`` receives evicted blocks not known to be below (leased units: the hook releases them)."""
        self._evict_hook = hook

    def mark_below(self, run: KeyRun, count: int | None = None) -> None:
        """The first ``count`` blocks of ``run`` are held by the tier below: evict them without demoting."""
        with self._lock:
            for i in range(len(run) if count is None else count):
                entry = self._index.get(run.key(i))
                if entry is not None:
                    entry.below = True

    # ---- lookups and reads -----------------------------------------------------------------------------

    def _contains_prefix(self, run: KeyRun, deadline: Deadline) -> int:
        # A hit becomes most recently used: blocks a scheduler is about to load are the last this tier
        # evicts, so a lookup's answer holds until the load (recency only; no entry is added or removed).
        index = self._index
        ns = run.namespace
        with self._lock:
            for i, block_hash in enumerate(run.hashes):
                key = ns + block_hash
                if key not in index:
                    return i
                index.move_to_end(key)
        return len(run)

    def _lease_run(self, run: KeyRun) -> tuple[list[_Entry], MissReason | None]:
        """Lease the leading present entries of ``run`` (touching them); why the next one is missing."""
        entries: list[_Entry] = []
        index = self._index
        with self._lock:
            for i in range(len(run)):
                key = run.key(i)
                entry = index.get(key)
                if entry is None:
                    return entries, self._ghosts.reason(key)
                index.move_to_end(key)
                entry.slot.leases += 1
                entries.append(entry)
        return entries, None

    def _release_all(self, entries: list[_Entry]) -> None:
        with self._lock:
            for entry in entries:
                self._release_locked(entry.slot)

    def _checked(
        self, entry: _Entry, run: KeyRun, i: int, layout: BlockLayout | None
    ) -> BlockHeader | MissReason:
        """The entry's header, parsed once and checked against this block (and ``layout`` when given)."""
        parsed = entry.parsed
        if parsed is None:
            assert entry.header is not None
            checked = check_header(entry.header, run.namespace, run.hashes[i], None)
            if isinstance(checked, MissReason):
                return checked
            entry.parsed = parsed = checked
        if layout is not None and parsed.layout != layout:
            return MissReason.WRONG_LAYOUT
        return parsed

    def _get_into(
        self, run: KeyRun, fence: BufferFence, layout: BlockLayout, deadline: Deadline
    ) -> GetResult:
        entries, missing = self._lease_run(run)
        checksums: list[int | None] = []
        try:
            for i, entry in enumerate(entries):
                header: BlockHeader | None = None
                if entry.header is not None:
                    checked = self._checked(entry, run, i, layout)
                    if isinstance(checked, MissReason):
                        return GetResult(i, checked, tuple(checksums))
                    header = checked
                elif entry.nbytes != fence.nbytes(i):
                    return GetResult(i, MissReason.WRONG_LAYOUT, tuple(checksums))
                fence.copy_into(i, entry.slot.view[: entry.nbytes])
                if header is None:  # unsealed: a caller that needs the checksum computes it
                    checksums.append(header_checksum(entry.header) if entry.header is not None else None)
                    continue
                bad = verify_payload(header, fence.peek(i)) if self.verify_payload else None
                if bad is not None:
                    return GetResult(i, bad, tuple(checksums))
                checksums.append(header.checksum)
        finally:
            self._release_all(entries)
        return GetResult(len(entries), missing, tuple(checksums))

    def _read(self, run: KeyRun, deadline: Deadline, layout: BlockLayout | None) -> ReadResult:
        entries, missing = self._lease_run(run)
        units: list[Unit] = []
        for i, entry in enumerate(entries):
            checked = self._checked(entry, run, i, None) if entry.header is not None else None
            if isinstance(checked, MissReason):
                self._release_all(entries[i:])
                return ReadResult(units, checked)
            units.append(self._unit(entry))
        return ReadResult(units, missing)

    def _unit(self, entry: _Entry) -> Unit:
        """A leased view of ``entry`` (the caller holds one lease, which the unit's ``release`` returns)."""
        return Unit(
            entry.slot.view[: entry.nbytes],
            entry.header,
            sealer=None if entry.header is not None else partial(self._seal, entry),
            release_fn=partial(self._release, entry.slot),
        )

    def _seal(self, entry: _Entry, _view: memoryview | None = None) -> bytes:
        """The entry's header, computing its checksum over the slot the first time (idempotent)."""
        header = entry.header
        if header is None:
            assert entry.sealer is not None, "an unsealed entry keeps its sealer"
            header = entry.sealer(entry.slot.view[: entry.nbytes])
            entry.header, entry.sealer = header, None
        return header

    # ---- writes ----------------------------------------------------------------------------------------

    def _put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> PutResult:
        begin = 0
        while begin < len(run):
            end, reserved = self._reserve_run(run, units, begin)
            self._fill_and_publish(run, units, reserved)
            if end == len(run):
                break
            if not reserved:  # nothing left to evict: the block is larger than the tier, or all is leased
                size = units[end].payload.nbytes
                self.metrics.error(f"put: no room for a {size}-byte block in {self.capacity_bytes} bytes")
                return PutResult(end, MissReason.ERROR)
            begin = end  # the blocks just published may now be evicted to make room for the rest
        return PutResult(len(run))

    def _reserve_run(
        self, run: KeyRun, units: Sequence[Unit], begin: int
    ) -> tuple[int, list[tuple[int, _Slot]]]:
        """Reserve slots for blocks ``begin..`` until one does not fit; (where it stopped, reservations)."""
        reserved: list[tuple[int, _Slot]] = []
        demoted: list[tuple[KeyRun, Unit]] = []
        end = len(run)
        with self._lock:
            evictions_before = self._evictions
            for i in range(begin, len(run)):
                key = run.key(i)
                if key in self._index:
                    self._index.move_to_end(key)
                    continue
                unit = units[i]
                slot = self._reserve(unit.payload.nbytes, demoted, adopt=unit.payload if unit.keep else None)
                if slot is None:
                    end = i
                    break
                reserved.append((i, slot))
            evicted = self._evictions - evictions_before
        if evicted:
            self.metrics.count(evictions=evicted)
        if demoted:
            self._demote(demoted)
        return end, reserved

    def _fill_and_publish(
        self, run: KeyRun, units: Sequence[Unit], reserved: list[tuple[int, _Slot]]
    ) -> None:
        """Copy each payload into its slot without the lock, then publish them all at once."""
        entries: list[tuple[bytes, _Entry]] = []
        for i, slot in reserved:
            unit = units[i]
            nbytes = unit.payload.nbytes
            if not slot.adopted:
                copy_bytes(slot.view[:nbytes], unit.payload)
            sealer = None if unit.header is not None else unit.sealer
            assert unit.header is not None or sealer is not None, "a unit is sealed or carries its sealer"
            entries.append(
                (
                    run.key(i),
                    _Entry(unit.header, slot, nbytes, run.start + i, run.anchor(i), sealer, unit.parsed),
                )
            )
        with self._lock:
            for key, entry in entries:
                if key in self._index:  # another writer published it first
                    self._recycle(entry.slot)
                    continue
                entry.slot.live = True
                self._index[key] = entry
                self._used += entry.nbytes
                self._ghosts.discard(key)

    def _delete(self, run: KeyRun, deadline: Deadline) -> int:
        deleted = 0
        with self._lock:
            for i in range(len(run)):
                entry = self._index.pop(run.key(i), None)
                if entry is not None:
                    self._unlink(entry)
                    deleted += 1
        return deleted

    # ---- slot bookkeeping (callers hold self._lock unless noted) ----------------------------------------

    def _reserve(
        self, nbytes: int, demoted: list[tuple[KeyRun, Unit]], adopt: memoryview | None = None
    ) -> _Slot | None:
        """A slot for ``nbytes``: a free one, a new one within capacity, or one freed by evicting LRU.

        With ``adopt``, the slot is that buffer itself (no copy; free slots are dropped to make room).
        Evicted blocks to demote are appended to ``demoted`` (each holding a lease on its slot).
        """
        free = self._free.setdefault(nbytes, []) if adopt is None else []
        # Evicted slots still leased are outside the budget: they return to it (or to the allocator) when
        # their last lease ends, so the overshoot is bounded by the demotions and sends in flight.
        while not free and self._allocated - self._in_flight + nbytes > self.capacity_bytes:
            if (adopt is not None or len(self._free) > 1) and self._drop_free_slot(
                keep=nbytes if adopt is None else None
            ):
                continue
            if not self._index:
                return None
            key, victim = self._index.popitem(last=False)
            self._ghosts.add(key)
            self._evictions += 1
            self._changed("removed", [key])
            if not victim.below and self._evict_hook is not None:
                victim.slot.leases += 1
                demoted.append(
                    (KeyRun(key[:16], [key[16:]], victim.start, (victim.anchor,)), self._unit(victim))
                )
            self._unlink(victim)
        if free:
            return free.pop()
        self._allocated += nbytes
        if adopt is not None:
            return _Slot(adopt, adopt, nbytes, adopted=True)
        if self.pin_memory:
            import torch

            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return _Slot(tensor, memoryview(tensor.numpy()), nbytes)  # type: ignore[arg-type]
        memory = bytearray(nbytes)
        return _Slot(memory, memoryview(memory), nbytes)

    def _drop_free_slot(self, keep: int | None) -> bool:
        """Give one free slot (of a size other than ``keep``) back to the allocator; False if none."""
        for size, slots in self._free.items():
            if size != keep and slots:
                slots.pop()
                self._allocated -= size
                return True
        return False

    def _unlink(self, entry: _Entry) -> None:
        """``entry`` left the index: its slot is recycled now, or when its last lease is released."""
        self._used -= entry.nbytes
        entry.slot.live = False
        if entry.slot.leases == 0:
            self._recycle(entry.slot)
        else:
            self._in_flight += entry.slot.size

    def _recycle(self, slot: _Slot) -> None:
        if slot.adopted or self._allocated - self._in_flight > self.capacity_bytes:
            self._allocated -= slot.size  # over budget (slots were reserved while others were in flight)
        else:
            self._free.setdefault(slot.size, []).append(slot)

    def _release(self, slot: _Slot) -> None:
        """Release one lease (any thread; takes the lock)."""
        with self._lock:
            self._release_locked(slot)

    def _release_locked(self, slot: _Slot) -> None:
        slot.leases -= 1
        assert slot.leases >= 0, "lease released twice"
        if slot.leases == 0 and not slot.live:
            self._in_flight -= slot.size
            self._recycle(slot)

    def _demote(self, demoted: list[tuple[KeyRun, Unit]]) -> None:
        hook = self._evict_hook
        if hook is None:
            for _, unit in demoted:
                unit.release()
            return
        hook(demoted)

    def _backend_stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "allocated_bytes": self._allocated,
                "in_flight_bytes": self._in_flight,
                "used_bytes": self._used,
                "blocks": len(self._index),
                "pinned": self.pin_memory,
            }

    def keys_lru(self) -> list[bytes]:
        """Index keys, least recently used first (for tests and tools)."""
        with self._lock:
            return list(self._index)


def _cuda_in_use() -> bool:
    """Pin by default only in a process that already runs torch on a GPU (an engine, not a store server)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())
