"""The router's side of LoRA: the kv-aware index matches an adapter's blocks only for that adapter, a
name resolves to the identity most nodes serve, and only nodes serving that identity are candidates."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.hashing import AdapterId
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from router.adapters import RouterAdapters, prefer_resident, serves
from router.kv_index import KVIndex
from router.nodes import NodeHandle, NodePool
from router.policy import RoutingInfo
from serving.errors import ServingError
from tests.tiny_adapters import peft_adapter_dir
from tests.tiny_models import random_prompts, tiny_model_dir
from wire.kv_events import EventBatch

PROMPT = random_prompts([35], seed=2)[0]


def test_the_kv_index_matches_an_adapters_blocks_only_for_that_adapter() -> None:
    a, b = peft_adapter_dir("llama", "r16"), peft_adapter_dir("llama", "attn_only")
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        block_size=4,
        num_blocks=64,
        enable_kv_events=True,
        loras=(("A", str(a)), ("B", str(b))),
    )
    llm.generate([PROMPT], SamplingParams(max_tokens=2), adapters="A")
    events = tuple(llm.engine.take_kv_events())
    index = KVIndex()
    batch = EventBatch("node", "epoch", 1, time.time(), events)
    assert index.expects("node", batch) is None and index.apply("node", batch)
    ns = llm.engine.namespace
    lora = llm.engine.lora
    blocks = (len(PROMPT) + 2 - 1) // 4
    a_id, b_id = lora.resolve("A"), lora.resolve("B")
    assert index.prefix_blocks("node", RoutingInfo("r", PROMPT, adapter=a_id).block_hashes(ns)) >= blocks - 1
    for other in (None, b_id, AdapterId("A", bytes(32))):  # B, the base, other weights named A
        assert index.prefix_blocks("node", RoutingInfo("r", PROMPT, adapter=other).block_hashes(ns)) == 0
    assert index.prefix_blocks("node", RoutingInfo("r", PROMPT, cache_salt="A").block_hashes(ns)) == 0


def _node(address: str, adapters: dict[str, bytes], resident: tuple[str, ...] = ()) -> NodeHandle:
    node = NodeHandle(address, "pdkv.v1.DecodeNode")
    node.adapters = {n: AdapterId(n, d) for n, d in adapters.items()}
    node.resident_adapters = {node.adapters[n] for n in resident}
    node.mark_up()
    return node


def test_a_name_resolves_to_the_identity_most_nodes_serve_and_only_they_are_candidates() -> None:
    old, new = bytes(32), bytes([1] * 32)
    nodes = [
        _node("127.0.0.1:1", {"A": new}),
        _node("127.0.0.1:2", {"A": new}, resident=("A",)),
        _node("127.0.0.1:3", {"A": old, "B": old}),
    ]
    pool = NodePool("decode", [], "pdkv.v1.DecodeNode")
    pool._nodes = {n.address: n for n in nodes}
    adapters = RouterAdapters([pool])
    try:
        assert adapters.resolve("A") == AdapterId("A", new)  # a reload half done: the majority's
        assert adapters.resolve("B") == AdapterId("B", old)
        with pytest.raises(ServingError) as refused:
            adapters.resolve("C", "model")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        assert "model: adapter 'C' is not served here (served: A, B)" in refused.value.message
        a = adapters.resolve("A")
        candidates = [n for n in nodes if serves(n, a)]
        assert [n.address for n in candidates] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert [n.address for n in prefer_resident(candidates, a)] == ["127.0.0.1:2"]
        assert prefer_resident(candidates, None) == candidates
        assert all(serves(n, None) for n in nodes)
        with pytest.raises(ServingError, match="allow-runtime-lora"):
            adapters.load("D", "/nowhere")
    finally:
        for n in nodes:
            n.close()


def test_a_request_admitted_under_a_retired_identity_still_has_candidates_new_ones_do_not() -> None:
    """After a replace or an unload, the parts of a request admitted before it (its decode phase, its
    later choices) go to nodes that served its identity since they started: no node served it any more
    by name, and the request failed ("no healthy decode node serves adapter A@...").  A new request
    resolves the name to what is served now, or NOT_FOUND after an unload."""
    from pdkv_proto.pdkv.v1 import types_pb2

    old, new = bytes(32), bytes([1] * 32)
    replaced = _node("127.0.0.1:1", {"A": old})
    replaced.known_adapters = {AdapterId("A", old)}
    replaced.note_adapter(types_pb2.AdapterInfo(name="A", digest=new))  # the router loaded new weights
    unloaded = _node("127.0.0.1:2", {"A": old})
    unloaded.known_adapters = {AdapterId("A", old)}
    unloaded.forget_adapter("A")
    pool = NodePool("decode", [], "pdkv.v1.DecodeNode")
    pool._nodes = {n.address: n for n in (replaced, unloaded)}
    adapters = RouterAdapters([pool])
    try:
        admitted = AdapterId("A", old)
        assert serves(replaced, admitted) and serves(unloaded, admitted)
        assert adapters.resolve("A") == AdapterId("A", new)  # a new request: the new weights
        assert not serves(unloaded, AdapterId("A", new))  # ... where they are
        assert not serves(replaced, AdapterId("A", bytes([2] * 32)))  # weights it never had
    finally:
        for n in (replaced, unloaded):
            n.close()


def test_a_health_round_read_before_an_unload_does_not_bring_the_adapter_back() -> None:
    """A review's find: a Stats call answered just before the router's unload, assigned after it, listed
    the adapter again for a round -- new requests admitted after the unload returned 200."""
    import threading
    from unittest import mock

    from pdkv_proto.pdkv.v1 import node_pb2, types_pb2

    node = _node("127.0.0.1:1", {"A": bytes(32)})
    node.namespace = mock.Mock()  # known already (a Stats of this test carries none)
    before = node_pb2.NodeStats(engine_id="e", adapters=[types_pb2.AdapterInfo(name="A", digest=bytes(32))])
    answered, unloaded = threading.Event(), threading.Event()

    def stats(request: object, timeout: float) -> node_pb2.NodeStats:
        answered.set()
        unloaded.wait(10)  # the unload lands while this answer is on its way
        return before

    try:
        with mock.patch.object(node, "control") as control:
            control.Stats.side_effect = stats
            round_ = threading.Thread(target=node._refresh_stats, args=(1.0,))
            round_.start()
            assert answered.wait(10)
            node.forget_adapter("A")
            unloaded.set()
            round_.join(10)
        assert "A" not in node.adapters and AdapterId("A", bytes(32)) in node.known_adapters
        with mock.patch.object(node, "control") as control:  # the next round reads the truth
            control.Stats.return_value = node_pb2.NodeStats(engine_id="e")
            node._refresh_stats(1.0)
        assert node.adapters == {}
    finally:
        node.close()


def test_a_frozen_node_s_calls_are_cut_only_where_another_node_can_run_them() -> None:
    """A review's find: the router cut every open call of a node unanswering for --reroute-after-s when
    any node of its kind served -- a call under an adapter only the frozen node had then failed ("no
    healthy decode node serves adapter") where waiting for the node to thaw would have served it."""
    only_here = AdapterId("X", bytes(32))
    frozen, other = _node("127.0.0.1:1", {"X": bytes(32)}), _node("127.0.0.1:2", {})
    pool = NodePool("decode", [], "pdkv.v1.DecodeNode")
    pool._nodes = {n.address: n for n in (frozen, other)}
    cut: list[str] = []
    try:
        with frozen.busy(lambda: cut.append("base")), frozen.busy(lambda: cut.append("X"), only_here):
            frozen.mark_down("UNREACHABLE: DEADLINE_EXCEEDED")
            frozen.unreachable_since = time.monotonic() - 10
            pool.reroute_unreachable(5.0)
            assert cut == ["base"]  # X waits for the node: no other runs it
        assert frozen.inflight == 0
    finally:
        for n in (frozen, other):
            n.close()


def test_an_adapter_unloaded_through_the_router_stays_unloaded_when_a_node_restarts_with_it() -> None:
    """An outside probe's find: after an unload of a ``--lora`` adapter, a node restarted (with that
    adapter on its command line) listed it again, and new requests naming it ran (200) -- docs/lora.md
    says new ones get 404.  The name stays unserved, the node is asked to unload it again, and a load of
    the name serves it again."""
    from concurrent.futures import Future
    from unittest import mock

    from pdkv_proto.pdkv.v1 import types_pb2

    digest = bytes([3] * 32)
    node = _node("127.0.0.1:1", {"B": digest})
    pool = NodePool("decode", [], "pdkv.v1.DecodeNode")
    pool._nodes = {node.address: node}
    adapters = RouterAdapters([pool], allow_runtime=True)
    try:
        with mock.patch.object(node, "control") as control:
            control.UnloadAdapter.return_value = types_pb2.UnloadAdapterResponse()
            adapters.unload("B")
            assert "B" not in adapters.served()
            node.adapters = {"B": AdapterId("B", digest)}  # it restarted: a health round lists B again
            with pytest.raises(ServingError) as refused:
                adapters.resolve("B")
            assert refused.value.code == grpc.StatusCode.NOT_FOUND and adapters.info() == []
            done: Future[object] = Future()
            control.UnloadAdapter.future.return_value = done
            adapters.reconcile()
            adapters.reconcile()  # in flight: asked once
            assert control.UnloadAdapter.future.call_count == 1
            assert control.UnloadAdapter.future.call_args.args[0].name == "B"
            done.set_result(types_pb2.UnloadAdapterResponse())
            assert "B" not in node.adapters
            control.LoadAdapter.return_value = types_pb2.AdapterInfo(name="B", digest=digest)
            adapters.load("B", "/adapters/b")  # loaded again by name: served again
            assert adapters.resolve("B") == AdapterId("B", digest)
            adapters.reconcile()
            assert control.UnloadAdapter.future.call_count == 1 and control.LoadAdapter.future.call_count == 0
            # A name no node has (a typo): the unload fails and leaves no mark that would keep a later
            # --lora of that name unserved (a review's find).
            control.UnloadAdapter.side_effect = grpc.RpcError()
            with pytest.raises(ServingError):
                adapters.unload("typo")
            assert "typo" not in adapters._unloaded
            # The base model's name, which gRPC's LoadAdapter took (HTTP refused it): requests naming it
            # ran the base over HTTP and the adapter over gRPC.
            adapters.base_name = "m"
            with pytest.raises(ServingError, match="'m' is the base model's name") as refused:
                adapters.load("m", "/adapters/b")
            assert (
                refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and control.LoadAdapter.call_count == 1
            )
    finally:
        node.close()
