"""Full nodes: the router is the queue.  A node that already runs --max-num-requests answers
RESOURCE_EXHAUSTED "the node is full"; the router waits for room rather than failing a request it
accepted (router/room.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import grpc
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from router.events import Cancellation
from router.room import RoomWait
from serving.client import GenerationClient, generate_request
from serving.errors import ServingError
from tests.serving.helpers import NODE_ARGS, assert_node_idle, pdkv_model, start_cluster


class _Scope:
    """A call scope as RoomWait reads it: its deadline, and whether the client left."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.callbacks: list[object] = []

    def time_remaining(self) -> float | None:
        return self.remaining

    def add_callback(self, callback: object) -> bool:
        self.callbacks.append(callback)
        return True


def test_a_wait_for_room_retries_the_full_nodes_and_ends_at_its_limit_or_the_client_s_cancel() -> None:
    scope: Any = _Scope(None)
    cancellation = Cancellation(scope)
    room = RoomWait("decode", scope, cancellation, limit_s=0.3)
    full: Any = "full"  # nodes as RoomWait compares them: by identity
    tried: list[Any] = ["down", full]
    assert not room.again(tried)  # no node was full: nothing to wait for
    room.note_full(full)
    assert room.again(tried) and tried == ["down"]  # the full one, again
    room.note_full(full)
    with pytest.raises(ServingError, match="every decode node that serves the request is full") as gave_up:
        while room.again([*tried, full]):
            room.note_full(full)
    assert gave_up.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The client's deadline bounds the wait; a client that leaves ends it at once.
    short = RoomWait("prefill", cast(Any, _Scope(0.05)), cancellation, limit_s=60)
    assert short.deadline - short.started <= 0.06
    left = RoomWait("prefill", scope, cancellation, limit_s=60)
    left.note_full(full)
    left.pause = 30.0
    threading.Timer(0.1, scope.callbacks[0]).start()
    started = time.monotonic()
    with pytest.raises(ServingError, match="cancelled") as cancelled:
        left.again(cast(Any, ["full"]))
    assert cancelled.value.code == grpc.StatusCode.CANCELLED and time.monotonic() - started < 5


def test_requests_beyond_what_the_nodes_take_wait_for_room_and_all_complete_exactly() -> None:
    """An outside probe's find: 80 concurrent requests on nodes that take 64 each failed 13-15 of them
    with UNAVAILABLE "no healthy prefill node" (some after their first token: the decode node was full),
    though every node was well and the router had admitted them.  Here nodes take 2 requests each and
    the router gets 10 at once, through both phases: each completes, with the tokens it gets alone."""
    cluster = start_cluster(num_prefill=1, num_decode=1, node_args=(*NODE_ARGS, "--max-num-requests", "2"))
    prompts = [f"Request number {i} of a burst larger than the nodes take. " * 2 for i in range(10)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        with GenerationClient(cluster.router_address) as client, ThreadPoolExecutor(10) as pool:
            outs = list(
                pool.map(lambda p: client.generate(generate_request(p, params), timeout=120), prompts)
            )
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate(prompts, params)
        assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
        assert_node_idle(cluster.prefill_nodes[0].address)
        assert_node_idle(cluster.decode_nodes[0].address)
    finally:
        cluster.stop()


def test_a_planned_restart_of_the_only_node_of_a_kind_pauses_requests_and_fails_none() -> None:
    """An outside probe's find: ``pdkv restart prefill-0`` with one prefill node answered 503 to every
    request for the 15 s it was away (8,749 refusals).  While no node of the pool is up and one is
    stopping, a request waits for its return: the restart costs latency, not requests."""
    from pdkv.launcher import RollingRestarts

    cluster = start_cluster(num_prefill=1, num_decode=1, drain_timeout_s=5.0)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    stop = threading.Event()
    outputs: list[tuple[str, list[int]]] = []
    failures: list[str] = []

    def client_loop(k: int) -> None:
        with GenerationClient(cluster.router_address) as client:
            i = 0
            while not stop.is_set():
                prompt = f"Client {k} asks question {i % 3} while a node restarts."
                try:
                    outputs.append(
                        (prompt, client.generate(generate_request(prompt, params), timeout=120).token_ids)
                    )
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code()}: {exc.details()}")
                i += 1

    threads = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(3)]
    try:
        for t in threads:
            t.start()
        for name in ("prefill-0", "decode-0"):
            before = len(outputs)
            RollingRestarts(cluster).restart(name, lambda line: None)
            deadline = time.monotonic() + 60
            while len(outputs) < before + 6 and time.monotonic() < deadline:
                time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(150)
        assert failures == [], failures[:3]
        llm = LLM(pdkv_model(), device="cpu", num_blocks=512)
        expected = {p: llm.generate([p], params)[0].token_ids for p in {p for p, _ in outputs}}
        assert len(outputs) >= 12 and all(ids == expected[p] for p, ids in outputs)
    finally:
        stop.set()
        cluster.stop()
