"""The caches of the simulated cluster: a node's paged prefix cache (``NodeCache``) and the shared store's
tiers (``StoreSim``).  Blocks are keys (``planner.trace.PrefixKeys``: equal keys, equal prefixes); keys
below zero are blocks nobody else can hit (generated tokens), which take room but publish nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class NodeCache:
    """A node's KV blocks: ``capacity`` in all; those in use (``refs`` by key, ``anon`` without one),
    the cached ones nobody uses (``lru``, least recently used first, evicted first), the rest free --
    the engine's block pool, at block granularity.  ``events`` records, in order, the keys that became
    cached (True) or were evicted (False) since the caller last took them (its KV events)."""

    capacity: int
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    refs: dict[int, int] = field(default_factory=dict)
    anon: int = 0
    events: list[tuple[bool, int]] = field(default_factory=list)
    evictions: int = 0
    _unique: int = -1

    @property
    def free(self) -> int:
        return self.capacity - self.anon - len(self.refs) - len(self.lru)

    def available(self) -> int:
        """Blocks an allocation can have now: the free ones and the evictable cached ones."""
        return self.capacity - self.anon - len(self.refs)

    def holds(self, key: int) -> bool:
        return key in self.refs or key in self.lru

    def prefix(self, keys: Sequence[int], limit: int) -> int:
        """How many of the first ``limit`` keys are cached, from the first on."""
        n = 0
        while n < limit and (keys[n] in self.refs or keys[n] in self.lru):
            n += 1
        return n

    def acquire(self, keys: Sequence[int]) -> None:
        """The request uses these cached blocks (its prefix hits)."""
        for key in keys:
            if key in self.lru:
                del self.lru[key]
                self.refs[key] = 1
            else:
                self.refs[key] += 1

    def allocate(self, n: int) -> bool:
        """``n`` new blocks, evicting cached ones least recently used first; False (nothing taken) when
        even that is not enough."""
        if n > self.available():
            return False
        short = n - self.free
        for _ in range(max(0, short)):
            key, _ = self.lru.popitem(last=False)
            self.evictions += 1
            if key >= 0:
                self.events.append((False, key))
        self.anon += n
        return True

    def cache(self, key: int) -> bool:
        """One of the request's new blocks now holds ``key``'s tokens: cached (True), unless another
        request cached the same key first (False: the block stays the request's own)."""
        if key in self.refs or key in self.lru:
            return False
        self.anon -= 1
        self.refs[key] = 1
        self.events.append((True, key))
        return True

    def release(self, keys: Sequence[int], full_own: int, own: int) -> None:
        """A request lets go of its blocks, in the engine's order (``KVCacheManager.free``: the chain's
        end first, so tails are evicted before their prefixes): ``full_own`` of its own full blocks --
        nobody can hit them (generated tokens), yet they take room -- then those with ``keys`` (in
        prefix order), which stay cached; the rest of its ``own`` blocks are free."""
        self.anon -= own
        for _ in range(full_own):
            self.lru[self._unique] = None
            self._unique -= 1
        for key in reversed(keys):
            count = self.refs[key] - 1
            if count:
                self.refs[key] = count
            else:
                del self.refs[key]
                self.lru[key] = None

    def take_events(self) -> list[tuple[bool, int]]:
        events, self.events = self.events, []
        return events


@dataclass
class Tier:
    kind: str  # "cpu", "disk": the profile's load cost of that kind
    capacity: int  # blocks
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)


class StoreSim:
    """The shared store: tiers top first, each an LRU of blocks.  A put lands in every tier (write-through:
    lower tiers hold supersets of the upper ones); a read walks the tiers for each block from the
    first on, stops at the first block no tier holds, and promotes what it found below into the tiers
    above.  ``events`` collects (stored, removed, tier kind) since the caller last took them."""

    def __init__(self, tiers: Sequence[tuple[str, int]]) -> None:
        self.tiers = [Tier(kind, capacity) for kind, capacity in tiers]
        self.events: list[tuple[list[int], list[int], str]] = []

    def lookup(self, keys: Sequence[int], start: int, limit: int) -> list[int]:
        """For keys ``start`` .. up to ``limit``: the blocks of the leading run held, by tier (the count
        each tier serves, top first)."""
        served = [0] * len(self.tiers)
        for i in range(start, limit):
            key = keys[i]
            for t, tier in enumerate(self.tiers):
                if key in tier.blocks:
                    served[t] += 1
                    break
            else:
                break
        return served

    def read(self, keys: Sequence[int]) -> None:
        """Blocks were loaded: touched where they are, copied into the tiers above."""
        for key in keys:
            for t, tier in enumerate(self.tiers):
                if key in tier.blocks:
                    tier.blocks.move_to_end(key)
                    for upper in self.tiers[:t]:
                        self._put(upper, [key])
                    break

    def put(self, keys: Sequence[int]) -> None:
        for tier in self.tiers:
            self._put(tier, keys)

    def _put(self, tier: Tier, keys: Sequence[int]) -> None:
        stored, removed = [], []
        for key in keys:
            if key in tier.blocks:
                tier.blocks.move_to_end(key)
                continue
            if len(tier.blocks) >= tier.capacity:
                if tier.capacity == 0:
                    return
                old, _ = tier.blocks.popitem(last=False)
                removed.append(old)
            tier.blocks[key] = None
            stored.append(key)
        if stored or removed:
            self.events.append((stored, removed, tier.kind))

    def take_events(self) -> list[tuple[list[int], list[int], str]]:
        events, self.events = self.events, []
        return events
