"""Per-request KV block accounting on top of the block pool.

The scheduler asks, this manager answers.  Queries (``get_computed_blocks``,
``get_num_blocks_to_allocate``) have no side effects; ``allocate_slots``, ``cache_blocks`` and ``free``
mutate.

A request's tokens, as ``allocate_slots`` sees them (``|`` marks block boundaries, bs = block size):

    |<------ num_computed_tokens ------>|<- new local hit ->|<- external ->|<-- num_new_tokens -->|
    | already in req_blocks (earlier     | new_computed_     | loaded by the | computed this step   |
    | steps: computed or hit)            | blocks (touched)  | connector     |                      |
    '----------------------- all of these need slots: cdiv(total, bs) blocks ----------------------'

Local hits and computed prefixes are always whole blocks; external tokens are whole blocks too (the
connector contract), so the first block that may be partial is the one that holds ``num_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from engine.block_pool import BlockPool, KVCacheBlock
from engine.integrity import require
from engine.request import Request, RequestId
from wire.kv_events import KVCacheEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """The answer of ``get_computed_blocks``: leading cached blocks and how many tokens they hold."""

    blocks: tuple[KVCacheBlock, ...]
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


NO_HIT = ComputedBlocks((), 0)


class KVCacheManager:
    def __init__(
        self, *, num_blocks: int, block_size: int, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events)
        self.req_to_blocks: dict[RequestId, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step so a step need not rebuild them.
        self.req_to_block_ids: dict[RequestId, list[int]] = {}
        # How many leading blocks of each request are registered in the cache map (or were hits).
        self.num_cached_blocks: dict[RequestId, int] = {}
        # Prefix-cache statistics over admitted requests (tokens).
        self.stats_queries = 0
        self.stats_hits = 0

    # -- queries ------------------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def max_hit_blocks(self, request: Request) -> int:
        """Hits may cover whole blocks only and never the last known token (it must produce logits)."""
        return min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of cached leading blocks of ``request``.  No side effects."""
        if not self.enable_caching:
            return NO_HIT
        limit = self.max_hit_blocks(request)
        blocks: list[KVCacheBlock] = []
        cached = self.pool.cached
        for h in request.block_hashes[:limit]:
            block = cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(tuple(blocks), len(blocks) * self.block_size)

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of ``request`` a local prefix hit would cover now (cheap; used by the lpm policy)."""
        if not self.enable_caching:
            return 0
        return (
            self.pool.num_cached_prefix(request.block_hashes, self.max_hit_blocks(request)) * self.block_size
        )

    def get_num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_tokens: int = 0,
    ) -> int:
        """How many blocks ``allocate_slots`` would take from the free queue.  No side effects.

        Hit blocks that are currently free count too: touching them removes them from the free queue.
        """
        held = self.req_to_blocks.get(request.request_id, ())
        total_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_external_tokens
            + num_new_tokens
        )
        num_new = max(0, cdiv(total_tokens, self.block_size) - len(held) - len(new_computed_blocks))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_new + num_evictable_hits

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_tokens: int = 0,
    ) -> bool:
        need = self.get_num_blocks_to_allocate(
            request, num_new_tokens, new_computed_blocks, num_external_tokens
        )
        return need <= self.pool.get_num_free_blocks()

    # -- mutations ----------------------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks = NO_HIT,
        num_external_tokens: int = 0,
        *,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` after the request's computed, hit and external tokens.

        Returns the newly allocated blocks, or None (and changes nothing) when the pool cannot satisfy
        the request.  Full blocks whose tokens are known after this step are registered in the cache map
        at once -- the forward pass writes their KV before any later step can read it -- unless
        ``delay_caching`` (an async external load: the blocks become cached when the load lands).
        """
        if num_new_tokens < 0 or num_external_tokens < 0:
            raise ValueError("token counts must be non-negative")
        hit_blocks = new_computed_blocks.blocks
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if held is not None and not hit_blocks and not num_external_tokens:
            # Fast path (most decodes): the request's last block still has room.
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(held) * self.block_size:
                if not delay_caching and total_tokens // self.block_size > self.num_cached_blocks[rid]:
                    self.cache_blocks(request, total_tokens)
                return []
        if not self.can_allocate(request, num_new_tokens, hit_blocks, num_external_tokens):
            return None
        req_blocks = self.req_to_blocks.setdefault(rid, [])
        req_block_ids = self.req_to_block_ids.setdefault(rid, [])
        self.num_cached_blocks.setdefault(rid, 0)
        if hit_blocks:
            assert request.num_computed_tokens == len(req_blocks) * self.block_size, (
                "prefix hits attach only to a request with no partial block"
            )
            self.pool.touch(hit_blocks)
            req_blocks.extend(hit_blocks)
            req_block_ids.extend(b.block_id for b in hit_blocks)
            self.num_cached_blocks[rid] = len(req_blocks)
        total_tokens = (
            request.num_computed_tokens
            + new_computed_blocks.num_tokens
            + num_external_tokens
            + num_new_tokens
        )
        num_new = cdiv(total_tokens, self.block_size) - len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new) if num_new > 0 else []
        req_blocks.extend(new_blocks)
        req_block_ids.extend(b.block_id for b in new_blocks)
        if not delay_caching:
            self.cache_blocks(request, total_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` tokens in the cache map."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if end <= start:
            return
        self.pool.cache_full_blocks(
            blocks,
            request.block_hashes,
            start,
            end,
            token_ids=request.all_token_ids if self.pool.enable_kv_events else None,
            block_size=self.block_size,
            adapter=None if request.adapter is None else str(request.adapter),
        )
        self.num_cached_blocks[rid] = end

    def uncache_from(self, request: Request, block_index: int) -> None:
        """Forget the cached hashes of the request's blocks from ``block_index`` on (their KV is bad)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        for block in blocks[block_index:]:
            self.pool.uncache(block)
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid], block_index)

    def free(self, request: Request) -> None:
        """Release every block of ``request``, tail first so chain ends are evicted before prefixes."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: RequestId) -> list[int]:
        """A copy of the request's block table (block ids in token order)."""
        return list(self.req_to_block_ids.get(request_id, ()))

    # -- what the scheduler may ask (it never reaches into the tables or the pool) -------------------------

    def owns_blocks(self, request_id: RequestId) -> bool:
        """Whether ``request_id`` holds blocks (running, loading, held, or back from a load)."""
        return request_id in self.req_to_blocks

    def block_owners(self) -> list[RequestId]:
        """Requests holding blocks, in allocation order."""
        return list(self.req_to_blocks)

    def blocks_of(self, requests: Iterable[RequestId]) -> set[int]:
        """Every block id the given requests hold."""
        return {b for rid in requests for b in self.req_to_block_ids.get(rid, ())}

    def first_block_in(self, request_id: RequestId, block_ids: Collection[int]) -> int | None:
        """Index in ``request_id``'s table of its first block among ``block_ids`` (None if none)."""
        table = self.req_to_block_ids.get(request_id, ())
        return next((i for i, b in enumerate(table) if b in block_ids), None)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats_queries += num_prompt_tokens
        self.stats_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()

    def check_integrity(self) -> None:
        """The pool's books balance and every reference is owned by a request of this manager."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            require(
                self.req_to_block_ids[rid] == [b.block_id for b in blocks], f"{rid}: block id table stale"
            )
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            require(
                block.ref_cnt == refs.get(block.block_id, 0),
                f"{block}: ref count {block.ref_cnt} but held by {refs.get(block.block_id, 0)} requests",
            )
