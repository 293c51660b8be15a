"""Faults with real processes: a decode node killed mid-stream, prefill nodes killed before they answer."""

from __future__ import annotations

import grpc
import pytest

from engine.sampling_params import SamplingParams
from serving.client import GenerationClient, generate_request
from tests.serving.helpers import assert_node_idle, start_cluster

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
