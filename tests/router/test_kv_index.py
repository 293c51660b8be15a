"""The router's KV index fed by real publishers over ZeroMQ: epochs, gaps and replay, node death,
garbage; and the kv-aware policy's choice, with costs injected."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from engine.hashing import BlockHash, HashNamespace, hash_blocks
from router.costs import NodeCosts
from router.kv_index import KVEventSubscriber, KVIndex, Publisher
from router.nodes import NodeHandle
from router.policy import STORE, KVAware, RoutingInfo
from wire.event_publisher import KVEventPublisher
from wire.kv_events import BlockRemoved, BlockStored, EventBatch

NS = HashNamespace(model_fingerprint="ab" * 16, block_size=4, algo="sha256")
H = [BlockHash(bytes([i + 1]) * 32) for i in range(16)]


def stored(*hashes: BlockHash) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * (4 * len(hashes)), 4)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


@pytest.fixture
def wiring() -> Iterator[tuple[KVIndex, dict[str, Publisher], KVEventSubscriber]]:
    index = KVIndex()
    targets: dict[str, Publisher] = {}
    sub = KVEventSubscriber(index, lambda: list(targets.values()), refresh_s=0.05).start()
    yield index, targets, sub
    sub.close()


def publisher(name: str) -> KVEventPublisher:
    return KVEventPublisher(name, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")


def target(node: str, pub: KVEventPublisher) -> Publisher:
    return Publisher(node, pub.publisher, pub.endpoint, pub.replay_endpoint)


def test_batches_fill_the_index_and_removals_empty_it(wiring) -> None:  # type: ignore[no-untyped-def]
    index, targets, _ = wiring
    pub = publisher("engine-a")
    try:
        targets["a:1"] = target("a:1", pub)
        time.sleep(0.3)  # the subscription is up (the first batches also arrive by replay otherwise)
        pub.publish([stored(H[0], H[1], H[2])])
        wait_for(lambda: index.prefix_blocks("a:1", H[:4]) == 3)
        pub.publish([BlockRemoved([H[1]])])
        wait_for(lambda: index.prefix_blocks("a:1", H[:4]) == 1)
    finally:
        pub.close()


def test_batches_missed_before_subscribing_are_replayed(wiring) -> None:  # type: ignore[no-untyped-def]
    index, targets, _ = wiring
    pub = publisher("engine-a")
    try:
        for h in H[:5]:  # nobody listens yet: these are only in the replay buffer
            pub.publish([stored(h)])
        time.sleep(0.2)
        targets["a:1"] = target("a:1", pub)
        time.sleep(0.3)
        # Subscribing, the router catches up from the replay buffer (a quiet publisher sends no later
        # batch that would show the gap).
        wait_for(lambda: index.prefix_blocks("a:1", H) == 5)
        assert index.counters["caught_up"] == 5 and index.counters["resyncs"] == 0
        pub.publish([stored(H[5])])
        wait_for(lambda: index.prefix_blocks("a:1", H) == 6)
    finally:
        pub.close()


def test_a_gap_the_replay_cannot_fill_restarts_the_node(wiring) -> None:  # type: ignore[no-untyped-def]
    index, targets, _ = wiring
    pub = KVEventPublisher("engine-a", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", replay_size=2)
    try:
        for h in H[:5]:
            pub.publish([stored(h)])
        time.sleep(0.2)
        targets["a:1"] = target("a:1", pub)
        # Only batches 4 and 5 are left: it starts over from them, and never claims blocks 0..2.
        wait_for(lambda: index.counters["resyncs"] == 1)
        wait_for(lambda: index.prefix_blocks("a:1", [H[3], H[4]]) == 2)
        assert index.prefix_blocks("a:1", H) == 0
        pub.publish([stored(H[5])])
        wait_for(lambda: index.prefix_blocks("a:1", [H[5]]) == 1)
    finally:
        pub.close()


def test_a_restarted_publisher_s_old_blocks_leave_the_index(wiring) -> None:  # type: ignore[no-untyped-def]
    index, targets, _ = wiring
    first = publisher("engine-a")
    targets["a:1"] = target("a:1", first)
    time.sleep(0.3)
    first.publish([stored(H[0], H[1])])
    wait_for(lambda: index.prefix_blocks("a:1", H) == 2)
    # The engine restarts (same node, same engine id, a new epoch) and reports other blocks.
    first.close()
    second = publisher("engine-a")
    try:
        targets["a:1"] = target("a:1", second)
        time.sleep(0.3)
        second.publish([stored(H[7])])
        wait_for(lambda: index.prefix_blocks("a:1", [H[7]]) == 1)
        assert index.prefix_blocks("a:1", H) == 0
    finally:
        second.close()


def test_a_gap_in_the_live_stream_is_replayed() -> None:
    """The subscriber misses batches while subscribed (here: it is handed a later batch directly)."""
    index = KVIndex()
    pub = publisher("engine-a")
    sub = KVEventSubscriber(index, lambda: [], refresh_s=60.0)
    try:
        sub._subs["a:1"] = (target("a:1", pub), None)  # type: ignore[assignment]
        for h in H[:4]:
            pub.publish([stored(h)])
        time.sleep(0.3)  # the sender has them in its replay buffer
        first = EventBatch("engine-a", pub.epoch, 1, 0.0, (stored(H[0]),))
        sub.receive("a:1", first.encode())
        late = EventBatch("engine-a", pub.epoch, 4, 0.0, (stored(H[3]),))
        sub.receive("a:1", late.encode())  # 2 and 3 never arrived: replayed
        assert index.counters["gaps"] == 1 and index.counters["resyncs"] == 0
        assert index.prefix_blocks("a:1", H) == 4
    finally:
        pub.close()
        sub._subs.clear()
        sub._context.term()  # never started: nothing else to stop


def test_the_epoch_check_itself() -> None:
    index = KVIndex()
    b1 = EventBatch("e", "epoch-1", 1, 0.0, (stored(H[0]),))
    assert index.expects("n", b1) is None and index.apply("n", b1)
    b2 = EventBatch("e", "epoch-2", 1, 0.0, (stored(H[1]),))
    assert index.expects("n", b2) is None and index.apply("n", b2)
    assert index.prefix_blocks("n", [H[0]]) == 0 and index.prefix_blocks("n", [H[1]]) == 1
    assert index.counters["epoch_changes"] == 1


def test_a_node_that_leaves_takes_its_blocks_with_it(wiring) -> None:  # type: ignore[no-untyped-def]
    index, targets, _ = wiring
    pub = publisher("engine-a")
    try:
        targets["a:1"] = target("a:1", pub)
        time.sleep(0.3)
        pub.publish([stored(H[0])])
        wait_for(lambda: index.prefix_blocks("a:1", H) == 1)
        del targets["a:1"]  # down, or gone from the pool
        wait_for(lambda: index.prefix_blocks("a:1", H) == 0)
    finally:
        pub.close()


def test_garbage_and_strangers_are_counted_and_dropped(wiring) -> None:  # type: ignore[no-untyped-def]
    index, targets, _ = wiring
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.PUB)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        targets["a:1"] = Publisher("a:1", "engine-a", f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:1")
        time.sleep(0.3)
        rogue.send(b"\xc1 garbage")
        rogue.send(EventBatch("engine-z", "e", 1, 0.0, (stored(H[0]),)).encode())
        wait_for(lambda: index.counters["garbage"] == 1 and index.counters["unknown_publisher"] == 1)
        assert index.prefix_blocks("a:1", H) == 0
        rogue.send(EventBatch("engine-a", "e", 1, 0.0, (stored(H[0]),)).encode())
        wait_for(lambda: index.prefix_blocks("a:1", H) == 1)  # and it keeps going
    finally:
        rogue.close()


# ---- the policy ---------------------------------------------------------------------------------------


def node(address: str, costs: NodeCosts, inflight: int = 0) -> NodeHandle:
    handle = NodeHandle(address, "pdkv.v1.PrefillNode")
    handle.namespace = NS
    handle.costs = costs
    handle._inflight = inflight
    return handle


PROMPT = list(range(64))  # 16 blocks of 4
HASHES = hash_blocks(PROMPT, namespace=NS)


def test_kv_aware_sends_a_request_to_the_node_holding_its_prefix() -> None:
    index = KVIndex()
    index.expects("b:1", EventBatch("x", "eb", 1, 0.0, ()))
    index.apply("b:1", EventBatch("x", "eb", 1, 0.0, (stored(*HASHES[:12]),)))
    same = NodeCosts(prefill_s_per_token=1e-3)
    a, b, c = node("a:1", same), node("b:1", same), node("c:1", same)
    policy = KVAware(index)
    info = RoutingInfo("r", PROMPT)
    assert policy.choose([a, b, c], info) is b
    est = {e.node.address: e for e in policy.estimates([a, b, c], info)}
    assert est["b:1"].local_tokens == 48 and est["b:1"].compute_tokens == 16
    assert est["a:1"].compute_tokens == 64


@pytest.mark.parametrize(("load_s_per_token", "winner"), [(1e-5, "b:1"), (5e-3, "a:1")])
def test_kv_aware_loads_instead_of_recomputing_only_when_the_measured_costs_say_so(
    load_s_per_token: float, winner: str
) -> None:
    """a holds the prefix but is busy; b holds nothing locally, the store holds it.  A fast store load
    makes b's load + compute cheaper than a's queue; a slow one does not."""
    index = KVIndex()
    for who, epoch in (("a:1", "ea"), (STORE, "es")):
        index.expects(who, EventBatch("x", epoch, 1, 0.0, ()))
        index.apply(who, EventBatch("x", epoch, 1, 0.0, (stored(*HASHES[:15]),)))
    a = node("a:1", NodeCosts(prefill_s_per_token=1e-3, load_s_per_token=1e-4, queued_prefill_tokens=200))
    b = node("b:1", NodeCosts(prefill_s_per_token=1e-3, load_s_per_token=load_s_per_token))
    assert KVAware(index).choose([a, b], RoutingInfo("r", PROMPT)).address == winner


def test_kv_aware_without_any_event_or_measurement_balances_the_load() -> None:
    index = KVIndex()
    a, b = node("a:1", NodeCosts(), inflight=3), node("b:1", NodeCosts())
    assert KVAware(index).choose([a, b], RoutingInfo("r", PROMPT)) is b  # equal estimates: least loaded


def test_kv_events_travel_over_curve_and_a_stranger_gets_none(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """With $PDKV_CURVE_DIR the events say which prefixes are cached to allow-listed subscribers only."""
    from wire.curve import write_curve_folder

    monkeypatch.setenv("PDKV_CURVE_DIR", str(write_curve_folder(tmp_path / "curve", ["router"])))
    monkeypatch.setenv("PDKV_CURVE_NAME", "router")
    pub = publisher("engine-a")
    index = KVIndex()
    sub = KVEventSubscriber(index, lambda: [target("a:1", pub)], refresh_s=0.05).start()
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.SUB)  # no CURVE keys
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.connect(pub.endpoint)
    try:
        time.sleep(0.3)
        pub.publish([stored(H[0], H[1])])
        wait_for(lambda: index.prefix_blocks("a:1", H[:2]) == 2)  # the allow-listed router sees them
        assert stranger.poll(500) == 0  # the stranger never completes the handshake
    finally:
        stranger.close(0)
        ctx.term()
        sub.close()
        pub.close()
