"""Completions' ``echo`` with the prompt's logprobs -- what lm-eval-harness's loglikelihood requests send
(``echo: true, max_tokens: 0, logprobs: 1``) -- through real local clusters, disaggregated and colocated,
driven by the official ``openai`` SDK and by gRPC.  The prompt's scores equal the local engine's (itself
equal to transformers' ``log_softmax``: tests/engine/test_prompt_logprobs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster
from pdkv_proto.pdkv.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from serving.client import GenerationClient
from tests.gguf_models import write_gguf
from tests.serving.helpers import NODE_ARGS, start_cluster
from tests.tiny_models import pdkv_tiny_model_dir

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(pdkv_tiny_model_dir(), tmp_path_factory.mktemp("echo") / "tiny-chat.gguf", qtype="F32")


@pytest.fixture(scope="module")
def local(model_file: Path) -> LLM:
    return LLM(model_file, device="cpu", dtype="float32", num_blocks=256)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request: pytest.FixtureRequest, model_file: Path) -> Iterator[Cluster]:
    c = start_cluster(model=str(model_file), mode=request.param, node_args=(*NODE_ARGS, "--dtype", "float32"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    assert cluster.http_address is not None
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _scores(local: LLM, k: int) -> tuple[list[int], list[float | None], list]:  # type: ignore[type-arg]
    ids = local.tokenizer.encode(PROMPT)
    out = local.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=k))[0]
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    return ids, out.prompt_logprobs, out.prompt_top_logprobs


def test_loglikelihood_request_as_lm_eval_sends_it(client: openai.OpenAI, local: LLM) -> None:
    ids, want, tops = _scores(local, 1)
    for _ in range(2):  # the second time the prompt is cached: the scores are whole all the same
        r = client.completions.create(
            model="tiny-chat", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1, temperature=0
        )
        choice = r.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        got = lp.token_logprobs[1:]
        assert all(g is not None and abs(g - w) < 1e-4 for g, w in zip(got, want[1:], strict=True))
        assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
        # the best alternative first, then the prompt's own token where it is not the best (OpenAI: "up to
        # logprobs+1 elements"; harnesses read top_logprobs[i][tokens[i]])
        assert all(1 <= len(m) <= 2 for m in lp.top_logprobs[1:])
        assert all(t in m for t, m in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
        best = [local.tokenizer.decode([t], skip_special_tokens=False) for ((t, _),) in tops[1:]]
        assert [next(iter(m)) for m in lp.top_logprobs[1:]] == best
        assert r.usage is not None and r.usage.completion_tokens == 0
        assert r.usage.prompt_tokens == len(ids)


def test_n_choices_of_a_scoring_request_are_the_prompt_scores_each(client: openai.OpenAI, local: LLM) -> None:
    """echo, max_tokens 0, n 3 (the prompt is scored once: tests/router/test_choices.py)."""
    ids, want, _ = _scores(local, 1)
    r = client.completions.create(
        model="tiny-chat", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1, temperature=0, n=3
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for choice in r.choices:
        assert choice.text == PROMPT and choice.logprobs is not None
        got = choice.logprobs.token_logprobs
        assert got is not None and got[0] is None
        assert all(g is not None and abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:], strict=True))
    assert r.usage is not None and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


def test_echo_with_a_completion_whole_and_streamed(client: openai.OpenAI, local: LLM) -> None:
    ids = local.tokenizer.encode(PROMPT)
    completion = local.generate([ids], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    kwargs = dict(model="tiny-chat", prompt=PROMPT, echo=True, max_tokens=5, logprobs=2, temperature=0)
    r = client.completions.create(**kwargs, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    choice = r.choices[0]
    assert choice.text == PROMPT + completion.text
    assert choice.logprobs.tokens is not None and len(choice.logprobs.tokens) == len(ids) + 5
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x is not None for x in choice.logprobs.token_logprobs[1:])
    # Two alternatives per position (one map entry where both decode to the same text: the map is keyed
    # by text, as OpenAI's is), and the token itself where it is not among them.
    maps = choice.logprobs.top_logprobs[1:]
    assert all(1 <= len(m) <= 3 for m in maps)
    assert all(t in m for t, m in zip(choice.logprobs.tokens[1:], maps, strict=True))
    assert sum(len(m) >= 2 for m in maps) > len(ids) // 2
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        if c.choices
    )
    assert streamed == choice.text
    plain = client.completions.create(
        model="tiny-chat", prompt=PROMPT, echo=True, max_tokens=3, temperature=0
    )  # echo without logprobs: the text only
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_token_id_prompts_echo_their_text_and_bad_input_is_400(client: openai.OpenAI, local: LLM) -> None:
    ids = local.tokenizer.encode(PROMPT)
    r = client.completions.create(model="tiny-chat", prompt=ids, echo=True, max_tokens=0, logprobs=0)
    assert r.choices[0].text == local.tokenizer.decode(ids, skip_special_tokens=False)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=0)  # no echo
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT, echo=True, logprobs=6)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "logprobs"
    assert client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2).choices[0].text


def test_grpc_scores_the_prompt(cluster: Cluster, local: LLM) -> None:
    ids, want, _ = _scores(local, 0)
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids),
        sampling=types_pb2.SamplingParams(max_tokens=0, prompt_logprobs=0),
    )
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        result = stub.GenerateUnary(request, timeout=60)
        first = next(iter(stub.Generate(request, timeout=60)))
    assert list(result.token_ids) == [] and len(result.prompt_logprobs.logprobs) == len(ids) - 1
    assert all(abs(g - w) < 1e-4 for g, w in zip(result.prompt_logprobs.logprobs, want[1:], strict=True))
    assert list(first.delta.prompt_logprobs.logprobs) == list(result.prompt_logprobs.logprobs)


def test_a_long_prompts_scores_pass_gRPC_default_message_limit() -> None:
    """36k scored tokens with 20 alternatives each: a 4.7 MB first message from the node to the router
    (over gRPC's default 4 MiB receive limit) and from the router to the client."""
    model = pdkv_tiny_model_dir(max_position_embeddings=40000)
    cluster = start_cluster(
        model=str(model),
        mode="colocated",
        num_decode=1,
        node_args=("--num-blocks", "2400", "--device", "cpu", "--max-num-batched-tokens", "8192"),
    )
    try:
        ids = [i % 300 + 20 for i in range(36000)]
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=ids),
            sampling=types_pb2.SamplingParams(max_tokens=1, prompt_logprobs=20),
        )
        assert request.ByteSize() > 0
        with GenerationClient(cluster.router_address) as client:
            result = client.stub.GenerateUnary(request, timeout=300)
        assert result.ByteSize() > 4 * 1024 * 1024
        assert len(result.prompt_logprobs.logprobs) == len(ids) - 1
        assert all(len(t.token_ids) == 20 for t in result.prompt_logprobs.top_logprobs)
    finally:
        cluster.stop()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_prompt_that_fills_the_context_is_scored_and_asked_for_no_output(
    mode: str, model_file: Path, local: LLM
) -> None:
    """A rolling loglikelihood (lm-eval's perplexity tasks) scores windows as long as the context: a prompt
    of exactly max_model_len tokens with max_tokens 0 fits (no output token follows it) -- it was refused
    as if it asked for one; asking for one is refused, naming max_tokens 0."""
    ids = [(7 * i) % 300 + 20 for i in range(32)]
    want = local.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs
    assert want is not None
    node_args = (*NODE_ARGS, "--dtype", "float32")
    cluster = start_cluster(model=str(model_file), mode=mode, node_args=node_args, max_model_len=32)
    try:
        assert cluster.http_address is not None
        with openai.OpenAI(
            base_url=f"http://{cluster.http_address}/v1", api_key="-", max_retries=0
        ) as client:
            r = client.completions.create(model="tiny-chat", prompt=ids, echo=True, max_tokens=0, logprobs=0)
            got = r.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
            assert got is not None and got[0] is None and len(got) == 32
            assert all(abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:], strict=True))  # type: ignore[operator]
            with pytest.raises(openai.BadRequestError, match=r"no room for an output token.*max_tokens 0"):
                client.completions.create(model="tiny-chat", prompt=ids, max_tokens=1)
            with pytest.raises(openai.BadRequestError, match="33 tokens, more than max_model_len 32 holds"):
                client.completions.create(
                    model="tiny-chat", prompt=[*ids, 5], echo=True, max_tokens=0, logprobs=0
                )
    finally:
        cluster.stop()
