"""The ``p2p`` connector end to end: a prefill engine streams a prompt's KV to a decode engine.

Two in-process engines on a tiny random Llama, each with its own ``p2p`` connector, driven by hand the
way the nodes drive them (``tests/p2p_harness.py``).  Greedy outputs must equal one local engine's (and
transformers'), the decode engine computes only the prompt's tail, and the prefill engine frees its
blocks once the decode engine acknowledged them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.base import ConnectorOptionsError
from connectors.p2p import P2PConnector
from connectors.p2p_options import P2POptions
from connectors.registry import KVConnectorConfig, resolve
from connectors.testing import conformance_suite
from engine.connector.params import (
    RemotePrefill,
    TransferParamsError,
    decode_transfer_params,
    encode_transfer_params,
)
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.p2p_harness import (
    BLOCK_SIZE,
    MODEL,
    assert_idle,
    decode,
    local_reference,
    make_engine,
    prefill,
    run_until,
    stats,
    tokens,
    worker,
)
from tests.tiny_models import hf_greedy, random_prompts, tiny_model_dir

PROMPT = random_prompts([23], seed=1)[0]  # 5 full blocks of 4 tokens, then 3 tokens
MAX_TOKENS = 8


@pytest.fixture
def producer() -> Iterator[LLMEngine]:
    engine = make_engine("prefill-0")
    yield engine
    engine.shutdown()


@pytest.fixture
def consumer() -> Iterator[LLMEngine]:
    engine = make_engine("decode-0")
    yield engine
    engine.shutdown()


def block_bytes(engine: LLMEngine) -> int:
    return engine.kv_spec.bytes_per_block


# ---- options and params ----------------------------------------------------------------------------------


def test_registry_knows_p2p() -> None:
    assert resolve("p2p") is P2PConnector


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"lease_s": 0}, "lease_s"),
        ({"pull_timeout_s": "soon"}, "pull_timeout_s"),
        ({"bind": "http://127.0.0.1:5000"}, "bind"),
        ({"bind": "tcp://127.0.0.1"}, "bind"),
        ({"bind": "tcp://0.0.0.0:0"}, "advertise_host"),
        ({"bind": "tcp://0.0.0.0:0", "advertise_host": "10.1.2.3"}, "bind"),  # wide, without CURVE
        ({"window": 0}, "window"),
        ({"max_in_flight": True}, "max_in_flight"),
        ({"batch_bytes": -1}, "batch_bytes"),
        ({"leases": 3}, "leases"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConnectorOptionsError, match=f"'{key}'"):
        make_engine("bad", **options)


def test_advertised_endpoint() -> None:
    opts = P2POptions(bind="tcp://0.0.0.0:0", advertise_host="10.1.2.3", insecure=True)
    assert opts.static_endpoint is None  # the port is chosen at bind time
    assert opts.advertised("tcp://0.0.0.0:5601") == "tcp://10.1.2.3:5601"
    assert P2POptions(bind="tcp://127.0.0.1:5601").static_endpoint == "tcp://127.0.0.1:5601"
    assert P2POptions(bind="ipc:///tmp/x.sock").static_endpoint == "ipc:///tmp/x.sock"


def test_params_round_trip_and_name_the_bad_key(producer: LLMEngine) -> None:
    pre = prefill(producer, "r", PROMPT)
    params = pre.params.to_map()
    assert json.loads(json.dumps(params)) == params  # JSON/msgpack-safe: travels through gRPC untouched
    assert RemotePrefill.from_map(params) == pre.params
    assert decode_transfer_params(encode_transfer_params(pre.params)) == pre.params
    for key, bad in [
        ("kv_endpoint", "http://x"),
        ("num_tokens", 3),
        ("block_hashes", ["zz"]),
        ("lease_s", 0),
    ]:
        with pytest.raises(TransferParamsError, match=f"'{key}'"):
            RemotePrefill.from_map({**params, key: bad})
    producer.abort_request("r")  # nobody pulls it: free the lease now
    run_until([producer], lambda: not producer.has_pending_work())
    assert_idle(producer)


# ---- the disaggregated flow ------------------------------------------------------------------------------


def test_prefill_to_decode_matches_a_local_engine_and_transformers(
    producer: LLMEngine, consumer: LLMEngine
) -> None:
    pre = prefill(producer, "r1", PROMPT)
    params = pre.params.to_map()  # as it travels
    whole = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    assert params["do_remote_prefill"] is True
    assert params["engine_id"] == "prefill-0"
    assert params["kv_endpoint"] == worker(producer).endpoint
    assert params["kv_endpoint"].startswith("tcp://127.0.0.1:")
    assert params["remote_request_id"] == "r1"
    assert params["num_tokens"] == whole == 20
    assert len(params["block_ids"]) == len(params["block_hashes"]) == 5
    assert params["namespace_id"] == producer.namespace.namespace_id
    assert params["layout"]["num_layers"] == 2 and params["layout"]["dtype"] == "float32"
    assert producer.has_pending_work()  # the blocks are held for the decode engine

    outs = decode(producer, consumer, "r1", PROMPT, pre, MAX_TOKENS)
    got = [pre.first_token, *tokens(outs)]
    assert got == local_reference(tuple(PROMPT), MAX_TOKENS)
    ref = hf_greedy(MODEL, [PROMPT], MAX_TOKENS)[0]
    assert ref.min_margin > 1e-3 and got == ref.token_ids

    final = outs[-1]
    assert final.finished and final.kv_transfer_params is None
    assert final.num_external_tokens == whole
    assert final.num_computed_prompt_tokens == len(PROMPT) + 1 - whole < BLOCK_SIZE + 1
    received = stats(consumer)
    assert received["bytes_received"] == 5 * block_bytes(consumer)
    assert received["pulls_ok"] == 1
    pulled = worker(consumer).get_stats().histograms
    assert pulled["kv_transfer_seconds.recv"].count == 1 and pulled["kv_load_seconds.p2p"].count == 1
    sent = stats(producer)
    assert sent["bytes_sent"] == 5 * block_bytes(producer)
    assert sent["leases_released"] == 1 and "lease_expiries" not in sent
    assert_idle(producer)  # freed on the decode engine's release
    assert worker(producer).get_stats().histograms["kv_transfer_seconds.send"].count == 1
    assert_idle(consumer)


def test_a_consumer_holding_a_prefix_pulls_only_the_rest(producer: LLMEngine, consumer: LLMEngine) -> None:
    consumer.add_request("warm", PROMPT[:10], SamplingParams(max_tokens=1))  # caches blocks 0 and 1
    run_until([consumer], lambda: not consumer.has_unfinished_requests())

    pre = prefill(producer, "r2", PROMPT)
    outs = decode(producer, consumer, "r2", PROMPT, pre, MAX_TOKENS)
    assert [pre.first_token, *tokens(outs)] == local_reference(tuple(PROMPT), MAX_TOKENS)
    final = outs[-1]
    assert final.num_cached_tokens == 8
    assert final.num_external_tokens == 20 - 8
    assert stats(consumer)["bytes_received"] == 3 * block_bytes(consumer)
    assert_idle(producer)
    assert_idle(consumer)


def test_a_consumer_holding_every_block_releases_the_lease_unread(
    producer: LLMEngine, consumer: LLMEngine
) -> None:
    """One owner ends a hold: the consumer, which will not read the lease, releases it at admission; the
    producer frees the blocks then, not when ``lease_s`` runs out, and nobody has to send an Abort."""
    consumer.add_request("warm", PROMPT, SamplingParams(max_tokens=1))  # caches every full prompt block
    run_until([consumer], lambda: not consumer.has_unfinished_requests())

    pre = prefill(producer, "r3", PROMPT)
    assert worker(producer).options.lease_s >= 30  # an expiry could not end it within this test
    outs = decode(producer, consumer, "r3", PROMPT, pre, MAX_TOKENS, timeout_s=10.0)
    assert [pre.first_token, *tokens(outs)] == local_reference(tuple(PROMPT), MAX_TOKENS)
    assert (
        outs[-1].num_external_tokens == 0
        and outs[-1].num_cached_tokens == len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    )
    assert stats(consumer).get("leases_unused") == 1 and "pulls_started" not in stats(consumer)
    assert stats(producer).get("leases_released") == 1 and "lease_expiries" not in stats(producer)
    assert_idle(producer)
    assert_idle(consumer)


def test_several_requests_transfer_concurrently(producer: LLMEngine, consumer: LLMEngine) -> None:
    prompts = random_prompts([9, 31, 40, 17], seed=7)
    pres = [prefill(producer, f"c{i}", p) for i, p in enumerate(prompts)]
    for i, (p, pre) in enumerate(zip(prompts, pres, strict=True)):
        consumer.add_request(
            f"c{i}", [*p, pre.first_token], SamplingParams(max_tokens=5), kv_transfer_params=pre.params
        )
    outs = run_until(
        [consumer, producer], lambda: not consumer.has_pending_work() and not producer.has_pending_work()
    )
    for i, (p, pre) in enumerate(zip(prompts, pres, strict=True)):
        assert [pre.first_token, *tokens(outs[f"c{i}"])] == local_reference(tuple(p), 6)
        assert outs[f"c{i}"][-1].num_external_tokens == len(p) // BLOCK_SIZE * BLOCK_SIZE
    assert stats(consumer)["pulls_ok"] == 4
    assert_idle(producer)
    assert_idle(consumer)


def test_a_prompt_shorter_than_a_block_holds_nothing(producer: LLMEngine, consumer: LLMEngine) -> None:
    prompt = PROMPT[:3]
    pre = prefill(producer, "tiny", prompt)
    assert pre.params.num_tokens == 0 and pre.params.block_ids == ()
    assert not producer.has_pending_work()
    outs = decode(producer, consumer, "tiny", prompt, pre, 4)
    assert [pre.first_token, *tokens(outs)] == local_reference(tuple(prompt), 4)
    assert outs[-1].num_external_tokens == 0
    assert "pulls_started" not in stats(consumer) and "leases_unused" not in stats(consumer)  # no lease
    assert_idle(producer)
    assert_idle(consumer)


@pytest.mark.parametrize("tamper", ["namespace", "layout", "other_prompt"])
def test_params_for_other_kv_are_never_used(producer: LLMEngine, consumer: LLMEngine, tamper: str) -> None:
    pre = prefill(producer, "t", PROMPT)
    params = pre.params.to_map()
    prompt = [*PROMPT, pre.first_token]
    if tamper == "namespace":
        params["namespace_id"] = "0" * 32  # another model (or block size, or hash algorithm)
    elif tamper == "layout":
        params["layout"] = {**pre.params.to_map()["layout"], "dtype": "bfloat16"}  # type: ignore[dict-item]
    else:
        prompt = random_prompts([24], seed=99)[0]  # another prompt under this prompt's params
    tampered = RemotePrefill.from_map(params)
    consumer.add_request("t", prompt, SamplingParams(max_tokens=4), kv_transfer_params=tampered)
    outs = run_until([consumer], lambda: not consumer.has_pending_work())["t"]
    assert tokens(outs) == local_reference(tuple(prompt), 4)
    assert outs[-1].num_external_tokens == 0
    reason = "hash_mismatch" if tamper == "other_prompt" else tamper
    assert stats(consumer)[f"params_rejected.{reason}"] >= 1
    assert "pulls_started" not in stats(consumer)
    # The consumer, which will not read the lease, releases it: nobody has to Abort it.
    run_until([consumer, producer], lambda: not producer.has_pending_work(), timeout_s=10.0)
    assert stats(producer).get("leases_released") == 1 and "lease_expiries" not in stats(producer)
    assert_idle(producer)
    assert_idle(consumer)


def test_p2p_composes_inside_multi() -> None:
    """A prefill node runs p2p next to other connectors (``multi``): leases and pulls still go through."""

    def engine(engine_id: str) -> LLMEngine:
        children = [{"name": "null"}, {"name": "p2p", "options": {"recv_timeout_s": 2.0}}]
        return LLMEngine(
            EngineConfig(
                model=tiny_model_dir(MODEL),
                device="cpu",
                block_size=BLOCK_SIZE,
                num_blocks=64,
                engine_id=engine_id,
                kv_connector=KVConnectorConfig("multi", {"connectors": children}),
            )
        )

    producer, consumer = engine("prefill-m"), engine("decode-m")
    try:
        pre = prefill(producer, "m", PROMPT)
        assert pre.params.num_tokens == 20
        outs = decode(producer, consumer, "m", PROMPT, pre, MAX_TOKENS)
        assert [pre.first_token, *tokens(outs)] == local_reference(tuple(PROMPT), MAX_TOKENS)
        assert outs[-1].num_external_tokens == 20
        assert_idle(producer)
        assert_idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


# ---- the conformance kit ---------------------------------------------------------------------------------

# The kit adds requests without kv_transfer_params: to p2p that is an engine no router asked to hold or
# pull KV, so it checks the lifecycle around the connector (request_finished exactly once, no leaked block
# after aborts, preemption or reclaimed delayed frees, shutdown with threads and sockets), not transfers --
# those are the tests above and tests/connectors/test_p2p_faults.py.
TestP2PConformance = conformance_suite(
    lambda shared: KVConnectorConfig("p2p"),
    provides_hits=False,  # it loads only what a producer leased for one request: never from a shared backend
    unreachable_factory=lambda shared: KVConnectorConfig("p2p"),  # it reaches a producer only per request
)


def test_a_wide_bind_needs_curve_or_insecure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConnectorOptionsError, match="without CURVE"):
        P2POptions(bind="tcp://10.0.0.5:5600")
    assert P2POptions(bind="tcp://10.0.0.5:5600", insecure=True).insecure
    from wire.curve import write_curve_folder

    monkeypatch.setenv("PDKV_CURVE_DIR", str(write_curve_folder(tmp_path / "curve", ["node"])))
    monkeypatch.setenv("PDKV_CURVE_NAME", "node")
    assert P2POptions(bind="tcp://0.0.0.0:5600", advertise_host="10.0.0.5").bind == "tcp://0.0.0.0:5600"
