"""``n`` choices (router/choices.py), driven by the official ``openai`` SDK and gRPC against real local
clusters -- disaggregated (1 prefill + 1 decode) and colocated -- on a small float32 GGUF model.

What must hold: each choice is the request alone with seed ``seed + i`` (so choices differ, and each is
reproducible); greedy choices all equal the local engine's output; a stream interleaves the choices by
``index`` and reassembles to the whole answer, with the request's usage once at the end; the prompt is
computed once (the node's prompt-token counter grows by the prompt plus, per further choice, only the
tokens after its last full block); ``n`` over the router's cap is a 400 naming ``n``, after which the
server keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster
from pdkv_proto.pdkv.v1 import generation_pb2, types_pb2
from tests.gguf_models import write_gguf
from tests.serving.helpers import NODE_ARGS, node_stats, start_cluster, wait_until
from tests.tiny_models import pdkv_tiny_model_dir

openai = pytest.importorskip("openai")

PROMPT = "Once upon a time, there was a little house in the middle of the forest, and in it lived"
BLOCK = 16  # the nodes' block size (engine_config's default)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(pdkv_tiny_model_dir(), tmp_path_factory.mktemp("n") / "tiny-chat.gguf", qtype="F32")


@pytest.fixture(scope="module")
def local(model_file: Path) -> LLM:
    return LLM(model_file, device="cpu", dtype="float32", num_blocks=256)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request: pytest.FixtureRequest, model_file: Path) -> Iterator[Cluster]:
    c = start_cluster(
        model=str(model_file),
        mode=request.param,
        node_args=(*NODE_ARGS, "--dtype", "float32"),
        router_args=("--max-n", "4"),
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    assert cluster.http_address is not None
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _computed(cluster: Cluster) -> float:
    """Prompt tokens the cluster's prompt-computing nodes computed so far."""
    nodes = cluster.prefill_nodes or cluster.decode_nodes
    return sum(node_stats(p.address).counters.get("prompt_tokens.local_compute", 0.0) for p in nodes)


def test_seeded_choices_are_the_request_alone_with_seed_plus_i(client: openai.OpenAI) -> None:
    def one(n: int, seed: int) -> list[str]:
        r = client.completions.create(
            model="tiny-chat", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed, n=n
        )
        assert [c.index for c in r.choices] == list(range(n))
        return [c.text for c in r.choices]

    choices = one(3, 1234)
    assert len(set(choices)) == 3, choices  # distinct: each its own seed stream
    assert choices == [one(1, 1234 + i)[0] for i in range(3)]


def test_greedy_choices_equal_the_local_engine_and_usage_sums_them(client: openai.OpenAI, local: LLM) -> None:
    ids = local.tokenizer.encode(PROMPT)
    want = local.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    r = client.completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=0, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in r.choices] == [want] * 3
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(ids)  # the prompt once
    assert r.usage.completion_tokens == 3 * 8


def test_the_prompt_is_computed_once(cluster: Cluster, client: openai.OpenAI, local: LLM) -> None:
    prompt = f"A fox named {cluster.topology.mode} said: {PROMPT}"  # no block of it cached yet
    length = len(local.tokenizer.encode(prompt))
    tail = length - (length - 1) // BLOCK * BLOCK  # after the last full block (the last token always)
    before = _computed(cluster)
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0.7, n=4)
    assert len(r.choices) == 4
    # The nodes' counters are snapshots a moment behind the answer: wait for them, then compare.
    want = length + 3 * tail
    wait_until(lambda: _computed(cluster) - before >= want, timeout=10, what="the prompt-token counters")
    time.sleep(0.5)
    assert _computed(cluster) - before == want


def test_a_chat_stream_interleaves_choices_and_ends_with_the_usage(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=3,
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    texts, finish = ["", "", ""], [None, None, None]
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )  # type: ignore[call-overload]
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_n_over_the_cap_is_a_400_naming_it_and_the_server_serves_on(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2, n=5)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "n"
    assert "max_n" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2, n=0)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "n"
    r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2, n=2)
    assert len(r.choices) == 2


def test_grpc_choices_unary_and_streamed(cluster: Cluster) -> None:
    import grpc

    from pdkv_proto.pdkv.v1 import generation_pb2_grpc

    request = generation_pb2.GenerateRequest(
        text=PROMPT,
        sampling=types_pb2.SamplingParams(max_tokens=6, temperature=1.0, seed=99),
        n=3,
    )
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30).max_n == 4
        result = stub.GenerateUnary(request, timeout=60)
        streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
        dones = {}
        for msg in stub.Generate(request, timeout=60):
            if msg.HasField("delta"):
                streamed[msg.index].extend(msg.delta.token_ids)
            else:
                dones[msg.index] = msg.done
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(generation_pb2.GenerateRequest(text=PROMPT, n=9), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in (err.value.details() or "")
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert {i: list(c.token_ids) for i, c in enumerate(result.choices)} == streamed
    assert list(result.token_ids) == list(result.choices[0].token_ids)
    assert sorted(dones) == [0, 1, 2] and all(d.usage.completion_tokens == 6 for d in dones.values())
    assert result.done.usage.completion_tokens == 18
    assert len({tuple(c.token_ids) for c in result.choices}) == 3
