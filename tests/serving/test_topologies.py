"""Larger and other topologies: 2 prefill + 2 decode nodes (against transformers too), colocated mode,
and the shared KV store (once the ``offload`` connector is registered)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from connectors.registry import discover
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import DEFAULT_STORE, Cluster
from serving.client import GenerationClient, generate_request
from tests.serving.helpers import (
    HF_NODE_ARGS,
    assert_node_idle,
    assert_usage_adds_up,
    hf_model,
    node_stats,
    start_cluster,
)
from tests.serving.test_cluster import TEXT_PROMPTS, assert_same, generate_all
from tests.tiny_models import hf_greedy, random_prompts

OFFLOAD = "offload" in discover()
MIN_MARGIN = 1e-3
LENGTHS = (3, 4, 9, 17, 30, 41, 56, 75)
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def cluster_2x2() -> Iterator[Cluster]:
    """2 prefill + 2 decode on the transformers-written tiny Llama (block size 4), round-robin routing,
    with the shared store when the offload connector exists."""
    c = start_cluster(
        num_prefill=2,
        num_decode=2,
        model=hf_model(),
        node_args=HF_NODE_ARGS,
        kv_store=DEFAULT_STORE if OFFLOAD else None,
        router_args=("--policy", "round-robin"),
    )
    try:
        yield c
    finally:
        c.stop()


def test_two_by_two_matches_local_engine_and_transformers(cluster_2x2: Cluster) -> None:
    prompts = random_prompts(LENGTHS, seed=11)
    with GenerationClient(cluster_2x2.router_address) as client:
        outs = generate_all(client, prompts, GREEDY)
    local = LLM(hf_model(), device="cpu", block_size=4, num_blocks=256)
    assert_same(outs, local, prompts, GREEDY)
    for out, ref in zip(outs, hf_greedy("llama", prompts, GREEDY.max_tokens), strict=True):
        assert ref.min_margin > MIN_MARGIN, "the reference has a near-tie; pick another seed"
        assert out.token_ids == ref.token_ids
    for node in cluster_2x2.prefill_nodes + cluster_2x2.decode_nodes:
        stats = assert_node_idle(node.address)
        finished = sum(v for k, v in stats.counters.items() if k.startswith("request_success."))
        assert finished > 0, f"{node.name} got no work"


@pytest.mark.skipif(not OFFLOAD, reason="the offload connector is not registered")
def test_a_repeated_prompt_hits_the_store_on_the_other_prefill_node(cluster_2x2: Cluster) -> None:
    prompt = random_prompts([40], seed=99)[0]
    with GenerationClient(cluster_2x2.router_address) as client:
        first = client.generate(generate_request(prompt, GREEDY), timeout=60)
        for node in cluster_2x2.prefill_nodes:  # idle: its saves to the store are done (delayed free)
            assert_node_idle(node.address)
        # Round-robin: the second request goes to the other prefill node, whose prefix cache is cold.
        second = client.generate(generate_request(prompt, GREEDY), timeout=60)
    assert first.usage is not None and second.usage is not None
    assert first.usage.cached.store == 0
    assert second.usage.cached.local_prefix == 0
    assert second.usage.cached.store == (40 - 1) // 4 * 4  # whole blocks, never the last token
    assert_usage_adds_up(first.usage)
    assert_usage_adds_up(second.usage)
    assert second.token_ids == first.token_ids
    externals = [
        node_stats(p.address).counters["prompt_tokens.external_kv_transfer"]
        for p in cluster_2x2.prefill_nodes
    ]
    assert sum(externals) == second.usage.cached.store


def test_colocated_mode_matches_local_engine() -> None:
    from tests.serving.helpers import pdkv_model

    c = start_cluster(mode="colocated", num_prefill=0, num_decode=1, node_threads=1)
    try:
        assert c.decode_nodes[0].info["threads"] == "1"  # its compute threads, as the launcher asked
        with GenerationClient(c.router_address) as client:
            outs = generate_all(client, TEXT_PROMPTS, GREEDY)
            again = client.generate(generate_request(TEXT_PROMPTS[1], GREEDY), timeout=60)
        assert_same(outs, LLM(pdkv_model(), device="cpu", num_blocks=512), TEXT_PROMPTS, GREEDY)
        assert again.usage is not None and again.usage.cached.local_prefix > 0
        assert_usage_adds_up(again.usage)
        assert again.usage.cached.remote_prefill == 0
        assert_node_idle(c.decode_nodes[0].address)
    finally:
        c.stop()
