"""An adapter's KV through each store tier (the ``offload`` connector over CPU, disk, Redis and the store
server) and over p2p: a fresh engine loads A's prompt blocks for A -- and its output equals peft's --
while B, the base model and other weights loaded under the name A find none of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.registry import KVConnectorConfig
from engine.connector.params import RemoteDecode, RemotePrefill
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.factories import store_tier_spec
from tests.p2p_harness import assert_idle, run_until, stats, tokens
from tests.tiny_adapters import peft_adapter_dir, peft_greedy
from tests.tiny_models import random_prompts, tiny_model_dir

BASE = "llama"
BS = 4
PROMPT = random_prompts([35], seed=2)[0]
PARAMS = SamplingParams(max_tokens=10)
WHOLE = (len(PROMPT) - 1) // BS * BS


def make_llm(spec: str, loras: dict[str, Path]) -> LLM:
    connector = KVConnectorConfig("offload", {"kv_store": spec, "lookup_timeout_s": 5.0})
    return LLM(
        tiny_model_dir(BASE),
        dtype="float32",
        block_size=BS,
        num_blocks=64,
        kv_connector=connector,
        loras=tuple((n, str(p)) for n, p in loras.items()),
    )


def run(llm: LLM, adapter: str | None) -> tuple[list[int], int]:
    [out] = llm.generate([PROMPT], PARAMS, adapters=adapter)
    assert llm.engine.drain(10.0), "saves did not finish"
    llm.engine.scheduler.check_integrity()
    return out.token_ids, out.num_external_tokens


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis", "remote"])
def test_each_tier_serves_an_adapters_blocks_to_that_adapter_only(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    spec = store_tier_spec(tier, tmp_path, request)
    a, b = peft_adapter_dir(BASE, "r16"), peft_adapter_dir(BASE, "attn_only")
    other_a = peft_adapter_dir(BASE, "r16", seed=7)
    want = {name: peft_greedy(BASE, path, [PROMPT], 10)[0].token_ids for name, path in (("A", a), ("B", b))}
    writer = make_llm(spec, {"A": a})
    assert run(writer, "A") == (want["A"], 0)
    writer.engine.shutdown()
    reader = make_llm(spec, {"A": a, "B": b})
    assert run(reader, "B") == (want["B"], 0)  # A's blocks are in the tier: none is B's
    tokens, external = run(reader, None)
    assert external == 0 and tokens == peft_greedy(BASE, None, [PROMPT], 10)[0].token_ids
    assert run(reader, "A") == (want["A"], WHOLE)  # A's own: loaded, not computed
    reader.engine.shutdown()
    reloaded = make_llm(spec, {"A": other_a})  # other weights under the same name
    tokens, external = run(reloaded, "A")
    assert external == 0 and tokens == peft_greedy(BASE, other_a, [PROMPT], 10)[0].token_ids
    reloaded.engine.shutdown()


def _p2p_engine(engine_id: str, loras: dict[str, Path]) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=tiny_model_dir(BASE),
            dtype="float32",
            block_size=BS,
            num_blocks=64,
            engine_id=engine_id,
            kv_connector=KVConnectorConfig("p2p", {"recv_timeout_s": 2.0}),
            loras=tuple((n, str(p)) for n, p in loras.items()),
        )
    )


@pytest.mark.parametrize("consumer_adapter", ["A", "B", None])
def test_a_p2p_pull_serves_an_adapters_kv_to_that_adapter_only(consumer_adapter: str | None) -> None:
    """The producer prefills under A; a consumer continuing the same prompt under A pulls the blocks,
    one under B or the base model refuses them (their hashes are A's) and computes its own."""
    a, b = peft_adapter_dir(BASE, "r16"), peft_adapter_dir(BASE, "attn_only")
    producer, consumer = _p2p_engine("producer", {"A": a}), _p2p_engine("consumer", {"A": a, "B": b})
    try:
        producer.add_request(
            "r", PROMPT, SamplingParams(max_tokens=1), kv_transfer_params=RemoteDecode(), adapter="A"
        )
        final = run_until([producer], lambda: producer.scheduler.get_request("r") is None)["r"][-1]
        assert isinstance(final.kv_transfer_params, RemotePrefill)
        first = final.new_token_ids[0]
        consumer.add_request(
            "r",
            [*PROMPT, first],
            SamplingParams(max_tokens=9),
            kv_transfer_params=final.kv_transfer_params,
            prior_output_token_ids=(first,),
            adapter=consumer_adapter,
        )
        outs = run_until(
            [consumer, producer],
            lambda: not consumer.has_pending_work() and not producer.has_pending_work(),
        )["r"]
        folder = {"A": a, "B": b}.get(consumer_adapter) if consumer_adapter else None
        expected = peft_greedy(BASE, folder, [[*PROMPT, first]], 9)[0].token_ids
        assert tokens(outs) == expected
        if consumer_adapter == "A":
            assert outs[-1].num_external_tokens > 0
        else:
            assert outs[-1].num_external_tokens == 0
            assert stats(consumer)["params_rejected.hash_mismatch"] >= 1
        assert_idle(producer)
        assert_idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()
