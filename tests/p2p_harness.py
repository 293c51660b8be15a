"""Two in-process engines joined by the ``p2p`` connector, driven by hand the way the nodes drive them.

    producer.add_request(prompt, max_tokens=1, {"do_remote_decode": true}) -> first token + params
    consumer.add_request(prompt + [first token], params)                   -> pulls, then decodes

``run_until`` steps every engine in turn until a condition holds, failing at a deadline: the transfer
runs on background threads, so the test waits on the outcome, never on a fixed sleep.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from connectors.p2p import P2PConnector
from connectors.registry import KVConnectorConfig
from engine.connector.params import KVTransferParams, RemoteDecode, RemotePrefill
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.tiny_models import tiny_model_dir

MODEL = "llama"  # tests/tiny_models.py: 2 layers, 2 KV heads, head dim 16, vocab 320
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def make_engine(
    engine_id: str, *, num_blocks: int = NUM_BLOCKS, p2p: bool = True, device: str = "cpu", **options: Any
) -> LLMEngine:
    """A tiny engine with the p2p connector; ``options`` are the connector's."""
    connector = KVConnectorConfig("p2p", {"recv_timeout_s": 2.0, **options}) if p2p else None
    return LLMEngine(
        EngineConfig(
            model=tiny_model_dir(MODEL),
            device=device,
            dtype="float32",  # the CPU reference's dtype on every device
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            engine_id=engine_id,
            kv_connector=connector,
        )
    )


def worker(engine: LLMEngine) -> P2PConnector:
    conn = engine.worker_connector
    assert isinstance(conn, P2PConnector)
    return conn


def stats(engine: LLMEngine) -> dict[str, float]:
    """Both halves' counters: the worker half's transfers, the scheduler half's rejected params."""
    scheduler_half = engine.scheduler_connector
    assert isinstance(scheduler_half, P2PConnector)
    return {**scheduler_half.transfer_stats(), **worker(engine).transfer_stats()}


@functools.cache
def local_reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of one plain engine (no connector) for ``prompt``."""
    engine = make_engine("local", p2p=False)
    engine.add_request("ref", list(prompt), SamplingParams(max_tokens=max_tokens))
    outs = run_until([engine], lambda: not engine.has_unfinished_requests())
    engine.shutdown()
    return [t for o in outs.get("ref", []) for t in o.new_token_ids]


def run_until(
    engines: Sequence[LLMEngine], done: Callable[[], bool], *, timeout_s: float = 15.0
) -> dict[str, list[RequestOutput]]:
    """Step ``engines`` in turn until ``done()``; every output, by request id.  Fails at the deadline."""
    outs: dict[str, list[RequestOutput]] = {}
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not done():
        assert time.monotonic() < deadline, f"no outcome within {timeout_s}s"
        progressed = False
        for engine in engines:
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
                progressed = True
        if not progressed:
            pause.wait(0.001)  # an async transfer is running: give its threads the cores
    return outs


def tokens(outs: Sequence[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@dataclass
class Prefilled:
    first_token: int
    params: RemotePrefill
    output: RequestOutput


def prefill(producer: LLMEngine, rid: str, prompt: Sequence[int]) -> Prefilled:
    """Run the prefill half: one token, with ``do_remote_decode``; returns the token and the params."""
    producer.add_request(rid, list(prompt), SamplingParams(max_tokens=1), kv_transfer_params=RemoteDecode())
    outs = run_until([producer], lambda: producer.scheduler.get_request(rid) is None)
    final = outs[rid][-1]
    assert final.finished and isinstance(final.kv_transfer_params, RemotePrefill), final
    return Prefilled(final.new_token_ids[0], final.kv_transfer_params, final)


def decode(
    producer: LLMEngine,
    consumer: LLMEngine,
    rid: str,
    prompt: Sequence[int],
    pre: Prefilled,
    max_tokens: int,
    *,
    params: KVTransferParams | None = None,
    timeout_s: float = 15.0,
) -> list[RequestOutput]:
    """Run the decode half until the consumer finished and the producer freed what it held."""
    consumer.add_request(
        rid,
        [*prompt, pre.first_token],
        SamplingParams(max_tokens=max_tokens - 1),
        kv_transfer_params=pre.params if params is None else params,
    )
    outs = run_until(
        [consumer, producer],
        lambda: not consumer.has_pending_work() and not producer.has_pending_work(),
        timeout_s=timeout_s,
    )
    return outs[rid]


def assert_idle(engine: LLMEngine) -> None:
    """Nothing running or held, the books balance, and every block is back in the free pool."""
    assert not engine.has_pending_work()
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == engine.kv_spec.num_blocks


@dataclass(frozen=True)
class SplitRun:
    """One request run on one engine and split prefill -> decode, for comparing the two."""

    local: list[RequestOutput]  # the plain engine's outputs
    first: RequestOutput  # the prefill engine's final output (the first token)
    decoded: list[RequestOutput]  # the decode engine's outputs


def run_local_and_split(name: str, prompt: Sequence[int], params: SamplingParams) -> SplitRun:
    """``prompt`` with ``params`` on a plain engine, then split: the prefill engine samples the first token
    (``max_tokens`` 1), the decode engine continues with it as a prior output token."""
    import dataclasses

    local = make_engine(f"{name}-local", p2p=False)
    producer, consumer = make_engine(f"{name}-p"), make_engine(f"{name}-d")
    try:
        local.add_request("r", list(prompt), params)
        want = run_until([local], lambda: not local.has_unfinished_requests())["r"]
        producer.add_request(
            "r", list(prompt), dataclasses.replace(params, max_tokens=1), kv_transfer_params=RemoteDecode()
        )
        first = run_until([producer], lambda: producer.scheduler.get_request("r") is None)["r"][-1]
        token = first.new_token_ids[0]
        consumer.add_request(
            "r",
            [*prompt, token],
            dataclasses.replace(params, max_tokens=params.max_tokens - 1),
            kv_transfer_params=first.kv_transfer_params,
            prior_output_token_ids=[token],
        )
        decoded = run_until(
            [consumer, producer], lambda: not consumer.has_pending_work() and not producer.has_pending_work()
        )["r"]
        return SplitRun(want, first, decoded)
    finally:
        for engine in (local, producer, consumer):
            engine.shutdown()
