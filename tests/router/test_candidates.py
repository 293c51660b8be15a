"""``router/candidates.py``: nodes continue one another's work only where they run one model (their hash
namespaces).  A prefill node is paired with a decode node of its model or not used -- the request then
runs whole on a decode node; a stream whose node failed resumes only on a node of the model that made
what the client has -- else a clear error, never a reply that is neither node's output."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from engine.hashing import AdapterId, HashNamespace
from engine.sampling_params import SamplingParams
from pdkv_proto.pdkv.v1 import node_pb2, types_pb2
from router import nodes
from router.admission import AdmittedRequest
from router.candidates import WHOLE, Pairing, PrefillPlan, Unpaired, choose
from router.events import Delta, Done
from router.nodes import NodeHandle, NodePool
from router.pipeline import Pipeline
from router.policy import RoundRobin
from serving.errors import ServingError
from tests.router.fakes import OpenScope

BF16 = HashNamespace("llama;kv=bfloat16;det", 16)
F32 = HashNamespace("llama;kv=float32", 16)
BF16_B8 = HashNamespace("llama;kv=bfloat16;det", 8)  # the same fingerprint, another block size
REQUEST = AdmittedRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
TOKENS = [11, 12, 13, 14]


class _Failed(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A node's call that died: UNAVAILABLE, as gRPC reports a killed peer."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"


class _Stream:
    """A Decode stream: its tokens one a message (the first carrying the prompt's sources), the last
    finished -- or the failure after ``fail_after`` tokens."""

    def __init__(self, tokens: list[int], fail_after: int | None) -> None:
        self.tokens, self.fail_after = tokens, fail_after

    def __iter__(self) -> Iterator[node_pb2.DecodeResponse]:
        for i, t in enumerate(self.tokens):
            if i == self.fail_after:
                raise _Failed()
            prompt = types_pb2.PromptUsage(prompt_tokens=3, local_prefix_tokens=1, computed_tokens=2)
            last = i == len(self.tokens) - 1
            yield node_pb2.DecodeResponse(token_ids=[t], text=f"<{t}>", finished=last, prompt=prompt)

    def cancel(self) -> None:
        pass


class _DecodeStub:
    def __init__(self, fail_after: int | None) -> None:
        self.fail_after = fail_after
        self.calls: list[node_pb2.DecodeRequest] = []

    def Decode(self, msg: node_pb2.DecodeRequest, timeout: Any = None) -> _Stream:
        self.calls.append(msg)
        done = len(msg.resume_output_token_ids) or int(msg.HasField("first_token_id"))
        return _Stream(TOKENS[done:], None if self.fail_after is None else self.fail_after - done)


class _Future:
    def __init__(self, answer: node_pb2.PrefillResponse | None) -> None:
        self.answer = answer

    def result(self) -> node_pb2.PrefillResponse:
        if self.answer is None:
            raise _Failed()
        return self.answer

    def cancel(self) -> None:
        pass


class _PrefillStub:
    """Prefill answers the first token (or fails: ``fails``); ``calls`` counts them."""

    def __init__(self, fails: bool = False) -> None:
        self.fails, self.calls = fails, 0
        self.Prefill = self

    def future(self, msg: node_pb2.PrefillRequest, timeout: Any = None) -> _Future:
        self.calls += 1
        answer = node_pb2.PrefillResponse(request_id=msg.request_id, first_token_id=TOKENS[0])
        return _Future(None if self.fails else answer)


def _node(address: str, namespace: HashNamespace | None, adapters: tuple[str, ...] = ()) -> NodeHandle:
    node = NodeHandle(address, "pdkv.v1.Node")
    node.namespace = namespace
    node.adapters = {a: AdapterId(a, bytes(32)) for a in adapters}
    node.mark_up()
    return node


def _pool(kind: str, *members: NodeHandle) -> NodePool:
    pool = NodePool(kind, [], f"pdkv.v1.{kind.capitalize()}Node")
    pool._nodes = {n.address: n for n in members}
    return pool


def test_a_prefill_node_pairs_only_with_a_decode_node_of_its_model(caplog: pytest.LogCaptureFixture) -> None:
    p32, p16 = _node("10.0.0.1:1", F32), _node("10.0.0.1:2", BF16)
    d16, d8 = _node("10.0.0.2:1", BF16), _node("10.0.0.2:2", BF16_B8)
    pairing = Pairing()
    with caplog.at_level(logging.WARNING, logger="router.candidates"):
        assert pairing.plan(_pool("prefill", p32, p16), _pool("decode", d16, d8), REQUEST) == PrefillPlan(
            frozenset({BF16, BF16_B8})
        )
        # Each node left without a partner of its model is named once: it gets no disaggregated request.
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and all("gets no disaggregated request" in m for m in said)
        assert "10.0.0.1:1 runs llama;kv=float32 (block size 16, sha256)" in said[0]
        assert "10.0.0.2:2 runs llama;kv=bfloat16;det (block size 8, sha256)" in said[1]
        assert choose(RoundRobin(), _pool("prefill", p32, p16), REQUEST, [], models={BF16}) is p16
        caplog.clear()
        # No prefill node runs a decode node's model: the requests run whole, said when it starts ...
        for _ in range(3):
            assert pairing.plan(_pool("prefill", p32), _pool("decode", d16), REQUEST) == WHOLE
        [started] = [r.getMessage() for r in caplog.records]
        assert "no healthy prefill node runs a model a healthy decode node runs" in started
        assert (
            "llama;kv=float32 (block size 16" in started and "llama;kv=bfloat16;det (block size 16" in started
        )
        caplog.clear()
        # ... and when it stops; and again when it starts again.
        assert pairing.plan(_pool("prefill", p16), _pool("decode", d16), REQUEST).models == {BF16}
        assert pairing.plan(_pool("prefill", p32), _pool("decode", d16), REQUEST) == WHOLE
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "are up again" in said[0] and "run whole" in said[1]


def test_the_pairing_counts_only_nodes_serving_the_request_s_adapter() -> None:
    """A review's find: a prefill node of the decode node's model that does not serve the adapter is no
    partner -- the request runs whole on the decode node, not refused."""
    p16, p32 = _node("10.0.0.1:1", BF16), _node("10.0.0.1:2", F32, adapters=("lora1",))
    d16 = _node("10.0.0.2:1", BF16, adapters=("lora1",))
    request = AdmittedRequest(
        "r", [1, 2, 3], SamplingParams(max_tokens=4), adapter=AdapterId("lora1", bytes(32))
    )
    assert Pairing().plan(_pool("prefill", p16, p32), _pool("decode", d16), request) == WHOLE
    assert Pairing().plan(_pool("prefill", p16, p32), _pool("decode", d16), REQUEST).models == {BF16}


def test_requests_of_several_adapters_alternating_say_each_change_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A review's find: the pairing's state was one flag for all requests -- base and adapter requests
    alternating (one pairs, the other runs whole) would log a change with every request."""
    p16, p32 = _node("10.0.0.1:1", BF16), _node("10.0.0.1:2", F32, adapters=("lora1",))
    d16 = _node("10.0.0.2:1", BF16, adapters=("lora1",))
    lora = AdmittedRequest(
        "r", [1, 2, 3], SamplingParams(max_tokens=4), adapter=AdapterId("lora1", bytes(32))
    )
    pairing, prefill, decode = Pairing(), _pool("prefill", p16, p32), _pool("decode", d16)
    with caplog.at_level(logging.WARNING, logger="router.candidates"):
        for _ in range(5):
            assert pairing.plan(prefill, decode, REQUEST).models == {BF16}
            assert pairing.plan(prefill, decode, lora) == WHOLE
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # p32 has no partner; lora1's requests run whole
    assert "10.0.0.1:2 runs llama;kv=float32" in said[0] and "requests of adapter lora1 run whole" in said[1]


def test_a_preferred_node_of_another_model_is_passed_over_and_none_left_is_unpaired() -> None:
    a16, b32, unknown = _node("10.0.0.2:1", BF16), _node("10.0.0.2:2", F32), _node("10.0.0.2:3", None)
    pool = _pool("decode", a16, b32, unknown)
    assert choose(RoundRobin(), pool, REQUEST, [], prefer=b32, models={BF16}) is a16
    with pytest.raises(Unpaired) as failed:
        choose(RoundRobin(), pool, REQUEST, [a16], models={BF16}, whose="the node that made 2 tokens")
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert failed.value.message == (
        "no healthy decode node runs the model of the node that made 2 tokens (llama;kv=bfloat16;det (block "
        "size 16, sha256)); those that serve the request run llama;kv=float32 (block size 16, sha256)"
    )


def _pipeline(
    mode: str, decode: list[tuple[HashNamespace, int | None]], prefill: list[tuple[HashNamespace, bool]] = ()
) -> tuple[Pipeline, list[_DecodeStub], list[_PrefillStub]]:
    """A pipeline over fake nodes: decode nodes (model, failing after that many tokens), prefill nodes
    (model, whether its Prefill fails)."""
    decode_stubs, prefill_stubs, decoders, prefills = [], [], [], []
    for i, (namespace, fail_after) in enumerate(decode):
        node = _node(f"10.0.0.2:{i + 1}", namespace)
        node.decode = decode_stubs.append(_DecodeStub(fail_after)) or decode_stubs[-1]  # type: ignore[assignment]
        decoders.append(node)
    for i, (namespace, fails) in enumerate(prefill):
        node = _node(f"10.0.0.1:{i + 1}", namespace)
        node.prefill = prefill_stubs.append(_PrefillStub(fails)) or prefill_stubs[-1]  # type: ignore[assignment]
        prefills.append(node)
    pipeline = Pipeline(
        mode,
        _pool("prefill", *prefills) if prefills else None,
        _pool("decode", *decoders),
        lambda pool: RoundRobin(),
        decode_attempts=3,
    )
    return pipeline, decode_stubs, prefill_stubs


def _run(pipeline: Pipeline) -> list[Any]:
    """The request's events, or the ServingError it ends with as the last item."""
    events: list[Any] = []
    try:
        events.extend(pipeline.generate(REQUEST, OpenScope()))  # type: ignore[arg-type]
    except ServingError as exc:
        events.append(exc)
    return events


def _tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def test_a_disaggregated_request_with_no_prefill_node_of_its_model_runs_whole_on_a_decode_node() -> None:
    pipeline, decode, prefill = _pipeline("disaggregated", [(BF16, None)], [(F32, False)])
    events = _run(pipeline)
    assert _tokens(events) == TOKENS and isinstance(events[-1], Done)
    assert prefill[0].calls == 0 and not decode[0].calls[0].HasField("first_token_id")
    usage = events[-1].usage  # the decode node computed the prompt: its sources are relayed
    assert (usage.local_prefix, usage.computed_prompt_tokens, usage.remote_prefill) == (1, 2, 0)
    assert pipeline.run_whole == 1


def test_a_request_runs_whole_once_the_last_prefill_node_of_its_model_fails() -> None:
    """A review's find: the pairing read before the first prefill attempt; its node failing left only a
    prefill node of another model, and the request was refused where a decode node could run it."""
    pipeline, _, prefill = _pipeline("disaggregated", [(BF16, None)], [(BF16, True), (F32, False)])
    events = _run(pipeline)
    assert _tokens(events) == TOKENS and isinstance(events[-1], Done)
    assert [p.calls for p in prefill] == [1, 0] and pipeline.run_whole == 1


def test_a_disaggregated_request_continues_on_the_decode_node_of_the_prefill_node_s_model() -> None:
    pipeline, decode, _ = _pipeline("disaggregated", [(F32, None), (BF16, None)], [(BF16, False)])
    for _ in range(2):  # round-robin would take the float32 node every other time
        assert _tokens(_run(pipeline)) == TOKENS
    assert decode[0].calls == [] and len(decode[1].calls) == 2 and pipeline.run_whole == 0
    assert all(c.first_token_id == TOKENS[0] for c in decode[1].calls)


def test_a_stream_resumes_only_on_a_node_of_the_model_that_made_its_first_tokens() -> None:
    # The first node (by address) fails after 2 tokens; the next runs another model, the last its own.
    pipeline, stubs, _ = _pipeline("colocated", [(BF16, 2), (F32, None), (BF16, None)])
    events = _run(pipeline)
    assert _tokens(events) == TOKENS and isinstance(events[-1], Done)
    assert stubs[1].calls == []  # the other model's node never saw the request
    assert list(stubs[2].calls[0].resume_output_token_ids) == TOKENS[:2]


def test_a_stream_with_no_node_of_its_model_left_fails_clearly_after_the_tokens_sent() -> None:
    pipeline, stubs, _ = _pipeline("colocated", [(BF16, 2), (F32, None)])
    events = _run(pipeline)
    assert _tokens(events) == TOKENS[:2]
    failed = events[-1]
    assert isinstance(failed, ServingError) and failed.code == grpc.StatusCode.UNAVAILABLE
    assert failed.message.startswith(
        "no healthy decode node runs the model of the node that made its first 2"
    )
    assert failed.message.count("retry") == 1
    assert stubs[1].calls == []


def test_a_node_is_up_only_once_its_stats_said_its_model_and_a_restart_reads_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nodes, "check", lambda *a, **k: "SERVING")
    node = NodeHandle("127.0.0.1:1", "pdkv.v1.DecodeNode")
    answers: list[node_pb2.NodeStats | None] = [None]

    class _Control:
        def Stats(self, request: object, timeout: float) -> node_pb2.NodeStats:
            answer = answers.pop(0)
            if answer is None:
                raise _Failed()
            return answer

    node.control = _Control()  # type: ignore[assignment]
    try:
        node.check(1.0)  # SERVING, but no Stats: which model it runs is not known
        assert not node.healthy and "model it runs is not known" in node.last_error
        answers.append(
            node_pb2.NodeStats(
                engine_id="a", model_fingerprint="llama;kv=float32", block_size=16, hash_algo="sha256"
            )
        )
        node.check(1.0)
        assert node.healthy and node.namespace == F32
        answers.append(
            node_pb2.NodeStats(
                engine_id="b", model_fingerprint="llama;kv=bfloat16;det", block_size=16, hash_algo="sha256"
            )
        )
        node.check(1.0)  # restarted on other weights at the same address
        assert node.healthy and node.namespace == BF16
    finally:
        node.close()


def test_a_node_left_alone_while_requests_ran_whole_is_named_once_pairing_resumes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A review's find: nodes seen without a partner while an adapter's requests ran whole were marked
    as said without being named, and never named after."""
    p16 = _node("10.0.0.1:1", BF16, adapters=("lora1",))
    d32, d16 = _node("10.0.0.2:1", F32, adapters=("lora1",)), _node("10.0.0.2:2", BF16)
    lora = AdmittedRequest(
        "r", [1, 2, 3], SamplingParams(max_tokens=4), adapter=AdapterId("lora1", bytes(32))
    )
    pairing, prefill, decode = Pairing(), _pool("prefill", p16), _pool("decode", d32, d16)
    with caplog.at_level(logging.WARNING, logger="router.candidates"):
        assert pairing.plan(prefill, decode, lora) == WHOLE
        assert pairing.plan(prefill, decode, REQUEST).models == {BF16, F32}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "requests of adapter lora1 run whole" in said[0]
    assert "node 10.0.0.2:1 runs llama;kv=float32" in said[1]
