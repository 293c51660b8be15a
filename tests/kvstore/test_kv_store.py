"""The tiered store: prefix-contiguous lookups across tiers, promotion, the write-down queue, demotion,
a tier that fails or hangs (bounded time, circuit breaker), and the engine-facing ``KVStore``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from kvtest import BLOCK, LAYOUT, Blocks, wait_until

from engine.hashing import HashNamespace, hash_blocks
from kvstore.breaker import BreakerConfig
from kvstore.buffers import BufferFence
from kvstore.config import CpuTierConfig, DiskTierConfig
from kvstore.deadline import Deadline
from kvstore.engine_view import KVStore
from kvstore.results import GetResult, MissReason, PutResult, ReadResult, Unit
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier, TierPolicy
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from wire.keys import KeyRun
from wire.layout import BlockLayout


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(cooldown_s: float = 1.0) -> TierPolicy:
    return TierPolicy(
        lookup_timeout_s=0.2,
        get_timeout_s=0.5,
        put_timeout_s=0.5,
        breaker=BreakerConfig(cooldown_s=cooldown_s),
    )


def cpu(blocks: int, name: str = "cpu") -> CpuTier:
    return CpuTier(CpuTierConfig(blocks * BLOCK, name=name), policy=policy())


def disk(path: Path, blocks: int = 64) -> DiskTier:
    return DiskTier(DiskTierConfig(str(path), blocks * (96 + BLOCK)), policy=policy())


class GateTier(Tier):
    """A remote-like tier backed by a cpu tier, whose calls can be made to hang or fail."""

    kind = "gate"

    def __init__(self, name: str = "gate", clock: Callable[[], float] | None = None) -> None:
        super().__init__(name, policy=policy(), clock=clock)
        self.inner = CpuTier(CpuTierConfig(1 << 20))
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.fail = False

    def _gate(self) -> None:
        self.entered.set()
        self.open.wait(30)
        if self.fail:
            raise ConnectionError("backend down")

    def _contains_prefix(self, run: KeyRun, deadline: Deadline) -> int:
        self._gate()
        return self.inner._contains_prefix(run, deadline)

    def _get_into(
        self, run: KeyRun, fence: BufferFence, layout: BlockLayout, deadline: Deadline
    ) -> GetResult:
        self._gate()
        return self.inner._get_into(run, fence, layout, deadline)

    def _read(self, run: KeyRun, deadline: Deadline) -> ReadResult:
        self._gate()
        return self.inner._read(run, deadline)

    def _put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> PutResult:
        self._gate()
        return self.inner._put(run, units, deadline)

    def _delete(self, run: KeyRun, deadline: Deadline) -> int:
        return self.inner._delete(run, deadline)


def store_of(*tiers: Tier, write_policy: str = "through", depth: int = 64) -> TieredStore:
    return TieredStore(list(tiers), policy=policy(), write_policy=write_policy, write_queue_depth=depth)


# ---- lookups ---------------------------------------------------------------------------------------------


def test_lookup_is_prefix_contiguous_across_tiers(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    # The module docstring's example: cpu ■■··■·, disk ■■■■··, redis-like ■■■■·· -> 5 blocks.
    b = make_blocks(6)
    top, middle, bottom = cpu(8), disk(tmp_path), GateTier("bottom")
    top.put(b.run(0, 2), b.units(0, 2))
    top.put(b.run(4, 5), b.units(4, 5))
    middle.put(b.run(0, 4), b.units(0, 4))
    bottom.inner.put(b.run(0, 4), b.units(0, 4))
    store = store_of(top, middle, bottom)
    assert store.contains_prefix(b.run()) == 5
    assert (top.stats().counter("lookups"), middle.stats().counter("lookups")) == (2, 2)
    assert bottom.stats().counter("lookups") == 2  # asked from block 4, then from block 5
    assert store.contains_prefix(b.run(1)) == 4
    assert store.contains_prefix(b.run(5)) == 0
    store.close()


def test_get_loads_across_tiers_and_promotes(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(6)
    top, bottom = cpu(8), disk(tmp_path)
    top.put(b.run(0, 2), b.units(0, 2))
    bottom.put(b.run(), b.units())
    store = store_of(top, bottom)
    result = store.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (6, None) and b.loaded(6)
    assert top.contains_prefix(b.run()) == 6  # blocks 2..5 were promoted
    assert top.stats().counter("promotions") == 4
    b.out.zero_()
    assert store.get_into(b.run(), b.out_views, LAYOUT).loaded == 6 and b.loaded(6)
    assert bottom.stats().counter("gets") == 1  # the second get was served from memory
    store.close()


# ---- writes ----------------------------------------------------------------------------------------------


def test_writes_go_to_the_top_and_flow_down(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(4)
    top, bottom = cpu(8), disk(tmp_path)
    store = store_of(top, bottom)
    assert store.put(b.run(), b.units()).stored == 4
    assert store.drain(5.0)
    assert bottom.contains_prefix(b.run()) == 4
    assert bottom.get_into(b.run(), b.out_views, LAYOUT).loaded == 4 and b.loaded(4)
    store.close()


def test_a_full_write_queue_drops_and_counts_without_blocking(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(5)
    top, bottom = cpu(8), GateTier()
    bottom.open.clear()  # the lower tier hangs
    store = store_of(top, bottom, depth=2)
    store.put(b.run(0, 1), b.units(0, 1))
    wait_until(bottom.entered.is_set, 5.0, "the writer to reach the lower tier")
    start = time.monotonic()
    for i in range(1, 5):  # two fit in the queue, two are dropped
        assert store.put(b.run(i, i + 1), b.units(i, i + 1)).stored == 1
    assert time.monotonic() - start < 1.0  # the lower tier is stuck for 30 s: nobody waited for it
    stats = store.stats()
    assert stats.tier("gate").counter("dropped_writes") == 2 and stats.write_jobs_dropped == 2
    bottom.open.set()
    assert store.drain(5.0)
    assert bottom.inner.contains_prefix(b.run(1, 3)) == 2  # the queued ones made it
    store.close()


def test_eviction_demotes_under_write_back(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(4)
    top, bottom = cpu(2), disk(tmp_path)
    store = store_of(top, bottom, write_policy="back")
    store.put(b.run(0, 2), b.units(0, 2))
    assert store.drain(5.0) and bottom.contains_prefix(b.run()) == 0  # nothing flows down at put time
    store.put(b.run(2, 4), b.units(2, 4))  # evicts 0 and 1: demoted
    assert store.drain(5.0)
    assert bottom.contains_prefix(b.run()) == 2
    assert bottom.stats().counter("demotions") == 2
    assert store.contains_prefix(b.run()) == 4  # disk answers 0..1, memory 2..3
    assert store.get_into(b.run(), b.out_views, LAYOUT).loaded == 4 and b.loaded(4)
    store.close()


def test_blocks_written_down_are_not_demoted_again(
    tmp_path: Path, make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(4)
    top, bottom = cpu(2), disk(tmp_path)
    store = store_of(top, bottom)
    store.put(b.run(0, 2), b.units(0, 2))
    assert store.drain(5.0)
    store.put(b.run(2, 4), b.units(2, 4))
    assert store.drain(5.0)
    assert bottom.stats().counter("demotions") == 0 and bottom.contains_prefix(b.run()) == 4
    store.close()


def test_under_write_through_a_block_evicted_before_its_write_down_reaches_every_tier_below(
    tmp_path: Path, make_blocks: Callable[..., Blocks]
) -> None:
    """An outside drill ran cpu:2MiB,disk,redis: the cpu tier evicted blocks before the background
    write-down read them (lost_writes), their demotion went to the disk only, and Redis stayed all but
    empty.  A demotion under write-through goes where the write-down would have."""
    b = make_blocks(4)
    top, middle, bottom = cpu(2), GateTier(), disk(tmp_path)
    store = store_of(top, middle, bottom)
    middle.open.clear()  # the write-down of block 0 waits in the middle tier
    store.put(b.run(0, 1), b.units(0, 1))
    wait_until(middle.entered.is_set, 5.0, "the writer to reach the middle tier")
    for i in range(1, 4):  # blocks 0 and 1 are evicted before their write-down read them
        store.put(b.run(i, i + 1), b.units(i, i + 1))
    middle.open.set()
    assert store.drain(5.0)
    assert bottom.contains_prefix(b.run()) == 4 and middle.inner.contains_prefix(b.run()) == 4
    assert bottom.stats().counter("lost_writes") >= 1 and bottom.stats().counter("demotions") >= 1
    store.close()


def test_a_put_falls_through_a_tier_that_is_down(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2)
    top, bottom = GateTier("top"), cpu(4)
    top.fail = True
    store = store_of(top, bottom)
    assert store.put(b.run(), b.units()).stored == 2
    assert bottom.contains_prefix(b.run()) == 2
    store.close()


# ---- failing and hanging tiers ---------------------------------------------------------------------------


def test_a_failing_tier_counts_as_zero_hits(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(3)
    broken, bottom = GateTier("broken"), cpu(4)
    broken.inner.put(b.run(), b.units())
    broken.fail = True
    bottom.put(b.run(), b.units())
    store = store_of(broken, bottom)
    assert store.contains_prefix(b.run()) == 3  # answered by the next tier
    assert store.get_into(b.run(), b.out_views, LAYOUT).loaded == 3 and b.loaded(3)
    stats = store.stats().tier("broken")
    assert stats.missed(MissReason.ERROR) == 1 and stats.missed(MissReason.UNAVAILABLE) == 1
    assert stats.breakers["read"] == "open" and "backend down" in stats.last_error
    store.close()


def test_a_hanging_tier_is_bounded_then_skipped_then_retried(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(4)
    clock = Clock()
    top, hung, bottom = cpu(8), GateTier("hung", clock=clock), cpu(8, name="bottom")
    top.put(b.run(0, 1), b.units(0, 1))
    hung.inner.put(b.run(), b.units())
    bottom.put(b.run(), b.units())
    store = store_of(top, hung, bottom)
    hung.open.clear()

    start = time.monotonic()
    assert store.contains_prefix(b.run(), Deadline.after(0.2)) == 1  # the deadline ran out in the hung tier
    assert time.monotonic() - start < 1.0
    assert hung.stats().missed(MissReason.TIMEOUT) == 1

    start = time.monotonic()
    assert store.contains_prefix(b.run(), Deadline.after(0.2)) == 4  # skipped now: the bottom answers
    assert time.monotonic() - start < 0.5  # no wait at all: the breaker is open
    assert hung.stats().breakers["read"] == "open"

    hung.open.set()  # the backend comes back
    wait_until(lambda: not hung._lanes["lookup"].stuck(), 5.0, "the abandoned call to finish")
    assert store.contains_prefix(b.run()) == 4
    assert hung.stats().counter("lookups") == 3  # the third call skipped it: cooldown not over
    clock.now += 1.0  # the cooldown passes: the next call probes the tier again
    assert store.contains_prefix(b.run()) == 4
    assert hung.stats().breakers["read"] == "closed"
    store.close()


def test_a_hanging_get_never_writes_after_giving_up(make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2)
    hung = GateTier("hung")
    hung.inner.put(b.run(), b.units())
    hung.open.clear()
    start = time.monotonic()
    result = hung.get_into(b.run(), b.out_views, LAYOUT, Deadline.after(0.2))
    assert (result.loaded, result.reason) == (0, MissReason.TIMEOUT)
    assert time.monotonic() - start < 1.0
    hung.open.set()  # the abandoned call resumes; its writes are fenced off
    wait_until(lambda: not hung._lanes["get"].stuck(), 5.0, "the abandoned call to finish")
    assert not b.out.any(), "an abandoned get wrote into the caller's buffers"
    hung.close()


# ---- the engine's view -------------------------------------------------------------------------------------


def test_kvstore_speaks_hashes_and_engine_blocks(tmp_path: Path) -> None:
    namespace = HashNamespace("tiny-model", LAYOUT.block_size)
    hashes = hash_blocks(list(range(LAYOUT.block_size * 6)), namespace=namespace)
    # The engine's paged cache: [num_blocks, layers, 2, block_size, kv heads, head dim]
    kv_cache = torch.randn(8, 2, 2, 4, 2, 8, dtype=torch.float16)
    layout = BlockLayout.from_kv_cache(kv_cache)
    store = KVStore.open(
        f"cpu:{4 * BLOCK},disk:{tmp_path}:1MiB", namespace_id=namespace.namespace_id, layout=layout
    )
    try:
        assert store.put(hashes, [kv_cache[i] for i in range(6)]).stored == 6  # blocks 0..5
        assert store.drain(5.0)
        assert store.contains_prefix(hashes) == 6
        assert store.contains_prefix(hashes, start=4) == 2
        future = store.lookup_async(hashes, start=2)
        assert isinstance(future, Future) and future.result(5.0) == 4
        restored = torch.zeros_like(kv_cache)
        result = store.get_into(hashes, [restored[i] for i in range(2, 6)], start=2)  # blocks 2..5
        assert result.loaded == 4
        assert torch.equal(restored[2:6], kv_cache[2:6])
        assert store.stats().tier("disk").counter("stored_blocks") == 6
        with pytest.raises(ValueError, match="512 bytes"):
            store.get_into(hashes, [torch.zeros(10, dtype=torch.uint8)])
        with pytest.raises(TypeError, match="contiguous"):
            store.get_into(hashes, [kv_cache[0].transpose(0, 1)])
    finally:
        store.close()


def test_another_kv_dtype_never_sees_these_blocks(make_blocks: Callable[..., Blocks]) -> None:
    namespace = HashNamespace("tiny-model", LAYOUT.block_size).namespace_id
    shared = store_of(cpu(8))
    fp16 = KVStore(shared, namespace_id=namespace, layout=LAYOUT)
    bf16 = KVStore(shared, namespace_id=namespace, layout=BlockLayout(2, 2, 8, 4, "bfloat16"))
    b = make_blocks(2)
    fp16.put(b.hashes, b.views)
    assert fp16.contains_prefix(b.hashes) == 2 and bf16.contains_prefix(b.hashes) == 0
    shared.close()


def test_from_config(tmp_path: Path) -> None:
    store = TieredStore.from_config(f"cpu:1MiB,disk:{tmp_path}:1MiB")
    assert [t.name for t in store.tiers] == ["cpu", "disk"]
    store.close()
    with pytest.raises(ValueError, match="'1MiX'"):
        TieredStore.from_config("cpu:1MiX")
