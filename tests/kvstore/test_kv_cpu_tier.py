"""The cpu tier: prefix lookups, exact reads, byte capacity with LRU eviction, leases, stats."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvtest import BLOCK, LAYOUT, NAMESPACE, Blocks

from kvstore.config import CpuTierConfig
from kvstore.results import MissReason, Unit
from kvstore.tiers.cpu import CpuTier
from wire.codec import BlockCodec, parse_header, payload_checksum
from wire.keys import KeyRun
from wire.layout import BlockLayout


def cpu(blocks: int) -> CpuTier:
    return CpuTier(CpuTierConfig(capacity_bytes=blocks * BLOCK))


def key(b: Blocks, i: int) -> bytes:
    return NAMESPACE + b.hashes[i]


def test_prefix_lookup_and_exact_get(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(8)
    tier = cpu(16)
    assert tier.contains_prefix(b.run()) == 0
    assert tier.put(b.run(0, 5), b.units(0, 5)).stored == 5
    assert tier.contains_prefix(b.run()) == 5
    assert tier.contains_prefix(b.run(2)) == 3
    assert tier.contains_prefix(b.run(5)) == 0
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (5, MissReason.ABSENT)
    assert b.loaded(5)
    assert result.checksums == (None,) * 5  # unsealed: the put cost a copy, nothing more
    for unit in tier.read(b.run(0, 5)).units:  # a write-down job seals them
        unit.seal()
        unit.release()
    result = tier.get_into(b.run(0, 5), b.out_views[:5], LAYOUT)
    assert result.checksums == tuple(payload_checksum(v) for v in b.views[:5])


def test_a_gap_ends_the_prefix(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(6)
    tier = cpu(16)
    tier.put(b.run(), b.units())
    tier.delete(b.run(3, 4))
    assert tier.contains_prefix(b.run()) == 3
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 3


def test_lru_eviction_order(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(6)
    tier = cpu(4)
    tier.put(b.run(0, 4), b.units(0, 4))
    assert tier.keys_lru() == [key(b, i) for i in range(4)]
    tier.get_into(b.run(1, 2), b.out_views[:1], LAYOUT)  # a get touches
    assert tier.keys_lru() == [key(b, i) for i in (0, 2, 3, 1)]
    # A lookup's hits touch too: the blocks a scheduler is about to load are evicted last.
    assert tier.contains_prefix(b.run(0, 1)) == 1
    assert tier.keys_lru() == [key(b, i) for i in (2, 3, 1, 0)]
    tier.get_into(b.run(1, 2), b.out_views[:1], LAYOUT)
    assert tier.keys_lru() == [key(b, i) for i in (2, 3, 0, 1)]
    tier.put(b.run(4, 6), b.units(4, 6))  # evicts 2 and 3, least recently used
    assert tier.keys_lru() == [key(b, i) for i in (0, 1, 4, 5)]
    stats = tier.stats()
    assert stats.counter("evictions") == 2
    assert stats.backend["used_bytes"] == 4 * BLOCK and stats.backend["allocated_bytes"] == 4 * BLOCK


def test_evicted_and_absent_are_told_apart(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(3)
    tier = cpu(1)
    tier.put(b.run(0, 2), b.units(0, 2))  # block 0 is evicted by block 1
    assert tier.get_into(b.run(0, 1), b.out_views[:1], LAYOUT).reason is MissReason.EVICTED
    assert tier.get_into(b.run(2, 3), b.out_views[:1], LAYOUT).reason is MissReason.ABSENT
    stats = tier.stats()
    assert stats.missed(MissReason.EVICTED) == 1 and stats.missed(MissReason.ABSENT) == 1


def test_a_put_larger_than_the_tier_keeps_the_tail(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(5)
    tier = cpu(2)
    assert tier.put(b.run(), b.units()).stored == 5
    assert tier.keys_lru() == [key(b, 3), key(b, 4)]


def test_a_block_larger_than_the_tier_is_refused_and_counted(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(1)
    tier = CpuTier(CpuTierConfig(capacity_bytes=BLOCK - 1))
    result = tier.put(b.run(), b.units())
    assert (result.stored, result.reason) == (0, MissReason.ERROR)
    assert tier.stats().put_failures == {"error": 1}


def test_putting_a_held_block_refreshes_it(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(3)
    tier = cpu(3)
    tier.put(b.run(), b.units())
    assert tier.put(b.run(0, 1), b.units(0, 1)).stored == 1
    assert tier.keys_lru() == [key(b, 1), key(b, 2), key(b, 0)]
    assert tier.stats().backend["blocks"] == 3


def test_unsealed_blocks_are_sealed_once_and_read_back_with_a_valid_header(
    make_blocks: Callable[..., Blocks],
) -> None:
    b = make_blocks(2)
    tier = cpu(4)
    calls: list[int] = []
    codec = BlockCodec(NAMESPACE, LAYOUT)

    def sealer(i: int) -> Callable[[memoryview], bytes]:
        def seal(view: memoryview) -> bytes:
            calls.append(i)
            return codec.header_of(b.hashes[i], view)

        return seal

    tier.put(b.run(), [Unit(b.views[i].toreadonly(), sealer=sealer(i)) for i in range(2)])
    assert calls == []  # a put is a copy, nothing more
    read = tier.read(b.run())
    headers = [u.seal() for u in read.units]
    for unit in read.units:
        unit.release()
    tier.read(b.run()).units[0].release()
    assert calls == [0, 1]  # sealed once each
    for i, header in enumerate(headers):
        parsed = parse_header(header)
        assert not isinstance(parsed, MissReason) and parsed.checksum == payload_checksum(b.views[i])


def test_another_layout_is_a_miss(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(1)
    tier = cpu(2)
    codec = BlockCodec(NAMESPACE, LAYOUT)
    tier.put(b.run(), [Unit(b.views[0], codec.header_of(b.hashes[0], b.views[0]))])  # a sealed block
    other = BlockLayout(2, 2, 8, 4, "bfloat16")
    assert tier.get_into(b.run(), b.out_views, other).reason is MissReason.WRONG_LAYOUT
    unsealed = make_blocks(1, salt=1)
    tier.put(unsealed.run(), unsealed.units())
    wrong_size = [memoryview(bytearray(2 * BLOCK))]
    assert tier.get_into(unsealed.run(), wrong_size, BlockLayout(4, 2, 8, 4, "float16")).reason is (
        MissReason.WRONG_LAYOUT
    )


def test_a_leased_block_survives_eviction_until_released(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(3)
    tier = cpu(1)
    tier.put(b.run(0, 1), b.units(0, 1))
    read = tier.read(b.run(0, 1))
    (unit,) = read.units
    tier.put(b.run(1, 3), b.units(1, 3))  # evicts block 0 twice over
    assert bytes(unit.payload) == bytes(b.views[0])  # its slot was not recycled under the lease
    assert tier.stats().backend["in_flight_bytes"] == BLOCK
    unit.release()
    stats = tier.stats().backend
    assert stats["in_flight_bytes"] == 0 and stats["allocated_bytes"] <= BLOCK


def test_the_evict_hook_receives_blocks_not_known_below(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(4)
    tier = cpu(2)
    demoted: list[tuple[KeyRun, Unit]] = []
    tier.set_evict_hook(demoted.extend)
    tier.put(b.run(0, 2), b.units(0, 2))
    tier.mark_below(b.run(1, 2))  # block 1 is already in the tier below
    tier.put(b.run(2, 4), b.units(2, 4))
    assert [(run.start, list(run.hashes)) for run, _ in demoted] == [(0, [b.hashes[0]])]
    assert bytes(demoted[0][1].payload) == bytes(b.views[0])
    demoted[0][1].release()


def test_stats_count_calls_blocks_and_bytes(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(4)
    tier = cpu(8)
    tier.put(b.run(0, 3), b.units(0, 3))
    tier.contains_prefix(b.run())
    tier.get_into(b.run(), b.out_views, LAYOUT)
    stats = tier.stats()
    assert {k: stats.counter(k) for k in ("puts", "put_blocks", "stored_blocks", "bytes_out")} == {
        "puts": 1,
        "put_blocks": 3,
        "stored_blocks": 3,
        "bytes_out": 3 * BLOCK,
    }
    assert (stats.counter("lookups"), stats.counter("lookup_blocks"), stats.counter("lookup_hits")) == (
        1,
        4,
        3,
    )
    assert (stats.counter("gets"), stats.counter("hit_blocks"), stats.counter("bytes_in")) == (
        1,
        3,
        3 * BLOCK,
    )
    assert stats.misses == {"absent": 1}
    assert stats.latency["get"].count == 1 and stats.latency["put"].count == 1
    assert stats.to_dict()["breakers"] == {"read": "closed", "write": "closed"}


def test_buffers_must_match_the_run(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2)
    with pytest.raises(ValueError, match="2 blocks but 1 buffers"):
        cpu(2).get_into(b.run(), b.out_views[:1], LAYOUT)


def test_a_kept_buffer_is_adopted_not_copied(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(3)
    tier = cpu(2)
    codec = BlockCodec(NAMESPACE, LAYOUT)
    frames = [bytes(v) for v in b.views]  # stand-ins for received ZeroMQ frames
    units = [
        Unit(memoryview(f), codec.header_of(h, f), keep=True) for f, h in zip(frames, b.hashes, strict=True)
    ]
    tier.put(b.run(0, 2), units[:2])
    read = tier.read(b.run(0, 1))
    assert read.units[0].payload.obj is frames[0]  # the very buffer, no copy
    read.units[0].release()
    tier.put(b.run(2, 3), units[2:])  # evicts block 1 (block 0 was just read): dropped, not recycled
    backend = tier.stats().backend
    assert backend["allocated_bytes"] == 2 * BLOCK and backend["blocks"] == 2
    assert tier.keys_lru() == [key(b, 0), key(b, 2)]
    assert tier.get_into(b.run(2, 3), b.out_views[:1], LAYOUT).loaded == 1
    assert torch.equal(b.out[0], b.data[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slots_are_pinned_in_a_process_that_uses_cuda(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2)
    tier = cpu(4)
    assert tier.pin_memory
    tier.put(b.run(), b.units())
    (unit,) = tier.read(b.run(0, 1)).units
    assert isinstance(unit.payload.obj, type(b.data.numpy()))  # a view of a pinned torch tensor
    unit.release()
    device_block = torch.zeros(BLOCK, dtype=torch.uint8, device="cuda")
    host = torch.zeros(BLOCK, dtype=torch.uint8).pin_memory()
    assert tier.get_into(b.run(0, 1), [memoryview(host.numpy())], LAYOUT).loaded == 1
    device_block.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device_block.cpu(), b.data[0])


def test_a_damaged_run_is_dropped_from_its_first_bad_block_so_one_put_heals_it(
    make_blocks: Callable[..., Blocks],
) -> None:
    """An outside probe's find: six blocks stored with payloads that fail their checksum took six
    requests to heal -- each get dropped the first bad block only, and the put of the recomputed run kept
    every later one (a put keeps a block already held).  The run's blocks from the first bad one are
    dropped together: the next put stores them all."""
    b = make_blocks(6)
    tier = CpuTier(CpuTierConfig(capacity_bytes=16 * BLOCK, verify_payload=True))  # as a reader checks
    codec = BlockCodec(NAMESPACE, LAYOUT)
    poison = torch.full((BLOCK,), 0x55, dtype=torch.uint8).numpy().tobytes()
    bad = [Unit(memoryview(poison), header=codec.header_of(b.hashes[i], b.views[i])) for i in range(6)]
    assert tier.put(b.run(), bad).stored == 6
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (0, MissReason.CORRUPT)
    assert tier.contains_prefix(b.run()) == 0 and tier.stats().counter("dropped_blocks") == 6
    assert tier.put(b.run(), b.units()).stored == 6  # the recomputed run, all of it
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 6 and b.loaded(6)
