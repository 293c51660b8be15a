"""The OpenAI-compatible HTTP API, driven by the official ``openai`` SDK (and curl, for the raw bytes)
against a real local cluster: router + 1 prefill + 1 decode on a small GGUF model with a ChatML template.

Greedy outputs equal the local engine's on the same file, token for token and character for character;
a client that disconnects mid-stream leaves both nodes idle.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster
from tests.gguf_models import write_gguf
from tests.serving.helpers import NODE_ARGS, assert_node_idle, start_cluster, wait_until
from tests.tiny_models import pdkv_tiny_model_dir

openai = pytest.importorskip("openai")

QUESTION = "Once upon a time, there was a little house in the middle of the forest."
N = 12


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(pdkv_tiny_model_dir(), tmp_path_factory.mktemp("http") / "tiny-chat.gguf", qtype="F32")


@pytest.fixture(scope="module")
def cluster(model_file: Path) -> Iterator[Cluster]:
    c = start_cluster(
        model=str(model_file), node_args=(*NODE_ARGS, "--dtype", "float32"), kv_store="cpu:64MiB"
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def local(model_file: Path) -> LLM:
    return LLM(model_file, device="cpu", dtype="float32", num_blocks=512)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    assert cluster.http_address is not None
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0) as c:
        yield c


def expected_chat(local: LLM, content: str, max_tokens: int = N) -> tuple[list[int], str, str]:
    tok = local.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": content}])
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=tok.end_of_turn_token_ids)
    out = local.generate([ids], params)[0]
    assert out.finish_reason is not None
    return ids, out.text, out.finish_reason


def test_models_and_health(client: openai.OpenAI, cluster: Cluster) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-chat"]
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 4096
    import urllib.request

    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as r:
        assert r.status == 200


def test_chat_completion_equals_the_local_engine(client: openai.OpenAI, local: LLM) -> None:
    ids, text, finish = expected_chat(local, QUESTION)
    r = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": QUESTION}], max_tokens=N, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    u = r.usage
    assert u is not None and u.prompt_tokens == len(ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens is not None
    extra = u.model_extra or {}
    by_source = extra["pdkv"]["cached_tokens_by_source"]
    assert by_source["remote_prefill"] == len(ids) // 16 * 16  # moved, not recomputed
    assert u.prompt_tokens_details.cached_tokens == by_source["local_prefix"] + by_source["store"]


def test_chat_stream_with_usage(client: openai.OpenAI, local: LLM) -> None:
    _, text, finish = expected_chat(local, QUESTION)
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0


def test_completions_text_and_token_ids_stream_and_not(client: openai.OpenAI, local: LLM) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    want = local.generate([prompt], SamplingParams(max_tokens=N))[0]
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=N, temperature=0)
    assert r.choices[0].text == want.text
    ids = local.tokenizer.encode(prompt)
    r2 = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=N, temperature=0, logprobs=0)
    assert r2.choices[0].text == want.text
    assert r2.choices[0].logprobs is not None and len(r2.choices[0].logprobs.token_logprobs or []) == len(
        want.token_ids
    )
    streamed = client.completions.create(
        model="tiny-chat", prompt=[prompt], max_tokens=N, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run() -> str | None:
        r = client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=N,
            temperature=1.0,
            seed=7,
        )
        return r.choices[0].message.content

    assert run() == run()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 17}, "n"),  # over the router's max_n (16 by default)
        ({"temperature": 5.0}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"999999": -100}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),  # over max_tokens (4)
        ({"best_of": 2}, "best_of"),
    ],
)
def test_a_bad_parameter_is_a_bad_request_naming_it(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    sdk = {k: v for k, v in body.items() if k not in ("min_tokens", "best_of")}  # not the SDK's chat fields
    extra = {k: v for k, v in body.items() if k in ("min_tokens", "best_of")}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**sdk, extra_body=extra)
    assert err.value.status_code == 400
    assert param in str(err.value)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param


def test_a_non_finite_temperature_is_refused(cluster: Cluster) -> None:
    """Raw JSON may carry NaN (Python's json writes it): refused naming the field, never sampled."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "tiny-chat", "prompt": "hi", "temperature": float("nan")}).encode()
    req = urllib.request.Request(
        f"http://{cluster.http_address}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"


def test_an_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert "tiny-chat" in str(err.value)


def test_a_list_of_prompts_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="send one prompt per request"):
        client.completions.create(model="tiny-chat", prompt=["a", "b"], max_tokens=2)


def test_raw_sse_bytes_with_curl(cluster: Cluster, local: LLM) -> None:
    _, text, _ = expected_chat(local, QUESTION)
    body = json.dumps(
        {"model": "tiny-chat", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": N,
         "temperature": 0, "stream": True}
    )  # fmt: skip
    out = subprocess.run(
        ["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
         f"http://{cluster.http_address}/v1/chat/completions"],
        capture_output=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    events = out.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events[:-1])
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text


def test_a_client_that_disconnects_mid_stream_leaves_both_nodes_idle(cluster: Cluster) -> None:
    import http.client

    assert cluster.http_address is not None
    host, port = cluster.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps(
        {"model": "tiny-chat", "prompt": "The quick brown fox", "max_tokens": 3000, "temperature": 0,
         "ignore_eos": True, "stream": True}
    )  # fmt: skip
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):  # a few deltas: the request runs on the decode node
        assert resp.readline().startswith(b"data: ")
        assert resp.readline() == b"\n"
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    gone = time.monotonic()
    for node in cluster.prefill_nodes + cluster.decode_nodes:
        assert_node_idle(node.address, timeout=5.0)
    assert time.monotonic() - gone < 3.0


