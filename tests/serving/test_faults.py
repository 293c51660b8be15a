"""Faults with real processes: a decode node killed mid-stream (with and without another node to resume
on), prefill nodes killed before they answer and while they compute."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from serving.client import GenerationClient, generate_request
from serving.launcher import Cluster, Process
from tests.serving.helpers import (
    NODE_ARGS,
    assert_node_idle,
    assert_usage_adds_up,
    node_stats,
    pdkv_model,
    start_cluster,
    wait_until,
)

LONG = SamplingParams(max_tokens=3000, ignore_eos=True)
PROMPT = "A prompt of a few blocks, so that the prefill node holds KV for the decode node. " * 3


def test_decode_node_killed_mid_stream() -> None:
    cluster = start_cluster(num_prefill=1, num_decode=1)
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, LONG), timeout=60)
            deltas = 0
            with pytest.raises(grpc.RpcError) as info:
                for msg in call:
                    deltas += msg.HasField("delta")
                    if deltas == 3:
                        cluster.kill(cluster.decode_nodes[0])
            assert deltas >= 3
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "decode node" in info.value.details()
            # Whatever the prefill node still held for the dead decoder is freed (well within the lease).
            assert_node_idle(cluster.prefill_nodes[0].address, timeout=10)
            # The router stops routing to the dead node: the next request fails fast, saying why.
            with pytest.raises(grpc.RpcError) as again:
                client.generate(generate_request("Hello", SamplingParams(max_tokens=4)), timeout=30)
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy decode node" in again.value.details()
    finally:
        cluster.stop()


def test_prefill_nodes_killed_before_they_answer() -> None:
    # A long health interval: the router learns that a node died only from the failed call.
    cluster = start_cluster(
        num_prefill=2, num_decode=1, router_args=("--health-interval-s", "60", "--policy", "round-robin")
    )
    try:
        params = SamplingParams(max_tokens=6)
        with GenerationClient(cluster.router_address) as client:
            cluster.kill(cluster.prefill_nodes[0])
            for i in range(4):  # round-robin would send half of them to the dead node: all are retried
                out = client.generate(generate_request(f"{PROMPT} {i}", params), timeout=30)
                assert len(out.token_ids) == 6 and out.finish_reason == "length"
            cluster.kill(cluster.prefill_nodes[1])
            with pytest.raises(grpc.RpcError) as info:
                client.generate(generate_request(PROMPT, params), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "prefill" in info.value.details()
        assert_node_idle(cluster.decode_nodes[0].address)
    finally:
        cluster.stop()


def serving_node(cluster: Cluster) -> Process:
    """The decode (or colocated) node running the one request in flight."""
    busy = [
        p
        for p in cluster.decode_nodes
        if node_stats(p.address, check_integrity=False).gauges["num_requests_running"]
    ]
    assert len(busy) == 1, "exactly one node should be running the request"
    return busy[0]


@pytest.mark.parametrize(
    ("mode", "params"),
    [
        ("disaggregated", SamplingParams(max_tokens=400, ignore_eos=True)),
        ("colocated", SamplingParams(max_tokens=400, ignore_eos=True, temperature=1.0, top_k=40, seed=5)),
    ],
)
def test_a_decode_node_killed_mid_stream_hands_the_request_to_another(
    mode: str, params: SamplingParams
) -> None:
    """The stream goes on on the other node, which resumes after the tokens the client already has: the
    client sees one uninterrupted output, greedy or seeded, token for token and character for character."""
    cluster = start_cluster(mode=mode, num_prefill=1 if mode == "disaggregated" else 0, num_decode=2)
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, params), timeout=120)
            token_ids: list[int] = []
            text = ""
            killed: Process | None = None
            done = None
            for msg in call:
                if msg.HasField("delta"):
                    token_ids += msg.delta.token_ids
                    text += msg.delta.text
                    if killed is None and len(token_ids) >= 5:
                        killed = serving_node(cluster)
                        cluster.kill(killed)
                elif msg.HasField("done"):
                    done = msg.done
            assert killed is not None and done is not None
        # Usage speaks of the client's prompt and output, not of the resumed node's longer prompt.
        usage = done.usage
        assert usage.completion_tokens == len(token_ids)
        assert_usage_adds_up(usage)
        if mode == "disaggregated":  # the first decode node pulled the prompt's blocks before it died
            assert usage.cached.remote_prefill > 0
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([PROMPT], params)[0]
        assert token_ids == expected.token_ids
        assert text == expected.text
        survivor = next(p for p in cluster.decode_nodes if p is not killed)
        assert_node_idle(survivor.address)
        metrics = urllib.request.urlopen(f"http://{cluster.router.info['metrics']}/metrics", timeout=10)
        assert b"pdkv_router_decode_resumes_total 1" in metrics.read()
    finally:
        cluster.stop()


def test_a_prefill_node_killed_while_it_computes_hands_the_request_to_another() -> None:
    """Chunked prefill of 16 tokens a step makes a long prompt take many steps; the node computing it is
    killed on the way, and the router runs the prefill again on the other node: the client sees one
    complete, exact output."""
    prompt = PROMPT * 12
    params = SamplingParams(max_tokens=8)
    cluster = start_cluster(
        num_prefill=2,
        num_decode=1,
        node_args=(*NODE_ARGS, "--max-num-batched-tokens", "16"),
        router_args=("--health-interval-s", "60"),
    )
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(prompt, params), timeout=120)

            def computing() -> Process | None:
                busy = [
                    p
                    for p in cluster.prefill_nodes
                    if node_stats(p.address, check_integrity=False).gauges["num_requests_running"]
                ]
                return busy[0] if busy else None

            victim = wait_until(
                computing, timeout=30, what="a prefill node to start computing", interval=0.01
            )
            assert node_stats(victim.address, check_integrity=False).num_requests == 1
            cluster.kill(victim)
            token_ids: list[int] = []
            text = ""
            for msg in call:
                if msg.HasField("delta"):
                    token_ids += msg.delta.token_ids
                    text += msg.delta.text
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([prompt], params)[0]
        assert token_ids == expected.token_ids and text == expected.text
        survivor = next(p for p in cluster.prefill_nodes if p is not victim)
        assert_node_idle(survivor.address)
        assert_node_idle(cluster.decode_nodes[0].address)
    finally:
        cluster.stop()
