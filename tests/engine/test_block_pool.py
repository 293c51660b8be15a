"""Block pool and KV cache manager: exact block ids, exact eviction order, tiny pools."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine.hashing import AdapterId
from engine.kv_cache_manager import KVCacheManager
from tests.factories import make_request
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def make_manager(num_blocks: int = 10, *, events: bool = False) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=4, enable_kv_events=events)


def admit(kv: KVCacheManager, request, num_new: int | None = None) -> list[int]:  # type: ignore[no-untyped-def]
    """What the scheduler does for a waiting request: hits, then room for the rest."""
    hit = kv.get_computed_blocks(request)
    n = request.num_tokens - hit.num_tokens if num_new is None else num_new
    assert kv.allocate_slots(request, n, hit) is not None
    request.num_computed_tokens = hit.num_tokens + n
    return kv.get_block_ids(request.request_id)


def test_free_queue_removes_from_the_middle_in_constant_steps() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]
    assert q.num_free_blocks == 4
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_prefix_hit_shares_blocks_and_partial_blocks_are_never_cached() -> None:
    kv = make_manager()
    a = make_request("a", range(10))  # blocks: [0..3] [4..7] [8,9]
    assert admit(kv, a) == [0, 1, 2]
    assert len(kv.pool.cached) == 2  # the partial third block has no hash
    assert kv.pool.blocks[2].block_hash is None

    b = make_request("b", [*range(8), 50, 51])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    assert admit(kv, b) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.check_integrity()


def test_free_is_tail_first_and_eviction_takes_chain_ends_first() -> None:
    kv = make_manager()
    a = make_request("a", range(10))
    b = make_request("b", [*range(8), 50, 51])
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2]
    kv.free(b)
    # b held [0, 1, 3]: freed tail first, so the chain's root is the last to go.
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    kv.check_integrity()

    # Lazy eviction: freed blocks keep their hashes until reused.
    c = make_request("c", range(12))
    assert kv.get_computed_blocks(c).block_ids == [0, 1]
    # Take 8 fresh blocks: 4..9, 2, 3 -- no cached block is evicted yet.
    big = make_request("big", range(100, 132))
    assert admit(kv, big) == [4, 5, 6, 7, 8, 9, 2, 3]
    assert kv.pool.num_evictions == 0
    # The next block evicts block 1's hash (the chain's end), leaving block 0's.
    d = make_request("d", range(200, 203))
    assert admit(kv, d) == [1]
    assert kv.pool.num_evictions == 1
    assert kv.get_computed_blocks(c).block_ids == [0]
    kv.check_integrity()


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = make_manager()
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 10
    b = make_request("b", range(9))
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1]
    # Admission counts the 2 free hit blocks it takes out of the queue plus 1 new block.
    assert kv.get_num_blocks_to_allocate(b, 1, hit.blocks) == 3
    admit(kv, b)
    assert kv.get_block_ids(b.request_id) == [0, 1, 3]
    assert 0 not in kv.pool.free_queue.block_ids() and 1 not in kv.pool.free_queue.block_ids()
    kv.check_integrity()


def test_a_hit_never_covers_the_last_token() -> None:
    kv = make_manager()
    a = make_request("a", range(8))  # exactly two blocks
    admit(kv, a)
    again = make_request("again", range(8))
    # Both blocks are cached, but the last token must be computed: only the first block is a hit.
    assert kv.get_computed_blocks(again).block_ids == [0]
    longer = make_request("longer", range(9))
    assert kv.get_computed_blocks(longer).block_ids == [0, 1]


def test_allocation_refused_when_the_pool_is_short_changes_nothing() -> None:
    kv = make_manager(num_blocks=3)
    a = make_request("a", range(9))
    admit(kv, a)  # 3 blocks
    b = make_request("b", range(50, 54))
    assert kv.allocate_slots(b, 4) is None
    assert kv.get_block_ids(b.request_id) == []
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_salt_and_adapter_separate_caches() -> None:
    kv = make_manager()
    admit(kv, make_request("plain", range(9)))
    assert kv.get_computed_blocks(make_request("salted", range(9), cache_salt="tenant-a")).num_tokens == 0
    assert (
        kv.get_computed_blocks(
            make_request("lora", range(9), adapter=AdapterId("adapter", bytes(32)))
        ).num_tokens
        == 0
    )
    admit(kv, make_request("salted-1", range(9), cache_salt="tenant-a"))
    assert kv.get_computed_blocks(make_request("salted-2", range(9), cache_salt="tenant-a")).num_tokens == 8
    assert kv.get_computed_blocks(make_request("salted-b", range(9), cache_salt="tenant-b")).num_tokens == 0


def test_duplicate_block_computed_twice_stays_uncached_and_is_freed() -> None:
    kv = make_manager()
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    # Both admitted before either is cached: b cannot hit a's blocks (same step, allocate_slots for a
    # already cached them, so force the duplicate by allocating b without hits).
    assert kv.allocate_slots(a, 9) is not None
    assert kv.allocate_slots(b, 9) is not None
    assert kv.get_block_ids(b.request_id) == [3, 4, 5]
    assert kv.pool.blocks[3].block_hash is None  # the first copy (block 0) owns the hash
    assert kv.pool.cached[a.block_hashes[0]].block_id == 0
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 10


def test_kv_events_report_stores_removals_and_clears() -> None:
    kv = make_manager(num_blocks=3, events=True)
    a = make_request("a", range(9))
    admit(kv, a)
    events = kv.take_events()
    assert events == [
        BlockStored(
            block_hashes=a.block_hashes[:2],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
        )
    ]
    kv.free(a)
    b = make_request("b", range(100, 112))
    admit(kv, b)  # reuses all three blocks: evicts the two cached ones, then caches its own
    events = kv.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(removed) == set(a.block_hashes[:2])
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert isinstance(kv.take_events()[-1], AllBlocksCleared)
    assert kv.pool.cached == {}


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    kv = make_manager()
    a = make_request("a", range(9))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    kv.check_integrity()


def test_check_integrity_catches_a_leaked_reference() -> None:
    kv = make_manager()
    a = make_request("a", range(9))
    admit(kv, a)
    kv.check_integrity()
    kv.pool.touch([kv.pool.blocks[0]])  # a reference no request owns
    kv.free(a)
    with pytest.raises(AssertionError, match="ref count 1 but held by 0"):
        kv.check_integrity()


def test_check_integrity_catches_a_corrupt_free_queue() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(1)[0].ref_cnt = 0  # dropped without going back to the free queue
    with pytest.raises(AssertionError, match="free 3 \\+ in use 0 != total 4"):
        pool.check_integrity()


def test_check_integrity_still_checks_under_python_dash_o() -> None:
    """Built on raise, not assert: ``python -O`` strips asserts, and a check that passes silently then
    would hide a leak."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        from engine.block_pool import BlockPool
        from engine.integrity import IntegrityError
        pool = BlockPool(4)
        pool.blocks[0].ref_cnt = 1  # a reference nobody owns, while the block sits in the free queue
        try:
            pool.check_integrity()
        except IntegrityError as exc:
            print("raised:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised: a block in the free queue has references"), out.stdout