def test_health_is_503_without_a_healthy_decode_node(model_file: Path) -> None:
    """A router whose decode node is gone answers /health with 503 (and requests with 503)."""
    c = start_cluster(model=str(model_file), node_args=(*NODE_ARGS, "--dtype", "float32"), kv_store=None)
    try:
        import urllib.error
        import urllib.request

        c.decode_nodes[0].popen.kill()  # type: ignore[union-attr]

        def unhealthy() -> bool:
            try:
                urllib.request.urlopen(f"http://{c.http_address}/health", timeout=5)
            except urllib.error.HTTPError as exc:
                return exc.code == 503
            return False

        wait_until(unhealthy, timeout=20, what="/health to report 503")
        with (
            openai.OpenAI(base_url=f"http://{c.http_address}/v1", api_key="x", max_retries=0) as cl,
            pytest.raises(openai.APIStatusError) as err,
        ):
            cl.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        c.stop()


def test_overload_is_429_and_a_deadline_is_504(model_file: Path) -> None:
    """A router at --max-inflight answers 429 (rate_limit_error); a request past --http-timeout-s is 504."""
    c = start_cluster(
        model=str(model_file),
        node_args=(*NODE_ARGS, "--dtype", "float32"),
        kv_store=None,
        router_args=("--max-inflight", "1", "--http-timeout-s", "1.0"),
    )
    try:
        with openai.OpenAI(base_url=f"http://{c.http_address}/v1", api_key="x", max_retries=0) as cl:
            held = cl.completions.create(
                model="tiny-chat", prompt="hold the only slot", max_tokens=3000, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            next(iter(held))  # the slot is taken while this streams
            with pytest.raises(openai.RateLimitError) as err:
                cl.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
            assert err.value.status_code == 429
            # Streamed too: the status is decided before the stream starts, not sent in-band with a 200.
            with pytest.raises(openai.RateLimitError):
                cl.chat.completions.create(
                    model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
                )
            held.close()
            wait_until(lambda: _served(cl), timeout=10, what="the slot to be free again")
            with pytest.raises(openai.APIStatusError) as late:
                cl.completions.create(
                    model="tiny-chat", prompt="too slow", max_tokens=3000, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
            assert late.value.status_code == 504
        for node in c.prefill_nodes + c.decode_nodes:
            assert_node_idle(node.address, timeout=10.0)
    finally:
        c.stop()


def _served(cl: openai.OpenAI) -> bool:
    try:
        cl.completions.create(model="tiny-chat", prompt="hi", max_tokens=1)
    except openai.RateLimitError:
        return False
    return True


def test_sdk_top_logprobs_penalties_and_bias_through_the_cluster(client: openai.OpenAI, local: LLM) -> None:
    """What the SDK asks is served through prefill and decode nodes: top_logprobs (the top entry is the
    token chosen, greedily), a frequency penalty that changes the output as on one engine, and a
    logit_bias of -100 that bans the greedy first token (found with /tokenize's neighbour, the engine)."""
    tok = local.tokenizer
    messages = [{"role": "user", "content": "Count: one two three"}]
    ids = tok.apply_chat_template(messages)
    stops = tok.end_of_turn_token_ids
    r = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
    )
    content = r.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 5 for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)
    assert all(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6 for e in content)
    penalized = SamplingParams(
        max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5, stop_token_ids=stops
    )
    want = local.generate([ids], penalized)[0].text
    r = client.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        max_tokens=12,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
    )
    assert r.choices[0].message.content == want
    first = local.generate([ids], SamplingParams(max_tokens=1, stop_token_ids=stops))[0].token_ids[0]
    r = client.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias={str(first): -100},
    )
    assert r.choices[0].logprobs.content[0].token != tok.decode([first], skip_special_tokens=False)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


