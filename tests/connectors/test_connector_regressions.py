"""Regressions found in review: wrong KV stored, blocks reused under a save, ids reused while held,
a failed forward pass losing the connector's report, and multi's send bookkeeping."""

from __future__ import annotations

import threading

import pytest
import torch

from connectors.registry import KVConnectorConfig
from engine.llm import LLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from kvstore.results import GetResult, MissReason
from tests.tiny_models import random_prompts, tiny_model_dir

MODEL = "llama"
PARAMS = SamplingParams(max_tokens=6)


def offload_llm(spec: str, num_blocks: int = 64) -> LLM:
    return LLM(
        tiny_model_dir(MODEL),
        block_size=4,
        num_blocks=num_blocks,
        kv_connector=KVConnectorConfig("offload", {"kv_store": spec}),
    )


def test_a_failed_load_never_stores_the_kv_computed_over_it() -> None:
    spec = "cpu:32MiB?name=failedload"
    p = random_prompts([37], seed=11)[0]  # 9 whole blocks
    p2 = p[:36] + random_prompts([33], seed=5)[0]  # the same 9 blocks, then 8 more
    truth = LLM(tiny_model_dir(MODEL), block_size=4, num_blocks=64).generate([p2], PARAMS)[0].token_ids

    a = offload_llm(spec)
    a.generate([p], PARAMS)
    assert a.engine.drain(10.0)

    b = offload_llm(spec)
    worker = b.engine.worker_connector
    real_get_into = worker.store.get_into  # type: ignore[attr-defined]

    def evicted_after_two(hashes, buffers, start=0, *, timeout_s=None):  # type: ignore[no-untyped-def]
        got = real_get_into(hashes, buffers[:2], start, timeout_s=timeout_s)
        return GetResult(got.loaded, MissReason.EVICTED, got.checksums)

    worker.store.get_into = evicted_after_two  # type: ignore[attr-defined]
    out_b = b.generate([p2], PARAMS)[0]
    assert b.engine.drain(10.0)
    del worker.store.get_into  # type: ignore[attr-defined]
    assert out_b.token_ids == truth
    assert b.engine.stats().counter("kv_load_failures") >= 1

    c = offload_llm(spec)  # fresh local cache: takes p2's blocks from the store
    out_c = c.generate([p2], PARAMS)[0]
    assert out_c.num_external_tokens > 36, "the recomputed blocks were saved after the failure"
    assert out_c.token_ids == truth, "KV computed over a failed load was stored and served"


def test_an_aborted_held_request_s_save_finishes_before_its_blocks_are_reused() -> None:
    spec = "cpu:32MiB?name=reclaim"
    p, q = random_prompts([37, 37], seed=21)
    llm = offload_llm(spec, num_blocks=11)
    engine = llm.engine
    kv = engine.runner.kv_cache
    store = engine.worker_connector.store  # type: ignore[attr-defined]
    release = threading.Event()
    real_put = store.put

    def slow_put(hashes, payloads, start=0, **kw):  # type: ignore[no-untyped-def]
        release.wait(10)
        return real_put(hashes, payloads, start, **kw)

    store.put = slow_put
    engine.add_request("r", p, SamplingParams(max_tokens=1))
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    r_blocks = [kv[i].clone() for i in range(9)]
    assert "r" in engine.scheduler.holds  # its save is still running
    threading.Timer(0.3, release.set).start()  # the save finishes while the stop waits for it
    engine.abort_request("r")
    engine.add_request("s", q, SamplingParams(max_tokens=1))
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    assert engine.drain(10.0)
    del store.put
    request = Request("x", p, SamplingParams(), namespace=engine.namespace)
    buffers = [torch.empty_like(kv[0]) for _ in range(9)]
    assert store.get_into(request.block_hashes[:9], buffers, 0).loaded == 9
    assert all(torch.equal(buffers[i], r_blocks[i]) for i in range(9)), "another request's KV stored as r's"


def test_a_request_id_still_held_for_a_transfer_is_refused() -> None:
    llm = offload_llm("cpu:32MiB?name=idreuse")
    engine = llm.engine
    store = engine.worker_connector.store  # type: ignore[attr-defined]
    release = threading.Event()
    real_put = store.put
    store.put = lambda *a, **kw: (release.wait(10), real_put(*a, **kw))[1]
    prompt = random_prompts([21], seed=4)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    assert "r" in engine.scheduler.holds
    with pytest.raises(ValueError, match="request_id 'r' is still in use"):
        engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    release.set()
    assert engine.drain(10.0)
    del store.put
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))  # free again once the hold ends
    assert engine.drain(10.0)


def test_a_failed_forward_pass_still_delivers_the_connector_report() -> None:
    llm = offload_llm("cpu:32MiB?name=failstep")
    engine = llm.engine
    p, q = random_prompts([37, 21], seed=3)
    engine.add_request("r", p, SamplingParams(max_tokens=1))
    engine.add_request("q", q, SamplingParams(max_tokens=50))
    while "r" not in engine.scheduler.holds:
        engine.step()
    model = engine.runner.model
    real_forward = type(model).forward

    def boom(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected forward failure")

    type(model).forward = boom  # type: ignore[method-assign]
    try:
        outs = engine.step()  # this step carries finished_request_ids={'r'}
    finally:
        type(model).forward = real_forward  # type: ignore[method-assign]
    failed = {o.request_id: o for o in outs}
    assert failed["q"].finish_reason == "error" and "injected forward failure" in (failed["q"].error or "")
    assert engine.drain(5.0), "the held request's release was lost with the failed step"
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == engine.kv_spec.num_blocks
    again = llm.generate([q], SamplingParams(max_tokens=3))[0]  # the engine keeps serving
    assert again.finish_reason == "length"


def test_multi_tracks_only_the_sends_a_child_delayed() -> None:
    from connectors.base import KVConnectorOutput

    spec = {"name": "offload", "options": {"kv_store": "cpu:32MiB?name=multisent"}}
    llm = LLM(
        tiny_model_dir(MODEL),
        block_size=4,
        num_blocks=64,
        kv_connector=KVConnectorConfig("multi", {"connectors": [spec, {"name": "null"}]}),
    )
    prompts = random_prompts([9] * 20, seed=8)
    llm.generate(prompts, SamplingParams(max_tokens=2))
    assert llm.engine.drain(10.0)
    worker = llm.engine.worker_connector
    assert worker._sent == {} and worker._pending_sends == {}  # type: ignore[attr-defined]
    assert KVConnectorOutput().is_empty
