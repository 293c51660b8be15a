"""The byte movers with the engine's cache on a GPU: offload and p2p move blocks through pinned host
staging on their own CUDA stream (``connectors/staging.py``).  Marked ``gpu``: skipped without a device."""

from __future__ import annotations

import pytest
import torch

from connectors.registry import KVConnectorConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.p2p_harness import BLOCK_SIZE, assert_idle, decode, local_reference, make_engine, prefill, tokens
from tests.tiny_models import random_prompts, tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL = "llama"
PARAMS = SamplingParams(max_tokens=8)
PROMPTS = random_prompts([37, 21, 50], seed=31)


SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough that a missing wait shows


def test_the_stager_round_trips_blocks() -> None:
    from connectors.staging import BlockStager

    kv = torch.randn(16, 2, 2, 4, 2, 16, device="cuda")
    stager = BlockStager.for_cache(kv)
    assert BlockStager.for_cache(kv) is stager  # one stream per cache, shared by every connector
    want = kv[[3, 7, 9]].cpu()
    staged = stager.to_host([3, 7, 9])
    assert torch.equal(staged.ready().host, want)
    stager.to_device(staged, [0, 1, 2])
    assert torch.equal(kv[[0, 1, 2]].cpu(), want)
    partial = stager.empty(2)
    partial.host.copy_(want[:2])
    stager.to_device(partial, [10, 11], count=1)  # only the good leading block goes in
    assert torch.equal(kv[10].cpu(), want[0]) and not torch.equal(kv[11].cpu(), want[1])
    assert len(stager.empty(0)) == 0 and len(stager.to_host([])) == 0


def test_a_copy_out_reads_what_the_forward_wrote_and_a_later_kernel_waits_for_it() -> None:
    from connectors.staging import BlockStager

    kv = torch.zeros(8, 2, 2, 4, 2, 16, device="cuda")
    stager = BlockStager.for_cache(kv)
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward" is slow ...
    kv[2].fill_(7.0)  # ... and writes block 2 last
    staged = stager.to_host([2])  # must see the 7s: it waits for the compute stream
    kv[2].fill_(-1.0)  # a later forward reusing the block: must run after the copy read it
    assert torch.equal(staged.ready().host[0], torch.full_like(staged.host[0], 7.0))


def test_a_copy_in_lands_before_the_forward_reads_and_after_it_wrote() -> None:
    from connectors.staging import BlockStager

    kv = torch.zeros(8, 2, 2, 4, 2, 16, device="cuda")
    stager = BlockStager.for_cache(kv)
    staged = stager.empty(1)
    staged.host.fill_(5.0)
    torch.cuda._sleep(SLEEP_CYCLES)
    kv[4].fill_(-1.0)  # an earlier forward still writing the (newly allocated) block
    stager.to_device(staged, [4])
    seen = kv[4].clone()  # the next forward reads the block: after the copy landed
    assert torch.equal(seen.cpu(), torch.full_like(staged.host[0], 5.0))


def test_offload_saves_and_loads_a_cuda_cache() -> None:
    reference = LLM(tiny_model_dir(MODEL), device="cpu", dtype="float32", block_size=4, num_blocks=64)
    want = [o.token_ids for o in reference.generate(PROMPTS, PARAMS)]
    spec = "cpu:32MiB?name=cuda-offload"

    def gpu_llm() -> LLM:
        return LLM(
            tiny_model_dir(MODEL),
            device="cuda",
            dtype="float32",
            block_size=4,
            num_blocks=64,
            kv_connector=KVConnectorConfig("offload", {"kv_store": spec}),
        )

    first = gpu_llm()
    outs = first.generate(PROMPTS, PARAMS)
    assert first.engine.drain(10.0)
    second = gpu_llm()  # a cold cache: every whole prompt block comes from the store
    again = second.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again] == want
    assert all(o.num_external_tokens == (len(p) - 1) // 4 * 4 for o, p in zip(again, PROMPTS, strict=True))
    assert second.engine.drain(10.0)
    second.engine.scheduler.check_integrity()


def test_p2p_streams_a_cuda_cache_to_a_cuda_cache() -> None:
    prompt = PROMPTS[0]
    producer = make_engine("prefill-cuda", device="cuda")
    consumer = make_engine("decode-cuda", device="cuda")
    try:
        pre = prefill(producer, "r", prompt)
        outs = decode(producer, consumer, "r", prompt, pre, PARAMS.max_tokens)
        assert [pre.first_token, *tokens(outs)] == local_reference(tuple(prompt), PARAMS.max_tokens)
        assert outs[-1].num_external_tokens == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
        assert_idle(producer)
        assert_idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()