def test_sdk_structured_outputs_through_the_cluster(client: openai.OpenAI) -> None:
    """response_format json_schema (whole and streamed), .parse() into a pydantic model, and vLLM's
    structured_outputs choice and regex: each honored through the prefill and decode nodes."""
    import pydantic

    messages = [{"role": "user", "content": "Who are you?"}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=80, response_format=schema
    )
    person = json.loads(r.choices[0].message.content or "")
    assert set(person) == {"name", "age", "color"} and person["color"] in ("red", "green", "blue")
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        max_tokens=80,
        response_format=schema,
        stream=True,
        temperature=0,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    again = json.loads(streamed)  # (not compared with the whole one: near-ties of a random model's logits
    assert set(again) == set(person) and again["color"] in ("red", "green", "blue")  # break either way)

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=99)
        color: typing.Literal["red", "green", "blue"]

    parsed = client.chat.completions.parse(
        model="tiny-chat", messages=messages, max_tokens=80, response_format=Person
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    choice = client.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    date = client.completions.create(
        model="tiny-chat",
        prompt="Today is",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}},
    )
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", date.choices[0].text)


def test_sdk_ignore_eos_nulls_bytes_and_stream_offsets_through_the_cluster(
    client: openai.OpenAI, local: LLM
) -> None:
    """What an outside probe found accepted and dropped, or wrong, each served now:

    - ``ignore_eos`` on a chat: the end-of-turn token (forced here by logit_bias) no longer ends it;
    - null for the SDK's Optional fields is their default;
    - chat logprobs' ``bytes`` are each token's own (a piece of a UTF-8 character as it is: joined, they
      are the reply's bytes), not U+FFFD's;
    - a stream's completions ``text_offset`` runs on through its chunks, as the whole answer's does."""
    tok = local.tokenizer
    [eot] = [t for t in tok.end_of_turn_token_ids if t != tok.eos_token_id] or tok.end_of_turn_token_ids[:1]
    ask: dict[str, Any] = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
    }
    ended = client.chat.completions.create(**ask, max_tokens=6, logit_bias={str(eot): 100})
    assert ended.choices[0].finish_reason == "stop" and ended.usage is not None
    assert ended.usage.completion_tokens == 1
    going = client.chat.completions.create(
        **ask, max_tokens=6, logit_bias={str(eot): 100}, extra_body={"ignore_eos": True}
    )
    assert going.choices[0].finish_reason == "length" and going.usage is not None
    assert going.usage.completion_tokens == 6

    nulls = client.chat.completions.create(**ask, max_tokens=3, n=None, logprobs=None, stream=None)
    assert len(nulls.choices) == 1 and nulls.choices[0].logprobs is None

    word = "日本"  # 6 bytes: several byte tokens of this vocabulary, each a piece of a character
    r = client.chat.completions.create(
        **ask,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        extra_body={"structured_outputs": {"choice": [word]}},
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == word and len(content) > 2
    ended_by = tok.decode([eot], skip_special_tokens=False)  # the reply's end token has its entry too
    assert b"".join(bytes(e.bytes) for e in content) == word.encode() + ended_by.encode()
    alternatives = [a for e in content for a in e.top_logprobs]  # the raw model's: not held to the choice
    assert len(alternatives) == 2 * len(content)
    assert all(bytes(a.bytes) == a.token.encode() for a in alternatives if "\ufffd" not in a.token)

    text = {"model": "tiny-chat", "prompt": QUESTION, "max_tokens": N, "temperature": 0, "logprobs": 0}
    whole = client.completions.create(**text, extra_body={"ignore_eos": True}).choices[0].logprobs
    chunks = client.completions.create(**text, stream=True, extra_body={"ignore_eos": True})
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert whole is not None and offsets == whole.text_offset and len(offsets) == N


def test_grpc_bytes_that_do_not_parse_are_invalid_argument_and_the_router_keeps_serving(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    """A prompt text that is not UTF-8 (protobuf strings must be), or bytes that are no message at all:
    INVALID_ARGUMENT saying so -- grpcio's own answer was INTERNAL "Exception deserializing request!"
    (an outside probe's find) -- and the next request is served."""
    import grpc

    from pdkv_proto.pdkv.v1 import generation_pb2

    good = generation_pb2.GenerateRequest(text="Hello world").SerializeToString()
    bad_text = good.replace(b"Hello world", b"Hello \xff\xfe world"[:11])
    assert cluster.router_address is not None
    with grpc.insecure_channel(cluster.router_address) as channel:
        for method in ("GenerateUnary", "Generate"):
            call = (channel.unary_unary if method == "GenerateUnary" else channel.unary_stream)(
                f"/pdkv.v1.Generation/{method}"
            )
            for payload in (bad_text, b"\xff\xff\xff\xff"):
                with pytest.raises(grpc.RpcError) as info:
                    result = call(payload, timeout=30)
                    list(result) if method == "Generate" else None
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
                assert "does not parse" in (info.value.details() or "")
    assert client.completions.create(model="tiny-chat", prompt="Hi", max_tokens=2).choices[0].text is not None
