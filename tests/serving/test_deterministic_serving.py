"""Deterministic bfloat16 through the whole stack (#26): concurrent streams through prefill and decode
nodes get the bits each prompt gets alone on one local engine, and a stream whose decode node is killed
mid-stream continues on the other node as the uninterrupted run would have -- greedy and seeded, tokens
and logprobs.  GetModelInfo and /v1/models say what the nodes run."""

from __future__ import annotations

import json
import random
import threading
import urllib.request
from typing import Any

import pytest

from engine.cpu_features import bf16_kernels_cpu
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import Process
from pdkv_proto.pdkv.v1 import generation_pb2
from serving.client import GenerationClient, generate_request
from tests.serving.helpers import NODE_ARGS, assert_node_idle, node_stats, serving_node, start_cluster
from tests.tiny_models import pdkv_tiny_model_dir

pytestmark = pytest.mark.skipif(not bf16_kernels_cpu(), reason="needs AVX-512 or AVX2 (the bfloat16 kernels)")

BF16_ARGS = (*NODE_ARGS, "--dtype", "bfloat16", "--deterministic", "on")


def model() -> str:
    """head_dim 32: what the native prefill attention (deterministic mode's) takes."""
    return str(pdkv_tiny_model_dir(hidden=128, heads=4, kv_heads=2))


def local(prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    """Each prompt alone on one local engine, as the nodes run it."""
    llm = LLM(model(), device="cpu", dtype="bfloat16", num_blocks=512, deterministic=True)
    assert llm.engine.determinism.on
    outs = [llm.generate([p], params)[0] for p in prompts]
    llm.engine.shutdown()
    return outs


def collect(
    client: GenerationClient, prompt: list[int], params: SamplingParams
) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    for msg in client.stream(generate_request(prompt, params), timeout=120):
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
            logprobs += msg.delta.logprobs
    return tokens, logprobs


def test_concurrent_streams_through_prefill_and_decode_nodes_equal_each_prompt_alone() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(rng.randrange(20, 300))] for _ in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True)
    cluster = start_cluster(model=model(), num_prefill=2, num_decode=2, node_args=BF16_ARGS)
    try:
        results: dict[int, tuple[list[int], list[float]]] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                with GenerationClient(cluster.router_address) as client:
                    results[i] = collect(client, prompts[i], params)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors
        for i, expected in enumerate(local(prompts, params)):
            assert results[i] == (expected.token_ids, expected.logprobs), f"prompt {i}"
        with GenerationClient(cluster.router_address) as client:
            info = client.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        assert (info.dtype, info.deterministic) == ("bfloat16", True)
        if cluster.http_address is not None:
            with urllib.request.urlopen(f"http://{cluster.http_address}/v1/models", timeout=10) as r:
                card = json.loads(r.read())["data"][0]
            assert (card["dtype"], card["deterministic"]) == ("bfloat16", True)
        for p in cluster.prefill_nodes + cluster.decode_nodes:
            stats = node_stats(p.address, check_integrity=False)
            assert (stats.dtype, stats.deterministic) == ("bfloat16", True)
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=1500, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=1500, ignore_eos=True, logprobs=True, temperature=0.8, seed=11),
    ],
    ids=["greedy", "seeded-t0.8"],
)
def test_a_stream_resumed_after_its_decode_node_is_killed_continues_bit_for_bit(
    params: SamplingParams,
) -> None:
    prompt = [random.Random(4).randrange(384) for _ in range(70)]
    cluster = start_cluster(model=model(), num_prefill=1, num_decode=2, node_args=BF16_ARGS)
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(prompt, params), timeout=180)
            tokens: list[int] = []
            logprobs: list[float] = []
            killed: Process | None = None
            for msg in call:
                if msg.HasField("delta"):
                    tokens += msg.delta.token_ids
                    logprobs += msg.delta.logprobs
                    if killed is None and len(tokens) >= 5:
                        killed = serving_node(cluster)
                        cluster.kill(killed)
            assert killed is not None
        [expected] = local([prompt], params)
        assert len(tokens) == 1500
        assert tokens == expected.token_ids
        assert logprobs == expected.logprobs
        survivor = next(p for p in cluster.decode_nodes if p is not killed)
        assert_node_idle(survivor.address)
    finally:
        cluster.stop()


def test_a_prefill_node_of_another_model_is_not_paired_with_the_decode_nodes(tmp_path: Any) -> None:
    """An outside probe's find: a prefill node running other weights than the decode nodes started fine;
    each decode node refused its KV and recomputed the prompt, but every reply began with the prefill
    node's token -- output neither setup makes.  The router pairs nodes of one model only (their
    namespaces, from Stats): here the prefill node (float32) runs nothing and every request runs whole on
    the decode node (bfloat16), bit for bit what one local engine makes."""
    config = tmp_path / "pdkv.toml"
    config.write_text('[prefill]\ndtype = "float32"\n[decode]\ndtype = "bfloat16"\ndeterministic = "on"\n')
    rng = random.Random(5)
    prompts = [[rng.randrange(384) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    cluster = start_cluster(model=model(), num_prefill=1, num_decode=1, config_file=config)
    try:
        [prefill], [decode] = cluster.prefill_nodes, cluster.decode_nodes
        assert node_stats(prefill.address).dtype == "float32"
        with GenerationClient(cluster.router_address) as client:
            results = [collect(client, p, params) for p in prompts]
        for i, expected in enumerate(local(prompts, params)):
            assert results[i] == (expected.token_ids, expected.logprobs), f"prompt {i}"
        assert prompt_tokens(prefill.address) == 0
        assert prompt_tokens(decode.address) == sum(map(len, prompts))
    finally:
        cluster.stop()


def prompt_tokens(address: str) -> float:
    """The prompt tokens a node took in, from any source."""
    counters = node_stats(address, check_integrity=False).counters
    return sum(v for k, v in counters.items() if k.startswith("prompt_tokens."))
