"""kv-aware routing on a real cluster: 3 colocated nodes publishing KV events, the router's index, and
requests that go where their prefix is cached -- with greedy outputs identical under every policy."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster, Process
from serving.client import GenerationClient, generate_request
from tests.serving.helpers import HF_NODE_ARGS, hf_model, node_stats, start_cluster, wait_until
from tests.tiny_models import random_prompts

GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def kv_cluster() -> Iterator[Cluster]:
    c = start_cluster(
        mode="colocated",
        num_prefill=0,
        num_decode=3,
        model=hf_model(),
        node_args=HF_NODE_ARGS,
        policy="kv-aware",
    )
    try:
        yield c
    finally:
        c.stop()


def test_nodes_publish_their_kv_events(kv_cluster: Cluster) -> None:
    for proc in kv_cluster.decode_nodes:
        s = node_stats(proc.address)
        assert s.kv_events_endpoint.startswith("tcp://") and s.kv_events_replay_endpoint and s.kv_events_epoch


def index_blocks(router: Process) -> dict[str, float]:
    """The router's KV index: blocks it knows per node (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{router.info['metrics']}/metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    family = families.get("pdkv_router_kv_index_blocks")
    return {s.labels["node"]: s.value for s in family.samples} if family else {}


def test_a_repeated_prefix_goes_to_the_node_that_holds_it(kv_cluster: Cluster) -> None:
    prompts = random_prompts([40, 40, 40], seed=77)
    assert kv_cluster.router is not None
    with GenerationClient(kv_cluster.router_address) as client:
        firsts = [client.generate(generate_request(p, GREEDY), timeout=60) for p in prompts]
        # The router learns of the blocks from the nodes' events (it subscribes within a health round).
        wait_until(
            lambda: sum(index_blocks(kv_cluster.router).values()) >= 3 * 10,
            timeout=15.0,
            what="the router's index to hold every prompt's blocks",
        )
        # Every prompt, asked again, finds its whole prefix on the node it ran on.
        again = [client.generate(generate_request(p, GREEDY), timeout=60) for p in prompts]
    for a in again:
        assert a.usage is not None and a.usage.cached.local_prefix == (40 - 1) // 4 * 4
    local = LLM(hf_model(), device="cpu", block_size=4, num_blocks=256)
    want = [o.token_ids for o in local.generate(prompts, GREEDY)]
    assert [f.token_ids for f in firsts] == [a.token_ids for a in again] == want


def test_the_launcher_s_run_folder_and_logs_are_the_owner_s_only(kv_cluster: Cluster) -> None:
    assert kv_cluster.run_dir.stat().st_mode & 0o777 == 0o700
    logs = list(kv_cluster.run_dir.glob("*.log"))
    assert logs and all(p.stat().st_mode & 0o777 == 0o600 for p in logs)
