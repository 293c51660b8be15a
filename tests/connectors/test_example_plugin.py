"""The example plugin (examples/pdkv-example-connector, installed by scripts/setup.sh) is found through
its entry point, listed by ``pdkv connectors list``, validates its options and passes the kit."""

from __future__ import annotations

import pytest
from pdkv_example_connector import MemoryConnector, get_store

from connectors.base import ConnectorOptionsError
from connectors.registry import KVConnectorConfig, discover_entries, resolve
from connectors.testing import conformance_suite
from engine.sampling_params import SamplingParams
from pdkv.cli import main

TARGET = "pdkv_example_connector.memory:MemoryConnector"


def test_discovered_by_name_through_its_entry_point() -> None:
    entries = {e.name: e for e in discover_entries()}
    assert (entries["example-memory"].target, entries["example-memory"].origin) == (
        TARGET,
        "pdkv-example-connector",
    )
    assert resolve("example-memory") is MemoryConnector


def test_pdkv_connectors_list_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["connectors", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "TARGET", "ORIGIN"]
    assert ["example-memory", TARGET, "pdkv-example-connector"] in [line.split() for line in lines]
    assert ["shared-dir", "connectors.shared_dir:SharedDirConnector", "built-in"] in [
        line.split() for line in lines
    ]


def test_options_are_validated_naming_the_bad_key() -> None:
    with pytest.raises(ConnectorOptionsError, match=r"unknown option 'stor'; known options: store"):
        resolve("example-memory")(None, None, {"stor": "x"})  # type: ignore[arg-type]


def test_two_engines_share_a_store_by_name() -> None:
    from engine.llm import LLM
    from tests.tiny_models import pdkv_tiny_model_dir, random_prompts

    model = pdkv_tiny_model_dir()
    config = KVConnectorConfig("example-memory", {"store": "test-example-plugin"})
    prompts = random_prompts([21, 13], seed=3, vocab=256)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = LLM(model, device="cpu", block_size=4, num_blocks=64, kv_connector=config).generate(
        prompts, params
    )
    second = LLM(model, device="cpu", block_size=4, num_blocks=64, kv_connector=config).generate(
        prompts, params
    )
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert [(o.num_external_tokens, o.num_computed_prompt_tokens) for o in second] == [(20, 1), (12, 1)]
    assert get_store("test-example-plugin").blocks


def damage(shared: object) -> None:
    blocks = get_store(str(shared)).blocks
    for key, block in blocks.items():
        blocks[key] = block._replace(payload=bytes([block.payload[0] ^ 1]) + block.payload[1:])


def evict(shared: object, block_hash: bytes) -> None:
    """Remove the one block ``block_hash`` from the store the factory below names."""
    blocks = get_store(str(shared)).blocks
    for key in [k for k in blocks if k.endswith(block_hash)]:
        del blocks[key]


def example(shared: object) -> KVConnectorConfig:
    return KVConnectorConfig("example-memory", {"store": str(shared)})


# In-process memory has nothing to reach: its own factory stands in for the unreachable backend.
TestExampleMemory = conformance_suite(
    example, corrupt=damage, evict=evict, unreachable_factory=example, nothing_to_reach=True
)


def test_blocks_computed_over_a_failed_load_are_not_stored() -> None:
    """The example does what shared-dir does: a block whose stored bytes changed is a load error, the
    blocks computed over it in that step are not stored, and after the recompute a fresh engine loads
    right KV."""
    from pdkv_example_connector.memory import StoredBlock

    from engine.llm import LLM
    from engine.request import Request
    from tests.tiny_models import pdkv_tiny_model_dir, random_prompts

    model = pdkv_tiny_model_dir()
    config = KVConnectorConfig("example-memory", {"store": "test-example-tainted"})
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    saved = random_prompts([13], seed=8, vocab=256)[0]
    prompt = saved[:8] + random_prompts([12], seed=9, vocab=256)[0]  # shares blocks 0..1 of 4 tokens

    def engine(connector: KVConnectorConfig | None = config) -> LLM:
        return LLM(model, device="cpu", block_size=4, num_blocks=64, kv_connector=connector)

    want = engine(None).generate([prompt], params)[0].token_ids
    engine().generate([saved], params)
    store = get_store("test-example-tainted")
    block0 = Request("probe", saved, params, namespace=engine(None).engine.namespace).block_hashes[0]
    key = next(k for k in store.blocks if k.endswith(block0))
    good = store.blocks[key]
    store.blocks[key] = StoredBlock(good.checksum, bytes([good.payload[0] ^ 1]) + good.payload[1:])
    loader = engine()
    assert loader.generate([prompt], params)[0].token_ids == want
    assert loader.stats().counter("kv_load_failures") == 1
    fresh = engine()
    [out] = fresh.generate([prompt], params)
    assert out.token_ids == want and fresh.stats().counter("kv_load_failures") == 0
    assert out.num_external_tokens == (len(prompt) - 1) // 4 * 4  # the recomputed blocks were stored
