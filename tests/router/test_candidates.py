"""``router/candidates.py``: nodes continue one another's work only where they run one model (their hash
namespaces).  A prefill node is paired with a decode node of its model or not used; a stream whose node
failed resumes only on a node of the model that made what the client has -- else a clear error, never a
reply that is neither node's output."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from engine.hashing import HashNamespace
from engine.sampling_params import SamplingParams
from pdkv_proto.pdkv.v1 import node_pb2
from router.admission import AdmittedRequest
from router.candidates import Pairing, choose
from router.events import Delta, Done
from router.nodes import NodeHandle, NodePool
from router.pipeline import Pipeline
from router.policy import RoundRobin
from serving.errors import ServingError
from tests.router.fakes import OpenScope

BF16 = HashNamespace("llama;kv=bfloat16;det", 16)
F32 = HashNamespace("llama;kv=float32", 16)
REQUEST = AdmittedRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))


class _Failed(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A node's stream that died: UNAVAILABLE, as gRPC reports a killed peer."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"


class _Stream:
    """A Decode stream: ``tokens`` one a message, then finished -- or the failure after ``fail_after``."""

    def __init__(self, tokens: list[int], fail_after: int | None) -> None:
        self.tokens, self.fail_after = tokens, fail_after

    def __iter__(self) -> Iterator[node_pb2.DecodeResponse]:
        for i, t in enumerate(self.tokens):
            if i == self.fail_after:
                raise _Failed()
            yield node_pb2.DecodeResponse(token_ids=[t], text=f"<{t}>", finished=i == len(self.tokens) - 1)

    def cancel(self) -> None:
        pass


class _DecodeStub:
    def __init__(self, node: NodeHandle, tokens: list[int], fail_after: int | None) -> None:
        self.node, self.tokens, self.fail_after = node, tokens, fail_after
        self.calls: list[node_pb2.DecodeRequest] = []

    def Decode(self, msg: node_pb2.DecodeRequest, timeout: Any = None) -> _Stream:
        self.calls.append(msg)
        done = len(msg.resume_output_token_ids)
        return _Stream(self.tokens[done:], None if self.fail_after is None else self.fail_after - done)


def _node(address: str, namespace: HashNamespace | None) -> NodeHandle:
    node = NodeHandle(address, "pdkv.v1.DecodeNode")
    node.namespace = namespace
    node.mark_up()
    return node


def _pool(kind: str, *nodes: NodeHandle) -> NodePool:
    pool = NodePool(kind, [], f"pdkv.v1.{kind.capitalize()}Node")
    pool._nodes = {n.address: n for n in nodes}
    return pool


def test_a_prefill_node_pairs_only_with_a_decode_node_of_its_model(caplog: pytest.LogCaptureFixture) -> None:
    p32, p16 = _node("10.0.0.1:1", F32), _node("10.0.0.1:2", BF16)
    d16, unknown = _node("10.0.0.2:1", BF16), _node("10.0.0.2:2", None)
    pairing = Pairing()
    assert pairing.prefill_models(_pool("prefill", p32, p16), _pool("decode", d16), REQUEST) == {BF16}
    choice = choose(RoundRobin(), _pool("prefill", p32, p16), REQUEST, [], models={BF16})
    assert choice is p16
    # A decode node whose model is not known yet: any prefill node (its engine refuses foreign KV).
    assert pairing.prefill_models(_pool("prefill", p32), _pool("decode", d16, unknown), REQUEST) is None
    # No prefill node runs a decode node's model: none is used (the request runs whole on a decode
    # node), said once for this set of nodes.
    with caplog.at_level(logging.WARNING, logger="router.candidates"):
        for _ in range(3):
            assert pairing.prefill_models(_pool("prefill", p32), _pool("decode", d16), REQUEST) == set()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no prefill node runs a model a decode node runs" in said[0]
    assert F32.model_fingerprint in said[0] and BF16.model_fingerprint in said[0]


def test_a_phase_s_preferred_node_of_another_model_is_passed_over_and_none_left_is_a_clear_error() -> None:
    a16, b32 = _node("10.0.0.2:1", BF16), _node("10.0.0.2:2", F32)
    pool = _pool("decode", a16, b32)
    assert choose(RoundRobin(), pool, REQUEST, [], prefer=b32, models={BF16}) is a16
    with pytest.raises(ServingError) as failed:
        choose(RoundRobin(), pool, REQUEST, [a16], models={BF16}, whose=lambda: "the node that made 2 tokens")
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no healthy decode node runs the model the node that made 2 tokens ran" in failed.value.message
    assert BF16.model_fingerprint in failed.value.message and F32.model_fingerprint in failed.value.message


def _run(nodes: list[tuple[str, HashNamespace, int | None]]) -> tuple[list[Any], list[_DecodeStub]]:
    """A colocated request over decode nodes (address, model, failing after that many tokens): the
    events it gives, or the ServingError it ends with as the last item."""
    handles, stubs = [], []
    for address, namespace, fail_after in nodes:
        handle = _node(address, namespace)
        stub = _DecodeStub(handle, [11, 12, 13, 14], fail_after)
        handle.decode = stub  # type: ignore[assignment]
        handles.append(handle)
        stubs.append(stub)
    pipeline = Pipeline(
        "colocated", None, _pool("decode", *handles), lambda pool: RoundRobin(), decode_attempts=3
    )
    events: list[Any] = []
    try:
        events.extend(pipeline.generate(REQUEST, OpenScope()))  # type: ignore[arg-type]
    except ServingError as exc:
        events.append(exc)
    return events, stubs


def test_a_stream_resumes_only_on_a_node_of_the_model_that_made_its_first_tokens() -> None:
    # The first node (by address) fails after 2 tokens; the next runs another model, the last its own.
    events, stubs = _run([("10.0.0.2:1", BF16, 2), ("10.0.0.2:2", F32, None), ("10.0.0.2:3", BF16, None)])
    assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == [11, 12, 13, 14]
    assert isinstance(events[-1], Done)
    assert stubs[1].calls == []  # the other model's node never saw the request
    assert list(stubs[2].calls[0].resume_output_token_ids) == [11, 12]


def test_a_stream_with_no_node_of_its_model_left_fails_clearly_after_the_tokens_sent() -> None:
    events, stubs = _run([("10.0.0.2:1", BF16, 2), ("10.0.0.2:2", F32, None)])
    assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == [11, 12]
    failed = events[-1]
    assert isinstance(failed, ServingError) and failed.code == grpc.StatusCode.UNAVAILABLE
    assert (
        "no healthy decode node runs the model the node that made its first 2 token(s) ran" in failed.message
    )
    assert stubs[1].calls == []
