"""The block pool: bookkeeping for a fixed set of KV blocks.  Mechanism only -- it never decides who runs.

Every block is in exactly one of two places:

    free queue  (ref_cnt == 0)   LRU order: the head is evicted first.  A freed block keeps its hash and
                                 stays findable through the cache map until it is popped for reuse
                                 (lazy eviction).
    in use      (ref_cnt >= 1)   held by that many requests (shared prefix blocks have ref_cnt > 1).

The cache map ``hash -> block`` indexes the blocks that hold the KV of a full, hashed block; a cached
block may be free or in use.  ``check_integrity()`` proves these books balance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.hashing import BlockHash
from engine.integrity import require
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the paged KV cache.  ``block_id`` is its index in the cache tensor."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; both None when the block is not in it (or is its only element at an end).
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) popleft, append and removal from the middle.

    Sentinel head and tail nodes keep every operation branch-free.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns every ``KVCacheBlock``, the free queue and the hash -> block cache map."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.enable_kv_events = enable_kv_events
        self._events: list[KVCacheEvent] = []
        # Counters: how many cached blocks were evicted to make room.
        self.num_evictions = 0

    # -- queries (no side effects) ------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def num_cached_prefix(self, block_hashes: Sequence[BlockHash], limit: int) -> int:
        """How many of the leading ``block_hashes[:limit]`` are cached (the first miss ends the run)."""
        cached = self.cached
        n = 0
        for h in block_hashes[:limit]:
            if h not in cached:
                break
            n += 1
        return n

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    # -- mutations ----------------------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks: only {self.free_queue.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching zero join the free queue's tail in order.

        Callers pass a request's blocks tail-first, so the ends of chains are evicted before their
        prefixes.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        *,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        adapter: str | None = None,
    ) -> None:
        """Register ``blocks[start:end]`` under ``block_hashes[start:end]``.

        A block whose hash is already cached under another block (two requests computed the same block
        concurrently) stays uncached: the first copy wins, the duplicate is freed normally later.
        """
        if not self.enable_caching or end <= start:
            return
        stored: list[BlockHash] = []
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit or cached in an earlier step
            h = block_hashes[i]
            if h in self.cached:
                continue
            block.block_hash = h
            self.cached[h] = block
            stored.append(h)
        if self.enable_kv_events and stored:
            parent = block_hashes[start - 1] if start > 0 else None
            tokens = list(token_ids[start * block_size : end * block_size]) if token_ids is not None else []
            self._events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=block_size,
                    adapter=adapter,
                )
            )

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s hash from the cache map now (its KV turned out bad); it stays allocated."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self.cached.get(h) is block:
            del self.cached[h]
            self.num_evictions += 1
            if self.enable_kv_events:
                self._events.append(BlockRemoved(block_hashes=[h]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash.  Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # -- proof --------------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless free + in use == total and the cache map is consistent."""
        free = list(self.free_queue)
        free_ids = {b.block_id for b in free}
        require(len(free_ids) == len(free) == self.free_queue.num_free_blocks, "free queue corrupt")
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        require(all(b.ref_cnt == 0 for b in free), "a block in the free queue has references")
        require(
            len(free) + len(in_use) == self.num_blocks,
            f"free {len(free)} + in use {len(in_use)} != total {self.num_blocks}",
        )
        require(all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count")
        for h, block in self.cached.items():
            require(block.block_hash == h, f"cache map entry {h.hex()[:8]} points at {block}")
        cached_blocks = sum(1 for b in self.blocks if b.block_hash is not None)
        require(cached_blocks == len(self.cached), "a block carries a hash the cache map does not know")
